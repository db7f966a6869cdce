"""Byte-exact KV delivery through the mori backend over the stand-in, across TP layouts."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvbridge.backends.base import Poll
from kvbridge.geometry import Rank
from kvbridge.testkit import connected_backends, connected_ranks, page_plan
from kvbridge_mori import standin
from kvbridge_mori.backend import BatchForm, MoriBackend
from kvbridge_mori.testing import Model, peer_info, plan_for, run_reshard, transfer, wait


@pytest.fixture(autouse=True)
def _fresh_fabric() -> Any:
    yield
    standin.reset()


def _make(api: Any = standin, **options: str) -> Any:
    return lambda name: MoriBackend(name=name, options=dict(options), api=api)


@pytest.mark.parametrize(("pt", "dt"), list(itertools.product((1, 2, 4), repeat=2)))
def test_token_major_reshard_is_byte_exact(pt: int, dt: int) -> None:
    run_reshard(_make(), pt, dt, Model(heads=4))


@pytest.mark.parametrize(("pt", "dt"), [(4, 2), (2, 4), (4, 4), (1, 4), (4, 1)])
def test_fewer_heads_than_ranks_is_byte_exact(pt: int, dt: int) -> None:
    run_reshard(_make(), pt, dt, Model(heads=2), seed=1)


def test_legacy_single_form_is_detected_and_byte_exact() -> None:
    made: list[MoriBackend] = []

    def make(name: str) -> MoriBackend:
        made.append(MoriBackend(name=name, api=standin.legacy))
        return made[-1]

    run_reshard(make, 2, 1, Model(heads=4))
    assert made[0]._form is BatchForm.SINGLE


def test_one_list_form_call_per_component_with_one_entry_per_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model(heads=4, layers=3)
    src_be = MoriBackend(name="p", api=standin)
    dst_be = MoriBackend(name="d", api=standin)
    src, dst, peer = connected_ranks(model, src_be, dst_be, fill=range(model.buffers), src_rank=Rank(1, 2))
    calls: list[tuple[Any, ...]] = []
    real = src_be._engine.batch_write
    monkeypatch.setattr(src_be._engine, "batch_write", lambda *a: calls.append(a) or real(*a))
    plan = plan_for(src, dst, Rank(1, 2), Rank(0, 1), np.array([1, 2, 3, 9]), np.array([4, 5, 6, 0]))
    handle = src_be.send_component(transfer(src, dst, peer, plan))
    assert wait(src_be, handle) == Poll.done()
    assert len(calls) == 1
    lmds, loffs, rmds, roffs, sizes, uids = calls[0]
    assert len(lmds) == len(rmds) == len(uids) == model.buffers and len(set(uids)) == model.buffers
    registered = src_be._tables.registrations[id(src.registered.handle)].handle
    assert [md.id for md in lmds] == [md.id for md in registered.per_region]
    # offsets are relative to each registered region, and every entry fits its region
    for md, offs, size in zip(rmds, roffs, sizes, strict=True):
        assert max(o + s for o, s in zip(offs, size, strict=True)) <= md.size
    assert sum(map(len, sizes)) == len(plan)
    for b in range(model.buffers):   # decode rank 0 of TP 1 holds heads 2,3 of prefill rank 1 at [.., 2:4, ..]
        assert np.all(dst.arrays[b][[4, 5, 6, 0]][:, :, 2:4, :] == b)
        assert np.all(dst.arrays[b][[4, 5, 6, 0]][:, :, 0:2, :] == 0)
    src_be.close()
    dst_be.close()


def test_pending_until_the_engine_completes() -> None:
    with connected_backends(Model(), _make()) as (src, dst, peer):
        standin.pause(src.backend.engine_key)
        handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
        assert src.backend.poll(handle) == Poll.pending()
        assert not dst.arrays[0].any()
        standin.resume(src.backend.engine_key)
        assert wait(src.backend, handle) == Poll.done()
        assert dst.arrays[0][:4].all()


def test_receiver_confirms_landing_through_inbound_status() -> None:
    model = Model()
    with connected_backends(model, _make()) as (src, dst, peer):
        src_be, dst_be = src.backend, dst.backend
        dst_be.add_peer(peer_info("p", src))
        plan = page_plan(src, dst, 3)
        handle = src_be.send_component(transfer(src, dst, peer, plan))
        assert wait(src_be, handle) == Poll.done()
        uids = src_be.transfer_uids(handle)
        assert len(uids) == model.buffers
        assert all(dst_be.inbound_status("p", uid) == Poll.done() for uid in uids)
        assert dst_be.inbound_status("p", uids[0]) is None          # popped once
        assert src_be.notify_completion(peer, b"room 1 kv") is False  # notices go through the control plane
        assert dst_be.drain_notifications() == []


def test_inbound_status_is_absent_without_notifications() -> None:
    model = Model()
    src_be = MoriBackend(name="p", api=standin, options={"enable_notification": "false"})
    dst_be = MoriBackend(name="d", api=standin)
    src, dst, peer = connected_ranks(model, src_be, dst_be)
    dst_be.add_peer(peer_info("p", src))
    handle = src_be.send_component(transfer(src, dst, peer, page_plan(src, dst, 2)))
    assert wait(src_be, handle) == Poll.done()
    assert dst_be.inbound_status("p", src_be.transfer_uids(handle)[0]) is None
    src_be.close()
    dst_be.close()


def _real_mori_imports() -> bool:
    try:
        import mori.io  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present without ROCm
        return False
    return True


@pytest.mark.skipif(not _real_mori_imports(), reason="hardware check: needs amd-mori on a ROCm host with an RDMA NIC")
@pytest.mark.parametrize(("pt", "dt"), [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_real_engine_reshard_of_host_memory(pt: int, dt: int) -> None:
    """The same byte-exact check against the real mori.io (host memory; MORI_RDMA_DEVICES picks NICs)."""
    run_reshard(lambda name: MoriBackend(name=name, options={"host": "127.0.0.1"}), pt, dt, Model(heads=4))

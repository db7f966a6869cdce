"""Refusals, injected failures and peer death, through the mori backend and the stand-in directly."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from kvbridge.backends.base import HandleState, Poll
from kvbridge.errors import PluginUnavailableError, RegionError
from kvbridge.geometry import DeviceKind, MemoryRegion
from kvbridge.planner import TransferPlan
from kvbridge.testkit import connected_backends, connected_ranks, page_plan
from kvbridge_mori import standin
from kvbridge_mori.backend import MoriBackend
from kvbridge_mori.testing import Model, peer_info, transfer, wait

MODEL = Model()


@pytest.fixture(autouse=True)
def _fresh_fabric() -> Any:
    yield
    standin.reset()


@pytest.fixture
def pair() -> Any:
    """A prefill rig and a decode rig (TP 1 each), the sender already knowing the receiver."""
    with connected_backends(MODEL, lambda name: MoriBackend(name=name, api=standin), fill=7) as ranks:
        yield ranks


def _shifted(plan: TransferPlan, *, src: int = 0, dst: int = 0) -> TransferPlan:
    return TransferPlan(plan.src_addr + np.uint64(src), plan.dst_addr + np.uint64(dst), plan.nbytes, plan.buffer)


# ------------------------------------------------------------------------------ backend refusals
def test_out_of_bounds_destination_is_refused_before_posting(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, peer = pair
    monkeypatch.setattr(src.backend._engine, "batch_write", lambda *a: pytest.fail("posted"))
    plan = page_plan(src, dst, 4)
    past_end = dst.arrays[0].nbytes - int(plan.nbytes[0]) + 1
    with pytest.raises(RegionError, match=r"destination \(kv\) descriptor 0 .* outside buffer 0"):
        src.backend.send_component(transfer(src, dst, peer, _shifted(plan, dst=past_end)))


def test_out_of_bounds_source_is_refused(pair: Any) -> None:
    src, dst, peer = pair
    plan = page_plan(src, dst, 4)
    with pytest.raises(RegionError, match=r"source \(kv\)"):
        src.backend.send_component(transfer(src, dst, peer, _shifted(plan, src=src.arrays[0].nbytes)))


def test_a_descriptor_straddling_two_buffers_is_refused(pair: Any) -> None:
    src, dst, peer = pair
    plan = page_plan(src, dst, 4)
    lying = TransferPlan(plan.src_addr, plan.dst_addr, plan.nbytes, np.zeros_like(plan.buffer))  # all "buffer 0"
    with pytest.raises(RegionError, match="outside buffer 0"):
        src.backend.send_component(transfer(src, dst, peer, lying))


def test_unregistered_source_and_unknown_peer_are_refused(pair: Any) -> None:
    src, dst, peer = pair
    with pytest.raises(RegionError, match="unknown peer 'nobody'"):
        src.backend.send_component(transfer(src, dst, "nobody", page_plan(src, dst, 4)))
    src.backend.deregister_buffers(src.registered)
    with pytest.raises(RegionError, match="not registered with this mori backend"):
        src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))


def test_non_host_non_gpu_memory_is_refused() -> None:
    backend = MoriBackend(name="x", api=standin)
    with pytest.raises(RegionError, match="npu region"):
        backend.register_buffers("kv", [MemoryRegion(0x1000, 64, DeviceKind.NPU, 0)])
    backend.close()


def test_a_peer_descriptor_that_disagrees_with_its_regions_is_refused(pair: Any) -> None:
    src, dst, _ = pair
    remote = dst.registered.remote()
    lie = type(remote)(remote.component, remote.regions[::-1], remote.descriptor)
    info = type(peer_info("d", dst))("liar", dst.backend.endpoint, (lie,))
    with pytest.raises(RegionError, match="MemoryDesc says"):
        src.backend.add_peer(info)


def test_options_are_typed_and_unknown_ones_are_refused() -> None:
    backend = MoriBackend(name="x", api=standin, options={"qp_per_transfer": "4", "poll_cq_mode": "event",
                                                         "chunk_bytes": "131072"})
    config = backend._engine._backends[standin.BackendType.RDMA]
    assert (config.qp_per_transfer, config.poll_cq_mode, config.chunk_bytes) == (4, standin.PollCqMode.EVENT, 131072)
    backend.close()
    with pytest.raises(ValueError, match="unknown field `qp_per_tranfser`.*known options: api, host"):
        MoriBackend(name="y", api=standin, options={"qp_per_tranfser": "4"})


@pytest.mark.skipif(importlib.util.find_spec("mori") is not None, reason="amd-mori is installed here")
def test_missing_engine_is_reported_as_unavailable_with_the_install_hint() -> None:
    with pytest.raises(PluginUnavailableError, match="cannot import mori.io.*pip install amd-mori"):
        MoriBackend(name="x")


# ------------------------------------------------------------------- engine-side failures -> Poll
def test_injected_failure_fails_the_handle_with_the_engine_reason(pair: Any) -> None:
    src, dst, peer = pair
    standin.fail_next_writes(src.backend.engine_key, 1, message="link flap on mlx5_2")
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    result = wait(src.backend, handle)
    assert result.state is HandleState.FAILED
    assert "ERR_RDMA_OP: link flap on mlx5_2" in result.reason and "entry 0" in result.reason
    again = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    assert wait(src.backend, again) == Poll.done()


def test_peer_memory_gone_fails_with_remote_access_error(pair: Any) -> None:
    src, dst, peer = pair
    dst.backend.deregister_buffers(dst.registered)
    result = wait(src.backend, src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4))))
    assert result.state is HandleState.FAILED and "remote access error" in result.reason


def test_peer_death_fails_pending_handles_and_later_sends(pair: Any) -> None:
    src, dst, peer = pair
    standin.pause(src.backend.engine_key)
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    assert src.backend.poll(handle) == Poll.pending()
    standin.kill(dst.backend.engine_key, "node rebooted")
    result = src.backend.poll(handle)
    assert result.state is HandleState.FAILED
    assert "peer engine" in result.reason and "node rebooted" in result.reason
    later = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    assert src.backend.poll(later).state is HandleState.FAILED
    standin.resume(src.backend.engine_key)
    assert src.backend.poll(handle) == result   # sticky


def test_peer_death_without_failure_events_surfaces_as_an_rdma_error() -> None:
    src_be = MoriBackend(name="p", api=standin.legacy)
    dst_be = MoriBackend(name="d", api=standin.legacy)
    src, dst, peer = connected_ranks(MODEL, src_be, dst_be)
    standin.kill(dst_be.engine_key)
    result = wait(src_be, src_be.send_component(transfer(src, dst, peer, page_plan(src, dst, 4))))
    assert result.state is HandleState.FAILED and "transport retry counter exceeded" in result.reason
    src_be.close()


def test_removed_peer_fails_its_pending_handles(pair: Any) -> None:
    src, dst, peer = pair
    standin.pause(src.backend.engine_key)
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    src.backend.remove_peer(peer)
    assert "was removed" in src.backend.poll(handle).reason
    standin.resume(src.backend.engine_key)


def test_release_in_flight_keeps_statuses_alive_until_close(pair: Any) -> None:
    src, dst, peer = pair
    standin.pause(src.backend.engine_key)
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    statuses = list(handle.statuses)
    src.backend.release(handle)
    assert src.backend._parked == [statuses]
    assert src.backend.poll(handle).reason == "handle was released"
    standin.resume(src.backend.engine_key)
    src.backend.close()
    assert all(s.Succeeded() for s in statuses)


def test_an_empty_plan_is_done_at_once(pair: Any) -> None:
    src, dst, peer = pair
    handle = src.backend.send_component(transfer(src, dst, peer, TransferPlan.empty()))
    assert src.backend.poll(handle) == Poll.done()


# ---------------------------------------------------------------- the stand-in refuses directly
def test_standin_refuses_what_mori_refuses(pair: Any) -> None:
    src, dst, _ = pair
    engine = src.backend._engine
    lmd = src.registered.handle.per_region[0]
    rmd = standin.MemoryDesc.unpack(dst.registered.handle.per_region[0].pack())
    uid = engine.allocate_transfer_uid
    # remote range past the end: asynchronous remote access error
    status = engine.batch_write([lmd], [[0]], [rmd], [[rmd.size - 8]], [[16]], [uid()])[0]
    assert status.WaitFor(2000) == standin.StatusCode.ERR_RDMA_OP and "remote access error" in status.Message()
    # local range past the end: local protection error
    status = engine.write(lmd, lmd.size - 8, rmd, 0, 16, uid())
    assert status.WaitFor(2000) == standin.StatusCode.ERR_RDMA_OP and "local protection" in status.Message()
    # mismatched list lengths
    status = engine.batch_write([lmd], [[0, 8]], [rmd], [[0]], [[8]], [uid()])[0]
    assert status.Code() == standin.StatusCode.ERR_INVALID_ARGS and status.Failed()
    # unregistered local memory, unknown remote engine: thrown at the call
    foreign = standin.MemoryDesc.unpack(lmd.pack())
    foreign.id = 999
    with pytest.raises(RuntimeError, match="not registered"):
        engine.batch_write([foreign], [[0]], [rmd], [[0]], [[8]], [uid()])
    stranger = standin.IOEngine("stranger", standin.IOEngineConfig("127.0.0.1", 0))
    smd = stranger.register_memory(dst.arrays[1].ctypes.data, 64, -1, standin.MemoryLocationType.CPU)
    with pytest.raises(RuntimeError, match="remote engine 'stranger' is not registered"):
        engine.batch_write([lmd], [[0]], [smd], [[0]], [[8]], [uid()])
    # the single form is not accepted by the 1.2.x list-form engine
    with pytest.raises(TypeError, match="incompatible function arguments"):
        engine.batch_write(lmd, [0], rmd, [0], [8], uid())


def test_standin_without_a_backend_fails_the_first_entry_and_leaves_the_rest_unposted() -> None:
    a = standin.IOEngine("a", standin.IOEngineConfig())
    b = standin.IOEngine("b", standin.IOEngineConfig())
    buf = np.zeros(64, np.uint8)
    amd = a.register_memory(buf.ctypes.data, 32, -1, standin.MemoryLocationType.CPU)
    bmd = b.register_memory(buf.ctypes.data + 32, 32, -1, standin.MemoryLocationType.CPU)
    a.register_remote_engine(b.get_engine_desc())
    first, second = a.batch_write([amd, amd], [[0], [8]], [bmd, bmd], [[0], [8]], [[8], [8]], [0, 1])
    assert first.Code() == standin.StatusCode.ERR_BAD_STATE and second.Init()
    assert a.create_session(amd, bmd) is None

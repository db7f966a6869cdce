"""Byte-exact KV delivery through the ascend backend over the stand-in, across TP layouts."""

from __future__ import annotations

import itertools
import os
import socket
from typing import Any

import numpy as np
import pytest

import kvbridge_ascend
from kvbridge.backends.base import Poll
from kvbridge.geometry import Rank
from kvbridge.testkit import connected_ranks
from kvbridge_ascend import standin
from kvbridge_ascend.backend import AscendBackend
from kvbridge_ascend.testing import (
    Model,
    plan_for,
    run_reshard,
    standin_backend,
    transfer,
    wait,
)


@pytest.fixture(autouse=True)
def _fresh_stores() -> Any:
    yield
    standin.reset()


def _make(**options: str) -> Any:
    return lambda name: standin_backend(name=name, options=dict(options))


@pytest.mark.parametrize(("pt", "dt"), list(itertools.product((1, 2, 4), repeat=2)))
def test_token_major_reshard_is_byte_exact(pt: int, dt: int) -> None:
    run_reshard(_make(), pt, dt, Model(heads=4))


@pytest.mark.parametrize(("pt", "dt"), [(4, 2), (2, 4), (4, 4), (1, 4), (4, 1)])
def test_fewer_heads_than_ranks_is_byte_exact(pt: int, dt: int) -> None:
    run_reshard(_make(), pt, dt, Model(heads=2), seed=1)


def test_device_rdma_protocol_and_two_workers_are_byte_exact() -> None:
    run_reshard(_make(protocol="device_rdma", workers="2"), 4, 2, Model(heads=8, layers=3), seed=2)


def test_max_batch_splits_the_call_but_not_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model(heads=4)
    src_be, dst_be = standin_backend(name="p", options={"max_batch": "5"}), standin_backend(name="d")
    src, dst, peer = connected_ranks(model, src_be, dst_be, fill=range(1, model.buffers + 1), dst_rank=Rank(1, 2))
    calls: list[int] = []
    real = src_be._te.batch_transfer_sync_write
    monkeypatch.setattr(src_be._te, "batch_transfer_sync_write",
                        lambda s, a, b, n, flags=0: calls.append(len(n)) or real(s, a, b, n, flags))
    pages = np.array([0, 2, 4, 6, 8, 10, 12])
    plan = plan_for(src, dst, Rank(0, 1), Rank(1, 2), pages, np.arange(7))
    assert wait(src_be, src_be.send_component(transfer(src, dst, peer, plan))) == Poll.done()
    assert sum(calls) == len(plan) and max(calls) == 5 and len(calls) == -(-len(plan) // 5)
    for b in range(model.buffers):
        assert np.all(dst.arrays[b][:7] == b + 1) and not dst.arrays[b][7:].any()
    src_be.close()
    dst_be.close()



@pytest.mark.skipif(not kvbridge_ascend.probe().available,
                    reason="hardware check: needs memfabric_hybrid and the Ascend NPU driver")
@pytest.mark.parametrize(("pt", "dt"), [(1, 1), (2, 1), (1, 2)])
def test_real_engine_reshard_of_host_memory(pt: int, dt: int) -> None:
    """The same byte-exact check against the real memfabric engine, in host memory. The protocol is
    $ASCEND_MF_TRANSFER_PROTOCOL, else host_rdma (the one meant for host memory); rank 0 hosts the store."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    protocol = os.environ.get("ASCEND_MF_TRANSFER_PROTOCOL", "host_rdma").lower()
    made: list[AscendBackend] = []

    def make(name: str) -> AscendBackend:
        opts = {"store_url": url, "host": "127.0.0.1", "protocol": protocol, "host_store": str(not made).lower()}
        made.append(AscendBackend(name=name, options=opts))
        return made[-1]

    run_reshard(make, pt, dt, Model(heads=4))

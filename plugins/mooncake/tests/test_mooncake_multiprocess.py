"""Prefill (this process) -> decode (a spawned process) over Mooncake TCP on 127.0.0.1.

PeerInfo crosses a pipe as msgpack bytes; the decode side checks its bytes the moment the notice lands,
which is the cross-process check that notices are ordered after the data.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.backends.base import HandleState
from kvbridge.geometry import Rank, region_of
from kvbridge.protocol.records import PeerInfo
from kvbridge_mooncake.testing import (
    KVShape,
    PeerSetup,
    decode_peer,
    plan_between,
    raw_plan,
    reference_reshard,
    shard,
    sink_peer,
    spawn_peer,
    transfer,
    unavailable_reason,
    wait_all,
)

NEEDS_MOONCAKE = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
pytestmark = [NEEDS_MOONCAKE, pytest.mark.kvbridge_multiprocess]
_PIPE_WAIT_S = 30.0


def _recv(conn: Connection, what: str) -> Any:
    if not conn.poll(_PIPE_WAIT_S):
        raise AssertionError(f"the decode process sent no {what} within {_PIPE_WAIT_S} s")
    return conn.recv()


def test_two_process_reshard_with_notice() -> None:
    from kvbridge_mooncake.backend import MooncakeBackend

    shape, pt, dt = KVShape(heads=4, layers=2, pages=16, page=8, head_dim=16), 2, 1
    parent, child, proc = spawn_peer(decode_peer)
    try:
        with MooncakeBackend(name="prefill-2p") as prefill:
            setup = PeerSetup(shape_heads=shape.heads, layers=shape.layers, pages=shape.pages,
                              page=shape.page, head_dim=shape.head_dim, tp=dt)
            parent.send_bytes(msgspec.msgpack.encode(setup))
            if not parent.poll(_PIPE_WAIT_S):
                raise AssertionError("the decode process never sent its PeerInfo")
            info = msgspec.msgpack.decode(parent.recv_bytes(), type=PeerInfo)
            peer = prefill.add_peer(info)
            remote = info.component("kv")

            full = shape.full(seed=7)
            rng = np.random.default_rng(7)
            src_idx = rng.choice(shape.pages, 9, replace=False)
            dst_idx = rng.choice(shape.pages, 9, replace=False)
            expected = reference_reshard(full, src_idx, dst_idx, 0, dt, shape.heads, shape.pages)
            for arr in expected:
                parent.send_bytes(arr.tobytes())

            src_arrays = [shard(full, p, pt, shape.heads) for p in range(pt)]
            handles = []
            for p in range(pt):
                reg = prefill.register_buffers("kv", [region_of(a) for a in src_arrays[p]])
                plan = plan_between(shape.component(pt), shape.component(dt), src_arrays[p],
                                    [r.region() for r in remote.regions], Rank(p, pt), Rank(0, dt), src_idx,
                                    dst_idx)
                handles.append(prefill.send_component(transfer(plan, reg, remote, peer)))
            assert all(r.state is HandleState.DONE for r in wait_all(prefill, handles))
            assert prefill.notify_completion(peer, b"room-1 kv")

            tag, notices, ok_at_notice = _recv(parent, "notice report")
            assert tag == "notice"
            assert notices == [("prefill-2p", b"room-1 kv")]
            assert ok_at_notice, "the notice arrived before every byte had landed"
            parent.send("bye")
            tag, final_ok = _recv(parent, "final report")
            assert final_ok
            proc.join(_PIPE_WAIT_S)
            assert proc.exitcode == 0

            # the peer is gone now: the next send fails with the engine's reason instead of hanging
            late = prefill.send_component(transfer(plan, reg, remote, peer))
            result = wait_all(prefill, [late])[0]
            assert result.state is HandleState.FAILED and "mooncake" in result.reason
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()
        child.close()


def test_stalled_peer_times_out_then_the_same_peer_works_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang #13054: one transient failure must not blacklist the peer. The decode process is stopped
    (SIGSTOP), so the write times out; once it resumes, the next write to the same peer succeeds."""
    from kvbridge_mooncake.backend import MooncakeBackend

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")   # Mooncake's minimum; read when an engine is built
    parent, child, proc = spawn_peer(sink_peer)
    pid = proc.pid
    assert pid is not None
    try:
        with MooncakeBackend(name="prefill-stall") as prefill:
            if not parent.poll(_PIPE_WAIT_S):
                raise AssertionError("the sink process never sent its PeerInfo")
            info = msgspec.msgpack.decode(parent.recv_bytes(), type=PeerInfo)
            peer = prefill.add_peer(info)
            remote = info.component("sink")
            src = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
            reg = prefill.register_buffers("sink", [region_of(src)])
            dst = np.array([remote.regions[0].addr], dtype=np.uint64)

            def send(nbytes: int) -> Any:
                plan = raw_plan(src, src, dst, nbytes=nbytes)
                return prefill.send_component(transfer(plan, reg, remote, peer, component="sink"))

            assert wait_all(prefill, [send(4096)])[0].state is HandleState.DONE
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            stalled = wait_all(prefill, [send(1 << 20)], timeout=60)[0]
            assert stalled.state is HandleState.FAILED and "returned -1" in stalled.reason, stalled
            assert time.monotonic() - started < 30
            os.kill(pid, signal.SIGCONT)
            assert wait_all(prefill, [send(1 << 20)])[0].state is HandleState.DONE
            parent.send("done")
            landed = np.frombuffer(_recv(parent, "buffer"), dtype=np.uint8)
            np.testing.assert_array_equal(landed, src)
    finally:
        if proc.is_alive():
            os.kill(pid, signal.SIGCONT)
            proc.kill()
        proc.join(5)
        parent.close()
        child.close()

"""Two real Mooncake engines in one process (TCP over 127.0.0.1): reshards, chunking, bounds, failures,
notices. Every destination byte is checked against a numpy reference."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.backends.base import HandleState, RegisteredBuffers, TransferBackend
from kvbridge.errors import RegionError
from kvbridge.geometry import MemoryRegion, Rank, region_of
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo, RegionWire, RemoteBuffers
from kvbridge_mooncake.backend import MooncakeBackend
from kvbridge_mooncake.testing import (
    KVShape,
    drain_until,
    plan_between,
    raw_plan,
    reference_reshard,
    shard,
    transfer,
    unavailable_reason,
    wait_all,
)

NEEDS_MOONCAKE = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
pytestmark = NEEDS_MOONCAKE


@pytest.fixture(scope="module")
def prefill() -> Iterator[MooncakeBackend]:
    with MooncakeBackend(name="prefill") as backend:
        yield backend


@pytest.fixture(scope="module")
def decode() -> Iterator[MooncakeBackend]:
    with MooncakeBackend(name="decode") as backend:
        yield backend


def _peer(backend: MooncakeBackend, name: str, *registered: RegisteredBuffers) -> PeerInfo:
    return PeerInfo(name=name, endpoint=backend.endpoint, buffers=tuple(r.remote() for r in registered))


def test_is_a_transfer_backend(prefill: MooncakeBackend) -> None:
    assert isinstance(prefill, TransferBackend)
    assert prefill.name == "mooncake"


@pytest.mark.parametrize(("heads", "pt", "dt"), [(4, p, d) for p in (1, 2, 4) for d in (1, 2, 4)]
                         + [(2, 4, 1), (2, 1, 4), (2, 2, 4)])
def test_token_major_reshard_is_byte_exact(prefill: MooncakeBackend, decode: MooncakeBackend, heads: int,
                                           pt: int, dt: int) -> None:
    shape = KVShape(heads=heads)
    full = shape.full(seed=100 * pt + 10 * dt + heads)
    rng = np.random.default_rng(pt * dt)
    src_idx = rng.choice(shape.pages, 7, replace=False)
    dst_idx = rng.choice(shape.pages, 7, replace=False)
    src_comp, dst_comp = shape.component(pt), shape.component(dt)
    src_arrays = [shard(full, p, pt, heads) for p in range(pt)]
    dst_arrays = [[np.zeros((shape.pages, *b.item_shape), np.uint16) for b in dst_comp.buffers]
                  for _ in range(dt)]
    src_reg = [prefill.register_buffers("kv", [region_of(a) for a in arrs]) for arrs in src_arrays]
    dst_reg = [decode.register_buffers("kv", [region_of(a) for a in arrs]) for arrs in dst_arrays]
    try:
        for d in range(dt):
            prefill.add_peer(_peer(decode, f"decode{d}", dst_reg[d]))
        handles = []
        for p in range(pt):
            for d in range(dt):
                plan = plan_between(src_comp, dst_comp, src_arrays[p], dst_reg[d].regions, Rank(p, pt),
                                    Rank(d, dt), src_idx, dst_idx)
                if len(plan):
                    handles.append(prefill.send_component(transfer(plan, src_reg[p], dst_reg[d].remote(),
                                                                   f"decode{d}")))
        assert handles
        assert all(r.state is HandleState.DONE for r in wait_all(prefill, handles)), handles
        for d in range(dt):
            expected = reference_reshard(full, src_idx, dst_idx, d, dt, heads, shape.pages)
            for got, want in zip(dst_arrays[d], expected, strict=True):
                np.testing.assert_array_equal(got, want)
    finally:
        for reg in src_reg:
            prefill.deregister_buffers(reg)
        for reg in dst_reg:
            decode.deregister_buffers(reg)


def _scattered(n: int, size: int, src: np.ndarray, dst: np.ndarray) -> TransferPlan:
    """``n`` descriptors of ``size`` bytes, item i -> item n-1-i, so no two merge."""
    i = np.arange(n, dtype=np.uint64)
    step = np.uint64(size)
    return TransferPlan(src.ctypes.data + i * step, dst.ctypes.data + (np.uint64(n - 1) - i) * step,
                        np.full(n, size, dtype=np.uint64), np.zeros(n, dtype=np.int32))


def _expected_scattered(src: np.ndarray, n: int, size: int) -> np.ndarray:
    return src.reshape(n, size)[::-1].ravel()


def test_batch_over_the_tcp_queue_limit_goes_through(prefill: MooncakeBackend,
                                                      decode: MooncakeBackend) -> None:
    n, size = 5000, 64   # 5000 descriptors: 2.4x the ~2048 the TCP transport queues per peer
    src = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = prefill.register_buffers("big", [region_of(src)]), decode.register_buffers("big", [region_of(dst)])
    try:
        prefill.add_peer(_peer(decode, "decode-big", d))
        plan = _scattered(n, size, src, dst)
        assert len(plan) == n
        handle = prefill.send_component(transfer(plan, s, d.remote(), "decode-big", component="big"))
        assert wait_all(prefill, [handle])[0].state is HandleState.DONE
        np.testing.assert_array_equal(dst, _expected_scattered(src, n, size))
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)


def test_odd_chunk_and_window_sizes(decode: MooncakeBackend) -> None:
    n, size = 101, 48
    src = np.random.default_rng(2).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    with MooncakeBackend(name="small-chunks", options={"chunk": "7", "window": "3"}) as sender:
        s, d = sender.register_buffers("c", [region_of(src)]), decode.register_buffers("c", [region_of(dst)])
        try:
            sender.add_peer(_peer(decode, "decode", d))
            handle = sender.send_component(transfer(_scattered(n, size, src, dst), s, d.remote(), "decode",
                                                    component="c"))
            assert wait_all(sender, [handle])[0].state is HandleState.DONE
            np.testing.assert_array_equal(dst, _expected_scattered(src, n, size))
        finally:
            decode.deregister_buffers(d)


def test_out_of_bounds_is_refused_before_posting(prefill: MooncakeBackend, decode: MooncakeBackend) -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s, d = prefill.register_buffers("oob", [region_of(src)]), decode.register_buffers("oob", [region_of(dst)])
    try:
        prefill.add_peer(_peer(decode, "decode-oob", d))
        too_far = raw_plan(src, dst, np.array([dst.ctypes.data + 4000], dtype=np.uint64), nbytes=200)
        with pytest.raises(RegionError, match="destination"):
            prefill.send_component(transfer(too_far, s, d.remote(), "decode-oob", component="oob"))
        foreign = np.ones(4096, dtype=np.uint8)
        with pytest.raises(RegionError, match="source"):
            prefill.send_component(transfer(raw_plan(foreign, dst), s, d.remote(), "decode-oob",
                                            component="oob"))
        with pytest.raises(RegionError, match="unknown peer"):
            prefill.send_component(transfer(raw_plan(src, dst), s, d.remote(), "nobody", component="oob"))
        assert not dst.any()
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)


def test_failure_then_retry_same_peer_is_not_blacklisted(prefill: MooncakeBackend,
                                                          decode: MooncakeBackend) -> None:
    """The peer rejects one write (its region is smaller than it claimed); the next send to it still goes."""
    src = np.random.default_rng(5).integers(0, 256, 8192, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s = prefill.register_buffers("retry", [region_of(src)])
    d = decode.register_buffers("retry", [region_of(dst)])
    try:
        prefill.add_peer(_peer(decode, "decode-retry", d))
        claimed = RemoteBuffers("retry", (RegionWire(dst.ctypes.data, 8192),))   # stale: twice the real size
        bad = prefill.send_component(transfer(raw_plan(src, dst, nbytes=8192), s, claimed, "decode-retry",
                                              component="retry"))
        result = wait_all(prefill, [bad])[0]
        assert result.state is HandleState.FAILED
        assert "returned -1" in result.reason and decode.session.split(":")[1] in result.reason
        good = prefill.send_component(transfer(raw_plan(src, dst, nbytes=4096), s, d.remote(), "decode-retry",
                                               component="retry"))
        assert wait_all(prefill, [good])[0].state is HandleState.DONE
        np.testing.assert_array_equal(dst, src[:4096])
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)


def test_peer_gone_fails_and_a_healthy_peer_still_works(prefill: MooncakeBackend,
                                                         decode: MooncakeBackend) -> None:
    src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_gone, dst = np.zeros_like(src), np.zeros_like(src)
    s = prefill.register_buffers("gone", [region_of(src)])
    victim = MooncakeBackend(name="victim")
    g = victim.register_buffers("gone", [region_of(dst_gone)])
    d = decode.register_buffers("gone", [region_of(dst)])
    try:
        prefill.add_peer(_peer(victim, "victim", g))
        prefill.add_peer(_peer(decode, "decode-gone", d))
        victim.close()
        lost = prefill.send_component(transfer(raw_plan(src, dst_gone), s, g.remote(), "victim",
                                               component="gone"))
        result = wait_all(prefill, [lost])[0]
        assert result.state is HandleState.FAILED and "mooncake" in result.reason, result
        assert not dst_gone.any()
        assert prefill.notify_completion("victim", b"room-9 \x00\xff")   # accepted, then fails to deliver
        deadline = time.monotonic() + 20
        while not (failed := prefill.drain_notify_failures()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(f.peer, f.notice) for f in failed] == [("victim", b"room-9 \x00\xff")], failed
        ok = prefill.send_component(transfer(raw_plan(src, dst), s, d.remote(), "decode-gone",
                                             component="gone"))
        assert wait_all(prefill, [ok])[0].state is HandleState.DONE
        np.testing.assert_array_equal(dst, src)
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)
        victim.close()


def test_notices_arrive_after_the_data_and_keep_every_byte(prefill: MooncakeBackend,
                                                            decode: MooncakeBackend) -> None:
    decode.drain_notifications()
    src = np.random.default_rng(4).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    s = prefill.register_buffers("note", [region_of(src)])
    d = decode.register_buffers("note", [region_of(dst)])
    try:
        prefill.add_peer(_peer(decode, "decode-note", d))
        handle = prefill.send_component(transfer(raw_plan(src, dst), s, d.remote(), "decode-note",
                                                 component="note"))
        notice = bytes(range(256)) + b"room-1 kv done"
        assert prefill.notify_completion("decode-note", notice)   # queued behind the write to that peer
        got = drain_until(decode, 1)
        landed = np.array_equal(dst, src)   # checked the moment the notice is seen
        assert got == [(prefill.endpoint_name, notice)]
        assert landed
        assert wait_all(prefill, [handle])[0].state is HandleState.DONE
        assert not prefill.notify_completion("nobody", b"x")
        assert prefill.drain_notify_failures() == []
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)


def test_shared_regions_are_refcounted(prefill: MooncakeBackend) -> None:
    buf = np.zeros(1 << 12, dtype=np.uint8)
    a = prefill.register_buffers("a", [region_of(buf)])
    b = prefill.register_buffers("b", [region_of(buf)])    # the same memory in two components
    prefill.deregister_buffers(a)
    assert MemoryRegion(buf.ctypes.data, buf.nbytes) in prefill.registered_regions
    prefill.deregister_buffers(b)
    prefill.deregister_buffers(b)   # twice is harmless
    assert MemoryRegion(buf.ctypes.data, buf.nbytes) not in prefill.registered_regions


def test_empty_plan_is_done_at_once(prefill: MooncakeBackend, decode: MooncakeBackend) -> None:
    buf = np.zeros(64, dtype=np.uint8)
    other = buf.copy()
    s, d = prefill.register_buffers("e", [region_of(buf)]), decode.register_buffers("e", [region_of(other)])
    try:
        prefill.add_peer(_peer(decode, "decode-e", d))
        handle = prefill.send_component(transfer(TransferPlan.empty(), s, d.remote(), "decode-e",
                                                 component="e"))
        assert prefill.poll(handle).state is HandleState.DONE
        assert prefill.poll(object()).state is HandleState.FAILED
    finally:
        prefill.deregister_buffers(s)
        decode.deregister_buffers(d)


def test_closed_backend_refuses_work() -> None:
    backend = MooncakeBackend(name="closing")
    port = int(backend.session.rsplit(":", 1)[1])
    backend.close()
    backend.close()
    with pytest.raises(ConnectionRefusedError):   # the engine itself is gone, not just forgotten
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(RegionError, match="closed"):
        backend.register_buffers("x", [MemoryRegion(4096, 64)])
    assert backend.drain_notifications() == []

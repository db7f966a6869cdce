"""The loopback backend: bounds checks before any byte moves, the vectorized copy, notifications."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.backends.base import ComponentTransfer, HandleState, RegisteredBuffers
from kvbridge.backends.copying import copy_descriptors
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.errors import RegionError
from kvbridge.geometry import DeviceKind, MemoryRegion, region_of
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo, RemoteBuffers


class Rig:
    """One sender backend with two registered source arrays, one receiver with two destination arrays."""

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.src = [rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)]
        self.dst = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
        self.sender = LoopbackBackend(name="lb-sender")
        self.receiver = LoopbackBackend(name="lb-receiver")
        self.reg = self.sender.register_buffers("kv", [region_of(a) for a in self.src])
        self.remote = self.receiver.register_buffers("kv", [region_of(a) for a in self.dst]).remote()
        self.sender.add_peer(PeerInfo("d0", self.receiver.endpoint, (self.remote,)))

    def addr(self, arrays: list[np.ndarray], i: int, off: int) -> int:
        return region_of(arrays[i]).addr + off

    def send(self, rows: list[tuple[int, int, int]], *, peer: str = "d0",
             src: RegisteredBuffers | None = None, dst: RemoteBuffers | None = None) -> object:
        column = [np.array([r[i] for r in rows], np.uint64) for i in range(3)]
        plan = TransferPlan(column[0], column[1], column[2], np.zeros(len(rows), np.int32))
        transfer = ComponentTransfer(room=3, component="kv", peer=peer, chunk=0, last=True,
                                     src=src or self.reg, dst=dst or self.remote, plan=plan)
        return self.sender.send_component(transfer)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_in_bounds_descriptors_copy_exactly(rig: Rig) -> None:
    a = rig.addr
    handle = rig.send([(a(rig.src, 0, 100), a(rig.dst, 1, 7), 50),
                       (a(rig.src, 1, 0), a(rig.dst, 0, 4000), 96)])
    assert rig.sender.poll(handle).state is HandleState.DONE
    assert np.array_equal(rig.dst[1][7:57], rig.src[0][100:150])
    assert np.array_equal(rig.dst[0][4000:], rig.src[1][:96])
    assert rig.dst[1][:7].sum() == 0 and rig.dst[1][57:].sum() == 0 and rig.dst[0][:4000].sum() == 0


@pytest.mark.parametrize("bad", [
    "src past the end", "dst past the end", "dst straddles two regions", "src before every region",
    "zero length",
])
def test_out_of_bounds_descriptor_is_refused_and_nothing_is_copied(rig: Rig, bad: str) -> None:
    a = rig.addr
    good = (a(rig.src, 0, 0), a(rig.dst, 0, 0), 64)
    wrong = {
        "src past the end": (a(rig.src, 0, 4090), a(rig.dst, 0, 100), 7),
        "dst past the end": (a(rig.src, 0, 0), a(rig.dst, 1, 4095), 2),
        "dst straddles two regions": (a(rig.src, 0, 0), a(rig.dst, 0, 4095), 2),
        "src before every region": (min(a(rig.src, 0, 0), a(rig.src, 1, 0)) - 16, a(rig.dst, 0, 0), 8),
        "zero length": (a(rig.src, 0, 0), a(rig.dst, 0, 200), 0),
    }[bad]
    if bad == "dst straddles two regions" and a(rig.dst, 0, 4096) != a(rig.dst, 1, 0):
        wrong = (a(rig.src, 0, 0), a(rig.dst, 0, 4095), 2)  # still past the end of region 0
    with pytest.raises(RegionError, match=r"descriptor 1 .*outside every registered region"):
        rig.send([good, wrong])
    assert not rig.dst[0].any() and not rig.dst[1].any(), "a refused plan must copy nothing"


def test_unknown_peer_and_closed_backend_are_refused(rig: Rig) -> None:
    a = rig.addr
    row = [(a(rig.src, 0, 0), a(rig.dst, 0, 0), 8)]
    with pytest.raises(RegionError, match="unknown peer 'nobody'"):
        rig.send(row, peer="nobody")
    rig.sender.close()
    with pytest.raises(RegionError, match="closed"):
        rig.send(row)
    assert not rig.dst[0].any()


def test_device_memory_is_refused_at_registration() -> None:
    backend = LoopbackBackend(name="lb-gpu")
    try:
        with pytest.raises(RegionError, match="host memory only.*cuda"):
            backend.register_buffers("kv", [MemoryRegion(0x7000_0000, 4096, DeviceKind.CUDA, 0)])
    finally:
        backend.close()


@pytest.mark.parametrize("count, length", [(3, 17), (64, 24), (200, 1), (40, 512), (400, 24)])
def test_copy_descriptors_matches_a_plain_copy(count: int, length: int) -> None:
    """Both paths (a few memmoves, and the vectorized same-length gather/scatter) against slicing."""
    rng = np.random.default_rng(count * 1000 + length)
    src = rng.integers(0, 256, count * length * 3, dtype=np.uint8)
    dst = np.zeros(count * length * 2, np.uint8)
    src_off = rng.choice(np.arange(0, src.size - length + 1, length), count, replace=False)
    dst_off = rng.permutation(np.arange(0, dst.size - length + 1, length))[:count]
    lens = np.full(count, length, np.uint64)
    lens[::5] = max(1, length // 2)  # a second length group
    copy_descriptors(region_of(src).addr + src_off.astype(np.uint64),
                     region_of(dst).addr + dst_off.astype(np.uint64), lens)
    want = np.zeros_like(dst)
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lens.tolist()):
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)


def test_notifications_reach_a_local_peer_once() -> None:
    sender, receiver = LoopbackBackend(name="n-sender"), LoopbackBackend(name="n-receiver")
    try:
        remote = receiver.register_buffers("kv", [region_of(np.zeros(8, np.uint8))]).remote()
        sender.add_peer(PeerInfo("d0", receiver.endpoint, (remote,)))
        assert sender.notify_completion("d0", b"room-1:kv:0") is True
        assert sender.notify_completion("unknown", b"x") is False  # left to the control plane
        assert receiver.drain_notifications() == [("n-sender", b"room-1:kv:0")]
        assert receiver.drain_notifications() == []
        receiver.close()
        assert sender.notify_completion("d0", b"late") is False  # the peer is gone
    finally:
        sender.close()
        receiver.close()


def test_sending_after_every_source_region_is_deregistered_is_refused(rig: Rig) -> None:
    a = rig.addr
    rig.sender.deregister_buffers(rig.reg)
    with pytest.raises(RegionError, match="source"):
        rig.send([(a(rig.src, 0, 0), a(rig.dst, 0, 0), 8)])
    assert not rig.dst[0].any()


# The addresses are fake and never copied: the check alone must refuse them (addr + len wraps in uint64).
@pytest.mark.parametrize("addr, length", [(2**64 - 8, 16), (0x1800, 2**64 - 0x100)])
def test_descriptor_wrapping_past_2_64_is_refused(addr: int, length: int) -> None:
    from kvbridge.backends.base import check_within

    with pytest.raises(RegionError):
        check_within(np.array([addr], np.uint64), np.array([length], np.uint64),
                     [MemoryRegion(0x1000, 0x1000)], "dst")


def test_bounds_check_of_a_region_re_registered_smaller_at_the_same_address() -> None:
    """check_within caches each registration's sorted bounds: a region of the same address but another size
    (a buffer registered again, smaller) is checked against its own size, never the cached larger one."""
    from kvbridge.backends.base import check_within

    addr, length = np.array([0x1000 + 0x800], np.uint64), np.array([0x100], np.uint64)
    big, small = [MemoryRegion(0x1000, 0x1000), MemoryRegion(0x4000, 0x10)], [MemoryRegion(0x1000, 0x800),
                                                                             MemoryRegion(0x4000, 0x10)]
    check_within(addr, length, big, "dst")
    with pytest.raises(RegionError, match="outside every registered region"):
        check_within(addr, length, small, "dst")
    check_within(addr, length, big, "dst")                 # and the larger one still passes
    with pytest.raises(RegionError):
        check_within(addr, length, [MemoryRegion(0x4000, 0x10), MemoryRegion(0x1000, 0x800)], "dst")   # any order

"""Lifetime of loopback's mappings of a peer's /dev/shm segments.

A peer in another process is written through mmaps of its segments (each holds the mapping and a dup'd
descriptor). They must go as soon as nothing can use them (remove_peer, a replacing add_peer, close), with
no garbage collection needed; and never while a send on another thread is still copying into them: an
unmapped destination under a running memmove is a crash, not an error. Each probe stops a send inside its
copy (``copy_descriptors`` patched), ends the peer from another thread, and looks at /proc/self/maps
before letting the copy run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

import kvbridge.backends.loopback as loopback
from kvbridge.backends.base import ComponentTransfer, HandleState
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.geometry import region_of
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo, RegionWire, RemoteBuffers
from kvbridge.testkit.pools import GUARD, GuardedBuffer

SIZE = 4096
SEGMENTS = 11               # a decode pool in the churn test: 10 KV regions and a staging area
REMOTE_BASE = 0x7F00_0000_0000


def _mapped(name: str) -> tuple[int, int]:
    """(mappings in /proc/self/maps, open descriptors) of /dev/shm/``name`` in this process."""
    path = f"/dev/shm/{name}"
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if line.rstrip("\n").split(maxsplit=5)[5:] in ([path], [path + " (deleted)"]))
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") in (path, path + " (deleted)")
        except OSError:
            pass
    return maps, fds


class Rig:
    """A sender and a peer "in another process" (a guessed proof): SEGMENTS guarded /dev/shm buffers, each
    mapped once by its owner here, and once more by the backend while the peer is known."""

    def __init__(self) -> None:
        self.backend = LoopbackBackend(name="lifetime-prefill")
        self.src = GuardedBuffer(SIZE)
        self.src.write(np.arange(SIZE, dtype=np.uint8) ^ 0x3C)
        self.reg = self.backend.register_buffers("kv", [region_of(self.src.data)])
        self.segs = [GuardedBuffer(SIZE, memory="shm") for _ in range(SEGMENTS)]
        self.info = self.peer_info(self.segs)

    @staticmethod
    def peer_info(segs: list[GuardedBuffer]) -> PeerInfo:
        regions = tuple(RegionWire(REMOTE_BASE + i * (1 << 20), SIZE) for i in range(len(segs)))
        descriptor = msgspec.msgpack.encode([[s.shm_name, GUARD] for s in segs])
        return PeerInfo("remote", msgspec.msgpack.encode(["remote", os.urandom(16)]),
                        (RemoteBuffers("kv", regions, descriptor),))

    def mapped(self, segs: list[GuardedBuffer] | None = None) -> list[tuple[int, int]]:
        return [_mapped(s.shm_name) for s in (self.segs if segs is None else segs)]

    def send(self, info: PeerInfo, k: int = 0) -> Any:
        plan = TransferPlan(np.array([region_of(self.src.data).addr], np.uint64),
                            np.array([REMOTE_BASE + k * (1 << 20)], np.uint64), np.array([SIZE], np.uint64),
                            np.zeros(1, np.int32))
        return self.backend.send_component(ComponentTransfer(room=1, component="kv", peer="remote", chunk=0,
                                                             last=True, src=self.reg, dst=info.buffers[0],
                                                             plan=plan))

    def close(self) -> None:
        self.backend.close()
        for seg in self.segs:
            assert not seg.guard_damage()
            seg.close()
        self.src.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


OWN, BOTH = (1, 1), (2, 2)      # the owner's mapping only; the owner's and the backend's


def _in_another_thread(action: Callable[[], None]) -> None:
    thread = threading.Thread(target=action)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "ending the peer blocked on a send in flight (it must defer, not wait)"


def _pause_copy(monkeypatch: pytest.MonkeyPatch, during: Callable[[], None],
                seen: list[list[tuple[int, int]]], rig: Rig, segs: list[GuardedBuffer]) -> None:
    """Patch the copy: run ``during`` on another thread, record what is mapped, and copy only if the
    destinations are all still mapped by the backend (else fail the send instead of crashing)."""
    real = loopback.copy_descriptors

    def copy(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        _in_another_thread(during)
        seen.append(rig.mapped(segs))
        if seen[-1] != [BOTH] * len(segs):
            raise AssertionError(f"destination unmapped under a send in flight: {seen[-1]}")
        real(src, dst, lens)

    monkeypatch.setattr(loopback, "copy_descriptors", copy)


def test_remove_peer_releases_every_mapping_and_descriptor_at_once(rig: Rig) -> None:
    assert rig.mapped() == [OWN] * SEGMENTS
    rig.backend.add_peer(rig.info)
    assert rig.mapped() == [BOTH] * SEGMENTS
    assert rig.backend.poll(rig.send(rig.info, 3)).state is HandleState.DONE
    rig.backend.remove_peer("remote")
    assert rig.mapped() == [OWN] * SEGMENTS        # no gc.collect(): nothing keeps an export of a map
    assert np.array_equal(rig.segs[3].read(), rig.src.read())


@pytest.mark.parametrize("end", ["remove_peer", "close"])
def test_ending_a_peer_during_a_send_defers_the_unmap_until_the_copy_is_done(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    rig.backend.add_peer(rig.info)
    seen: list[list[tuple[int, int]]] = []
    action = (lambda: rig.backend.remove_peer("remote")) if end == "remove_peer" else rig.backend.close
    _pause_copy(monkeypatch, action, seen, rig, rig.segs[5:6])
    assert rig.backend.poll(rig.send(rig.info, 5)).state is HandleState.DONE
    assert seen == [[BOTH]]                        # still mapped while the copy ran
    assert np.array_equal(rig.segs[5].read(), rig.src.read())
    assert rig.mapped() == [OWN] * SEGMENTS        # and released by the send that finished last
    assert "remote" not in rig.backend._peers


def test_a_replacing_add_peer_during_a_send_keeps_the_old_maps_until_the_copy_is_done(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.backend.add_peer(rig.info)
    fresh = [GuardedBuffer(SIZE, memory="shm") for _ in range(SEGMENTS)]
    try:
        seen: list[list[tuple[int, int]]] = []
        _pause_copy(monkeypatch, lambda: rig.backend.add_peer(rig.peer_info(fresh)), seen, rig, rig.segs[:1])
        assert rig.backend.poll(rig.send(rig.info, 0)).state is HandleState.DONE
        assert seen == [[BOTH]]
        assert rig.mapped() == [OWN] * SEGMENTS    # the old incarnation's maps went with the send
        assert rig.mapped(fresh) == [BOTH] * SEGMENTS
        rig.backend.remove_peer("remote")
        assert rig.mapped(fresh) == [OWN] * SEGMENTS
    finally:
        for seg in fresh:
            seg.close()


def test_a_failed_send_of_a_removed_peer_still_releases_its_maps(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The release runs when the send ends by an exception too (here: the copy itself raises)."""
    rig.backend.add_peer(rig.info)

    def copy(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        _in_another_thread(lambda: rig.backend.remove_peer("remote"))
        assert rig.mapped(rig.segs[:1]) == [BOTH]
        raise OSError("copy failed")

    monkeypatch.setattr(loopback, "copy_descriptors", copy)
    with pytest.raises(OSError, match="copy failed"):
        rig.send(rig.info, 0)
    assert rig.mapped() == [OWN] * SEGMENTS


def test_sends_racing_removals_never_write_unmapped_memory(rig: Rig) -> None:
    """Bounded: 200 rounds of sends on one thread against remove/add on another, with the real copy; a
    write into an unmapped destination would kill the process (SIGSEGV), a refused send is fine."""
    stop = threading.Event()
    done = [0, 0]

    def sender() -> None:
        while not stop.is_set():
            try:
                rig.send(rig.info, done[0] % SEGMENTS)
                done[0] += 1
            except Exception:  # noqa: BLE001 - unknown peer between remove and add: refused, counted
                done[1] += 1

    rig.backend.add_peer(rig.info)
    thread = threading.Thread(target=sender)
    thread.start()
    try:
        for _ in range(200):
            rig.backend.remove_peer("remote")
            rig.backend.add_peer(rig.info)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    rig.backend.remove_peer("remote")
    assert rig.mapped() == [OWN] * SEGMENTS
    assert done[0] > 0

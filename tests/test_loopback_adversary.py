"""Forged loopback peers: what a peer announces is validated before anything is opened, mapped or written.

Each probe builds the PeerInfo a forged Hello would yield (the agent passes ``hello.agent``, ``hello.endpoint``
and ``hello.buffers`` to ``add_peer`` unchanged) and asserts three things: ``add_peer`` (or the send) is
refused with an error naming the field and the value; no file outside /dev/shm is opened; and not one
byte outside what the peer legitimately registered changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvbridge.backends.base import ComponentTransfer, HandleState
from kvbridge.backends.loopback import LoopbackBackend, PeerDataError
from kvbridge.errors import ProtocolError, RegionError
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, region_of
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo, RegionWire, RemoteBuffers
from kvbridge.protocol.wire import PROTOCOL_VERSION, Codec, Hello, Role
from kvbridge.shmnames import MAX_SEGMENT_NAME, segment_prefix
from kvbridge.testkit.pools import GuardedBuffer

SIZE = 4096
PREFIX = segment_prefix("adv")


def _descriptor(*entries: tuple[str, int]) -> bytes:
    return msgspec.msgpack.encode([list(e) for e in entries])


def _endpoint(name: str, proof: bytes) -> bytes:
    return msgspec.msgpack.encode([name, proof])


def _forged(name: str, endpoint: bytes, regions: list[tuple[int, int]], descriptor: bytes | None = None,
            component: str = "kv") -> PeerInfo:
    """A peer's announcement; without a descriptor every region is private memory of the peer's process."""
    if descriptor is None:
        descriptor = _descriptor(*[("", 0)] * len(regions))
    return PeerInfo(name, endpoint, (RemoteBuffers(component, tuple(RegionWire(a, n) for a, n in regions),
                                                   descriptor),))


class Prefill:
    """A sender with one registered source array of SIZE bytes (a fixed pattern), guarded on both sides."""

    def __init__(self) -> None:
        self.backend = LoopbackBackend(name="adv-prefill")
        self.src = GuardedBuffer(SIZE)
        self.src.write(np.arange(SIZE, dtype=np.uint8) ^ 0x5A)
        self.reg = self.backend.register_buffers("kv", [region_of(self.src.data)])

    def send(self, peer: str, dst: RemoteBuffers, dst_addr: int, nbytes: int = SIZE) -> object:
        plan = TransferPlan(np.array([region_of(self.src.data).addr], np.uint64), np.array([dst_addr], np.uint64),
                            np.array([nbytes], np.uint64), np.zeros(1, np.int32))
        return self.backend.send_component(ComponentTransfer(room=1, component="kv", peer=peer, chunk=0,
                                                             last=True, src=self.reg, dst=dst, plan=plan))

    def close(self) -> None:
        self.backend.close()
        assert not self.src.guard_damage()
        self.src.close()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path os.open is asked for while the test runs (relative ones as given, with their dir_fd)."""
    paths: list[str] = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        paths.append(os.fsdecode(path) if dir_fd is None else f"<dir {os.readlink(f'/proc/self/fd/{dir_fd}')}>/"
                     f"{os.fsdecode(path)}")
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    return paths


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file outside /dev/shm that a traversal would reach; its bytes must never change."""
    path = tmp_path / "victim.bin"
    path.write_bytes(b"\x11" * (2 * SIZE))
    yield path
    assert path.read_bytes() == b"\x11" * (2 * SIZE), "a byte of a file outside /dev/shm was written"


def _outside_shm(paths: list[str]) -> list[str]:
    return [p for p in paths if not (p == "/dev/shm" or p.startswith("<dir /dev/shm>/"))]


# ---------------------------------------------------------------------------------- segment names
def _traversals(victim: Path) -> list[str]:
    rel = os.path.relpath(victim, "/dev/shm")
    return [rel, f"../..{victim}", str(victim), "../" + victim.name, f"{PREFIX}a/../../{rel}"]


@pytest.mark.parametrize("which", range(5))
def test_path_traversal_segment_name_is_refused_before_anything_is_opened(
        prefill: Prefill, victim: Path, opened: list[str], which: int) -> None:
    name = _traversals(victim)[which]
    forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, SIZE)], _descriptor((name, 0)))
    with pytest.raises(PeerDataError, match=r"buffers\['kv'\]\.descriptor\[0\]\.shm_name=.* is not a /dev/shm "
                                            r"segment name"):
        prefill.backend.add_peer(forged)
    assert opened == [], f"opened {opened} for a refused peer"
    with pytest.raises(RegionError, match="unknown peer 'evil'"):
        prefill.send("evil", forged.buffers[0], 0x10_0000)


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "/", "x" * (MAX_SEGMENT_NAME + 1), "x" * 4096,
                                  "seg\0ment", "seg ment", "séance", "-" * 3 + "/"])
def test_segment_name_outside_the_grammar_is_refused(prefill: Prefill, opened: list[str], name: str) -> None:
    forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, SIZE)], _descriptor((name, 0)))
    with pytest.raises(PeerDataError, match=r"shm_name=.* is not a /dev/shm segment name \(allowed: "):
        prefill.backend.add_peer(forged)
    assert _outside_shm(opened) == [] and not opened


def test_symlink_in_dev_shm_is_not_followed(prefill: Prefill, victim: Path, opened: list[str]) -> None:
    link = f"{PREFIX}{os.getpid()}-link"
    os.symlink(victim, f"/dev/shm/{link}")
    try:
        forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, SIZE)], _descriptor((link, 0)))
        with pytest.raises(PeerDataError, match=rf"shm_name='{link}': cannot open /dev/shm/{link}: is a symbolic link"):
            prefill.backend.add_peer(forged)
    finally:
        os.unlink(f"/dev/shm/{link}")
    assert _outside_shm(opened) == [], opened


def test_a_segment_shorter_than_the_claimed_region_is_refused(prefill: Prefill) -> None:
    """Mapping past the end of a file succeeds, and the first write there kills the process (SIGBUS)."""
    seg = GuardedBuffer(64, memory="shm")
    try:
        forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, SIZE)], _descriptor((seg.shm_name, 0)))
        with pytest.raises(PeerDataError, match=rf"shm_name='{seg.shm_name}': .* holds 576 B, the region needs "
                                                rf"{SIZE} B"):
            prefill.backend.add_peer(forged)
        for offset in (-1, 2**63):
            forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, 8)],
                             _descriptor((seg.shm_name, offset)))
            with pytest.raises(PeerDataError, match=rf"descriptor\[0\]\.offset={offset} is outside"):
                prefill.backend.add_peer(forged)
    finally:
        seg.close()


def test_the_senders_own_segment_is_never_a_destination() -> None:
    """A peer naming the segment that holds the sender's own source pool would make it overwrite its KV."""
    backend = LoopbackBackend(name="adv-own")
    src = GuardedBuffer(SIZE, memory="shm")
    try:
        reg = backend.register_buffers("kv", [region_of(src.data)])
        own = msgspec.msgpack.decode(reg.descriptor)[0]
        forged = _forged("evil", _endpoint("evil", b"\0" * 16), [(0x10_0000, SIZE)], _descriptor(tuple(own)))
        overlap = rf"segment '{src.shm_name}' .* overlaps memory this backend registered"
        with pytest.raises(PeerDataError, match=overlap):
            backend.add_peer(forged)
    finally:
        backend.close()
        src.close()


# ------------------------------------------------------------------- the same-process fast path
def test_a_claimed_pid_does_not_switch_on_raw_addresses(prefill: Prefill) -> None:
    """The old endpoint was (name, pid): claiming the sender's pid made it copy to raw addresses the peer chose
    (its own source pool here; anywhere, a segfault). Such an endpoint is now malformed."""
    target = region_of(prefill.src.data).addr
    forged = PeerInfo("evil", msgspec.msgpack.encode(["evil", os.getpid()]),
                      (RemoteBuffers("kv", (RegionWire(target, SIZE),)),))
    with pytest.raises(PeerDataError, match=r"peer 'evil': endpoint is not a loopback endpoint"):
        prefill.backend.add_peer(forged)


# fixed ids: a random one would differ between xdist workers, which then refuse to run
@pytest.mark.parametrize("proof", [b"\0" * 16, os.urandom(16)], ids=["zeros", "random"])
def test_a_guessed_proof_is_a_remote_peer_and_its_raw_addresses_are_never_written(
        prefill: Prefill, proof: bytes) -> None:
    """Not proven local: a region without a /dev/shm segment is unreachable, so the send is refused."""
    loot = np.zeros(SIZE, np.uint8)
    forged = _forged("evil", _endpoint("evil", proof), [(region_of(loot).addr, SIZE)])
    prefill.backend.add_peer(forged)
    with pytest.raises(RegionError, match="private memory of another process"):
        prefill.send("evil", forged.buffers[0], region_of(loot).addr)
    assert not loot.any()


def test_a_replayed_endpoint_of_the_sender_itself_is_refused(prefill: Prefill) -> None:
    """The sender's own endpoint (sent to every peer in its Welcome) with its own source regions."""
    forged = PeerInfo("evil", prefill.backend.endpoint, (prefill.reg.remote(),))
    with pytest.raises(PeerDataError, match=r"regions\[0\] .* overlaps memory this backend registered"):
        prefill.backend.add_peer(forged)


def test_a_replayed_endpoint_writes_only_where_that_backend_registered(prefill: Prefill) -> None:
    """A genuine in-process endpoint with regions its backend never registered: refused, nothing written."""
    decode = LoopbackBackend(name="adv-decode")
    dst, loot = GuardedBuffer(SIZE), np.zeros(SIZE, np.uint8)
    try:
        decode.register_buffers("kv", [region_of(dst.data)])
        forged = _forged("evil", decode.endpoint, [(region_of(loot).addr, SIZE)])
        with pytest.raises(PeerDataError, match=r"regions\[0\] .* is not registered by the in-process backend "
                                                r"'adv-decode'"):
            prefill.backend.add_peer(forged)
        stolen_name = _forged("evil", _endpoint("other-name", msgspec.msgpack.decode(decode.endpoint)[1]),
                              [(region_of(dst.data).addr, SIZE)])
        prefill.backend.add_peer(stolen_name)      # the proof binds the name: not local, so private memory
        with pytest.raises(RegionError, match="private memory"):
            prefill.send("evil", stolen_name.buffers[0], region_of(dst.data).addr)
        assert not loot.any() and not dst.read().any() and not dst.guard_damage()
    finally:
        decode.close()
        dst.close()


def test_a_local_peer_that_deregistered_or_closed_is_not_written(prefill: Prefill) -> None:
    decode = LoopbackBackend(name="adv-decode")
    dst = GuardedBuffer(SIZE)
    try:
        reg = decode.register_buffers("kv", [region_of(dst.data)])
        prefill.backend.add_peer(PeerInfo("d", decode.endpoint, (reg.remote(),)))
        assert prefill.backend.poll(prefill.send("d", reg.remote(), region_of(dst.data).addr)).state is HandleState.DONE
        dst.write(np.zeros(SIZE, np.uint8))
        decode.deregister_buffers(reg)
        with pytest.raises(PeerDataError, match="is not registered by the in-process backend 'adv-decode'"):
            prefill.send("d", reg.remote(), region_of(dst.data).addr)
        decode.close()
        with pytest.raises(RegionError, match="in-process backend is closed"):
            prefill.send("d", reg.remote(), region_of(dst.data).addr)
        assert not dst.read().any() and not dst.guard_damage()
    finally:
        decode.close()
        dst.close()


# ----------------------------------------------------------------------------- region shapes
@pytest.mark.parametrize("regions, descriptor, match", [
    ([(0x10_0000, 0)], None, r"regions\[0\]: region at 0x100000 has non-positive length 0"),
    ([(0x10_0000, -8)], None, r"regions\[0\]: region at 0x100000 has non-positive length -8"),
    ([(2**64 - 8, 16)], None, r"regions\[0\]: .* runs past the end of the 64-bit address space"),
    ([(0x10_0000, 0x2000), (0x10_1000, 0x100)], None, r"regions\[0\] and \[1\] overlap"),
    ([(0x10_0000, SIZE)], b"\xc1", r"descriptor is not a list of \(shm_name, offset\)"),
    ([(0x10_0000, SIZE), (0x20_0000, SIZE)], _descriptor(("", 0)), r"descriptor has 1 entries for 2 regions"),
])
def test_malformed_regions_are_refused_naming_the_field(prefill: Prefill, regions: list[tuple[int, int]],
                                                        descriptor: bytes | None, match: str) -> None:
    desc = descriptor if descriptor is not None else _descriptor(*[("", 0)] * len(regions))
    with pytest.raises(PeerDataError, match=rf"peer 'evil': buffers\['kv'\]\.{match}"):
        prefill.backend.add_peer(_forged("evil", _endpoint("evil", b"\0" * 16), regions, desc))


def test_a_component_announced_twice_is_refused(prefill: Prefill) -> None:
    one = RemoteBuffers("kv", (RegionWire(0x10_0000, SIZE),), _descriptor(("", 0)))
    with pytest.raises(PeerDataError, match=r"buffers name a component twice: \['kv', 'kv'\]"):
        prefill.backend.add_peer(PeerInfo("evil", _endpoint("evil", b"\0" * 16), (one, one)))


@pytest.mark.parametrize("endpoint, match", [
    (b"", "endpoint is not a loopback endpoint"),
    (msgspec.msgpack.encode(["evil", b"short"]), r"endpoint\.proof of 5 bytes"),
    (msgspec.msgpack.encode(["x" * 300, b"\0" * 16]), r"endpoint\.name of 300 characters"),
])
def test_a_malformed_endpoint_is_refused(prefill: Prefill, endpoint: bytes, match: str) -> None:
    with pytest.raises(PeerDataError, match=match):
        prefill.backend.add_peer(_forged("evil", endpoint, [(0x10_0000, SIZE)], _descriptor(("", 0))))


# ------------------------------------------------------------------------- legitimate paths still work
def test_a_peer_segment_in_dev_shm_is_written_exactly_and_only_there(prefill: Prefill) -> None:
    """The cross-process path (a peer that is not proven local): its segment is mapped and written in bounds."""
    seg = GuardedBuffer(SIZE, memory="shm")
    try:
        from mmap import ALLOCATIONGRANULARITY  # the guard before the data is not page-aligned: offset != 0

        offset = 256
        assert offset % ALLOCATIONGRANULARITY
        fake_addr = 0x7F00_0000_0000
        peer = _forged("remote", _endpoint("remote", os.urandom(16)), [(fake_addr, SIZE)],
                       _descriptor((seg.shm_name, offset)))
        prefill.backend.add_peer(peer)
        handle = prefill.send("remote", peer.buffers[0], fake_addr)
        assert prefill.backend.poll(handle).state is HandleState.DONE
        assert np.array_equal(seg.read(), prefill.src.read()) and not seg.guard_damage()
        with pytest.raises(RegionError, match="outside every registered region"):
            prefill.send("remote", peer.buffers[0], fake_addr + 1)
    finally:
        prefill.backend.remove_peer("remote")
        seg.close()


# ------------------------------------------------------------------------------ through the codec
def _hello(buffers: tuple[RemoteBuffers, ...]) -> Hello:
    comp = Component(name="kv", state_type="kv",
                     buffers=(BufferGeometry(name="k.0", num_items=1, item_shape=(SIZE,), dtype=DType.UINT8),))
    return Hello(version=PROTOCOL_VERSION, agent="evil", address="tcp://127.0.0.1:1", role=Role.DECODE,
                 layout=PoolLayout(components=(comp,), tp_size=1, tp_rank=0, page_size=16),
                 backend="loopback", endpoint=_endpoint("evil", b"\0" * 16),
                 buffers=buffers)


def test_a_forged_hello_with_a_traversal_name_decodes_and_is_refused_by_the_backend(
        prefill: Prefill, victim: Path, opened: list[str]) -> None:
    frame = Codec(sender="evil").encode(_hello((RemoteBuffers("kv", (RegionWire(0x10_0000, SIZE),),
                                                 _descriptor((os.path.relpath(victim, "/dev/shm"), 0))),)))
    hello = Codec().decode(frame)
    assert isinstance(hello, Hello)
    with pytest.raises(PeerDataError, match="is not a /dev/shm segment name"):
        prefill.backend.add_peer(PeerInfo(hello.agent, hello.endpoint, hello.buffers))
    assert opened == []


def test_a_forged_hello_with_a_negative_region_is_a_protocol_error() -> None:
    hello = _hello((RemoteBuffers("kv", (RegionWire(0x10_0000, SIZE),)),))
    raw = msgspec.msgpack.decode(Codec(sender="evil").encode(hello))
    raw[-1]["buffers"][0]["regions"][0][1] = -SIZE
    with pytest.raises(ProtocolError, match=r"Hello from 'evil': buffers of 'kv' region 0: .*non-positive length"):
        Codec().decode(msgspec.msgpack.encode(raw))

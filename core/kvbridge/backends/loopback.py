"""``loopback``: the reference backend. Copies between registered host regions with memmove.

It works within one process, and across processes on one host when the destination regions live in
named shared memory (``/dev/shm``): registration finds the segment backing each region from
``/proc/self/maps`` and puts its name in the descriptor; a peer in another process maps it. Every
descriptor is checked against the registered regions on both sides before a byte is copied.
Copies are vectorized per (buffer pair, descriptor length); notifications are delivered in-process
(a peer in another process gets them through the core's control plane instead).

Peer data is never a capability. What a peer announces (its endpoint, regions, segment names and
offsets) is validated in :meth:`LoopbackBackend.add_peer` before anything is opened or mapped:

* a segment name must match ``[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}`` (no ``/``, no leading dot); it is
  opened relative to a descriptor of ``/dev/shm`` with ``O_NOFOLLOW``, and must be a regular file of
  this user at least ``offset + nbytes`` long (a shorter one would fault on write);
* a component's regions must be valid host regions, one descriptor entry each, not overlapping, and
  never overlapping memory this backend registered itself;
* the same-process fast path (raw addresses, no mapping) is on only for a peer whose endpoint carries
  the proof of a live backend of *this* process: every backend keeps a random 16-byte token that is
  never sent, and advertises ``HMAC(token, name)`` truncated to 16 bytes. A process-local table maps
  proofs to backends, so no claim (a pid, an address, a guessed proof) from elsewhere matches it; and
  even then every destination region must be one that backend has registered for that component.

A remote that replays another endpoint it was sent (in a Hello or Welcome) impersonates that peer, as
it could with any descriptor; its writes still land only in memory that peer registered. Binding a
Hello to its sender is the control plane's job (the shared secret), not the backend's.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge._markers import hookimpl
from kvbridge.backends.base import ComponentTransfer, Poll, RegisteredBuffers, check_within
from kvbridge.backends.copying import copy_descriptors
from kvbridge.errors import GeometryError, ProtocolError, RegionError
from kvbridge.geometry import DeviceKind, MemoryRegion
from kvbridge.protocol.records import PeerInfo, RemoteBuffers
from kvbridge.shmnames import MAX_SEGMENT_NAME, is_segment_name
from kvbridge.specs import BackendSpec, Capability

_MAILBOXES: dict[bytes, deque[tuple[str, bytes]]] = {}      # proof -> notices for that local backend
_MAILBOX_LOCK = threading.Lock()
_LOCAL: dict[bytes, tuple[bytes, weakref.ref[LoopbackBackend]]] = {}   # proof -> (token, backend): this process
_PROOF_BYTES = 16
_MAX_ENDPOINT_NAME = 256
SHM_DIR = "/dev/shm"


class PeerDataError(ProtocolError, RegionError):
    """What a peer announced (endpoint, regions, segment names, offsets) fails validation; names the field."""


class _Endpoint(msgspec.Struct, frozen=True, array_like=True):
    name: str
    proof: bytes       # HMAC(token, name)[:16] of a backend whose token never leaves its process
    alive: str = ""    # abstract unix socket name bound while the backend lives (see writer_gone)


_ALIVE = re.compile(r"kvbridge-alive-[0-9a-f]{32}")


def _bind_alive() -> tuple[socket.socket, str]:
    """Bind a fresh abstract unix socket name; the kernel releases it when this process dies."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    name = f"kvbridge-alive-{secrets.token_hex(16)}"
    sock.bind("\0" + name)
    return sock, name


class _Backing(msgspec.Struct, frozen=True, array_like=True):
    shm_name: str      # "" when the region is private memory of its process
    offset: int        # byte offset of the region inside the shm segment


def _proof(token: bytes, name: str) -> bytes:
    return hmac.new(token, name.encode(), hashlib.sha256).digest()[:_PROOF_BYTES]


def check_segment_name(name: object, field: str) -> str:
    """``name`` if it is a plain /dev/shm segment name (no ``/``, no leading dot, bounded), else PeerDataError."""
    if not is_segment_name(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 60 else repr(name[:60]) + "..."
        raise PeerDataError(f"{field}={shown} is not a /dev/shm segment name (allowed: [A-Za-z0-9._-], no leading "
                            f"dot, 1 to {MAX_SEGMENT_NAME} characters)")
    return name


def _open_segment(name: str, need: int, field: str) -> tuple[int, os.stat_result]:
    """Open /dev/shm/``name`` read-write without following a link; it must be a regular file of this user
    holding at least ``need`` bytes. Returns the descriptor (the caller closes it) and its stat."""
    check_segment_name(name, field)
    directory = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK, dir_fd=directory)
    except OSError as exc:
        why = "is a symbolic link" if os.path.islink(os.path.join(SHM_DIR, name)) else exc.strerror
        raise PeerDataError(f"{field}={name!r}: cannot open {SHM_DIR}/{name}: {why}") from None
    finally:
        os.close(directory)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PeerDataError(f"{field}={name!r}: {SHM_DIR}/{name} is not a regular file")
        if info.st_uid != os.geteuid():
            raise PeerDataError(f"{field}={name!r}: {SHM_DIR}/{name} belongs to uid {info.st_uid}, not this user")
        if info.st_size < need:
            raise PeerDataError(f"{field}={name!r}: {SHM_DIR}/{name} holds {info.st_size} B, the region needs "
                                f"{need} B (offset + length)")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _file_id(backing: _Backing) -> tuple[int, int] | None:
    """(device, inode) of the segment behind a registration of ours, or None for private memory."""
    if not backing.shm_name:
        return None
    try:
        info = os.stat(os.path.join(SHM_DIR, backing.shm_name), follow_symlinks=False)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _shm_backing(region: MemoryRegion) -> _Backing:
    """Find the /dev/shm segment mapping ``region`` (if any) in /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= region.addr and region.end <= hi:
                    return _Backing(parts[5].strip()[len("/dev/shm/"):], region.addr - lo + int(parts[2], 16))
    except OSError:
        pass
    return _Backing("", 0)


@dataclass(slots=True, kw_only=True)
class _Peer:
    info: PeerInfo
    proof: bytes
    target: weakref.ref[LoopbackBackend] | None   # the proven backend of this process, or None (another process)
    maps: list[mmap.mmap]
    translate: dict[str, np.ndarray]   # component -> per-region (remote base, local base) uint64 pairs
    checked_generation: int = -1        # the target's registration generation its regions were last checked at
    sending: int = 0                    # sends between their peer look-up and the end of their copy
    retired: bool = False               # removed, replaced or backend closed: no new send finds it

    def retire(self) -> list[mmap.mmap]:
        """Mark the peer gone (caller holds the backend lock); the maps to close now: all of them when no
        send is copying through them, else none (the last send to finish closes them)."""
        self.retired = True
        if self.sending:
            return []
        maps, self.maps = self.maps, []
        return maps

    def send_done(self) -> list[mmap.mmap]:
        """A send finished (caller holds the backend lock); the maps to close now, if it was the last one
        of a retired peer."""
        self.sending -= 1
        return self.retire() if self.retired else []

    @property
    def local(self) -> bool:
        return self.target is not None


def _overlaps(spans: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Indices of two overlapping ``(start, end)`` spans, or None."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    for a, b in zip(order, order[1:]):
        if spans[b][0] < spans[a][1]:
            return a, b
    return None


class LoopbackBackend:
    """In-process / same-host shared-memory copy engine. ``name`` must be unique per endpoint."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        self.name = "loopback"
        self.endpoint_name = name
        token = secrets.token_bytes(16)              # never leaves this process
        self._proof = _proof(token, name)
        self._alive, alive = _bind_alive()
        self.endpoint = msgspec.msgpack.encode(_Endpoint(name, self._proof, alive))
        self._registered: dict[str, list[RegisteredBuffers]] = {}
        self._generation = 0                         # bumped on every (de)registration
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        with _MAILBOX_LOCK:
            _MAILBOXES[self._proof] = deque()
            _LOCAL[self._proof] = (token, weakref.ref(self))

    # -- memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        for region in regions:
            if region.device is not DeviceKind.CPU:
                raise RegionError(f"loopback moves host memory only; {component} has a {region.device.value} region")
        backing = [_shm_backing(r) for r in regions]
        files = [(_file_id(b), b.offset, b.offset + r.nbytes) for b, r in zip(backing, regions)]
        registered = RegisteredBuffers(component, tuple(regions), msgspec.msgpack.encode(backing), handle=files)
        with self._lock:
            self._registered.setdefault(component, []).append(registered)
            self._generation += 1
        return registered

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        with self._lock:
            entries = self._registered.get(registered.component, [])
            if registered in entries:
                entries.remove(registered)
                self._generation += 1
            if not entries:
                self._registered.pop(registered.component, None)

    @property
    def registered_regions(self) -> list[MemoryRegion]:
        with self._lock:
            return [r for regs in self._registered.values() for reg in regs for r in reg.regions]

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        """Validate everything ``peer`` announces (see the module docstring), then map its segments."""
        endpoint = _decode_endpoint(peer)
        target = self._proven_local(endpoint)
        components = [b.component for b in peer.buffers]
        if len(set(components)) != len(components):
            raise PeerDataError(f"peer {peer.name!r}: buffers name a component twice: {components}")
        regions = {b.component: _checked_regions(peer.name, b) for b in peer.buffers}
        maps: list[mmap.mmap] = []
        translate: dict[str, np.ndarray] = {}
        try:
            if target is not None:
                generation = target._check_holds(peer.name, peer.buffers)
                own = self._own_spans()
                for component, spans in regions.items():
                    for i, (lo, hi) in enumerate(spans):
                        if any(lo < o_hi and o_lo < hi for o_lo, o_hi in own):
                            raise PeerDataError(f"peer {peer.name!r}: buffers[{component!r}].regions[{i}] "
                                                f"[{lo:#x}, {hi:#x}) overlaps memory this backend registered")
            else:
                generation = -1
                for buffers in peer.buffers:
                    translate[buffers.component] = self._map_remote(peer.name, buffers, maps)
        except BaseException:
            _close_maps(maps)
            raise
        with self._lock:
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = _Peer(info=peer, proof=endpoint.proof,
                                           target=None if target is None else weakref.ref(target),
                                           maps=maps, translate=translate, checked_generation=generation)
            stale = old.retire() if old is not None else []
        _close_maps(stale)
        return peer.name

    def _proven_local(self, endpoint: _Endpoint) -> LoopbackBackend | None:
        """The live backend of this process whose proof ``endpoint`` carries, or None (a peer elsewhere)."""
        with _MAILBOX_LOCK:
            entry = _LOCAL.get(endpoint.proof)
        if entry is None:
            return None
        token, ref = entry
        backend = ref()
        if backend is None or backend._closed or not hmac.compare_digest(_proof(token, endpoint.name), endpoint.proof):
            return None
        return backend

    def _check_holds(self, peer: str, claimed: Sequence[RemoteBuffers]) -> int:
        """Raise unless every claimed region is one this backend has registered for that component;
        return the registration generation checked."""
        with self._lock:
            generation = self._generation
            held = {c: {(r.addr, r.nbytes) for reg in regs for r in reg.regions}
                    for c, regs in self._registered.items()}
        for buffers in claimed:
            mine = held.get(buffers.component, set())
            for i, region in enumerate(buffers.regions):
                if (region.addr, region.nbytes) not in mine:
                    raise PeerDataError(f"peer {peer!r}: buffers[{buffers.component!r}].regions[{i}] "
                                        f"[{region.addr:#x}, +{region.nbytes}) is not registered by the in-process "
                                        f"backend {self.endpoint_name!r} it claims to be")
        return generation

    def _own_spans(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(r.addr, r.end) for regs in self._registered.values() for reg in regs for r in reg.regions]

    def _own_files(self) -> list[tuple[tuple[int, int], int, int]]:
        with self._lock:
            return [f for regs in self._registered.values() for reg in regs for f in (reg.handle or ())
                    if f[0] is not None]

    def _map_remote(self, peer: str, buffers: RemoteBuffers, maps: list[mmap.mmap]) -> np.ndarray:
        where_field = f"peer {peer!r}: buffers[{buffers.component!r}].descriptor"
        try:
            backing = msgspec.msgpack.decode(buffers.descriptor, type=list[_Backing])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerDataError(f"{where_field} is not a list of (shm_name, offset): {exc}") from None
        if len(backing) != len(buffers.regions):
            raise PeerDataError(f"{where_field} has {len(backing)} entries for {len(buffers.regions)} regions")
        own = self._own_files()
        pairs = np.zeros((len(buffers.regions), 2), dtype=np.uint64)
        for i, (region, where) in enumerate(zip(buffers.regions, backing)):
            if not where.shm_name:
                pairs[i] = (region.addr, 0)   # private memory of the peer: unreachable, refused at send
                continue
            field = f"{where_field}[{i}]"
            check_segment_name(where.shm_name, f"{field}.shm_name")
            if not 0 <= where.offset <= 2**63 - 1 - region.nbytes:
                raise PeerDataError(f"{field}.offset={where.offset} is outside [0, 2**63 - length)")
            fd, info = _open_segment(where.shm_name, where.offset + region.nbytes, f"{field}.shm_name")
            try:
                lo, hi = where.offset, where.offset + region.nbytes
                for file_id, o_lo, o_hi in own:
                    if file_id == (info.st_dev, info.st_ino) and lo < o_hi and o_lo < hi:
                        raise PeerDataError(f"{field}: segment {where.shm_name!r} [{lo}, {hi}) overlaps memory this "
                                            "backend registered")
                page = mmap.ALLOCATIONGRANULARITY
                start = where.offset - where.offset % page
                mapped = mmap.mmap(fd, where.offset - start + region.nbytes, offset=start)
            finally:
                os.close(fd)
            maps.append(mapped)
            base = ctypes.addressof(ctypes.c_uint8.from_buffer(mapped)) + (where.offset - start)
            pairs[i] = (region.addr, base)
        return pairs

    def remove_peer(self, peer_id: str) -> None:
        """Forget the peer and unmap its segments: now, or when the last send copying into them ends (an
        unmapped destination under a running copy would crash the process)."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            maps = peer.retire() if peer is not None else []
        _close_maps(maps)

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> Any:
        if self._closed:
            raise RegionError("loopback backend is closed")
        with self._lock:
            peer = self._peers.get(transfer.peer)
            registered = any(reg is transfer.src for reg in self._registered.get(transfer.component, []))
            if peer is None:
                raise RegionError(f"unknown peer {transfer.peer!r}; add_peer first")
            peer.sending += 1                # its maps stay until this send is over, whoever removes it
        try:
            return self._send(transfer, peer, registered)
        finally:
            with self._lock:
                maps = peer.send_done()
            _close_maps(maps)

    def _send(self, transfer: ComponentTransfer, peer: _Peer, registered: bool) -> Poll:
        plan = transfer.plan
        if not registered:
            raise RegionError(f"source buffers of {transfer.component!r} are not registered with this backend")
        check_within(plan.src_addr, plan.nbytes, transfer.src.regions, f"source ({transfer.component})")
        remote = peer.info.component(transfer.component).regions if transfer.component in {
            b.component for b in peer.info.buffers} else ()
        if tuple(transfer.dst.regions) != tuple(remote):
            raise RegionError(f"destination regions of {transfer.component!r} are not what peer {transfer.peer!r} "
                              "registered")
        check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, f"destination ({transfer.component})")
        dst = plan.dst_addr
        if peer.target is not None:
            self._recheck_local(transfer.peer, peer)
        else:
            pairs = peer.translate.get(transfer.component)
            if pairs is None:
                raise RegionError(f"peer {transfer.peer!r} registered no component {transfer.component!r}")
            order = np.argsort(pairs[:, 0])
            rows = order[np.searchsorted(pairs[order, 0], dst, side="right") - 1]
            if np.any(pairs[rows, 1] == 0):
                raise RegionError(f"peer {transfer.peer!r}: {transfer.component} region is private memory of another "
                                  "process; loopback reaches other processes only through /dev/shm")
            dst = dst - pairs[rows, 0] + pairs[rows, 1]
        copy_descriptors(plan.src_addr, dst, plan.nbytes)
        return Poll.done()

    @staticmethod
    def _recheck_local(peer_id: str, peer: _Peer) -> None:
        """An in-process peer's regions are written at their raw addresses: they must still be registered."""
        target = peer.target() if peer.target is not None else None
        if target is None or target._closed:
            raise RegionError(f"peer {peer_id!r}: its in-process backend is closed")
        if target._generation != peer.checked_generation:
            peer.checked_generation = target._check_holds(peer_id, peer.info.buffers)

    def poll(self, handle: Any) -> Poll:
        return handle if isinstance(handle, Poll) else Poll.failed(f"not a loopback handle: {handle!r}")

    def release(self, handle: Any) -> None:
        return None

    # -- notifications
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None or not peer.local:
            return False
        with _MAILBOX_LOCK:
            box = _MAILBOXES.get(peer.proof)
            if box is None:
                return False
            box.append((self.endpoint_name, notice))
        return True

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with _MAILBOX_LOCK:
            box = _MAILBOXES.get(self._proof)
            if not box:
                return []
            out = list(box)
            box.clear()
        return out

    @staticmethod
    def writer_gone(endpoint: bytes) -> bool:
        """True only when the kernel confirms that the backend which advertised ``endpoint`` is closed or
        its process is gone: its abstract socket name is free again. A stopped (SIGSTOP) process still
        holds it, so silence alone never makes this True.

        The name comes from the peer; a writer that lies about it can only make its own rooms look fenced,
        and such a writer could write into them anyway.
        """
        try:
            alive = msgspec.msgpack.decode(endpoint, type=_Endpoint).alive
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if not _ALIVE.fullmatch(alive):
            return False
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.bind("\0" + alive)
        except OSError:
            return False            # still bound: the writer lives (perhaps stopped)
        finally:
            probe.close()
        return True

    def close(self) -> None:
        self._closed = True
        self._alive.close()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._registered.clear()
            maps = [m for peer in peers for m in peer.retire()]
        _close_maps(maps)
        with _MAILBOX_LOCK:
            _MAILBOXES.pop(self._proof, None)
            _LOCAL.pop(self._proof, None)


def _decode_endpoint(peer: PeerInfo) -> _Endpoint:
    try:
        endpoint = msgspec.msgpack.decode(peer.endpoint, type=_Endpoint)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise PeerDataError(f"peer {peer.name!r}: endpoint is not a loopback endpoint (name, proof): {exc}") from None
    if not endpoint.name or len(endpoint.name) > _MAX_ENDPOINT_NAME:
        raise PeerDataError(f"peer {peer.name!r}: endpoint.name of {len(endpoint.name)} characters (1 to "
                            f"{_MAX_ENDPOINT_NAME} allowed)")
    if len(endpoint.proof) != _PROOF_BYTES:
        raise PeerDataError(f"peer {peer.name!r}: endpoint.proof of {len(endpoint.proof)} bytes (want {_PROOF_BYTES})")
    return endpoint


def _checked_regions(peer: str, buffers: RemoteBuffers) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each announced region: valid host regions that do not overlap each other."""
    spans = []
    for i, wire in enumerate(buffers.regions):
        field = f"peer {peer!r}: buffers[{buffers.component!r}].regions[{i}]"
        try:
            region = wire.region()
        except GeometryError as exc:
            raise PeerDataError(f"{field}: {exc}") from None
        if region.device is not DeviceKind.CPU:
            raise PeerDataError(f"{field}.device={region.device.value!r}: loopback moves host memory only")
        spans.append((region.addr, region.end))
    clash = _overlaps(spans)
    if clash is not None:
        a, b = clash
        raise PeerDataError(f"peer {peer!r}: buffers[{buffers.component!r}].regions[{a}] and [{b}] overlap")
    return spans


def _close_maps(maps: list[mmap.mmap]) -> None:
    """Unmap and close each (its descriptor too). Nothing here keeps an export of a map (the address is
    taken through a ctypes object freed at once), so a BufferError means someone else holds a view: that
    mapping then goes when the view is collected."""
    for mapped in maps:
        try:
            mapped.close()
        except BufferError:
            pass


SPEC = BackendSpec(
    name="loopback", factory=LoopbackBackend,
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.MULTI_PROCESS, Capability.NOTIFICATIONS,
                            Capability.WRITER_GONE}),
    description="reference memmove backend: in-process, or same-host via /dev/shm",
    # copy_descriptors costs ~0.2-0.5 us per descriptor beyond its bytes (2-core host, 2026-11): staging
    # (two more host passes) wins only for runs below ~1.5 KB
    descriptor_cost_us=0.5,
    # writer_gone reads the kernel's own state: the abstract name is free once the writer's last descriptor
    # closed, which its exit does at once (a copy is a memmove of the writer's process: none outlives it)
    writer_gone_bound_s=1.0,
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

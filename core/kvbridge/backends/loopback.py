"""``loopback``: the reference backend. Copies between registered host regions with memmove.

It works within one process, and across processes on one host when the destination regions live in
named shared memory (``/dev/shm``): registration finds the segment backing each region from
``/proc/self/maps`` and puts its name in the descriptor; a peer in another process maps it. Every
descriptor is checked against the registered regions on both sides before a byte is copied.
Copies are vectorized per (buffer pair, descriptor length); notifications are delivered in-process
(a peer in another process gets them through the core's control plane instead).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.backends.base import (
    ComponentTransfer, PeerInfo, Poll, RegisteredBuffers, RemoteBuffers, check_within,
)
from kvbridge.errors import RegionError
from kvbridge.geometry import DeviceKind, MemoryRegion
from kvbridge.plugin import hookimpl
from kvbridge.specs import BackendSpec, Capability

_MAILBOXES: dict[bytes, deque[tuple[str, bytes]]] = {}
_MAILBOX_LOCK = threading.Lock()
_SMALL_GROUP = 8  # below this many same-length descriptors, memmove each directly
_LARGE_DESCRIPTOR = 16384  # and from this size on too: the per-call cost is lost in the copy itself


class _Endpoint(msgspec.Struct, frozen=True, array_like=True):
    name: str
    pid: int


class _Backing(msgspec.Struct, frozen=True, array_like=True):
    shm_name: str      # "" when the region is private memory of its process
    offset: int        # byte offset of the region inside the shm segment


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


@dataclass(slots=True)
class _Peer:
    info: PeerInfo
    local: bool
    maps: list[mmap.mmap]
    translate: dict[str, np.ndarray]   # component -> per-region (remote base, local base) uint64 pairs


def _bytes_at(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def copy_descriptors(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
    """Copy ``lens[i]`` bytes from address ``src[i]`` to ``dst[i]`` for all i, vectorized per length.

    Callers bounds-check first. Same-length descriptors are copied with one gather and one scatter over
    sliding-window views of the spanned memory; a handful go through memmove directly.
    """
    if lens.size == 0:
        return
    if lens.size < _SMALL_GROUP:          # a handful: no grouping work at all
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        return
    for length in np.unique(lens):
        sel = np.flatnonzero(lens == length)
        n = int(length)
        if sel.size < _SMALL_GROUP or n >= _LARGE_DESCRIPTOR:
            for i in sel:
                ctypes.memmove(int(dst[i]), int(src[i]), n)
            continue
        s, d = src[sel], dst[sel]
        s_lo, d_lo = int(s.min()), int(d.min())
        s_view = np.lib.stride_tricks.sliding_window_view(_bytes_at(s_lo, int(s.max()) - s_lo + n), n)
        d_view = np.lib.stride_tricks.sliding_window_view(_bytes_at(d_lo, int(d.max()) - d_lo + n), n,
                                                          writeable=True)
        d_view[(d - np.uint64(d_lo)).astype(np.int64)] = s_view[(s - np.uint64(s_lo)).astype(np.int64)]


class LoopbackBackend:
    """In-process / same-host shared-memory copy engine. ``name`` must be unique per endpoint."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        self.name = "loopback"
        self.endpoint_name = name
        self.endpoint = msgspec.msgpack.encode(_Endpoint(name, os.getpid()))
        self._registered: dict[str, list[RegisteredBuffers]] = {}
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        with _MAILBOX_LOCK:
            _MAILBOXES[self.endpoint] = deque()

    # -- memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        for region in regions:
            if region.device is not DeviceKind.CPU:
                raise RegionError(f"loopback moves host memory only; {component} has a {region.device.value} region")
        backing = [_shm_backing(r) for r in regions]
        registered = RegisteredBuffers(component, tuple(regions), msgspec.msgpack.encode(backing))
        with self._lock:
            self._registered.setdefault(component, []).append(registered)
        return registered

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        with self._lock:
            entries = self._registered.get(registered.component, [])
            if registered in entries:
                entries.remove(registered)
            if not entries:
                self._registered.pop(registered.component, None)

    @property
    def registered_regions(self) -> list[MemoryRegion]:
        with self._lock:
            return [r for regs in self._registered.values() for reg in regs for r in reg.regions]

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        endpoint = msgspec.msgpack.decode(peer.endpoint, type=_Endpoint)
        local = endpoint.pid == os.getpid()
        maps: list[mmap.mmap] = []
        translate: dict[str, np.ndarray] = {}
        if not local:
            for buffers in peer.buffers:
                translate[buffers.component] = self._map_remote(buffers, maps)
        with self._lock:
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = _Peer(peer, local, maps, translate)
        if old is not None:
            _close_maps(old.maps)
        return peer.name

    def _map_remote(self, buffers: RemoteBuffers, maps: list[mmap.mmap]) -> np.ndarray:
        backing = msgspec.msgpack.decode(buffers.descriptor, type=list[_Backing])
        pairs = np.zeros((len(buffers.regions), 2), dtype=np.uint64)
        for i, (region, where) in enumerate(zip(buffers.regions, backing)):
            if not where.shm_name:
                pairs[i] = (region.addr, 0)   # private memory of the peer: unreachable, refused at send
                continue
            fd = os.open(f"/dev/shm/{where.shm_name}", os.O_RDWR)
            try:
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
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            _close_maps(peer.maps)

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> Any:
        if self._closed:
            raise RegionError("loopback backend is closed")
        plan = transfer.plan
        with self._lock:
            peer = self._peers.get(transfer.peer)
            registered = any(reg is transfer.src for reg in self._registered.get(transfer.component, []))
        if peer is None:
            raise RegionError(f"unknown peer {transfer.peer!r}; add_peer first")
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
        if not peer.local:
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
            box = _MAILBOXES.get(peer.info.endpoint)
            if box is None:
                return False
            box.append((self.endpoint_name, notice))
        return True

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with _MAILBOX_LOCK:
            box = _MAILBOXES.get(self.endpoint)
            if not box:
                return []
            out = list(box)
            box.clear()
        return out

    def close(self) -> None:
        self._closed = True
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._registered.clear()
        for peer in peers:
            _close_maps(peer.maps)
        with _MAILBOX_LOCK:
            _MAILBOXES.pop(self.endpoint, None)


def _close_maps(maps: list[mmap.mmap]) -> None:
    for mapped in maps:
        try:
            mapped.close()
        except BufferError:  # a numpy view still alive; the mapping goes when it is collected
            pass


SPEC = BackendSpec(
    name="loopback", factory=LoopbackBackend,
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.MULTI_PROCESS, Capability.NOTIFICATIONS}),
    description="reference memmove backend: in-process, or same-host via /dev/shm",
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

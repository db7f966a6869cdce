"""Host buffers for a pool layout, optionally in /dev/shm so a peer process can map them (loopback).

Used by the demo's rank processes and by ``kvbridge bench control``; segments are named
``<prefix><pid>-<n>`` so the ones a killed process left behind can be reaped by its pid.

    pool = HostPool(layout, shared=True)
    agent = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, ...)
    ...
    pool.close()                       # unlinks its segments
    reap_segments(dead_pid)            # or: another process cleans up after a killed one
"""

from __future__ import annotations

import itertools
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from kvbridge.geometry import PoolLayout
from kvbridge.shmnames import segment_prefix

__all__ = ["SEGMENT_PREFIX", "HostPool", "reap_segments"]

_SERIAL = itertools.count()               # segment numbers, unique across every pool of this process
SEGMENT_PREFIX = segment_prefix("demo")   # kvbridge-demo-<run tag>-: unique per run (kvbridge.shmnames)


def reap_segments(pid: int, prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink the /dev/shm segments named ``<prefix><pid>-<n>`` of process ``pid`` (e.g. one that was
    killed and could not unlink its own); return their names."""
    gone: list[str] = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return gone
    for name in names:
        if name.startswith(f"{prefix}{pid}-"):
            try:
                os.unlink(f"/dev/shm/{name}")
                gone.append(name)
            except FileNotFoundError:
                pass
    return gone


class HostPool:
    """Zeroed host buffers of every component (``buffers[name]``: uint8 ``[items, item bytes]`` per buffer)
    and a staging area; in /dev/shm when ``shared`` (so peers can map them)."""

    def __init__(self, layout: PoolLayout, shared: bool, staging_bytes: int = 16 << 20, *,
                 prefix: str = SEGMENT_PREFIX) -> None:
        self._prefix = prefix
        self._segments: list[SharedMemory] = []
        self.buffers: dict[str, list[np.ndarray]] = {}
        for comp in layout.components:
            arrays = []
            for geom in comp.buffers:
                arrays.append(self._array(geom.nbytes, shared).reshape(geom.num_items, geom.item_nbytes))
            self.buffers[comp.name] = arrays
        self.staging = self._array(staging_bytes, shared) if staging_bytes else None

    def _array(self, nbytes: int, shared: bool) -> np.ndarray:
        if shared:
            seg = SharedMemory(name=f"{self._prefix}{os.getpid()}-{next(_SERIAL)}", create=True, size=nbytes)
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            self._segments.append(seg)
            arr = np.ndarray((nbytes,), np.uint8, seg.buf)
        else:
            arr = np.empty(nbytes, np.uint8)
        arr.fill(0)            # pre-touch: first-touch page faults would cost ~20x on the first write
        return arr

    def close(self) -> None:
        self.buffers.clear()
        self.staging = None
        for seg in self._segments:
            try:
                seg.close()
            except BufferError:
                pass
            try:  # not seg.unlink(): the segment is not tracked by the resource tracker (see __init__)
                os.unlink(f"/dev/shm/{seg.name}")
            except FileNotFoundError:
                pass
        self._segments.clear()

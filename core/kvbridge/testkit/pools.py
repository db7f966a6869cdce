"""Memory the kit registers: buffers with guard bytes on both sides, in host memory, /dev/shm or CUDA.

Every registered buffer sits between two guard zones filled with a fixed pattern; a write that strays
outside registered memory changes a guard and is reported. /dev/shm buffers (what ``loopback`` needs
to reach another process) are named ``kvbridge-kit-<run>-<pid>-<n>`` (``<run>``: this test run's tag, see
:mod:`kvbridge.shmnames`) so a killed process's can be reaped and no other run's is ever touched.

    buf = GuardedBuffer(4096, memory="host")
    agent_buffers = [buf.data]            # a contiguous uint8 array exactly the registered size
    assert not buf.guard_damage()
"""

from __future__ import annotations

import itertools
import mmap
import os
from typing import Any

import numpy as np

from kvbridge import hostpool
from kvbridge import pattern as ref
from kvbridge.shmnames import segment_prefix

__all__ = ["GUARD", "SHM_PREFIX", "GuardedBuffer", "reap_segments"]

GUARD = 256                  # bytes of guard on each side of a registered buffer
SHM_PREFIX = segment_prefix("kit")   # kvbridge-kit-<run tag>-: this run's only
_COUNTER = itertools.count()


def _guard_pattern(n: int) -> np.ndarray:
    return ref.pattern(0x6A7D, 0xA11CE, np.arange(n, dtype=np.int64))


def reap_segments(pid: int, prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink the /dev/shm segments named ``<prefix><pid>-<n>`` of process ``pid`` (e.g. one that was
    killed and could not unlink its own); return their names. The default prefix is this run's."""
    return hostpool.reap_segments(pid, prefix)


class GuardedBuffer:
    """``nbytes`` of registrable memory (``data``) with ``GUARD`` bytes of canary before and after.

    ``memory``: ``"host"`` (numpy), ``"shm"`` (a /dev/shm mapping, reachable from another process) or
    ``"cuda"`` (a torch tensor on ``device``). ``read()``/``write()`` work on host copies for every kind.
    """

    def __init__(self, nbytes: int, *, memory: str = "host", device: int = 0) -> None:
        self.nbytes, self.memory = int(nbytes), memory
        total = self.nbytes + 2 * GUARD
        self._map: mmap.mmap | None = None
        self.shm_name = ""
        if memory == "host":
            self._whole: Any = np.zeros(total, np.uint8)
        elif memory == "shm":
            self.shm_name = f"{SHM_PREFIX}{os.getpid()}-{next(_COUNTER)}"
            fd = os.open(f"/dev/shm/{self.shm_name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)
                self._map = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            self._whole = np.frombuffer(self._map, np.uint8)
        elif memory == "cuda":
            import torch

            self._whole = torch.zeros(total, dtype=torch.uint8, device=f"cuda:{device}")
        else:
            raise ValueError(f"memory must be host, shm or cuda, got {memory!r}")
        self.data = self._whole[GUARD: GUARD + self.nbytes]
        self._set(0, _guard_pattern(GUARD))
        self._set(GUARD + self.nbytes, _guard_pattern(GUARD))

    def _set(self, offset: int, values: np.ndarray) -> None:
        if self.memory == "cuda":
            import torch

            self._whole[offset: offset + values.size].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        else:
            self._whole[offset: offset + values.size] = values

    def _get(self, offset: int, n: int) -> np.ndarray:
        if self.memory == "cuda":
            return self._whole[offset: offset + n].cpu().numpy()
        return np.array(self._whole[offset: offset + n])

    def read(self) -> np.ndarray:
        """A host copy of the registered bytes."""
        return self._get(GUARD, self.nbytes)

    def write(self, values: np.ndarray) -> None:
        flat = np.ascontiguousarray(values, dtype=np.uint8).reshape(-1)
        if flat.size != self.nbytes:
            raise ValueError(f"writing {flat.size} bytes into a buffer of {self.nbytes}")
        self._set(GUARD, flat)

    def guard_damage(self) -> str:
        """Empty when both guards are intact, else which bytes outside the buffer changed."""
        want = _guard_pattern(GUARD)
        out = []
        for side, offset in (("before", 0), ("after", GUARD + self.nbytes)):
            bad = np.flatnonzero(self._get(offset, GUARD) != want)
            if bad.size:
                first = int(bad[0]) - GUARD if side == "before" else int(bad[0])
                out.append(f"{bad.size} byte(s) {side} the buffer changed (first at offset "
                           f"{first:+d} from the {'start' if side == 'before' else 'end'})")
        return "; ".join(out)

    def close(self) -> None:
        if self.shm_name:
            try:
                os.unlink(f"/dev/shm/{self.shm_name}")
            except FileNotFoundError:
                pass
            self.shm_name = ""
        self.data = self._whole = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:     # a view is still alive (an agent keeps its buffers); freed when collected
                pass
            self._map = None

"""Move an engine-allocated host tensor's memory into a named /dev/shm segment, in place.

kvbridge's ``loopback`` backend reaches another process's memory only through /dev/shm: the writer maps
the destination's segment by name. vLLM allocates its CPU KV cache itself (one large ``torch.zeros``), so
a decode instance that receives over loopback moves that allocation into a segment at the *same virtual
addresses*: copy the pages to a new segment, then map the segment over them (``MAP_FIXED``). Every
tensor view vLLM already holds keeps working; only the backing changes. The allocation must be a private
anonymous mapping of its own (what glibc gives a multi-MiB allocation), so no unrelated heap data shares its
pages: checked in /proc/self/maps, or, where the kernel merged it with an adjacent anonymous mapping into one
entry there (two large allocations in a row), in glibc's header of the chunk it mapped alone. Linux only.
"""

from __future__ import annotations

import ctypes
import mmap
import os

from kvbridge.errors import KVBridgeError
from kvbridge.hostpool import reap_segments

__all__ = ["SEGMENT_PREFIX", "reap", "remap_to_shm"]

SEGMENT_PREFIX = "kvbridge-vllm-"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mapping_of(lo: int, hi: int) -> tuple[int, int, str]:
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= lo and hi <= end:
                return start, end, parts[5] if len(parts) > 5 else ""
    raise KVBridgeError(f"no single mapping holds [{lo:#x}, {hi:#x})")


def _glibc_mmapped_chunk(addr: int, lo: int) -> tuple[int, int] | None:
    """The span glibc mapped for the allocation at ``addr`` alone, from its chunk header, or None: the two words
    before the pointer are the padding in front of the chunk (an aligned allocation) and the chunk's size,
    whose bit 1 (IS_MMAPPED) says the chunk has a mapping of its own, ``[chunk - padding, + padding + size)``.
    ``lo`` (the page of ``addr``, known mapped) bounds the read."""
    if addr - 16 < lo:
        return None
    padding, size = (ctypes.c_size_t * 2).from_address(addr - 16)
    if not size & 2:
        return None
    start = addr - 16 - padding
    return start, start + padding + (size & ~7)


def remap_to_shm(addr: int, nbytes: int, tag: str) -> str:
    """Back ``[addr, addr + nbytes)`` with /dev/shm/``<prefix><pid>-<tag>``; return the segment name.

    The page-aligned span around the range is copied and remapped whole: it must lie inside one private
    anonymous mapping no larger than the span plus two pages (the allocator's header page and tail), as
    /proc/self/maps shows it or, inside a larger anonymous entry there (merged neighbours), as glibc's header
    of a chunk mapped alone gives it."""
    page = mmap.PAGESIZE
    lo, hi = addr & ~(page - 1), (addr + nbytes + page - 1) & ~(page - 1)
    start, end, path = _mapping_of(lo, hi)
    if not path and end - start > hi - lo + 2 * page:
        chunk = _glibc_mmapped_chunk(addr, lo)
        if chunk is not None and start <= chunk[0] <= lo and hi <= chunk[1] <= end:
            start, end = chunk
    if path or end - start > hi - lo + 2 * page:
        raise KVBridgeError(f"the KV cache at {addr:#x} ({nbytes} B) is not an anonymous mapping of its own "
                            f"(mapping [{start:#x}, {end:#x}) {path!r}); cannot move it to /dev/shm")
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{tag}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, hi - lo)
        view = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        written = 0
        while written < hi - lo:
            written += os.pwrite(fd, view[written:], written)
        flags = mmap.MAP_SHARED | 0x10   # MAP_FIXED
        got = _libc.mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if got in (None, _MAP_FAILED) or got != lo:
            err = ctypes.get_errno()
            raise KVBridgeError(f"mmap of /dev/shm/{name} over the KV cache failed: {os.strerror(err)}")
    except BaseException:
        os.unlink(f"/dev/shm/{name}")
        raise
    finally:
        os.close(fd)
    return name


def reap(pid: int) -> list[str]:
    """Unlink the segments process ``pid`` made (for a test or supervisor cleaning up after a kill)."""
    return reap_segments(pid, SEGMENT_PREFIX)

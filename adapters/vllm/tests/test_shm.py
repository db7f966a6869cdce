"""``remap_to_shm`` on allocations like vLLM's CPU KV cache: which it must move in place, which it must refuse.

The promise: only memory that is one allocation's own mapping is moved to /dev/shm (no unrelated data may
share its pages), its bytes survive the move, and a neighbour's memory is left alone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import pytest

from kvbridge.errors import KVBridgeError
from kvbridge_vllm.shm import SEGMENT_PREFIX, remap_to_shm

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.free.argtypes = [ctypes.c_void_p]
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
LIBC.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
MIB = 1 << 20


def aligned(nbytes: int) -> int:
    """What torch's CPU allocator does: posix_memalign(64, n) (glibc maps a large one alone)."""
    ptr = ctypes.c_void_p()
    assert LIBC.posix_memalign(ctypes.byref(ptr), 64, nbytes) == 0
    assert ptr.value is not None
    return ptr.value


def maps_entry(addr: int) -> tuple[int, int]:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return start, end
    raise AssertionError(f"{addr:#x} is not mapped")


def in_heap(addr: int) -> bool:
    """Is ``addr`` in the brk heap? glibc serves even a large request from a free heap chunk big enough, which
    earlier tests in this worker process can leave (freed, consolidated arrays)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= addr < end:
                return fields[-1] == "[heap]"
    return False


@pytest.fixture
def segments() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        os.unlink(f"/dev/shm/{name}")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")]


def mmapped_chunk(ptr: int, span: int) -> None:
    """Write glibc's header of a chunk mapped alone in front of ``ptr`` (as posix_memalign(64, n) lays one out at a
    page start: 48 bytes of padding, then the two header words): padding 48, size ``span - 48`` with IS_MMAPPED."""
    (ctypes.c_size_t * 2).from_address(ptr - 16)[:] = [48, (span - 48) | 2]


def test_allocation_merged_with_its_neighbour_moves_alone(segments: list[str]) -> None:
    """Two large allocations in a row: the kernel shows them as one anonymous entry in /proc/self/maps (the
    layout that made every loopback decode of the vLLM end-to-end tests refuse its KV cache). The second moves
    to /dev/shm with its bytes; the first, sharing that entry, is neither copied into the segment nor changed.

    The layout is built, not hoped for: one anonymous mapping holding two chunks with glibc's headers (whether
    the kernel merges two real allocations depends on what else the process mapped)."""
    size = 40 * MIB
    span = size + mmap.PAGESIZE                     # 64 bytes in front of the data, rounded up to pages
    region = mmap.mmap(-1, 2 * span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    first, second = base + 64, base + span + 64
    try:
        mmapped_chunk(first, span)
        mmapped_chunk(second, span)
        start, end = maps_entry(second)
        assert start <= base and base + 2 * span <= end, "the two chunks are not one entry in /proc/self/maps"
        ctypes.memset(first, 0x11, size)
        ctypes.memset(second, 0x22, size)
        name = remap_to_shm(second, size, "merged")
        segments.append(name)
        assert ctypes.string_at(second, size) == b"\x22" * size, "bytes lost in the move"
        with open(f"/dev/shm/{name}", "r+b") as seg, mmap.mmap(seg.fileno(), 0) as view:
            offset = second & (mmap.PAGESIZE - 1)
            view[offset:offset + 4] = b"abcd"           # the segment now backs the allocation
            assert ctypes.string_at(second, 4) == b"abcd"
            assert len(view) <= size + 2 * mmap.PAGESIZE and b"\x11" not in bytes(view), \
                "the neighbour's bytes were moved with it"
        ctypes.memset(first, 0x33, size)                # the neighbour stays private memory
        with open(f"/dev/shm/{name}", "rb") as moved:
            assert b"\x33" not in moved.read()
        assert ctypes.string_at(first, 16) == b"\x33" * 16
    finally:
        region.close()


def test_glibc_heads_a_large_aligned_allocation_as_remap_reads_it() -> None:
    """The header the merged-neighbour case relies on, on this glibc: a 40 MiB posix_memalign(64) chunk that got a
    mapping of its own says so (IS_MMAPPED) and spans whole pages holding the allocation inside its mapping; one
    malloc served from free heap space (earlier tests can leave some) does not claim a mapping and is refused."""
    size = 40 * MIB
    ptr = aligned(size)
    try:
        padding, word = (ctypes.c_size_t * 2).from_address(ptr - 16)
        if in_heap(ptr):
            assert not word & 2, "a heap chunk claims a mapping of its own"
            with pytest.raises(KVBridgeError, match="not an anonymous mapping of its own"):
                remap_to_shm(ptr, size, "heap-served")
            return
        assert word & 2, "a chunk of its own mapping lacks IS_MMAPPED"
        chunk_start = ptr - 16 - padding
        chunk_end = chunk_start + padding + (word & ~7)
        start, end = maps_entry(ptr)
        assert chunk_start % mmap.PAGESIZE == 0 and chunk_end % mmap.PAGESIZE == 0
        assert start <= chunk_start and chunk_end <= end and chunk_start <= ptr and ptr + size <= chunk_end
    finally:
        LIBC.free(ptr)


def test_heap_allocation_is_refused(segments: list[str]) -> None:
    """A small allocation shares its pages with other heap data: refused, naming the mapping."""
    ptr = LIBC.malloc(64 * 1024)
    assert ptr
    try:
        with pytest.raises(KVBridgeError, match="not an anonymous mapping of its own"):
            segments.append(remap_to_shm(ptr, 64 * 1024, "heap"))
    finally:
        LIBC.free(ptr)


@pytest.mark.parametrize("header", ["zeros", "span-outside-the-mapping"])
def test_range_inside_a_larger_mapping_without_a_chunk_of_its_own_is_refused(segments: list[str],
                                                                            header: str) -> None:
    """Part of a larger anonymous mapping with no glibc chunk header of its own (or one claiming a span the
    mapping does not hold) is refused: moving it would take other data's pages along."""
    region = mmap.mmap(-1, 32 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    addr = base + 4 * MIB + 64
    try:
        if header == "span-outside-the-mapping":    # IS_MMAPPED, padding 48 (page start), size 1 TiB
            (ctypes.c_size_t * 2).from_address(addr - 16)[:] = [48, 1 << 40 | 2]
        with pytest.raises(KVBridgeError, match="not an anonymous mapping of its own"):
            segments.append(remap_to_shm(addr, 8 * MIB, "inside"))
    finally:
        region.close()

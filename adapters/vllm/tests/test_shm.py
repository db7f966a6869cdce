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


def test_allocation_merged_with_its_neighbour_moves_alone(segments: list[str]) -> None:
    """Two large allocations in a row: the kernel shows them as one anonymous entry in /proc/self/maps (the
    layout that made every loopback decode of the vLLM end-to-end tests refuse its KV cache). The second moves
    to /dev/shm with its bytes; the first, sharing that entry, is neither copied into the segment nor changed."""
    size = 40 * MIB                # above glibc's largest mmap threshold (32 MiB): always mapped alone
    first, second = aligned(size), aligned(size)
    try:
        if in_heap(first) or in_heap(second):
            pytest.skip("malloc served the allocations from free heap space left by earlier tests in this process "
                        "(no mapping of their own to test)")
        start, end = maps_entry(second)
        if end - start <= size + 2 * mmap.PAGESIZE:
            pytest.skip("the kernel placed the two allocations apart (no merged entry to test)")
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
        with open(f"/dev/shm/{name}", "rb") as seg:
            assert b"\x33" not in seg.read()
        assert ctypes.string_at(first, 16) == b"\x33" * 16
    finally:
        LIBC.free(second)
        LIBC.free(first)


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

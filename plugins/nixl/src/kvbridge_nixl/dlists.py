"""Prepped descriptor lists for one component: built once, indexed per request (pure numpy, no NIXL).

One side's dlist holds, for each buffer that has segments, one descriptor per (item, segment)::

    index   = start[b] + item * nseg[b] + seg
    address = base[b] + item * item_nbytes[b] + seg_off[b][seg]

A request names its descriptors by index, ordered buffer -> item (ascending source item) -> segment, so
runs that are contiguous in memory on both sides sit next to each other in the index lists and NIXL
merges them into one descriptor (it does so on the prepped path only).

Item sizes are not part of ``ComponentTransfer``; they are recovered exactly from the plan: the furthest
byte a buffer's descriptors reach is ``base + max(items) * item_nbytes + max(seg_off + seg_len)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.plugin import RegionError, Segments

_I32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class Pattern:
    """What one tuple of per-buffer ``Segments`` implies; computed once per tuple."""

    active: np.ndarray                 # int64: buffers with at least one segment
    nseg: np.ndarray                   # int64 per active buffer
    src_off: tuple[np.ndarray, ...]    # per active buffer
    dst_off: tuple[np.ndarray, ...]
    seg_len: tuple[np.ndarray, ...]
    src_end: np.ndarray                # int64 per active buffer: max(src_off + len)
    dst_end: np.ndarray
    item_bytes: int                    # bytes one (source item, destination item) pair moves, all buffers
    groups: tuple[tuple[int, np.ndarray], ...]   # (nseg, positions into ``active`` with that count)
    src_key: bytes
    dst_key: bytes

    @classmethod
    def of(cls, segments: Sequence[Segments]) -> Pattern:
        active = [b for b, seg in enumerate(segments) if len(seg)]
        segs = [segments[b] for b in active]
        nseg = np.array([len(s) for s in segs], dtype=np.int64)
        src_end = np.array([int((s.src_off + s.nbytes).max()) for s in segs], dtype=np.int64)
        dst_end = np.array([int((s.dst_off + s.nbytes).max()) for s in segs], dtype=np.int64)
        groups = tuple((int(n), np.flatnonzero(nseg == n)) for n in np.unique(nseg))
        idx = np.array(active, dtype=np.int64)
        src_key = idx.tobytes() + b"".join(s.src_off.tobytes() + s.nbytes.tobytes() + b"|" for s in segs)
        dst_key = idx.tobytes() + b"".join(s.dst_off.tobytes() + s.nbytes.tobytes() + b"|" for s in segs)
        return cls(active=idx, nseg=nseg, src_off=tuple(s.src_off for s in segs),
                   dst_off=tuple(s.dst_off for s in segs),
                   seg_len=tuple(s.nbytes for s in segs), src_end=src_end, dst_end=dst_end,
                   item_bytes=sum(s.total_nbytes for s in segs), groups=groups,
                   src_key=src_key, dst_key=dst_key)


@dataclass(frozen=True, slots=True, eq=False)
class SideGeometry:
    """Per active buffer of one side: region base, item size, and how many items its dlist covers."""

    base: np.ndarray          # uint64
    item_nbytes: np.ndarray   # int64
    count: np.ndarray         # int64

    def key(self) -> bytes:
        return self.base.tobytes() + self.item_nbytes.tobytes() + self.count.tobytes()


def derive_side(addr: np.ndarray, length: np.ndarray, buffer: np.ndarray, bases: np.ndarray,
                sizes: np.ndarray, pattern: Pattern, items: np.ndarray, side: str,
                item_nbytes: Sequence[int] = ()) -> SideGeometry:
    """Each active buffer's item size (given, or recovered from one side of a plan; ``side``: "src"/"dst").

    ``bases``/``sizes`` describe every buffer's region (uint64/int64, in buffer order); ``items`` are this
    side's item indices, paired with the other side's and sorted by source. The plan must already be
    bounds-checked. Raises RegionError when the plan and its structured form disagree.
    """
    active, seg_end = pattern.active, (pattern.src_end if side == "src" else pattern.dst_end)
    nbuf = bases.size
    if buffer.size and (int(buffer.min()) < 0 or int(buffer.max()) >= nbuf):
        raise RegionError(f"{side}: plan names buffer {int(buffer.max())} but the component has {nbuf} regions")
    if items.size and int(items.min()) < 0:
        raise RegionError(f"{side}: negative item index {int(items.min())}")
    act_base, act_size = bases[active], sizes[active]
    top = int(items.max()) if items.size else 0
    if len(item_nbytes):
        item = np.asarray(item_nbytes, dtype=np.int64)[active]
        count = (act_size.astype(np.int64) - seg_end) // np.maximum(item, 1) + 1
        if np.any(item < seg_end) or np.any(count <= top):
            raise RegionError(f"{side}: item {top} or its segments lie outside a buffer of the given item sizes")
        geo = SideGeometry(act_base, item, count)
    elif top == 0:  # only item 0 moves: any item size works; let the whole region be one item
        geo = SideGeometry(act_base, act_size.astype(np.int64), np.ones(active.size, dtype=np.int64))
    else:
        ends = addr + length
        reach = np.zeros(nbuf, dtype=np.uint64)
        if buffer.size > 1 and bool(np.all(buffer[1:] >= buffer[:-1])):
            first = np.flatnonzero(np.concatenate(([True], buffer[1:] != buffer[:-1])))
            reach[buffer[first]] = np.maximum.reduceat(ends, first)
        else:
            np.maximum.at(reach, buffer, ends)
        span = (reach[active] - act_base).astype(np.int64) - seg_end
        if np.any(reach[active] < act_base) or np.any(span <= 0) or np.any(span % top):
            raise RegionError(f"{side}: the plan's descriptors and its item indices and segments disagree")
        item = span // top
        if np.any(item < seg_end):
            raise RegionError(f"{side}: segments reach past the end of an item")
        geo = SideGeometry(act_base, item, (act_size.astype(np.int64) - seg_end) // item + 1)
    _spot_check(addr, buffer, geo, pattern, items, side)
    return geo


def _spot_check(addr: np.ndarray, buffer: np.ndarray, geo: SideGeometry, pattern: Pattern, items: np.ndarray,
                side: str) -> None:
    """The plan's first descriptor must be (first item, first segment) of its buffer (O(1))."""
    if not addr.size:
        return
    pos = np.flatnonzero(pattern.active == buffer[0])
    if not pos.size:
        raise RegionError(f"{side}: the plan writes buffer {int(buffer[0])}, which has no segments")
    k = int(pos[0])
    off = (pattern.src_off if side == "src" else pattern.dst_off)[k]
    want = int(geo.base[k]) + int(items[0]) * int(geo.item_nbytes[k]) + int(off[0])
    if int(addr[0]) != want:
        raise RegionError(f"{side}: the plan's first descriptor {int(addr[0]):#x} is not item {int(items[0])} "
                          f"of buffer {int(buffer[0])} ({want:#x}); the plan and its items and segments disagree")


def dlist_rows(geo: SideGeometry, offsets: Sequence[np.ndarray], lengths: Sequence[np.ndarray],
               devices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (N, 3) uint64 rows ``(addr, len, device id)`` of one side's dlist and each buffer's first index.

    Vectorized per buffer over items and segments; called once per (peer, component, segment pattern).
    """
    sizes = geo.count * np.array([o.size for o in offsets], dtype=np.int64)
    total = int(sizes.sum())
    if total > _I32_MAX:
        raise RegionError(f"a prepped dlist of {total} descriptors exceeds NIXL's int32 index range")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    rows = np.empty((total, 3), dtype=np.uint64)
    for k, (off, ln) in enumerate(zip(offsets, lengths)):
        rel = np.arange(int(geo.count[k]), dtype=np.uint64)[:, None] * np.uint64(geo.item_nbytes[k])
        block = rows[starts[k]: starts[k] + sizes[k]]
        block[:, 0] = (geo.base[k] + rel + off.astype(np.uint64)[None, :]).ravel()
        block[:, 1] = np.broadcast_to(ln.astype(np.uint64)[None, :], (int(geo.count[k]), off.size)).ravel()
        block[:, 2] = devices[k]
    return rows, starts


def indices(starts: np.ndarray, groups: Sequence[tuple[int, np.ndarray]], items: np.ndarray) -> np.ndarray:
    """Dlist indices (int32) of ``items`` for every active buffer, ordered buffer -> item -> segment."""
    parts = []
    for nseg, pos in groups:
        seg = np.arange(nseg, dtype=np.int64)
        parts.append((starts[pos][:, None, None] + items[None, :, None] * nseg + seg[None, None, :]).ravel())
    out = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out.astype(np.int32)

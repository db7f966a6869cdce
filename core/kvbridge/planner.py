"""Turn (source items, destination items, per-item segments) into address descriptors, vectorized.

Address of item ``i`` of a buffer = ``base + i * item_nbytes`` in unsigned 64-bit arithmetic. Runs that are
contiguous on both sides merge into one descriptor. The merge is computed once per group of buffers that
share item sizes and segments (e.g. all K layers), on offsets relative to the buffer base, then broadcast
over the group's base addresses: no Python loop per page, token or layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import GeometryError
from kvbridge.repaging import SidePages
from kvbridge.slicing import Segments

_U64 = np.uint64


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class BufferPair:
    """One source buffer and its destination counterpart, as the planner needs them."""

    src_base: int
    src_item_nbytes: int
    src_num_items: int
    dst_base: int
    dst_item_nbytes: int
    dst_num_items: int
    segments: Segments
    src_pages: SidePages | None = None     # sub-pages of several planes (kvbridge.repaging.spread): item addresses
    dst_pages: SidePages | None = None     # are not ``i * item_nbytes`` then


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """Descriptors of one component of one request to one peer (uint64 addresses and lengths).

    ``buffer[i]`` is the index of the buffer pair descriptor ``i`` belongs to; backends that address by
    (registered region, offset), like MoRI, use ``src_addr - src_base[buffer]``.
    """

    src_addr: np.ndarray
    dst_addr: np.ndarray
    nbytes: np.ndarray
    buffer: np.ndarray

    @classmethod
    def empty(cls) -> TransferPlan:
        z = np.zeros(0, dtype=_U64)
        return cls(z, z, z, np.zeros(0, dtype=np.int32))

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum(dtype=_U64))


def check_indices(indices: np.ndarray, num_items: int, what: str) -> np.ndarray:
    """Validate an index array against a buffer's item count; return it as int64."""
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise GeometryError(f"{what}: indices must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":          # np.issubdtype(dtype, np.integer), without its cost
        raise GeometryError(f"{what}: indices must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_items):
        bad = arr[(arr < 0) | (arr >= num_items)][:4].tolist()
        raise GeometryError(f"{what}: indices {bad} are outside [0, {num_items})")
    return arr


def _offsets(idx: np.ndarray, item: int, off: np.ndarray, pages: SidePages | None) -> np.ndarray:
    if pages is None:
        return (idx[:, None] * item + off[None, :]).ravel()
    page, sub = np.divmod(idx, pages.factor)
    return (page[:, None] * pages.page_nbytes + sub[:, None] * pages.stride[None, :] + off[None, :]).ravel()


def _relative_runs(src_idx: np.ndarray, dst_idx: np.ndarray, src_item: int, dst_item: int,
                   seg: Segments, src_pages: SidePages | None = None,
                   dst_pages: SidePages | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merged descriptors relative to the buffer bases, for one item-size/segment pattern."""
    src_rel = _offsets(src_idx, src_item, seg.src_off, src_pages)
    dst_rel = _offsets(dst_idx, dst_item, seg.dst_off, dst_pages)
    lens = np.broadcast_to(seg.nbytes[None, :], (src_idx.size, len(seg))).ravel()
    if lens.size <= 1:
        return src_rel, dst_rel, lens.copy()
    brk = np.flatnonzero((src_rel[1:] != src_rel[:-1] + lens[:-1]) | (dst_rel[1:] != dst_rel[:-1] + lens[:-1]))
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk + 1))
    return src_rel[starts], dst_rel[starts], np.add.reduceat(lens, starts)


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class PairGroup:
    """Buffer pairs that share item sizes and segments (e.g. all K layers): planned once, then broadcast."""

    src_item_nbytes: int
    dst_item_nbytes: int
    segments: Segments
    members: np.ndarray          # int32 buffer indices
    src_base: np.ndarray         # uint64, one per member
    dst_base: np.ndarray
    src_pages: SidePages | None = None
    dst_pages: SidePages | None = None


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class PairGroups:
    """A list of buffer pairs grouped for :func:`plan_transfer`. Grouping costs a Python step per pair, so a
    sender that plans many requests over the same pairs groups them once and passes this instead::

        groups = PairGroups.of(pairs)
        plan = plan_transfer(groups, src_pages, dst_pages)      # same plan as plan_transfer(pairs, ...)
    """

    groups: tuple[PairGroup, ...]
    src_num_items: int           # the smallest of the pairs': indices are checked against it
    dst_num_items: int

    @classmethod
    def of(cls, pairs: Sequence[BufferPair]) -> PairGroups:
        if not pairs:
            return cls(groups=(), src_num_items=0, dst_num_items=0)
        found: dict[tuple[int, int, bytes, bytes, bytes], list[int]] = {}
        for b, pair in enumerate(pairs):
            if len(pair.segments):
                found.setdefault((pair.src_item_nbytes, pair.dst_item_nbytes, pair.segments.key(),
                                  _pages_key(pair.src_pages), _pages_key(pair.dst_pages)), []).append(b)
        groups = tuple(PairGroup(src_item_nbytes=pairs[m[0]].src_item_nbytes,
                                 dst_item_nbytes=pairs[m[0]].dst_item_nbytes, segments=pairs[m[0]].segments,
                                 src_pages=pairs[m[0]].src_pages, dst_pages=pairs[m[0]].dst_pages,
                                 members=np.array(m, dtype=np.int32),
                                 src_base=np.array([pairs[b].src_base for b in m], dtype=_U64),
                                 dst_base=np.array([pairs[b].dst_base for b in m], dtype=_U64))
                       for m in found.values())
        return cls(groups=groups, src_num_items=min(p.src_num_items for p in pairs),
                   dst_num_items=min(p.dst_num_items for p in pairs))


def _pages_key(pages: SidePages | None) -> bytes:
    if pages is None:
        return b""
    return np.array([pages.factor, pages.page_nbytes], np.int64).tobytes() + pages.stride.tobytes()


def plan_transfer(pairs: Sequence[BufferPair] | PairGroups, src_idx: np.ndarray,
                  dst_idx: np.ndarray) -> TransferPlan:
    """Plan the copy of items ``src_idx[k] -> dst_idx[k]`` for every buffer pair (``pairs``: a list, or the
    same list grouped once with :meth:`PairGroups.of`).

    Pairs are sorted by source index first so that runs merge maximally; descriptors come out grouped
    by buffer, in ascending source address within a buffer (so engines can merge further).
    """
    if len(src_idx) != len(dst_idx):
        raise GeometryError(f"{len(src_idx)} source items but {len(dst_idx)} destination items")
    if len(src_idx) == 0 or (not isinstance(pairs, PairGroups) and not pairs):
        return TransferPlan.empty()
    grouped = pairs if isinstance(pairs, PairGroups) else PairGroups.of(pairs)
    src_idx = np.asarray(src_idx, dtype=np.int64)
    dst_idx = np.asarray(dst_idx, dtype=np.int64)
    check_indices(src_idx, grouped.src_num_items, "source")
    check_indices(dst_idx, grouped.dst_num_items, "destination")
    if not grouped.groups:
        return TransferPlan.empty()
    if src_idx.size > 1 and np.any(src_idx[1:] < src_idx[:-1]):
        order = np.argsort(src_idx, kind="stable")
        src_idx, dst_idx = src_idx[order], dst_idx[order]
    out_src, out_dst, out_len, out_buf = [], [], [], []
    for g in grouped.groups:
        rs, rd, rl = _relative_runs(src_idx, dst_idx, g.src_item_nbytes, g.dst_item_nbytes, g.segments,
                                    g.src_pages, g.dst_pages)
        out_src.append((g.src_base[:, None] + rs.astype(_U64)[None, :]).ravel())
        out_dst.append((g.dst_base[:, None] + rd.astype(_U64)[None, :]).ravel())
        out_len.append(np.broadcast_to(rl.astype(_U64)[None, :], (g.members.size, rl.size)).ravel())
        out_buf.append(np.repeat(g.members, rl.size))
    if len(grouped.groups) == 1:
        return TransferPlan(out_src[0], out_dst[0], out_len[0], out_buf[0])
    buf = np.concatenate(out_buf)
    final = np.argsort(buf, kind="stable")
    return TransferPlan(np.concatenate(out_src)[final], np.concatenate(out_dst)[final],
                        np.concatenate(out_len)[final], buf[final])

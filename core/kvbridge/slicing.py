"""TP resharding math: which prefill ranks serve a decode rank, and which bytes of an item go where.

All functions are pure. A slice is expressed per buffer as *segments inside one item*: parallel arrays
``(src_off, dst_off, nbytes)`` that apply to every (source item, destination item) pair of a request.
The planner turns them into address descriptors for whole index arrays at once.

Example (sglang-notes worked example A: 8 KV heads, Pt=4 -> Dt=2, token-major bf16, 16-token pages):
prefill rank 3 writes its two heads into bytes ``[512, 1024)`` of every token row of decode rank 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, Rank, owned_range

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class Segments:
    """Byte ranges inside one item: ``src_off[i] -> dst_off[i]`` for ``nbytes[i]`` bytes (int64 arrays)."""

    src_off: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def empty(cls) -> Segments:
        return cls(_EMPTY, _EMPTY, _EMPTY)

    @classmethod
    def whole(cls, item_nbytes: int) -> Segments:
        one = np.array([0], dtype=np.int64)
        return cls(one, one, np.array([item_nbytes], dtype=np.int64))

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())

    def key(self) -> bytes:
        """A hashable identity, so buffers with identical segments can be planned together."""
        return self.src_off.tobytes() + b"|" + self.dst_off.tobytes() + b"|" + self.nbytes.tobytes()


@dataclass(frozen=True, slots=True, eq=False)
class ComponentSlice:
    """What one source rank writes into one destination rank for one component: segments per buffer."""

    buffers: tuple[Segments, ...]

    @property
    def is_empty(self) -> bool:
        return all(len(s) == 0 for s in self.buffers)


def check_ratio(src_size: int, dst_size: int) -> None:
    if src_size <= 0 or dst_size <= 0 or (src_size % dst_size and dst_size % src_size):
        raise UnsupportedTopology(
            f"prefill TP {src_size} and decode TP {dst_size} do not divide each other; kvbridge reshards "
            "only when one TP size is a multiple of the other")


def target_ranks(src_size: int, dst_size: int, dst_rank: int) -> tuple[int, ...]:
    """The prefill ranks that decode rank ``dst_rank`` talks to (every prefill rank is someone's target).

    >>> target_ranks(4, 2, 1), target_ranks(2, 4, 3), target_ranks(2, 2, 1)
    ((2, 3), (1,), (1,))
    """
    check_ratio(src_size, dst_size)
    if src_size >= dst_size:
        k = src_size // dst_size
        return tuple(range(dst_rank * k, dst_rank * k + k))
    return (dst_rank // (dst_size // src_size),)


def served_ranks(src_size: int, dst_size: int, src_rank: int) -> tuple[int, ...]:
    """The decode ranks that will contact prefill rank ``src_rank``."""
    check_ratio(src_size, dst_size)
    if src_size >= dst_size:
        return (src_rank // (src_size // dst_size),)
    m = dst_size // src_size
    return tuple(range(src_rank * m, src_rank * m + m))


def _elected(total: int, src: Rank, dst: Rank) -> bool:
    """Is ``src`` the first of ``dst``'s targets holding exactly its range of this sharded axis (group)?

    Replicas (ranks holding the same units because the axis has fewer units than ranks) are elected
    independently per shard group, so a group replicated on several ranks is written once even when
    another group of the same tensor is split between them.
    """
    mine = owned_range(total, src.size, src.rank)
    for candidate in target_ranks(src.size, dst.size, dst.rank):
        if owned_range(total, src.size, candidate) == mine:
            return candidate == src.rank
    return False


def is_elected_writer(buf: BufferGeometry, src: Rank, dst: Rank) -> bool:
    """True when ``src`` writes at least one unit of ``buf`` into ``dst`` (the first of ``dst``'s targets
    holding that unit; for a replicated tensor the first target)."""
    if src.rank not in target_ranks(src.size, dst.size, dst.rank):
        return False
    if buf.shard is None:
        return target_ranks(src.size, dst.size, dst.rank)[0] == src.rank
    return any(_elected(g, src, dst) for g in buf.shard.group_totals)


def check_pairable(src: BufferGeometry, dst: BufferGeometry) -> None:
    """Raise IncompatiblePeer unless the two buffers are the same tensor under different TP."""
    where = f"buffer {src.name!r}"
    if src.dtype != dst.dtype:
        raise IncompatiblePeer(f"{where}: dtype {src.dtype.value} vs {dst.dtype.value}")
    if src.shard != dst.shard:
        raise IncompatiblePeer(f"{where}: sharding {src.shard} vs {dst.shard}")
    if len(src.item_shape) != len(dst.item_shape):
        raise IncompatiblePeer(f"{where}: item shape {src.item_shape} vs {dst.item_shape}")
    axis = src.shard.axis if src.shard else -1
    for i, (a, b) in enumerate(zip(src.item_shape, dst.item_shape)):
        if i != axis and a != b:
            raise IncompatiblePeer(f"{where}: item dim {i} is {a} on prefill and {b} on decode "
                                   f"(item shape {src.item_shape} vs {dst.item_shape})")


def buffer_segments(src_buf: BufferGeometry, dst_buf: BufferGeometry, src: Rank, dst: Rank) -> Segments:
    """Segments of one item that ``src`` writes into ``dst`` for one buffer (empty if it writes none)."""
    check_pairable(src_buf, dst_buf)
    check_ratio(src.size, dst.size)
    if not is_elected_writer(src_buf, src, dst):
        return Segments.empty()
    shard = src_buf.shard
    if shard is None:
        return Segments.whole(src_buf.item_nbytes)
    inner = src_buf.inner_nbytes
    outer = src_buf.outer_count
    src_units, dst_units = src_buf.item_shape[shard.axis], dst_buf.item_shape[shard.axis]
    so, do, ln = [], [], []
    src_group_off = dst_group_off = 0
    for total in shard.group_totals:
        s_lo, s_hi = owned_range(total, src.size, src.rank)
        d_lo, d_hi = owned_range(total, dst.size, dst.rank)
        lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
        if lo < hi and _elected(total, src, dst):
            so.append(src_group_off + lo - s_lo)
            do.append(dst_group_off + lo - d_lo)
            ln.append(hi - lo)
        src_group_off += s_hi - s_lo
        dst_group_off += d_hi - d_lo
    if not ln:
        return Segments.empty()
    rows = np.arange(outer, dtype=np.int64)[:, None]
    src_off = (rows * src_units + np.array(so, dtype=np.int64)) * inner
    dst_off = (rows * dst_units + np.array(do, dtype=np.int64)) * inner
    nbytes = np.broadcast_to(np.array(ln, dtype=np.int64) * inner, src_off.shape)
    return merge_segments(src_off.ravel(), dst_off.ravel(), nbytes.ravel())


def merge_segments(src_off: np.ndarray, dst_off: np.ndarray, nbytes: np.ndarray) -> Segments:
    """Merge consecutive segments that are contiguous on both sides (input in emission order)."""
    if nbytes.size <= 1:
        return Segments(src_off.astype(np.int64), dst_off.astype(np.int64), nbytes.astype(np.int64))
    brk = np.flatnonzero((src_off[1:] != src_off[:-1] + nbytes[:-1]) | (dst_off[1:] != dst_off[:-1] + nbytes[:-1]))
    starts = np.concatenate(([0], brk + 1))
    return Segments(src_off[starts].astype(np.int64), dst_off[starts].astype(np.int64),
                    np.add.reduceat(nbytes, starts).astype(np.int64))


def sharded_component_slice(src_comp: Component, dst_comp: Component, src: Rank, dst: Rank) -> ComponentSlice:
    """The default slice of a component whose buffers follow the generic shard-axis rules."""
    if len(src_comp.buffers) != len(dst_comp.buffers):
        raise IncompatiblePeer(f"component {src_comp.name!r}: {len(src_comp.buffers)} buffers on prefill, "
                               f"{len(dst_comp.buffers)} on decode")
    return ComponentSlice(tuple(buffer_segments(s, d, src, dst) for s, d in zip(src_comp.buffers, dst_comp.buffers)))

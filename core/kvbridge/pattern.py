"""The deterministic fill pattern, and an independent reference for TP resharding of paged KV cache.

Sources are filled and destinations verified with it: by the demo (:mod:`kvbridge.demo`) and by the
conformance kit (:mod:`kvbridge.testkit`, which re-exports it as ``kvbridge.testkit.reference``). It is
the yardstick the planner is measured against, so it deliberately shares no code with
``kvbridge.slicing`` or ``kvbridge.planner`` (it imports nothing from kvbridge). It works on the
*logical* tensor - the un-sharded KV cache of the whole model - and simply cuts out what a rank holds,
in plain numpy, the slow and obvious way. Everything is in bytes: the last axis of every array here is
the bytes of one head vector (``head_dim * itemsize``), so one reference serves every dtype.

Layouts of one page (``P`` tokens, ``H`` total KV heads, ``B`` bytes per head vector):

* ``token-major`` (SGLang MHA): ``[P, H, B]`` - a token row holds all heads;
* ``head-major``: ``[H, P, B]`` - each head holds all tokens of the page;
* ``mla``: ``[P, B]`` - one latent vector per token, replicated on every rank.

Which heads a rank of a TP group of size ``T`` holds: ``[r*H/T, (r+1)*H/T)`` when ``H >= T``;
otherwise the single head ``r // (T/H)``, replicated on ``T/H`` consecutive ranks. Sizes that do not
divide raise :class:`ReferenceTopologyError`.

The fill pattern. Byte ``b`` of head ``h`` of token ``t`` of the page at request position ``pos`` of
tensor ``tensor`` of layer ``layer`` has the value::

    pattern(seed, layer, tensor, pos, t, h, b)      # MLA: h = 0

where :func:`pattern` is the top byte of a chain of splitmix64 mixes, one per coordinate. The value
depends only on those logical coordinates - never on the physical page id, the rank or the layout - so a
verifier can recompute the expected bytes of any destination page from its request position alone, and
replicas of one head on different ranks are byte-identical (as they are in a real engine). Memory that
no transfer should touch is filled with :func:`background`, a pattern of (seed, buffer key, page, byte
offset) that no KV page shares.

Example: what decode rank 1 of TP 2 must hold for a 4-head token-major model after a transfer that put
request positions 0..2 into its pages [7, 3, 5]::

    spec = KVSpec("token-major", total_heads=4, page_size=16, head_bytes=256)
    want = expected_buffer(spec, seed=1, layer=0, tensor=0, tp_size=2, rank=1, num_pages=8,
                           pages=[7, 3, 5], positions=[0, 1, 2], background_seed=99, buffer_key=0)
    assert np.array_equal(byte_view(decode_k0), want)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "HEAD_MAJOR", "LAYOUTS", "MLA", "TOKEN_MAJOR", "KVSpec", "ReferenceTopologyError", "background", "byte_view",
    "expected_buffer", "expected_pages", "fill_source", "heads_held", "logical_pages", "pattern", "shard_axis",
    "shard_pages", "source_buffer", "units_held",
]

TOKEN_MAJOR = "token-major"
HEAD_MAJOR = "head-major"
MLA = "mla"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR, MLA)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_BACKGROUND_TAG = 0xB6B6_0000_0000_0001  # separates the background stream from every KV stream


class ReferenceTopologyError(ValueError):
    """The reference cannot shard this axis over this TP size (it does not divide)."""


# --------------------------------------------------------------------------------------------- pattern
def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MUL1
    x = x ^ (x >> np.uint64(27))
    x = x * _MUL2
    return x ^ (x >> np.uint64(31))


def pattern(seed: int, *coords: int | np.ndarray) -> np.ndarray:
    """One pseudo-random byte per element of the broadcast of ``coords`` (uint8 array).

    Each coordinate (a non-negative int or int array) is folded into a splitmix64 state started from
    ``seed``; the result is the top byte. Equal coordinates give equal bytes, anywhere, any time.

    >>> pattern(7, np.arange(4)).shape, pattern(7, 3) == pattern(7, np.array([3]))
    ((4,), array([ True]))
    """
    with np.errstate(over="ignore"):
        state = np.full(1, int(seed) % 2**64, dtype=np.uint64)
        for coord in coords:
            c = np.asarray(coord)
            if c.size and int(c.min()) < 0:
                raise ValueError("pattern coordinates must be non-negative")
            state = _mix(state ^ _mix(c.astype(np.uint64) + _GOLDEN))
        return (state >> np.uint64(56)).astype(np.uint8)


def background(seed: int, buffer_key: int, shape: Sequence[int]) -> np.ndarray:
    """Filler for memory no transfer may touch: a byte of (seed, buffer key, item, byte offset).

    ``shape`` is ``[num_items, ...]``; the result is a uint8 array of that shape.
    """
    num_items = int(shape[0])
    item_bytes = int(np.prod(shape[1:], dtype=np.int64))
    items = np.arange(num_items, dtype=np.int64)[:, None]
    offsets = np.arange(item_bytes, dtype=np.int64)[None, :]
    return pattern(seed, _BACKGROUND_TAG, buffer_key, items, offsets).reshape(tuple(shape))


# --------------------------------------------------------------------------------------------- sharding
def units_held(total: int, tp_size: int, rank: int) -> range:
    """The global units (heads, channels) of a sharded axis of ``total`` units held by ``rank``.

    >>> units_held(8, 4, 3), units_held(2, 8, 5), units_held(1, 4, 2)
    (range(6, 8), range(1, 2), range(0, 1))
    """
    if tp_size <= 0 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside TP size {tp_size}")
    if total <= 0:
        raise ValueError(f"a sharded axis needs at least one unit, got {total}")
    if total >= tp_size:
        if total % tp_size:
            raise ReferenceTopologyError(f"{total} units do not split evenly over TP {tp_size}")
        per_rank = total // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % total:
        raise ReferenceTopologyError(f"TP {tp_size} is not a multiple of {total} replicated units")
    ranks_per_unit = tp_size // total
    unit = rank // ranks_per_unit
    return range(unit, unit + 1)


heads_held = units_held


def shard_axis(logical: np.ndarray, axis: int, tp_size: int, rank: int,
               groups: Sequence[int] = ()) -> np.ndarray:
    """Cut out of ``logical`` what ``rank`` holds along ``axis`` (a copy).

    ``groups`` splits the axis into consecutive blocks that are sharded independently and concatenated
    on the rank (GDN-style ``[q | k | v]`` channels); by default the whole axis is one block.
    """
    total = logical.shape[axis]
    blocks = tuple(groups) or (total,)
    if sum(blocks) != total:
        raise ValueError(f"groups {tuple(blocks)} do not add up to the axis size {total}")
    pieces = []
    start = 0
    for size in blocks:
        held = units_held(size, tp_size, rank)
        index = np.arange(start + held.start, start + held.stop)
        pieces.append(np.take(logical, index, axis=axis))
        start += size
    return np.concatenate(pieces, axis=axis)


# --------------------------------------------------------------------------------------------- KV pages
@dataclass(frozen=True)
class KVSpec:
    """One KV tensor of a model as the reference sees it (bytes, not dtypes).

    ``head_bytes`` is the bytes of one head vector of one token (``head_dim * itemsize``); for MLA it
    is the bytes of one token's latent and ``total_heads`` must be 1.
    """

    layout: str
    total_heads: int
    page_size: int
    head_bytes: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == MLA and self.total_heads != 1:
            raise ValueError("an MLA latent has no heads: total_heads must be 1")
        if min(self.total_heads, self.page_size, self.head_bytes) <= 0:
            raise ValueError(f"every size must be positive: {self}")

    @property
    def head_axis(self) -> int | None:
        """Axis of the heads inside one page (None for MLA)."""
        return {TOKEN_MAJOR: 1, HEAD_MAJOR: 0, MLA: None}[self.layout]

    def page_shape(self, heads: int) -> tuple[int, ...]:
        if self.layout == TOKEN_MAJOR:
            return (self.page_size, heads, self.head_bytes)
        if self.layout == HEAD_MAJOR:
            return (heads, self.page_size, self.head_bytes)
        return (self.page_size, self.head_bytes)

    @property
    def logical_page_shape(self) -> tuple[int, ...]:
        return self.page_shape(self.total_heads)

    def local_heads(self, tp_size: int) -> int:
        return len(units_held(self.total_heads, tp_size, 0)) if self.layout != MLA else 1

    def local_page_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape (bytes last) of one page as a rank of TP ``tp_size`` stores it."""
        return self.page_shape(self.local_heads(tp_size))

    def local_page_nbytes(self, tp_size: int) -> int:
        return int(np.prod(self.local_page_shape(tp_size)))


def logical_pages(spec: KVSpec, seed: int, layer: int, tensor: int, positions: Sequence[int] | np.ndarray,
                  heads: Sequence[int] | None = None) -> np.ndarray:
    """The un-sharded pages at request ``positions`` of one tensor: uint8 ``[n, *logical_page_shape]``
    (only the given ``heads``, in that order, when asked: the pattern is elementwise in its coordinates)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1, 1, 1, 1)
    token = np.arange(spec.page_size).reshape(1, -1, 1, 1)
    head = (np.arange(spec.total_heads) if heads is None else np.asarray(heads, dtype=np.int64)).reshape(1, 1, -1, 1)
    byte = np.arange(spec.head_bytes).reshape(1, 1, 1, -1)
    pages = pattern(seed, layer, tensor, pos, token, head, byte)  # [n, P, H, B]: token-major order
    if spec.layout == HEAD_MAJOR:
        return np.ascontiguousarray(pages.transpose(0, 2, 1, 3))
    if spec.layout == MLA:
        return np.ascontiguousarray(pages[:, :, 0, :])
    return pages


def shard_pages(spec: KVSpec, logical: np.ndarray, tp_size: int, rank: int) -> np.ndarray:
    """What ``rank`` of TP ``tp_size`` holds of ``logical`` pages ``[n, *logical_page_shape]``."""
    if spec.head_axis is None:
        return logical.copy()
    return shard_axis(logical, 1 + spec.head_axis, tp_size, rank)


def expected_pages(spec: KVSpec, seed: int, layer: int, tensor: int, tp_size: int, rank: int,
                   positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """The bytes ``rank`` must hold for request ``positions``: uint8 ``[n, *local_page_shape]``."""
    if spec.head_axis is None:
        return logical_pages(spec, seed, layer, tensor, positions)
    return logical_pages(spec, seed, layer, tensor, positions, heads=units_held(spec.total_heads, tp_size, rank))


def source_buffer(spec: KVSpec, seed: int, layer: int, tensor: int, tp_size: int, rank: int, num_pages: int,
                  pages: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                  background_seed: int, buffer_key: int) -> np.ndarray:
    """A whole rank buffer (uint8 ``[num_pages, *local_page_shape]``): background everywhere, and the
    rank's share of request position ``positions[k]`` at page ``pages[k]``."""
    buf = background(background_seed, buffer_key, (num_pages, *spec.local_page_shape(tp_size)))
    page_ids = np.asarray(pages, dtype=np.int64)
    if page_ids.size:
        if len(np.unique(page_ids)) != page_ids.size:
            raise ValueError("a page cannot hold two request positions")
        buf[page_ids] = expected_pages(spec, seed, layer, tensor, tp_size, rank, positions)
    return buf


#: The destination side: what a decode buffer must equal after every write of a request has landed.
expected_buffer = source_buffer


def fill_source(buffer: Any, spec: KVSpec, seed: int, layer: int, tensor: int, tp_size: int, rank: int,
                pages: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray) -> None:
    """Write the rank's share of request ``positions`` into pages ``pages`` of an existing ``buffer``
    (numpy array or CPU torch tensor of any dtype, first axis = pages), in place."""
    view = byte_view(buffer).reshape(-1, *spec.local_page_shape(tp_size))
    share = expected_pages(spec, seed, layer, tensor, tp_size, rank, positions)
    view[np.asarray(pages, dtype=np.int64)] = share


def byte_view(array: Any) -> np.ndarray:
    """A writable uint8 view of a C-contiguous numpy array or CPU torch tensor, same first axes, the
    last axis widened to bytes (``[..., D]`` of bf16 -> ``[..., 2*D]``)."""
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("byte_view needs a C-contiguous array")
        return array.view(np.uint8)
    to_numpy = getattr(array, "numpy", None)
    if to_numpy is None or not array.is_contiguous():
        raise ValueError("byte_view needs a contiguous numpy array or CPU torch tensor, "
                         f"got {type(array).__name__}")
    import torch  # only when a torch tensor is given

    return array.view(torch.uint8).numpy()

"""Different page sizes on the two sides: both pools seen as pages of ``g = gcd(P, D)`` tokens ("sub-pages").

A page is one or more token planes (:data:`Planes`): token-major KV ``[page, heads, dim]`` is one (every head of a
token together), head-major KV ``[heads, page, dim]`` one per head, an NSA indexer page its keys then its scales.
A sub-page is ``g`` consecutive tokens of every plane: one run of memory for one plane (a page of ``g`` tokens,
byte for byte), one run per plane otherwise (planned with per-plane strides, :func:`spread`). So a prefill with
64-token pages and a decode with 16-token pages are paired as two pools of 16-token pages and the whole protocol
(slicing, planning, coverage, digests) runs on those sub-pages.

Positions: both sides list pages from the one holding the decode's prefix end on (``prefix // page``); in
sub-pages the prefill's first page starts ``lead`` sub-pages after the decode's (negative: before it, on
sub-pages the decode has cached). The last page of either side may hold padding past the request's last
token, so up to ``factor - 1`` sub-pages at the end of the other side's list have no counterpart::

    >>> r = Repaging.of(ours=64, theirs=16)
    >>> r.granule, r.ours, r.theirs
    (16, 4, 1)
    >>> sub_pages(np.array([3, 7]), 4).tolist()
    [12, 13, 14, 15, 28, 29, 30, 31]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.errors import IncompatiblePeer
from kvbridge.geometry import BufferGeometry, Component, IndexKind
from kvbridge.slicing import Segments

PAGE_OPTION = "page_size"       # a state type's option naming the page size (SWA, NSA): the sub-page size then
SUB_PAGE_OPTION = "sub_page_of"  # added to a repaged component: the smaller of the pair's page sizes


@dataclass(frozen=True, slots=True)
class Repaging:
    """One pair of page sizes: the sub-page (``granule`` tokens) and how many of them each side's page holds."""

    granule: int
    ours: int
    theirs: int

    @classmethod
    def of(cls, *, ours: int, theirs: int) -> Repaging:
        g = math.gcd(ours, theirs)
        return cls(granule=g, ours=ours // g, theirs=theirs // g)

    @property
    def flipped(self) -> Repaging:
        return Repaging(granule=self.granule, ours=self.theirs, theirs=self.ours)

    def lead(self, prefix_len: int, *, prefill: int, decode: int) -> int:
        """Sub-pages from the decode's first listed page to the prefill's first sent page (both lists start at
        the page holding token ``prefix_len`` on their side; ``prefill``/``decode``: the two page sizes)."""
        return ((prefix_len // prefill) * prefill - (prefix_len // decode) * decode) // self.granule


def sub_pages(pages: np.ndarray, factor: int) -> np.ndarray:
    """The sub-page indices of ``pages`` (each page ``factor`` sub-pages), in order. Vectorized."""
    pages = np.asarray(pages, dtype=np.int64)
    if factor == 1:
        return pages
    return (pages[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).ravel()


Planes = tuple[int, ...]
"""Bytes per token of each plane of a page, in page order: a page of ``P`` tokens is the planes one after the
other, plane ``r`` holding ``P * planes[r]`` bytes, token after token. Token-major KV has one plane (every head of
a token together); head-major KV one per head; an NSA indexer page its keys, then its scales."""


def token_axis(buf: BufferGeometry, page_size: int) -> int | None:
    """The axis of a page that counts its tokens: the first axis of size ``page_size`` that is not the sharded
    one (tokens come before a head's dims in every KV layout: ``[page, heads, dim]`` with ``dim == page`` is
    token-major), except a leading K/V axis of 2 followed by another candidate (vLLM's FlashInfer ``[2, page,
    heads, dim]`` with 2-token pages). None when no axis has that size."""
    shard = buf.shard.axis if buf.shard is not None else -1
    found = [i for i, n in enumerate(buf.item_shape) if n == page_size and i != shard]
    if len(found) > 1 and found[0] == 0 and page_size == 2:
        found = found[1:]
    return found[0] if found else None


def default_planes(buf: BufferGeometry, page_size: int) -> Planes | None:
    """The planes of a page with a token axis (:func:`token_axis`): every combination of the axes before it is a
    plane (head-major ``[heads, page, dim]``: one per head; vLLM's FlashInfer ``[2, page, heads, dim]``: K and V),
    everything after it is one token's bytes in that plane. Token-major ``[page, heads, dim]``: one plane."""
    axis = token_axis(buf, page_size)
    if axis is None:
        return None
    shape = buf.item_shape
    return (math.prod(shape[axis + 1:]) * buf.dtype.itemsize,) * math.prod(shape[:axis])


def _compact_shape(buf: BufferGeometry, page_size: int, granule: int) -> tuple[int, ...]:
    """The item shape of a sub-page laid out compactly (each plane's ``granule`` tokens, plane after plane)."""
    shape = buf.item_shape
    axis = token_axis(buf, page_size)
    if axis is not None:
        return (*shape[:axis], granule, *shape[axis + 1:])
    return (shape[0] // page_size * granule, *shape[1:])      # a flat page of bytes (its state type's planes)


PlanesOf = Callable[[Component, BufferGeometry, int], "Planes | None"]


def check_repageable(comp: Component, page_size: int, granule: int, side: str, planes_of: PlanesOf) -> None:
    """Raise IncompatiblePeer unless every buffer of a paged component splits into sub-pages of ``granule``."""
    if comp.index_kind is not IndexKind.PAGE:
        return
    for buf in comp.buffers:
        planes = planes_of(comp, buf, page_size)
        if planes is None or sum(planes) * page_size != buf.item_nbytes:
            raise IncompatiblePeer(
                f"component {comp.name!r}: the page sizes differ and buffer {buf.name!r} on {side} (item shape "
                f"{buf.item_shape}, {page_size}-token pages) has no token planes its state type names (pages "
                f"with tokens first or second under a sharded axis): it cannot be paired as sub-pages of {granule} "
                "tokens; run both sides with the same page size")


def repaged(comp: Component, page_size: int, granule: int, smaller: int) -> Component:
    """``comp`` as pages of ``granule`` tokens, each laid out compactly (paged components only). With one plane
    per page this is the same memory; with several, the planner spreads each sub-page's bytes over the planes
    (:func:`spread`). A ``page_size`` option becomes ``granule``, and ``smaller`` (the smaller of the pair's two
    page sizes) is added as option ``sub_page_of``: a window's sub-pages, paired, span up to that many tokens
    more at each end than a window of ``granule``-token pages would."""
    if comp.index_kind is not IndexKind.PAGE:
        return comp
    factor = page_size // granule
    buffers = tuple(msgspec.structs.replace(b, num_items=b.num_items * factor,
                                            item_shape=_compact_shape(b, page_size, granule)) for b in comp.buffers)
    options = dict(comp.options)
    if PAGE_OPTION in options:
        options[PAGE_OPTION] = granule
    options[SUB_PAGE_OPTION] = smaller
    return msgspec.structs.replace(comp, buffers=buffers, options=options)


def repaged_view(view: Any, factor: int) -> Any:
    """A uint8 ``[pages, page_nbytes]`` view of a one-plane buffer (numpy or torch) as ``[sub_pages, page_nbytes /
    factor]``: the same memory."""
    if factor == 1:
        return view
    return view.reshape(view.shape[0] * factor, view.shape[1] // factor)


@dataclass(frozen=True, slots=True)
class SidePages:
    """One side of a buffer pair in sub-pages: item ``i`` starts at ``(i // factor) * page_nbytes +
    (i % factor) * stride[s]`` for its segment ``s`` (the planner's addressing for several planes)."""

    factor: int
    page_nbytes: int
    stride: np.ndarray


def _plane_starts(planes: Planes, tokens: int) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(planes, dtype=np.int64) * tokens)))


def spread(segments: Segments, granule: int, src: tuple[Planes, int], dst: tuple[Planes, int]
           ) -> tuple[Segments, SidePages, SidePages]:
    """Segments of a compact sub-page (:func:`repaged`) as runs inside the real pages of both sides, cut where a
    plane ends on either side; with the strides that move each run from one sub-page of a page to the next.
    ``src``/``dst``: (planes, page size in tokens) of each side.

    >>> from kvbridge.slicing import Segments
    >>> seg = Segments.whole(2 * 4 * 8)        # a head-major sub-page of 2 heads x 4 tokens x 8 B
    >>> out, s, d = spread(seg, 4, ((8, 8), 16), ((8, 8), 8))
    >>> out.src_off.tolist(), out.dst_off.tolist(), out.nbytes.tolist(), s.stride.tolist(), d.page_nbytes
    ([0, 128], [0, 64], [32, 32], [32, 32], 128)
    """
    sides = []
    for planes, page in (src, dst):
        compact = _plane_starts(planes, granule)
        sides.append((compact, _plane_starts(planes, page), np.asarray(planes, dtype=np.int64)))
    so, do, ln, ss, ds = [], [], [], [], []
    for a, b, n in zip(segments.src_off.tolist(), segments.dst_off.tolist(), segments.nbytes.tolist()):
        bounds = {0, n}
        for base, (compact, _, _) in zip((a, b), sides):
            bounds.update(int(c) - base for c in compact if 0 < int(c) - base < n)
        cuts = sorted(bounds)
        for lo, hi in zip(cuts, cuts[1:]):
            out = []
            for base, (compact, real, widths) in zip((a + lo, b + lo), sides):
                r = int(np.searchsorted(compact, base, side="right")) - 1
                out.append((int(real[r]) + base - int(compact[r]), granule * int(widths[r])))
            (s_off, s_stride), (d_off, d_stride) = out
            so.append(s_off)
            do.append(d_off)
            ln.append(hi - lo)
            ss.append(s_stride)
            ds.append(d_stride)
    i64 = np.int64
    result = Segments(np.array(so, i64), np.array(do, i64), np.array(ln, i64))
    (src_planes, src_page), (dst_planes, dst_page) = src, dst
    return (result,
            SidePages(src_page // granule, sum(src_planes) * src_page, np.array(ss, i64)),
            SidePages(dst_page // granule, sum(dst_planes) * dst_page, np.array(ds, i64)))


def compact_items(view: Any, items: np.ndarray, planes: Planes, page_size: int, granule: int) -> Any:
    """The bytes of sub-pages ``items`` of a several-plane buffer (uint8 ``[pages, page_nbytes]``, numpy or torch),
    each laid out compactly as :func:`repaged` describes: ``[len(items), granule * sum(planes)]``, a copy."""
    factor = page_size // granule
    items = np.asarray(items, dtype=np.int64)
    compact, real = _plane_starts(planes, granule), _plane_starts(planes, page_size)
    within = np.arange(int(compact[-1]), dtype=np.int64)
    plane = np.searchsorted(compact, within, side="right") - 1
    width = granule * np.asarray(planes, dtype=np.int64)[plane]
    offset = real[plane] + within - compact[plane]           # for sub-page 0 of a page
    cols = offset[None, :] + (items % factor)[:, None] * width[None, :]
    rows = (items // factor)[:, None]
    if isinstance(view, np.ndarray):
        return view[rows, cols]
    import torch  # a tensor was given

    return view[torch.as_tensor(rows, device=view.device), torch.as_tensor(cols, device=view.device)]

"""Different page sizes on the two sides: both pools seen as pages of ``gcd(P, D)`` tokens.

A page whose token axis comes first (token-major KV ``[page, heads, dim]``, MLA ``[page, dim]``, indexer pages)
is ``P / g`` consecutive sub-pages of ``g`` tokens each, byte for byte; so a prefill with 64-token pages and a
decode with 16-token pages are paired as two pools of 16-token pages, without moving a byte, and the whole
protocol (slicing, planning, coverage, digests) runs on those sub-pages. A head-major page (``[heads, page,
dim]``) is not: its sub-page is one run per head, and such a pair is refused naming why.

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
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.errors import IncompatiblePeer
from kvbridge.geometry import BufferGeometry, Component, IndexKind

PAGE_OPTION = "page_size"       # a state type's option naming the page size (SWA, NSA): the sub-page size then


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


def token_axis_first(buf: BufferGeometry, page_size: int) -> bool:
    """Is the buffer's first item axis the page's tokens (so a run of tokens is contiguous)?"""
    return buf.item_shape[0] == page_size and (buf.shard is None or buf.shard.axis != 0)


def check_repageable(comp: Component, page_size: int, granule: int, side: str) -> None:
    """Raise IncompatiblePeer unless every buffer of a paged component splits into sub-pages of ``granule``."""
    if comp.index_kind is not IndexKind.PAGE:
        return
    for buf in comp.buffers:
        if not token_axis_first(buf, page_size):
            raise IncompatiblePeer(
                f"component {comp.name!r}: the page sizes differ and buffer {buf.name!r} on {side} (item shape "
                f"{buf.item_shape}, {page_size}-token pages) does not start with its tokens: a sub-page of "
                f"{granule} tokens of a head-major page is one run per head, not a page kvbridge can pair; "
                "run both sides with the same page size or a token-major layout")


def repaged(comp: Component, page_size: int, granule: int) -> Component:
    """``comp`` as pages of ``granule`` tokens (paged components only; the memory is the same)."""
    if comp.index_kind is not IndexKind.PAGE or granule == page_size:
        return comp
    factor = page_size // granule
    buffers = tuple(msgspec.structs.replace(b, num_items=b.num_items * factor,
                                            item_shape=(granule, *b.item_shape[1:])) for b in comp.buffers)
    options = dict(comp.options)
    if PAGE_OPTION in options:
        options[PAGE_OPTION] = granule
    return msgspec.structs.replace(comp, buffers=buffers, options=options)


def repaged_view(view: Any, factor: int) -> Any:
    """A uint8 ``[pages, page_nbytes]`` view of one buffer (numpy or torch) as ``[sub_pages, page_nbytes /
    factor]``: the same memory, when the page's first axis is its tokens."""
    if factor == 1:
        return view
    return view.reshape(view.shape[0] * factor, view.shape[1] // factor)

"""The ``nsa`` state type: DeepSeek sparse-attention indexer pages, whole sequence, replicated across TP.

A component holds one buffer per layer (the indexer key cache of that layer), each item one page of
``page_size`` tokens stored as raw bytes (DeepSeek-V3.2: 64 tokens x 132 bytes = 8448 bytes per page, fp8
keys then fp32 scales). Every buffer is replicated (``shard=None``): each decode rank receives whole
pages from exactly one prefill rank (the first of its targets when prefill has more ranks).

    >>> from kvbridge import Rank
    >>> from kvbridge_nsa.geometry import nsa_component
    >>> comp = nsa_component("indexer", layers=2, num_pages=1024)
    >>> comp.buffers[0].item_nbytes
    8448
    >>> [len(NSAState().slice(comp, comp, Rank(p, 4), Rank(0, 2)).buffers[0]) for p in range(4)]
    [1, 0, 0, 0]
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvbridge.plugin import (
    BufferGeometry,
    Component,
    ComponentSlice,
    GeometryError,
    IncompatiblePeer,
    IndexKind,
    Rank,
    StateType,
    as_index,
)
from kvbridge_nsa.pages import PageRange, indexer_pages

_AGREED = ("page_size", "bytes_per_token")
SCALE_BYTES = 4          # one fp32 scale per token, after the page's keys


class NSAState(StateType):
    """Sparse-attention indexer pages from position 0, replicated on every rank; travels with the last chunk."""

    name: ClassVar[str] = "nsa"
    chunked: ClassVar[bool] = False
    repageable: ClassVar[bool] = True     # a page is its keys, then its scales: two token planes

    def token_planes(self, component: Component, buffer: BufferGeometry, page_size: int) -> tuple[int, ...] | None:
        """A page holds every token's key bytes, then every token's 4-byte scale (DeepSeek-V3.2's layout).

        >>> from kvbridge_nsa.geometry import nsa_component
        >>> comp = nsa_component("i", layers=1, num_pages=8)
        >>> NSAState().token_planes(comp, comp.buffers[0], 64)
        (128, 4)
        """
        per_token = component.options.get("bytes_per_token")
        if not isinstance(per_token, int) or per_token <= SCALE_BYTES or buffer.item_nbytes != page_size * per_token:
            return None
        return (per_token - SCALE_BYTES, SCALE_BYTES)

    def check_component(self, component: Component, tp: Rank) -> None:
        where = f"component {component.name!r}"
        if component.index_kind is not IndexKind.PAGE:
            raise GeometryError(f"{where}: nsa is indexed by page, not {component.index_kind.value}")
        for key in _AGREED:
            value = component.options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise GeometryError(f"{where}: options[{key!r}] must be a positive int, got {value!r}")
        page_size, per_token = (component.options.get(k) for k in _AGREED)
        for buf in component.buffers:
            if buf.shard is not None:
                raise GeometryError(f"buffer {buf.name!r}: the nsa indexer is replicated on every TP rank; "
                                    f"it has no shard axis (got {buf.shard})")
            if isinstance(page_size, int) and buf.item_nbytes % page_size:
                raise GeometryError(f"buffer {buf.name!r}: a page of {buf.item_nbytes} B does not hold "
                                    f"{page_size} tokens evenly")
            if isinstance(page_size, int) and isinstance(per_token, int) and buf.item_nbytes != page_size * per_token:
                raise GeometryError(f"buffer {buf.name!r}: a page of {buf.item_nbytes} B, expected {page_size} "
                                    f"tokens x {per_token} B = {page_size * per_token} B")

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        for key in _AGREED:
            if src.options.get(key) != dst.options.get(key):
                raise IncompatiblePeer(f"component {src.name!r}: {key} {src.options.get(key)} on prefill, "
                                       f"{dst.options.get(key)} on decode")
        for buf in (*src.buffers, *dst.buffers):
            if buf.shard is not None:
                raise IncompatiblePeer(f"buffer {buf.name!r}: the nsa indexer must be replicated (shard=None)")
        return super().slice(src, dst, src_rank, dst_rank)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        """Both lists start at position 0; every decode page must have a source page (extra source pages
        past the decode's sequence are left out).

        >>> from kvbridge_nsa.geometry import nsa_component
        >>> NSAState().pair_indices(nsa_component("i", layers=1, num_pages=8), np.array([4, 5, 6]), 0,
        ...                         np.array([1, 2]), 0)
        (array([4, 5]), array([1, 2]))
        """
        where = f"component {component.name!r}"
        if src_first != 0 or dst_first != 0:
            raise GeometryError(f"{where}: nsa indexer pages cover the sequence from position 0, prefix hits "
                                f"included; got first positions {src_first} (prefill) and {dst_first} (decode)")
        src, dst = as_index(src_items, f"{where}: prefill"), as_index(dst_items, f"{where}: decode")
        if len(src) < len(dst):
            raise GeometryError(f"{where}: decode expects {len(dst)} indexer pages, prefill sent {len(src)}; "
                                "the two sides disagree on the sequence length")
        return src[: len(dst)], dst

    def pages(self, component: Component, seq_len: int, page_size: int | None = None) -> PageRange:
        """The indexer page positions of a ``seq_len``-token request (page size from the options)."""
        size = page_size if page_size is not None else component.options.get("page_size")
        if not isinstance(size, int):
            raise GeometryError(f"component {component.name!r}: no page_size option; pass page_size")
        return indexer_pages(seq_len, size)

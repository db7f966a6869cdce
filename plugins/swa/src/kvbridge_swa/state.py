"""The ``swa`` state type: the sliding-window-attention KV pages of the window only, head-sliced like KV.

A component holds one buffer per SWA layer and tensor (K of every layer, then V), each item a page of the
SWA pool, token-major ``[page, heads_local, head_dim]`` (``ShardAxis(axis=1, total=kv_heads)``) or
head-major ``[heads_local, page, head_dim]`` (``axis=0``). ``options["window"]`` is the attention window in
tokens (both sides must agree), ``options["page_size"]`` the tokens per page.

Each side lists the SWA-pool pages of its own window together with the absolute position of the first
one (:func:`kvbridge_swa.window.window_pages`); :meth:`SWAState.pair_indices` pairs them by position.
Different prefill and decode TP sizes are resharded by head ranges, as for full-attention KV.

    >>> from kvbridge import Rank
    >>> from kvbridge_swa.geometry import swa_component
    >>> def comp(tp):
    ...     return swa_component("swa", layers=1, page_size=16, kv_heads=8, head_dim=64, tp=tp,
    ...                          dtype="bfloat16", num_pages=128, window=4096)
    >>> seg = SWAState().slice(comp(4), comp(2), Rank(3, 4), Rank(1, 2)).buffers[0]
    >>> len(seg), seg.src_off[:2].tolist(), seg.dst_off[:2].tolist(), int(seg.nbytes[0])   # per token row
    (16, [0, 256], [256, 768], 256)
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvbridge.plugin import (
    Component,
    ComponentSlice,
    GeometryError,
    IncompatiblePeer,
    IndexKind,
    Rank,
    StateType,
)
from kvbridge_swa.window import PageRange, align_by_position, max_window_pages, window_pages

_AGREED = ("window", "page_size")


class SWAState(StateType):
    """Window pages of sliding-window attention layers; travels with the last chunk."""

    name: ClassVar[str] = "swa"
    chunked: ClassVar[bool] = False
    repageable: ClassVar[bool] = True     # token- or head-major window pages split into sub-pages (kvbridge.repaging)

    def check_component(self, component: Component, tp: Rank) -> None:
        where = f"component {component.name!r}"
        if component.index_kind is not IndexKind.PAGE:
            raise GeometryError(f"{where}: swa is indexed by page, not {component.index_kind.value}")
        _positive_option(component, "window", required=True)
        _positive_option(component, "page_size", required=False)
        for buf in component.buffers:
            if buf.shard is not None and buf.shard.groups:
                raise GeometryError(f"buffer {buf.name!r}: swa heads have no shard groups")
            buf.check_tp(tp.size)

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        for key in _AGREED:
            if src.options.get(key) != dst.options.get(key):
                raise IncompatiblePeer(f"component {src.name!r}: {key} {src.options.get(key)} on prefill, "
                                       f"{dst.options.get(key)} on decode")
        return super().slice(src, dst, src_rank, dst_rank)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        """Pair window pages by absolute page position (``*_first``); the decode window must be covered.

        >>> from kvbridge_swa.geometry import swa_component
        >>> comp = swa_component("swa", layers=1, page_size=64, kv_heads=2, head_dim=8, tp=1,
        ...                      dtype="float16", num_pages=512, window=4096)
        >>> SWAState().pair_indices(comp, np.arange(300, 366), 91, np.arange(65), 92)[0][:3]
        array([301, 302, 303])
        """
        page_size = component.options.get("page_size")
        if isinstance(page_size, int):
            # paired as sub-pages of two page sizes, a window spans up to a smaller page more at each end
            edge = component.options.get("sub_page_of", page_size)
            limit = max_window_pages(int(component.options["window"]) + 2 * (int(edge) - page_size), page_size)
            if len(dst_items) > limit:
                raise GeometryError(f"component {component.name!r}: decode lists {len(dst_items)} pages, but a "
                                    f"window of {component.options['window']} tokens spans at most {limit} pages "
                                    f"of {page_size}; send the window's pages only")
        return align_by_position(src_items, src_first, dst_items, dst_first, f"component {component.name!r}")

    def pages(self, component: Component, seq_len: int, page_size: int | None = None) -> PageRange:
        """The window's page positions for a ``seq_len``-token request (page size from the options)."""
        size = page_size if page_size is not None else component.options.get("page_size")
        if not isinstance(size, int):
            raise GeometryError(f"component {component.name!r}: no page_size option; pass page_size")
        return window_pages(seq_len, int(component.options["window"]), size)


def _positive_option(component: Component, key: str, *, required: bool) -> None:
    value = component.options.get(key)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"component {component.name!r}: options[{key!r}] must be a positive int "
                            f"(tokens), got {value!r}")

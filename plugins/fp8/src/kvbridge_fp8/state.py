"""The ``block_scale`` and ``block_scale_swa`` state types: FP8 KV block scales, resliced by KV head.

``block_scale`` travels in chunks with the KV pages it scales (the same page ids: a chunk's pages carry their
scales, a decode prefix hit skips both); ``block_scale_swa`` carries the scales of an SWA pool's window pages
with the last chunk, paired by window position like ``swa``. Both refuse a peer whose scale layout, scale block or
page size differs (a scale byte means something else there), and buffers that are not bytes sharded by KV head.

    >>> from kvbridge import Rank
    >>> from kvbridge_fp8.geometry import block_scale_component
    >>> def comp(tp):
    ...     return block_scale_component("bs", layers=1, page_size=16, kv_heads=8, head_dim=64, tp=tp, num_pages=32)
    >>> seg = BlockScaleState().slice(comp(4), comp(2), Rank(3, 4), Rank(1, 2)).buffers[0]
    >>> len(seg), seg.src_off[:2].tolist(), seg.dst_off[:2].tolist(), int(seg.nbytes[0])   # per token row
    (16, [0, 4], [4, 12], 4)
"""

from __future__ import annotations

from typing import ClassVar

from kvbridge.plugin import (
    Component,
    ComponentSlice,
    GeometryError,
    IncompatiblePeer,
    IndexKind,
    Rank,
    StateType,
)
from kvbridge_fp8.geometry import LAYOUTS
from kvbridge_swa import SWAState

_AGREED = ("layout", "scale_block", "page_size")


def _check_scales(component: Component, tp: Rank) -> None:
    where = f"component {component.name!r}"
    if component.index_kind is not IndexKind.PAGE:
        raise GeometryError(f"{where}: block scales are indexed by page, not {component.index_kind.value}")
    layout = component.options.get("layout")
    if layout not in LAYOUTS:
        raise GeometryError(f"{where}: options['layout'] must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for key in ("scale_block", "page_size"):
        value = component.options.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GeometryError(f"{where}: options[{key!r}] must be a positive int, got {value!r}")
    axis = 0 if layout == "interleaved" else 1
    for buf in component.buffers:
        if buf.dtype.itemsize != 1:
            raise GeometryError(f"buffer {buf.name!r}: block scales are one byte each (UE8M0), not {buf.dtype.value}")
        if buf.shard is None or buf.shard.groups or buf.shard.axis != axis:
            raise GeometryError(f"buffer {buf.name!r}: {layout} scales are sharded by KV head on axis {axis} "
                                f"(got {buf.shard})")
        buf.check_tp(tp.size)


def _agree(src: Component, dst: Component) -> None:
    for key in _AGREED:
        if src.options.get(key) != dst.options.get(key):
            raise IncompatiblePeer(f"component {src.name!r}: block-scale {key} {src.options.get(key)!r} on prefill, "
                                   f"{dst.options.get(key)!r} on decode (a scale byte would scale other elements)")


class BlockScaleState(StateType):
    """Block scales of the full-attention KV pages; travel in chunks with those pages."""

    name: ClassVar[str] = "block_scale"
    chunked: ClassVar[bool] = True

    def check_component(self, component: Component, tp: Rank) -> None:
        _check_scales(component, tp)

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        _agree(src, dst)
        return super().slice(src, dst, src_rank, dst_rank)


class SWABlockScaleState(SWAState):
    """Block scales of an SWA pool's window pages; travel with the last chunk, paired by window position."""

    name: ClassVar[str] = "block_scale_swa"
    chunked: ClassVar[bool] = False

    def check_component(self, component: Component, tp: Rank) -> None:
        _check_scales(component, tp)
        super().check_component(component, tp)

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        _agree(src, dst)
        return super().slice(src, dst, src_rank, dst_rank)


__all__ = ["BlockScaleState", "SWABlockScaleState"]

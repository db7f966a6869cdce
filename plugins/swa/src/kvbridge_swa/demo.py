"""The ``swa`` state type in ``kvbridge demo``: sliding-window KV pages of the swa preset.

Provided to the demo through ``StateTypeSpec(demo_model="kvbridge_swa.demo:SWAModel")``. Fill pattern, one
byte per logical coordinate (a rank's share is cut out on heads with :func:`kvbridge.pattern.shard_axis`)::

    K / V     pattern(seed, TAG_SWA, layer, tensor, position, token, head, byte)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.plugin import (
    Component,
    DType,
    GeometryError,
    RequestShape,
    StateModel,
    UnsupportedTopology,
    pattern,
    shard_axis,
)
from kvbridge_swa.geometry import swa_component

__all__ = ["TAG_SWA", "SWAModel"]

TAG_SWA = 0x5357_4131


@dataclass(frozen=True, kw_only=True)
class SWAModel(StateModel):
    """Sliding-window KV, token-major pages ``[page, heads, head_dim]``; only the window's pages travel.

    The window starts at ``max(0, seq_len - window)`` floored to a page; both sides list the pages of
    their window with the absolute position of the first (``{name: (pages, first)}``).
    """

    name: str
    layers: tuple[int, ...]
    page_size: int
    kv_heads: int
    head_dim: int
    window: int
    dtype: DType = DType.BFLOAT16

    def component(self, tp_size: int, num_items: int) -> Component:
        try:
            return swa_component(self.name, layers=self.layers, page_size=self.page_size, kv_heads=self.kv_heads,
                                 head_dim=self.head_dim, tp=tp_size, dtype=self.dtype, num_pages=num_items,
                                 window=self.window)
        except UnsupportedTopology as exc:
            raise GeometryError(f"{self.kv_heads} SWA KV heads cannot be sharded over TP {tp_size} ({exc})") from None

    def region_items(self, region_pages: int) -> int:
        # a window of W tokens starting anywhere, floored to a page, spans at most this many pages
        return min(region_pages, (self.window + 2 * self.page_size - 2) // self.page_size)

    def span(self, request: RequestShape) -> tuple[int, int]:
        start = max(0, request.seq_len - self.window) // self.page_size
        return start, -(-request.seq_len // self.page_size) - start

    def pages(self, request: RequestShape, first: int, count: int) -> list[np.ndarray]:
        """The rank-independent (logical) K then V pages at positions ``first..first+count``."""
        pos = np.arange(first, first + count).reshape(-1, 1, 1, 1)
        token = np.arange(self.page_size).reshape(1, -1, 1, 1)
        head = np.arange(self.kv_heads).reshape(1, 1, -1, 1)
        byte = np.arange(self.head_dim * DType.parse(self.dtype).itemsize).reshape(1, 1, 1, -1)
        return [pattern(request.seed, TAG_SWA, layer, tensor, pos, token, head, byte)
                for tensor in (0, 1) for layer in self.layers]

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        first, count = self.span(request)
        return [shard_axis(p, 2, tp_size, rank).reshape(count, -1) for p in self.pages(request, first, count)]

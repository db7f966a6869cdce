"""The ``nsa`` state type in ``kvbridge demo``: sparse-attention indexer pages of the deepseek-v32 preset.

Provided to the demo through ``StateTypeSpec(demo_model="kvbridge_nsa.demo:NSAModel")``. Fill pattern, one
byte per logical coordinate, the same on every rank (``byte`` < 132 of one token)::

    indexer   pattern(seed, TAG_NSA, layer, 0, position, token, byte)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.plugin import Component, RequestShape, StateModel, pattern
from kvbridge_nsa.geometry import nsa_component

__all__ = ["TAG_NSA", "NSAModel"]

TAG_NSA = 0x4E53_4131


@dataclass(frozen=True, kw_only=True)
class NSAModel(StateModel):
    """DeepSeek-V3.2 sparse-attention indexer: pages of ``page_size`` tokens x ``bytes_per_token`` (fp8
    key bytes then a 4-byte scale per token; a page stores all keys, then all scales), replicated on
    every rank, the whole sequence from position 0 (also when decode has a prefix hit)."""

    name: str
    layers: tuple[int, ...]
    kv_page_size: int
    page_size: int = 64
    bytes_per_token: int = 132
    scale_bytes: int = 4

    def component(self, tp_size: int, num_items: int) -> Component:
        return nsa_component(self.name, layers=self.layers, page_size=self.page_size,
                             bytes_per_token=self.bytes_per_token, num_pages=num_items)

    def region_items(self, region_pages: int) -> int:
        return -(-region_pages * self.kv_page_size // self.page_size)

    def span(self, request: RequestShape) -> tuple[int, int]:
        return 0, -(-request.seq_len // self.page_size)

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        first, count = self.span(request)
        pos = np.arange(first, first + count).reshape(-1, 1, 1)
        token = np.arange(self.page_size).reshape(1, -1, 1)
        byte = np.arange(self.bytes_per_token).reshape(1, 1, -1)
        key = self.bytes_per_token - self.scale_bytes
        out = []
        for layer in self.layers:
            tokens = pattern(request.seed, TAG_NSA, layer, 0, pos, token, byte)       # [n, P, 132]
            out.append(np.concatenate([tokens[:, :, :key].reshape(count, -1),
                                       tokens[:, :, key:].reshape(count, -1)], axis=1))
        return out

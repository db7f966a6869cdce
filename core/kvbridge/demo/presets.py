"""Model presets for the demo: how each rank's pool looks, how prefill fills it, what decode must hold.

A preset is a list of component models. Each knows its geometry for a (TP size, rank), how to fill the
source items of a request on prefill (the deterministic pattern of ``kvbridge.testkit.reference``), and
what the destination items of a request must hold on decode, computed independently of the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, ShardAxis
from kvbridge.testkit import reference as ref


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One request as both sides see it (page positions are absolute, in pages of the sequence)."""

    index: int
    room: int
    seed: int
    seq_len: int            # tokens
    prefix_pages: int       # pages decode already holds (prefix hit); not sent
    num_pages: int          # pages of the whole sequence

    @property
    def positions(self) -> np.ndarray:
        """Page positions that travel (the delta after the decode prefix)."""
        return np.arange(self.prefix_pages, self.num_pages, dtype=np.int64)


class ComponentModel(Protocol):
    name: str
    chunked: bool

    def component(self, tp_size: int, num_items: int) -> Component: ...
    def items_needed(self, request: RequestShape) -> np.ndarray: ...
    def fill(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None: ...
    def verify(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int: ...


@dataclass(frozen=True, slots=True)
class KVModel:
    """Paged KV: K then V per layer (MHA/GQA) or one latent per layer (MLA)."""

    name: str
    layout: str                 # reference layout: token-major | head-major | mla
    total_heads: int
    head_dim: int
    layers: int
    page_size: int
    dtype: DType = DType.BFLOAT16
    chunked: bool = True

    def spec(self) -> ref.KVSpec:
        return ref.KVSpec(self.layout, total_heads=self.total_heads, page_size=self.page_size,
                          head_bytes=self.head_dim * self.dtype.itemsize)

    @property
    def tensors(self) -> int:
        return 1 if self.layout == ref.MLA else 2

    def component(self, tp_size: int, num_items: int) -> Component:
        if self.layout == ref.MLA:
            shape, shard = (self.page_size, self.head_dim), None
        else:
            heads = len(ref.units_held(self.total_heads, tp_size, 0))
            if self.layout == ref.TOKEN_MAJOR:
                shape, shard = (self.page_size, heads, self.head_dim), ShardAxis(axis=1, total=self.total_heads)
            else:
                shape, shard = (heads, self.page_size, self.head_dim), ShardAxis(axis=0, total=self.total_heads)
        buffers = tuple(BufferGeometry(f"{'kv'[t] if self.tensors == 2 else 'c'}.{layer}", num_items, shape,
                                       self.dtype, shard)
                        for t in range(self.tensors) for layer in range(self.layers))
        return Component(self.name, "kv", buffers, IndexKind.PAGE)

    def items_needed(self, request: RequestShape) -> np.ndarray:
        return request.positions

    def _coords(self, index: int) -> tuple[int, int]:
        return index % self.layers, index // self.layers   # (layer, tensor)

    def fill(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None:
        spec = self.spec()
        for b, buf in enumerate(buffers):
            layer, tensor = self._coords(b)
            ref.fill_source(buf, spec, request.seed, layer, tensor, tp_size, rank, items, request.positions)

    def verify(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int:
        """Return how many bytes differ from the reference (0 = byte-exact)."""
        spec = self.spec()
        bad = 0
        for b, buf in enumerate(buffers):
            layer, tensor = self._coords(b)
            want = ref.expected_pages(spec, request.seed, layer, tensor, tp_size, rank, request.positions)
            got = ref.byte_view(buf).reshape(-1, *spec.local_page_shape(tp_size))[items]
            bad += int(np.count_nonzero(got != want))
        return bad


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    page_size: int
    components: tuple[ComponentModel, ...]
    model: str

    def check_tp(self, prefill_tp: int, decode_tp: int) -> None:
        """Raise UnsupportedTopology/GeometryError with the reason when the shapes forbid these sizes."""
        from kvbridge.slicing import check_ratio

        check_ratio(prefill_tp, decode_tp)
        for tp in (prefill_tp, decode_tp):
            for model in self.components:
                for buf in model.component(tp, 2).buffers:
                    buf.check_tp(tp)


PRESETS: dict[str, Callable[[], Preset]] = {
    "dense-gqa": lambda: Preset(
        "dense-gqa", "Llama-like GQA: 8 KV heads x 128, bf16, token-major 16-token pages, 4 layers", 16,
        (KVModel("kv", ref.TOKEN_MAJOR, total_heads=8, head_dim=128, layers=4, page_size=16),), "demo-dense-gqa"),
    "dense-gqa-headmajor": lambda: Preset(
        "dense-gqa-headmajor", "GQA with head-major pages: 8 KV heads x 128, bf16, 16-token pages, 4 layers", 16,
        (KVModel("kv", ref.HEAD_MAJOR, total_heads=8, head_dim=128, layers=4, page_size=16),), "demo-gqa-hm"),
    "mla": lambda: Preset(
        "mla", "DeepSeek-like MLA: one 576-wide bf16 latent per token, replicated, 16-token pages, 4 layers", 16,
        (KVModel("kv", ref.MLA, total_heads=1, head_dim=576, layers=4, page_size=16),), "demo-mla"),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None

"""Model presets for the demo: how each rank's pool looks, how prefill fills it, what decode must hold.

A preset is a tuple of component models in the pool's wire order. Each knows its geometry for a
(TP size, rank), which logical items a request moves (``span``: first position and count; KV pages are
the delta after the decode prefix, state components have their own: one Mamba slot, the SWA window's
pages, every NSA indexer page from position 0), how many items a request region of its pool holds, how
to fill the source items of a request on prefill (the deterministic pattern of :mod:`kvbridge.pattern`),
and what the destination items must hold on decode, computed independently of the planner (the contract:
:mod:`kvbridge.demo.model`). The paged KV model is here; the hybrid presets' state models come from the
installed state-type plugins (:mod:`kvbridge.demo.state_models`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge import pattern as ref
from kvbridge.demo.model import ComponentModel, RequestShape
from kvbridge.demo.state_models import StateModels
from kvbridge.errors import GeometryError, KVBridgeError, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, ShardAxis
from kvbridge.registry import Registry

__all__ = ["PRESETS", "ComponentModel", "KVModel", "Preset", "RequestShape", "get_preset"]


@dataclass(frozen=True, slots=True, kw_only=True)
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
    first_layer: int = 0        # the model's id of the first layer (a pipeline stage's share: ids first_layer..)

    def spec(self) -> ref.KVSpec:
        return ref.KVSpec(self.layout, total_heads=self.total_heads, page_size=self.page_size,
                          head_bytes=self.head_dim * self.dtype.itemsize)

    @property
    def tensors(self) -> int:
        return 1 if self.layout == ref.MLA else 2

    def component(self, tp_size: int, num_items: int) -> Component:
        if self.layout == ref.MLA:
            shape: tuple[int, ...] = (self.page_size, self.head_dim)
            shard: ShardAxis | None = None
        else:
            try:
                heads = len(ref.units_held(self.total_heads, tp_size, 0))
            except ValueError as exc:
                raise GeometryError(f"{self.total_heads} KV heads cannot be sharded over TP {tp_size} "
                                    f"({exc})") from None
            if self.layout == ref.TOKEN_MAJOR:
                shape, shard = (self.page_size, heads, self.head_dim), ShardAxis(axis=1, total=self.total_heads)
            else:
                shape, shard = (heads, self.page_size, self.head_dim), ShardAxis(axis=0, total=self.total_heads)
        buffers = tuple(BufferGeometry(name=f"{'kv'[t] if self.tensors == 2 else 'c'}.{layer}",
                                       num_items=num_items, item_shape=shape,
                                       dtype=self.dtype, shard=shard)
                        for t in range(self.tensors)
                        for layer in range(self.first_layer, self.first_layer + self.layers))
        return Component(name=self.name, state_type="kv", buffers=buffers, index_kind=IndexKind.PAGE)

    def region_items(self, region_pages: int) -> int:
        return region_pages

    def span(self, request: RequestShape) -> tuple[int, int]:
        return request.prefix_pages, request.num_pages - request.prefix_pages

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        """What ``rank`` holds of the request's pages, per buffer (wire order): uint8 ``[pages, page bytes]``."""
        spec, shape = self.spec(), (len(request.positions), self.spec().local_page_nbytes(tp_size))
        return [ref.expected_pages(spec, request.seed, *self._coords(b), tp_size, rank,
                                   request.positions).reshape(shape)
                for b in range(self.tensors * self.layers)]

    def _coords(self, index: int) -> tuple[int, int]:
        return self.first_layer + index % self.layers, index // self.layers   # (layer id, tensor)

    def fill(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None:
        spec = self.spec()
        for b, buf in enumerate(buffers):
            layer, tensor = self._coords(b)
            ref.fill_source(buf, spec, request.seed, layer, tensor, tp_size, rank, items, request.positions)

    def verify(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int:
        """Return how many bytes differ from the reference (0 = byte-exact), plus any byte written into
        page 0 (padding: no request owns it, and the demo pool starts zeroed)."""
        spec = self.spec()
        bad = 0
        for b, buf in enumerate(buffers):
            layer, tensor = self._coords(b)
            want = ref.expected_pages(spec, request.seed, layer, tensor, tp_size, rank, request.positions)
            pages = ref.byte_view(buf).reshape(-1, *spec.local_page_shape(tp_size))
            bad += int(np.count_nonzero(pages[items] != want)) + int(np.count_nonzero(pages[0]))
        return bad


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    name: str
    description: str
    page_size: int
    components: tuple[ComponentModel, ...]
    model: str
    moves: str = ""             # one line: what travels per request

    @property
    def chunked(self) -> ComponentModel:
        """The component whose items travel chunk by chunk (the KV pages; exactly one per preset)."""
        found = [m for m in self.components if m.chunked]
        if len(found) != 1:
            raise ValueError(f"preset {self.name!r} needs exactly one chunked component, has {len(found)}")
        return found[0]

    def check_tp(self, prefill_tp: int, decode_tp: int) -> None:
        """Raise UnsupportedTopology naming the preset, the side and the component whose shapes forbid these
        TP sizes (or the ratio, when neither size is a multiple of the other)."""
        from kvbridge.slicing import check_ratio

        what = f"preset {self.name!r} cannot run prefill TP {prefill_tp} -> decode TP {decode_tp}"
        try:
            check_ratio(prefill_tp, decode_tp)
        except UnsupportedTopology as exc:
            raise UnsupportedTopology(f"{what}: {exc}") from None
        for side, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            for model in self.components:
                try:
                    for buf in model.component(tp, 2).buffers:
                        buf.check_tp(tp)
                except (KVBridgeError, ValueError) as exc:
                    raise UnsupportedTopology(f"{what}: {side} TP {tp}: component {model.name!r}: {exc}") from None


def _qwen3_next(models: StateModels) -> Preset:
    kv = KVModel(name="kv", layout=ref.TOKEN_MAJOR, total_heads=2, head_dim=64, layers=2, page_size=16)
    gdn = models.build("mamba", name="mamba", layers=(0, 1, 2), key_dim=32, value_dim=64, kernel=4, heads=8,
                       head_k_dim=8, head_v_dim=8)
    return Preset(
        name="qwen3-next",
        description="Qwen3-Next-like hybrid: GQA KV (2 KV heads x 64, bf16, token-major 16-token pages, 2 layers) "
        "+ GDN Mamba slots (conv [q|k|v] = 32|32|64 channels x 3 bf16, SSM 8 heads x 8x8 fp32, 3 layers)",
        page_size=16,
        components=(kv, gdn), model="demo-qwen3-next",
        moves="KV pages after the decode prefix, head-sliced (replicated heads above TP 2) + one GDN slot: conv "
        "channels resharded group by group [q|k|v], SSM state by heads")


def _swa(models: StateModels) -> Preset:
    kv = KVModel(name="kv", layout=ref.TOKEN_MAJOR, total_heads=8, head_dim=32, layers=2, page_size=16)
    swa = models.build("swa", name="swa", layers=(0, 2), page_size=16, kv_heads=8, head_dim=32, window=40)
    return Preset(
        name="swa",
        description="gpt-oss-like hybrid: full-attention KV (8 KV heads x 32, bf16, token-major 16-token pages, "
        "2 layers) + sliding-window KV (same heads, window 40 tokens = 2.5 pages, 2 layers)", page_size=16,
        components=(kv, swa), model="demo-swa",
        moves="KV pages after the decode prefix + the SWA pages of the last 40 tokens only (window start floored "
        "to a page, aligned by absolute position), both head-sliced")


def _deepseek_v32(models: StateModels) -> Preset:
    kv = KVModel(name="kv", layout=ref.MLA, total_heads=1, head_dim=64, layers=2, page_size=64)
    nsa = models.build("nsa", name="nsa", layers=(0, 1), kv_page_size=64, page_size=64, bytes_per_token=132)
    return Preset(
        name="deepseek-v32",
        description="DeepSeek-V3.2-like: MLA latent (64 x bf16 per token, replicated, 64-token pages, 2 layers) + NSA "
        "indexer (64-token pages of 132 B per token, replicated, 2 layers)", page_size=64,
        components=(kv, nsa), model="demo-deepseek-v32",
        moves="MLA pages after the decode prefix + every NSA indexer page from position 0 (prefix hits "
        "included), whole pages from one elected prefill rank per decode rank")


def _dense(name: str, model: str, description: str, moves: str, layout: str, total_heads: int,
           head_dim: int) -> Callable[[StateModels], Preset]:
    """A preset of one paged KV component (4 layers, 16-token pages): needs no state-type plugin."""
    kv = KVModel(name="kv", layout=layout, total_heads=total_heads, head_dim=head_dim, layers=4, page_size=16)
    preset = Preset(name=name, description=description, page_size=16, components=(kv,), model=model, moves=moves)
    return lambda _: preset


#: Each preset is built with the state models of the installed plugins (dense presets need none).
PRESETS: dict[str, Callable[[StateModels], Preset]] = {
    "dense-gqa": _dense("dense-gqa", "demo-dense-gqa",
                        "Llama-like GQA: 8 KV heads x 128, bf16, token-major 16-token pages, 4 layers",
                        "KV pages after the decode prefix, head-sliced per token row",
                        layout=ref.TOKEN_MAJOR, total_heads=8, head_dim=128),
    "dense-gqa-headmajor": _dense("dense-gqa-headmajor", "demo-gqa-hm",
                                  "GQA with head-major pages: 8 KV heads x 128, bf16, 16-token pages, 4 layers",
                                  "KV pages after the decode prefix, head-sliced per page",
                                  layout=ref.HEAD_MAJOR, total_heads=8, head_dim=128),
    "mla": _dense("mla", "demo-mla",
                  "DeepSeek-like MLA: one 576-wide bf16 latent per token, replicated, 16-token pages, 4 layers",
                  "MLA latent pages after the decode prefix, whole pages from one elected prefill rank",
                  layout=ref.MLA, total_heads=1, head_dim=576),
    "qwen3-next": _qwen3_next,
    "swa": _swa,
    "deepseek-v32": _deepseek_v32,
}


def get_preset(name: str, registry: Registry | None = None) -> Preset:
    """The preset ``name``; a hybrid one takes its state models from ``registry`` (default: built here)."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return build(StateModels(name, registry))

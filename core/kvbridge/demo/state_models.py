"""Component models of the hybrid demo presets: GDN/Mamba slots, sliding-window pages, NSA indexer pages.

Each model describes one state component three ways: the kvbridge ``Component`` a rank registers (built
by the state type's own plugin), which logical items a request moves (:meth:`span`), and the bytes every
rank holds of them (:meth:`expected`), computed here from logical coordinates with plain numpy and the
pattern of :mod:`kvbridge.testkit.reference` -- never through ``kvbridge.slicing`` or the planner.

Fill pattern, one byte per logical coordinate (``tag`` separates the components, so a page of one
component landing in another is caught)::

    mamba conv      pattern(seed, TAG_MAMBA, layer, 0, 0, channel, byte)      # channel of q|k|v, all ranks
    mamba temporal  pattern(seed, TAG_MAMBA, layer, 1, 0, head, byte)
    swa  K / V      pattern(seed, TAG_SWA, layer, tensor, position, token, head, byte)
    nsa  indexer    pattern(seed, TAG_NSA, layer, 0, position, token, byte)  # byte < 132 of one token

A rank's share is cut out of the logical tensor with :func:`kvbridge.testkit.reference.shard_axis`
(GDN conv channels group by group: ``[q/tp | k/tp | v/tp]``); NSA is the same on every rank. The
plugins are imported only when a model builds its component, so the core demo does not need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import GeometryError, UnsupportedTopology
from kvbridge.geometry import Component, DType
from kvbridge.testkit import reference as ref

if TYPE_CHECKING:
    from kvbridge.demo.presets import RequestShape

TAG_MAMBA = 0x4D41_4D42
TAG_SWA = 0x5357_4131
TAG_NSA = 0x4E53_4131


def item_rows(buffer: Any) -> np.ndarray:
    """A writable uint8 view ``[num_items, item bytes]`` of a rank buffer (first axis = items)."""
    view = ref.byte_view(buffer)
    return view.reshape(view.shape[0], -1)


def _bytes_of(dtype: DType) -> int:
    return DType.parse(dtype).itemsize


class StateModel:
    """Shared fill / verify over :meth:`expected`; subclasses give the geometry and the logical bytes."""

    name: str
    chunked = False

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        """What ``rank`` holds of the request's items, per buffer (wire order): uint8 ``[count, item bytes]``."""
        raise NotImplementedError

    def span(self, request: RequestShape) -> tuple[int, int]:
        """(first position, count) of the logical items the request moves."""
        raise NotImplementedError

    def fill(self, buffers: Sequence[Any], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None:
        for buf, want in zip(buffers, self.expected(tp_size, rank, request), strict=True):
            item_rows(buf)[items] = want

    def verify(self, buffers: Sequence[Any], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int:
        """Bytes that differ from the reference in the request's items, plus any byte written into item 0
        (the padding item no request owns; the demo pool starts zeroed)."""
        bad = 0
        for buf, want in zip(buffers, self.expected(tp_size, rank, request), strict=True):
            rows = item_rows(buf)
            bad += int(np.count_nonzero(rows[items] != want)) + int(np.count_nonzero(rows[0]))
        return bad


@dataclass(frozen=True)
class MambaModel(StateModel):
    """GDN (Qwen3-Next) linear-attention state: one slot per request (slot 0 is padding).

    Conv state per layer ``[channels, kernel-1]`` with channels ``[q | k | v]`` = (key_dim, key_dim,
    value_dim), each group sharded on its own; temporal (SSM) state ``[heads, head_k_dim, head_v_dim]``
    sharded on heads.
    """

    name: str
    layers: tuple[int, ...]
    key_dim: int
    value_dim: int
    kernel: int
    heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: DType = DType.BFLOAT16
    ssm_dtype: DType = DType.FLOAT32
    slots_per_region: int = 3

    @property
    def groups(self) -> tuple[int, int, int]:
        return (self.key_dim, self.key_dim, self.value_dim)

    def component(self, tp_size: int, num_items: int) -> Component:
        from kvbridge_mamba import mamba_component

        try:
            return mamba_component(self.name, layers=self.layers, conv_groups=self.groups, kernel=self.kernel,
                                   heads=self.heads, head_dim=self.head_k_dim, state=self.head_v_dim, tp=tp_size,
                                   dtype=self.conv_dtype, ssm_dtype=self.ssm_dtype, num_slots=num_items)
        except UnsupportedTopology as exc:
            raise GeometryError(f"GDN conv groups [q|k|v] = {list(self.groups)} channels and {self.heads} SSM heads "
                                f"cannot be sharded over TP {tp_size} ({exc})") from None

    def region_items(self, region_pages: int) -> int:
        return self.slots_per_region

    def span(self, request: RequestShape) -> tuple[int, int]:
        return 0, 1

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        conv_bytes = (self.kernel - 1) * _bytes_of(self.conv_dtype)
        head_bytes = self.head_k_dim * self.head_v_dim * _bytes_of(self.ssm_dtype)
        channel = np.arange(sum(self.groups)).reshape(-1, 1)
        head = np.arange(self.heads).reshape(-1, 1)
        conv, temporal = [], []
        for layer in self.layers:
            logical = ref.pattern(request.seed, TAG_MAMBA, layer, 0, 0, channel, np.arange(conv_bytes))
            conv.append(ref.shard_axis(logical, 0, tp_size, rank, self.groups).reshape(1, -1))
            logical = ref.pattern(request.seed, TAG_MAMBA, layer, 1, 0, head, np.arange(head_bytes))
            temporal.append(ref.shard_axis(logical, 0, tp_size, rank).reshape(1, -1))
        return conv + temporal


@dataclass(frozen=True)
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
        from kvbridge_swa import swa_component

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
        byte = np.arange(self.head_dim * _bytes_of(self.dtype)).reshape(1, 1, 1, -1)
        return [ref.pattern(request.seed, TAG_SWA, layer, tensor, pos, token, head, byte)
                for tensor in (0, 1) for layer in self.layers]

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        first, count = self.span(request)
        return [ref.shard_axis(p, 2, tp_size, rank).reshape(count, -1) for p in self.pages(request, first, count)]


@dataclass(frozen=True)
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
        from kvbridge_nsa import nsa_component

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
            tokens = ref.pattern(request.seed, TAG_NSA, layer, 0, pos, token, byte)       # [n, P, 132]
            out.append(np.concatenate([tokens[:, :, :key].reshape(count, -1),
                                       tokens[:, :, key:].reshape(count, -1)], axis=1))
        return out

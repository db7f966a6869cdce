"""The ``mamba`` state type in ``kvbridge demo``: GDN/Mamba slots of the qwen3-next preset.

Provided to the demo through ``StateTypeSpec(demo_model="kvbridge_mamba.demo:MambaModel")``. Fill pattern,
one byte per logical coordinate (conv channels of ``[q | k | v]``, the same on every rank; a rank's share
is cut out group by group with :func:`kvbridge.pattern.shard_axis`)::

    conv      pattern(seed, TAG_MAMBA, layer, 0, 0, channel, byte)
    temporal  pattern(seed, TAG_MAMBA, layer, 1, 0, head, byte)
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
from kvbridge_mamba.geometry import mamba_component

__all__ = ["TAG_MAMBA", "MambaModel"]

TAG_MAMBA = 0x4D41_4D42


@dataclass(frozen=True, kw_only=True)
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
        conv_bytes = (self.kernel - 1) * DType.parse(self.conv_dtype).itemsize
        head_bytes = self.head_k_dim * self.head_v_dim * DType.parse(self.ssm_dtype).itemsize
        channel = np.arange(sum(self.groups)).reshape(-1, 1)
        head = np.arange(self.heads).reshape(-1, 1)
        conv, temporal = [], []
        for layer in self.layers:
            logical = pattern(request.seed, TAG_MAMBA, layer, 0, 0, channel, np.arange(conv_bytes))
            conv.append(shard_axis(logical, 0, tp_size, rank, self.groups).reshape(1, -1))
            logical = pattern(request.seed, TAG_MAMBA, layer, 1, 0, head, np.arange(head_bytes))
            temporal.append(shard_axis(logical, 0, tp_size, rank).reshape(1, -1))
        return conv + temporal

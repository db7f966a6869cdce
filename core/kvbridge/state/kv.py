"""The built-in ``kv`` state type: paged KV cache, MHA/GQA head-sliced, MLA replicated.

Buffers are one per layer and tensor (K layers, then V layers), each item a page. Token-major pages are
``[page_size, heads, head_dim]`` with ``ShardAxis(axis=1, total=H)``; head-major pages are
``[heads, page_size, head_dim]`` with ``ShardAxis(axis=0, total=H)``; MLA pages have no shard axis.
Head ranges are computed from the model's total KV heads, never ``local * TP``; with fewer heads than
ranks, one replica per destination is elected to write.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

from kvbridge._markers import hookimpl
from kvbridge.errors import GeometryError
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, Rank, ShardAxis, local_units
from kvbridge.specs import StateTypeSpec
from kvbridge.state.base import StateType


class KVState(StateType):
    name: ClassVar[str] = "kv"
    chunked: ClassVar[bool] = True
    repageable: ClassVar[bool] = True

    def check_component(self, component: Component, tp: Rank) -> None:
        if component.index_kind is not IndexKind.PAGE:
            raise GeometryError(f"component {component.name!r}: kv is indexed by page, "
                                f"not {component.index_kind.value}")
        for buf in component.buffers:
            if buf.shard is not None and buf.shard.groups:
                raise GeometryError(f"buffer {buf.name!r}: kv heads have no shard groups")


class KVLayout(str, enum.Enum):
    """How a KV page is laid out in memory."""

    TOKEN_MAJOR = "token_major"   # [page_size, heads, head_dim], K and V
    HEAD_MAJOR = "head_major"     # [heads, page_size, head_dim], K and V
    MLA = "mla"                   # [page_size, head_dim]: one latent per token, replicated on every rank


def kv_component(name: str = "kv", *, layers: int | Sequence[int], page_size: int, kv_heads: int, head_dim: int,
                 tp: int, dtype: DType | str, num_pages: int,
                 layout: KVLayout | str = KVLayout.TOKEN_MAJOR) -> Component:
    """The paged KV component of one rank of a TP group of size ``tp``, in wire order: K of every layer,
    then V of every layer (``<name>.k.<layer>``, ``<name>.v.<layer>``; MLA: ``<name>.c.<layer>``).

    ``kv_heads`` is the model's total KV heads (fewer heads than ranks replicates them; ignored for MLA),
    ``layers`` a count or the model's layer ids. Raises UnsupportedTopology when the heads cannot be split
    over ``tp``::

        kv_component(layers=32, page_size=16, kv_heads=8, head_dim=128, tp=4, dtype="bfloat16", num_pages=1024)
    """
    kind = KVLayout(layout)
    if page_size <= 0 or tp <= 0 or head_dim <= 0 or kv_heads <= 0:
        raise GeometryError(f"{name}: page size {page_size}, TP {tp}, head dim {head_dim} and KV heads {kv_heads} "
                            "must be positive")
    ids = tuple(range(layers)) if isinstance(layers, int) else tuple(int(i) for i in layers)
    if not ids or len(set(ids)) != len(ids):
        raise GeometryError(f"{name}: layer ids {ids} must be non-empty and distinct")
    dt = DType.parse(dtype)
    if kind is KVLayout.MLA:
        return Component(name=name, state_type="kv", index_kind=IndexKind.PAGE, buffers=tuple(
            BufferGeometry(name=f"{name}.c.{i}", num_items=num_pages, item_shape=(page_size, head_dim),
                           dtype=dt) for i in ids))
    heads = local_units(kv_heads, tp)
    head_major = kind is KVLayout.HEAD_MAJOR
    shape = (heads, page_size, head_dim) if head_major else (page_size, heads, head_dim)
    shard = ShardAxis(axis=0 if head_major else 1, total=kv_heads)
    buffers = tuple(BufferGeometry(name=f"{name}.{t}.{i}", num_items=num_pages, item_shape=shape, dtype=dt,
                                   shard=shard) for t in "kv" for i in ids)
    return Component(name=name, state_type="kv", buffers=buffers, index_kind=IndexKind.PAGE)


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="kv", factory=KVState, description="paged KV cache (MHA/GQA/MLA), built in")]

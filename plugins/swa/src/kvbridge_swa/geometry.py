"""Build the ``Component`` of an SWA KV pool as one TP rank holds it.

Buffers come in wire order: K of every SWA layer, then V of every SWA layer, named by model layer id
(``<name>.k.<layer>``, ``<name>.v.<layer>``). Pages are token-major ``[page, heads_local, head_dim]`` unless
``head_major``, which gives ``[heads_local, page, head_dim]`` (one contiguous slice per page when resharding).

Example, gpt-oss-like: 8 KV heads of 64, window 128, every other layer sliding, TP 4::

    >>> comp = swa_component("swa", layers=range(0, 36, 2), page_size=16, kv_heads=8, head_dim=64, tp=4,
    ...                      dtype="bfloat16", num_pages=4096, window=128)
    >>> comp.buffers[0].name, comp.buffers[18].name, comp.buffers[0].item_shape, comp.options
    ('swa.k.0', 'swa.v.0', (16, 2, 64), {'window': 128, 'page_size': 16})
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.plugin import BufferGeometry, Component, DType, GeometryError, IndexKind, ShardAxis, local_units


def swa_component(name: str, *, layers: int | Sequence[int], page_size: int, kv_heads: int, head_dim: int, tp: int,
                  dtype: DType | str, num_pages: int, window: int, v_head_dim: int | None = None,
                  head_major: bool = False) -> Component:
    """The paged SWA component of one rank of a TP group of size ``tp``.

    ``kv_heads`` is the model's total KV heads (fewer heads than ranks replicates them); ``window`` the
    attention window in tokens. Raises UnsupportedTopology when the heads cannot be split over ``tp``.
    """
    if window <= 0 or page_size <= 0 or tp <= 0:
        raise GeometryError(f"{name}: window {window}, page size {page_size} and TP {tp} must be positive")
    ids = tuple(range(layers)) if isinstance(layers, int) else tuple(int(i) for i in layers)
    if not ids or len(set(ids)) != len(ids):
        raise GeometryError(f"{name}: layer ids {ids} must be non-empty and distinct")
    heads = local_units(kv_heads, tp)
    shard = ShardAxis(axis=0 if head_major else 1, total=kv_heads)
    kind = DType.parse(dtype)

    def page(dim: int) -> tuple[int, ...]:
        return (heads, page_size, dim) if head_major else (page_size, heads, dim)

    k = tuple(BufferGeometry(name=f"{name}.k.{i}", num_items=num_pages, item_shape=page(head_dim), dtype=kind,
                             shard=shard) for i in ids)
    v = tuple(BufferGeometry(name=f"{name}.v.{i}", num_items=num_pages,
                             item_shape=page(v_head_dim or head_dim), dtype=kind, shard=shard) for i in ids)
    return Component(name=name, state_type="swa", buffers=k + v, index_kind=IndexKind.PAGE,
                     options={"window": window, "page_size": page_size})

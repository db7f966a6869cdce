"""Build the ``Component`` of an FP8 KV cache's block scales as one TP rank holds it.

MXFP8 KV (SGLang's ``MHATokenToKVPoolMXFP8``) stores K and V as FP8 E4M3 with one UE8M0 scale byte per 32
elements of a head, beside the pages: per layer a K scale buffer then a V scale buffer, indexed by the same page
ids as the pages they scale. Two layouts of a page's scales:

* ``token`` (any page size but 128): ``[page_size, heads_local, head_dim // 32]``, token-major
  (``ShardAxis(axis=1, total=kv_heads)``);
* ``interleaved`` (SGLang with 128-token pages, the FA4 atom layout): ``[heads_local, 32, page_size // 32,
  head_dim // 32]``, each head's scales contiguous (``ShardAxis(axis=0, total=kv_heads)``).

Either way a head's scales travel with that head's pages: resliced by KV head across TP sizes, replicated like
the heads when there are fewer heads than ranks.

    >>> comp = block_scale_component("block_scale", layers=2, page_size=16, kv_heads=8, head_dim=128, tp=2,
    ...                              num_pages=64)
    >>> [b.name for b in comp.buffers], comp.buffers[0].item_shape, comp.options["layout"]
    (['block_scale.k.0', 'block_scale.k.1', 'block_scale.v.0', 'block_scale.v.1'], (16, 4, 4), 'token')
    >>> block_scale_component("bs", layers=1, page_size=128, kv_heads=8, head_dim=128, tp=4,
    ...                       num_pages=8).buffers[0].item_shape
    (2, 32, 4, 4)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.plugin import BufferGeometry, Component, DType, GeometryError, IndexKind, ShardAxis, local_units

#: elements of a head that share one scale (MXFP8)
SCALE_BLOCK = 32
#: the page size at which SGLang stores scales interleaved (FA4's BlockScaledBasicChunk atom)
INTERLEAVED_PAGE = 128
LAYOUTS = ("token", "interleaved")


def scale_shape(layout: str, page_size: int, heads: int, head_dim: int, scale_block: int = SCALE_BLOCK
                ) -> tuple[int, ...]:
    """The shape of one page's scales (bytes) of ``heads`` heads."""
    dim = head_dim // scale_block
    if layout == "interleaved":
        return (heads, scale_block, page_size // scale_block, dim)
    return (page_size, heads, dim)


def block_scale_component(name: str, *, layers: int | Sequence[int], page_size: int, kv_heads: int, head_dim: int,
                          tp: int, num_pages: int, v_head_dim: int | None = None, layout: str | None = None,
                          state_type: str = "block_scale", window: int | None = None,
                          scale_block: int = SCALE_BLOCK) -> Component:
    """The block-scale component of one rank of a TP group of size ``tp``: K scales of every layer, then V.

    ``layout`` defaults to SGLang's choice (``interleaved`` for 128-token pages, else ``token``);
    ``state_type="block_scale_swa"`` with ``window``: the scales of an SWA pool (paired by window position).
    """
    kind = layout or ("interleaved" if page_size == INTERLEAVED_PAGE else "token")
    if kind not in LAYOUTS:
        raise GeometryError(f"{name}: scale layout {kind!r}; one of {', '.join(LAYOUTS)}")
    if page_size <= 0 or tp <= 0 or kv_heads <= 0 or scale_block <= 0:
        raise GeometryError(f"{name}: page size {page_size}, TP {tp}, KV heads {kv_heads} and scale block "
                            f"{scale_block} must be positive")
    for dim in (head_dim, v_head_dim or head_dim):
        if dim <= 0 or dim % scale_block:
            raise GeometryError(f"{name}: head dim {dim} is not a whole number of {scale_block}-element blocks")
    if kind == "interleaved" and page_size % scale_block:
        raise GeometryError(f"{name}: interleaved scales need pages of a multiple of {scale_block} tokens, got "
                            f"{page_size}")
    ids = tuple(range(layers)) if isinstance(layers, int) else tuple(int(i) for i in layers)
    if not ids or len(set(ids)) != len(ids):
        raise GeometryError(f"{name}: layer ids {ids} must be non-empty and distinct")
    heads = local_units(kv_heads, tp)
    shard = ShardAxis(axis=0 if kind == "interleaved" else 1, total=kv_heads)
    buffers = tuple(BufferGeometry(name=f"{name}.{t}.{i}", num_items=num_pages, dtype=DType.UINT8, shard=shard,
                                   item_shape=scale_shape(kind, page_size, heads, dim, scale_block))
                    for t, dim in (("k", head_dim), ("v", v_head_dim or head_dim)) for i in ids)
    options: dict[str, int | str | float] = {"page_size": page_size, "scale_block": scale_block, "layout": kind}
    if state_type == "block_scale_swa":
        if window is None or window <= 0:
            raise GeometryError(f"{name}: the scales of an SWA pool need its window (tokens)")
        options["window"] = window
    return Component(name=name, state_type=state_type, buffers=buffers, index_kind=IndexKind.PAGE, options=options)

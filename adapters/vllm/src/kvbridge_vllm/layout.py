"""vLLM's paged KV tensors as a kvbridge ``PoolLayout``: pure shape logic, no vLLM import.

vLLM hands ``register_kv_caches`` one tensor per attention layer. How a (block, head) sits in memory
depends on the attention backend:

``cpu``
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM's CPU attention). Each (block, head)
    is ``2 * block_size`` rows of ``head_size``: the block's K rows, then its V rows (it is *not* K|V
    along the last axis). One buffer per layer; an item is a block of shape
    ``(heads, 2 * block_size, head_size)`` sharded by heads (axis 0), so K and V of a head move together.
``nhd``
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (FlashAttention's default). K and V are
    two contiguous halves: buffers ``k.<layer>`` and ``v.<layer>`` with items
    ``(block_size, heads, head_size)`` sharded on axis 1 (head-sliced per token row).
``hnd``
    the same logical shape with a head-major physical order (``[2, num_blocks, heads, block_size,
    head_size]`` in memory; vLLM exposes it as a permuted view): items ``(heads, block_size, head_size)``
    sharded on axis 0.
``flashinfer``
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (FlashInfer's NHD): a block's K and V are
    adjacent. One buffer per layer; an item is ``(2, block_size, heads, head_size)`` sharded on axis 2.
``flashinfer_hnd``
    the same logical shape, head-major in memory (``[num_blocks, 2, heads, block_size, head_size]``): items
    ``(2, heads, block_size, head_size)`` sharded on axis 1.
``mla``
    ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (MLA backends): one latent per token, the same on
    every TP rank. One buffer per layer, replicated (no shard axis): each decode rank gets it from one
    prefill rank.

Wire order is the layer order vLLM gives (its layer names sorted by layer index), K before V per layer for
the GPU layouts. Both sides must agree: the handshake refuses a peer whose layout differs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import GeometryError
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, PoolLayout, ShardAxis

__all__ = ["KV_COMPONENT", "LAYOUTS", "KVPool", "layer_order", "pool_layout"]

KV_COMPONENT = "kv"
LAYOUTS = ("cpu", "nhd", "hnd", "flashinfer", "flashinfer_hnd", "mla")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVPool:
    """What an agent registers: the layout and, per component, one tensor per buffer (wire order)."""

    layout: PoolLayout
    buffers: dict[str, list[Any]]
    layers: tuple[str, ...]             # vLLM layer names, wire order
    num_blocks: int
    kind: str


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM layer names sorted by their layer index (``model.layers.<i>.self_attn.attn``), then by name."""
    def key(name: str) -> tuple[int, str]:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(found[0]) if found else -1, name)
    return sorted(names, key=key)


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def _hnd_physical(tensor: Any, name: str) -> Any:
    """The head-major memory of an HND cache, exposed as the logical ``[2, B, N, H, D]``: permute back to
    ``[2, B, H, N, D]`` and require it to be contiguous. A tensor that is already physically
    ``[2, B, H, N, D]`` (contiguous) is taken as it is when its strides say so."""
    permuted = tensor.permute(0, 1, 3, 2, 4)
    if permuted.is_contiguous():
        return permuted
    raise GeometryError(f"layer {name!r}: HND cache of shape {_shape(tensor)} is not head-major in memory "
                        f"(strides {tuple(tensor.stride())})")


def _check_block_size(name: str, size: int, block_size: int) -> None:
    if size != block_size:
        raise GeometryError(f"layer {name!r}: block size {size} in the tensor, {block_size} configured")


def _check_contiguous(name: str, tensor: Any, what: str) -> None:
    if not tensor.is_contiguous():
        raise GeometryError(f"layer {name!r}: {what} is not contiguous")


def _block_major(kind: str, t: Any, name: str, index: int, shape: tuple[int, ...], block_size: int, dtype: DType,
                 total: int) -> tuple[BufferGeometry, Any]:
    """One buffer per layer for the layouts whose block is the outer axis (FlashInfer, MLA)."""
    if kind == "mla":
        if len(shape) != 3:
            raise GeometryError(f"layer {name!r}: MLA KV cache must be [blocks, block_size, latent], got {shape}")
        _check_block_size(name, shape[1], block_size)
        _check_contiguous(name, t, "MLA KV cache")
        return BufferGeometry(name=f"c.{index}", num_items=shape[0], item_shape=shape[1:], dtype=dtype), t
    if len(shape) != 5 or shape[1] != 2:
        raise GeometryError(f"layer {name!r}: FlashInfer KV cache must be [blocks, 2, block_size, heads, head_size], "
                            f"got {shape}")
    num_blocks, _, size, heads, dim = shape
    _check_block_size(name, size, block_size)
    if kind == "flashinfer":
        _check_contiguous(name, t, "FlashInfer NHD KV cache")
        phys, item, axis = t, (2, size, heads, dim), 2
    else:
        phys = t.permute(0, 1, 3, 2, 4)
        if not phys.is_contiguous():
            raise GeometryError(f"layer {name!r}: FlashInfer HND cache of shape {shape} is not head-major in memory "
                                f"(strides {tuple(t.stride())})")
        item, axis = (2, heads, size, dim), 1
    return BufferGeometry(name=f"kv.{index}", num_items=num_blocks, item_shape=item, dtype=dtype,
                          shard=ShardAxis(axis=axis, total=total)), phys


def pool_layout(kv_caches: Mapping[str, Any], *, kind: str, total_kv_heads: int, tp_size: int, tp_rank: int,
                block_size: int, model: str = "") -> KVPool:
    """The ``PoolLayout`` and registrable buffers of one vLLM worker's KV caches.

    ``total_kv_heads`` is the model's KV heads before TP sharding (vLLM's ``get_total_num_kv_heads()``);
    fewer heads than ranks means each rank holds one replicated head.
    """
    if kind not in LAYOUTS:
        raise GeometryError(f"unknown vLLM KV layout {kind!r}; known: {', '.join(LAYOUTS)}")
    if not kv_caches:
        raise GeometryError("vLLM registered no KV cache tensors")
    names = layer_order(list(kv_caches))
    shard_total = total_kv_heads
    geoms: list[BufferGeometry] = []
    tensors: list[Any] = []
    later: list[tuple[BufferGeometry, Any]] = []     # GPU layouts: V buffers after every K buffer
    blocks = set()
    for index, name in enumerate(names):
        t = kv_caches[name]
        shape = _shape(t)
        dtype = DType.parse(t.dtype)
        if kind in ("flashinfer", "flashinfer_hnd", "mla"):
            geom, tensor = _block_major(kind, t, name, index, shape, block_size, dtype, shard_total)
            geoms.append(geom)
            tensors.append(tensor)
            blocks.add(shape[0])
            continue
        if kind == "cpu":
            if len(shape) != 4 or shape[3] % 2:
                raise GeometryError(f"layer {name!r}: CPU KV cache must be [blocks, heads, block_size, "
                                    f"2*head_size], got {shape}")
            num_blocks, heads, size, two_d = shape
            _check_block_size(name, size, block_size)
            _check_contiguous(name, t, "CPU KV cache")
            item = (heads, 2 * size, two_d // 2)
            geoms.append(BufferGeometry(name=f"kv.{index}", num_items=num_blocks, item_shape=item, dtype=dtype,
                                        shard=ShardAxis(axis=0, total=shard_total)))
            tensors.append(t.view(num_blocks, heads, 2 * size, two_d // 2))
        else:
            if len(shape) != 5 or shape[0] != 2:
                raise GeometryError(f"layer {name!r}: {kind.upper()} KV cache must be [2, blocks, block_size, "
                                    f"heads, head_size], got {shape}")
            _, num_blocks, size, heads, dim = shape
            _check_block_size(name, size, block_size)
            if kind == "nhd":
                _check_contiguous(name, t, "NHD KV cache")
                phys, item, axis = t, (size, heads, dim), 1
            else:
                phys, item, axis = _hnd_physical(t, name), (heads, size, dim), 0
            shard = ShardAxis(axis=axis, total=shard_total)
            geoms.append(BufferGeometry(name=f"k.{index}", num_items=num_blocks, item_shape=item, dtype=dtype,
                                        shard=shard))
            tensors.append(phys[0])
            later.append((BufferGeometry(name=f"v.{index}", num_items=num_blocks, item_shape=item, dtype=dtype,
                                         shard=shard), phys[1]))
        blocks.add(num_blocks)
    for geom, tensor in later:
        geoms.append(geom)
        tensors.append(tensor)
    if len(blocks) != 1:
        raise GeometryError(f"layers disagree on the number of blocks: {sorted(blocks)}")
    component = Component(name=KV_COMPONENT, state_type="kv", buffers=tuple(geoms), index_kind=IndexKind.PAGE)
    layout = PoolLayout(components=(component,), tp_size=tp_size, tp_rank=tp_rank, page_size=block_size,
                        model=model)
    return KVPool(layout=layout, buffers={KV_COMPONENT: tensors}, layers=tuple(names), num_blocks=blocks.pop(),
                  kind=kind)

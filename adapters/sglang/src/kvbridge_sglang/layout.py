"""Pool layouts from SGLang's ``KVArgs``: raw pointers, lengths and item lengths become components.

``KVArgs`` describes memory in bytes (one entry per layer tensor: pointer, length, bytes per page or
slot) plus a few shapes: the rank's and the model's KV heads, the page size, per-tensor sliced dims of
the Mamba state. Every buffer is described as ``uint8`` rows whose sharded axis is the one SGLang
reshards on (KV heads, Mamba channels/heads), so the generic kvbridge slicing applies unchanged.

Wire order of a rank's pool: ``kv`` (K of every layer, then V, then a draft model's K and V), one
component per SGLang state component in ``state_types`` order, then ``aux`` (the metadata buffers).
Buffer names carry the model's layer id (``kv.k.12``), so a pipeline stage that holds layers 12..23 is
a sub-layout that both sides build the same way: :meth:`RankPool.layout` takes a layer range.

Which SGLang ``StateType`` becomes which kvbridge state type (:data:`SUPPORTED`), and why the others are
refused at startup (:data:`REFUSED`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import GeometryError, KVBridgeError
from kvbridge.geometry import (
    BufferGeometry,
    Component,
    DeviceKind,
    DType,
    IndexKind,
    MemoryRegion,
    PoolLayout,
    ShardAxis,
    local_units,
)

KV = "kv"
AUX = "aux"

#: SGLang StateType value -> (kvbridge state type, component name)
SUPPORTED: dict[str, tuple[str, str]] = {
    "mamba": ("mamba", "mamba"),
    "swa": ("swa", "swa"),
    "dsa": ("nsa", "dsa"),
    "request_row": ("row", "request_row"),
    "block_scale": ("block_scale", "block_scale"),
    "block_scale_swa": ("block_scale_swa", "block_scale_swa"),
}

#: SGLang StateType value -> why kvbridge-sglang refuses it (raised when the manager starts)
REFUSED: dict[str, str] = {
    "qsa_pending": "a per-request ring of raw index-K/RoPE rows whose TP split KVArgs does not describe (no "
                   "sliced dims), and whose ring order is model code; no kvbridge state type models it",
    "qsa_compressed": "compressed QSA pages whose per-page layout and TP split KVArgs does not describe",
    "dsa_tail": "a ring row of the kpool compression tail whose live sub-range is encoded in the indices "
                "themselves; kvbridge pairs items, not encoded sub-ranges",
    "swa_ring": "DeepSeek-V4 unified-KV SWA ring rows (req_pool_idx * stride + pos % stride) sliced "
                "by compression bucket; its geometry lives in the pool, not in KVArgs",
    "minimax_index_k": "MiniMax sparse index-K pages with a model-specific page selection "
                       "(minimax_index_transfer_pages) and no head geometry in KVArgs",
    "minimax_dense_kv": "MiniMax dense-layer KV described only by byte lengths; no head count to reshard by",
    "c128_state": "DeepSeek-V4 request-scoped compression state; indices come from the pool's own "
                  "request_state_transfer_indices, with no geometry in KVArgs",
}


class UnsupportedStateType(KVBridgeError):
    """An SGLang state component kvbridge-sglang cannot carry; the message names it and says why."""


def state_value(state_type: Any) -> str:
    """``StateType.MAMBA`` (a str enum), or a plain string, as its value ``"mamba"``."""
    return str(getattr(state_type, "value", state_type))


def check_state_types(state_types: Sequence[Any]) -> None:
    """Raise UnsupportedStateType for the first state component that is not supported, with the reason."""
    for st in state_types:
        name = state_value(st)
        if name in SUPPORTED:
            continue
        reason = REFUSED.get(name, "unknown to kvbridge-sglang (newer SGLang?)")
        raise UnsupportedStateType(f"SGLang state type {name!r} is not supported by kvbridge-sglang: {reason}")


@dataclass(frozen=True, slots=True)
class Entry:
    """One registered buffer: its geometry, its memory, and the model layer it belongs to (None: travels
    with the last pipeline stage, e.g. aux rows and a draft model's KV)."""

    geometry: BufferGeometry
    region: MemoryRegion
    layer: int | None


@dataclass(frozen=True, slots=True)
class Part:
    """One component as KVArgs describes it. ``state_index``: its position in SGLang's ``state_types``
    (None for kv and aux)."""

    name: str
    state_type: str
    index_kind: IndexKind
    entries: tuple[Entry, ...]
    options: dict[str, int | str | float] = field(default_factory=dict)
    state_index: int | None = None


@dataclass(frozen=True, slots=True)
class RankPool:
    """Everything one SGLang rank registers, with layer ids, from which stage layouts are cut."""

    parts: tuple[Part, ...]
    tp_size: int
    tp_rank: int
    page_size: int
    model: str

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)

    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({e.layer for p in self.parts for e in p.entries if e.layer is not None}))

    def layout(self, layers: range | None = None, *, tail: bool = True,
               parts: Sequence[str] | None = None) -> tuple[PoolLayout, dict[str, list[Any]]]:
        """The layout and buffers of the entries whose layer is in ``layers`` (all when None), plus the
        layer-less ones when ``tail``; components left without buffers are omitted. ``parts`` keeps only
        those components."""
        comps: list[Component] = []
        buffers: dict[str, list[Any]] = {}
        for part in self.parts:
            if parts is not None and part.name not in parts:
                continue
            chosen = [e for e in part.entries
                      if (e.layer is None and tail) or (e.layer is not None and (layers is None or e.layer in layers))]
            if not chosen:
                continue
            comps.append(Component(name=part.name, state_type=part.state_type, index_kind=part.index_kind,
                                   buffers=tuple(e.geometry for e in chosen), options=dict(part.options)))
            buffers[part.name] = [e.region for e in chosen]
        if not comps:
            raise GeometryError(f"no buffer of this rank lies in layers {layers}")
        return (PoolLayout(components=tuple(comps), tp_size=self.tp_size, tp_rank=self.tp_rank,
                           page_size=self.page_size, model=self.model), buffers)


def _list(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _region(ptr: int, nbytes: int, device: DeviceKind, device_id: int) -> MemoryRegion:
    return MemoryRegion(int(ptr) & (2**64 - 1), int(nbytes), device, device_id)


def _rows(name: str, ptr: int, nbytes: int, item: int, shape: tuple[int, ...], shard: ShardAxis | None,
          device: DeviceKind, device_id: int, layer: int | None) -> Entry:
    item, nbytes = int(item), int(nbytes)
    if item <= 0 or nbytes <= 0 or nbytes % item:
        raise GeometryError(f"buffer {name!r}: length {nbytes} B is not a whole number of {item}-byte items")
    if math.prod(shape) != item:
        raise GeometryError(f"buffer {name!r}: item shape {shape} does not make {item} bytes")
    geometry = BufferGeometry(name=name, num_items=nbytes // item, item_shape=shape, dtype=DType.UINT8, shard=shard)
    return Entry(geometry, _region(ptr, nbytes, device, device_id), layer)


def _split(name: str, item: int, parts: int, what: str) -> int:
    if parts <= 0 or item % parts:
        raise GeometryError(f"buffer {name!r}: an item of {item} B does not split into {parts} {what}")
    return item // parts


def _head_shape(name: str, item: int, page: int, heads: int, head_major: bool) -> tuple[int, int, int]:
    per_head = _split(name, item, page * heads, f"tokens x {heads} heads")
    return (heads, page, per_head) if head_major else (page, heads, per_head)


def _is_head_major(layout: Any) -> bool:
    return str(layout or "").lower() in ("hnd", "head_major", "headmajor")


def kv_part(args: Any, *, tp_size: int, is_mla: bool, device: DeviceKind, device_id: int) -> Part:
    """The paged ``kv`` component: K then V per layer (MLA: one latent per layer), then draft K and V."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    if not (len(ptrs) == len(lens) == len(items)) or not ptrs:
        raise GeometryError(f"KVArgs: kv_data_ptrs/lens/item_lens have {len(ptrs)}/{len(lens)}/{len(items)} entries")
    page = int(args.page_size)
    draft = int(_list(args, "num_draft_entries", 0))
    target = len(ptrs) - draft
    ids = list(_list(args, "kv_layer_ids", []))
    start = int(_list(args, "prefill_start_layer", 0))
    entries: list[Entry] = []
    if is_mla:
        layer_ids = ids[:target] if len(ids) >= target else list(range(start, start + target))
        for j in range(len(ptrs)):
            layer = layer_ids[j] if j < target else None
            label = f"c.{layer}" if layer is not None else f"dc.{j - target}"
            shape = (page, _split(label, items[j], page, "tokens"))
            entries.append(_rows(f"{KV}.{label}", ptrs[j], lens[j], items[j], shape, None, device, device_id, layer))
        return Part(KV, "kv", IndexKind.PAGE, tuple(entries), {"mla": 1, "kv_cache_dtype": _dtype(args)})
    if target % 2 or draft % 2:
        raise GeometryError(f"KVArgs: {target} target and {draft} draft KV entries; MHA needs K and V pairs")
    heads = int(args.kv_head_num)
    total = int(_list(args, "total_kv_head_num", heads * tp_size))
    head_major = _is_head_major(getattr(args, "kv_layout", None))
    shard = ShardAxis(axis=0 if head_major else 1, total=total)
    if heads != local_units(total, tp_size):
        raise GeometryError(f"KVArgs: kv_head_num={heads} but {total} KV heads over attention TP {tp_size} "
                            f"gives {local_units(total, tp_size)} per rank")
    n = target // 2
    layer_ids = ids[:n] if len(ids) >= n else list(range(start, start + n))
    for j in range(len(ptrs)):
        if j < target:
            tensor, layer = ("k" if j < n else "v"), layer_ids[j % n]
            label = f"{tensor}.{layer}"
        else:
            d = j - target
            tensor, layer = ("dk" if d < draft // 2 else "dv"), None
            label = f"{tensor}.{d % (draft // 2)}"
        page_shape = _head_shape(label, items[j], page, heads, head_major)
        entries.append(_rows(f"{KV}.{label}", ptrs[j], lens[j], items[j], page_shape, shard, device, device_id,
                             layer))
    return Part(KV, "kv", IndexKind.PAGE, tuple(entries),
                {"kv_cache_dtype": _dtype(args), "layout": "hnd" if head_major else "nhd"})


def _dtype(args: Any) -> str:
    return str(_list(args, "kv_cache_dtype_str", "auto"))


def aux_part(args: Any) -> Part | None:
    """SGLang's metadata buffers (first token, logprobs, hidden state, bootstrap room): one row per slot,
    host memory, replicated on every rank."""
    ptrs = list(_list(args, "aux_data_ptrs", []))
    if not ptrs:
        return None
    lens, items = list(args.aux_data_lens), list(args.aux_item_lens)
    entries = tuple(_rows(f"{AUX}.{i}", p, n, it, (int(it),), None, DeviceKind.CPU, 0, None)
                    for i, (p, n, it) in enumerate(zip(ptrs, lens, items)))
    counts = {e.geometry.num_items for e in entries}
    if len(counts) != 1:
        raise GeometryError(f"KVArgs: aux buffers disagree on the number of slots {sorted(counts)}")
    return Part(AUX, "row", IndexKind.SLOT, entries)


def _state_layers(args: Any, i: int, count: int, start: int) -> list[int | None]:
    ids = list((_list(args, "state_layer_ids", []) or [])[i:i + 1] or [[]])[0] or []
    if len(ids) >= count:
        return [int(x) for x in ids[:count]]
    return [None] * count


def state_parts(args: Any, *, tp_size: int, device: DeviceKind, device_id: int,
                swa_window: int | None = None) -> list[Part]:
    """One part per SGLang state component, in ``state_types`` order (refused types raise)."""
    state_types = list(_list(args, "state_types", []))
    check_state_types(state_types)
    parts: list[Part] = []
    start = int(_list(args, "prefill_start_layer", 0))
    page = int(args.page_size)
    for i, st in enumerate(state_types):
        kind, name = SUPPORTED[state_value(st)]
        ptrs = list(args.state_data_ptrs[i])
        lens = list(args.state_data_lens[i])
        items = list(args.state_item_lens[i])
        if not ptrs and not lens and not items:
            continue            # a pipeline stage that holds none of this state's layers: nothing to move
        if not (len(ptrs) == len(lens) == len(items)):
            raise GeometryError(f"KVArgs: state component {i} ({name}) has {len(ptrs)}/{len(lens)}/{len(items)} "
                                "pointers/lengths/item lengths")
        if any(p.name == name for p in parts):
            name = f"{name}.{i}"
        layers = _state_layers(args, i, len(ptrs), start)
        if kind == "mamba":
            parts.append(_mamba(args, i, name, ptrs, lens, items, layers, tp_size, device, device_id))
        elif kind == "swa":
            parts.append(_swa(args, i, name, ptrs, lens, items, layers, tp_size, device, device_id, swa_window))
        elif kind in ("block_scale", "block_scale_swa"):
            parts.append(_block_scales(args, i, name, kind, ptrs, lens, items, layers, tp_size, device, device_id,
                                       swa_window))
        elif kind == "nsa":
            if all(layer is None for layer in layers):
                layers = [start + j for j in range(len(ptrs))]
            entries = tuple(_rows(f"{name}.indexer.{layers[j] if layers[j] is not None else j}", ptrs[j], lens[j],
                                  items[j], (int(items[j]),), None, device, device_id, layers[j])
                            for j in range(len(ptrs)))
            per_token = _split(name, int(items[0]), page, "tokens")
            parts.append(Part(name, "nsa", IndexKind.PAGE, entries,
                              {"page_size": page, "bytes_per_token": per_token}, i))
        else:   # row
            entries = tuple(_rows(f"{name}.{j}", ptrs[j], lens[j], items[j], (int(items[j]),), None, device,
                                  device_id, None) for j in range(len(ptrs)))
            parts.append(Part(name, "row", IndexKind.SLOT, entries, {}, i))
    return parts


def _mamba(args: Any, i: int, name: str, ptrs: list[int], lens: list[int], items: list[int],
           layers: list[int | None], tp_size: int, device: DeviceKind, device_id: int) -> Part:
    dims = list((_list(args, "state_dim_per_tensor", []) or [])[i:i + 1] or [[]])[0] or []
    groups_all = list((_list(args, "state_conv_shard_groups", []) or [])[i:i + 1] or [[]])[0] or []
    outers = list((_list(args, "state_slice_outer_counts", []) or [])[i:i + 1] or [[]])[0] or []
    seen: dict[int | None, int] = {}
    entries: list[Entry] = []
    for j, (p, n, it) in enumerate(zip(ptrs, lens, items)):
        layer = layers[j]
        k = seen[layer] = seen.get(layer, -1) + 1
        label = f"{name}.{k}.{layer}" if layer is not None else f"{name}.{j}"
        if j >= len(dims) or not dims[j]:
            if tp_size > 1:
                raise GeometryError(f"buffer {label!r}: KVArgs gives no sliced dim for this Mamba tensor; it "
                                    "cannot be resharded")
            entries.append(_rows(label, p, n, it, (int(it),), None, device, device_id, layer))
            continue
        dim = int(dims[j])
        outer = int(outers[j]) if j < len(outers) and outers[j] else 1
        inner = _split(label, int(it), outer * dim, f"rows x {dim} sliced units")
        groups = [int(g) for g in (groups_all[j] or [])] if j < len(groups_all) and groups_all[j] else []
        if groups and sum(local_units(g, tp_size) for g in groups) != dim and sum(groups) == dim:
            groups = [g * tp_size for g in groups]          # given per rank: make them model-wide
        total = sum(groups) if groups else dim * tp_size
        axis = 1 if outer > 1 else 0
        shape = (outer, dim, inner) if outer > 1 else (dim, inner)
        shard = ShardAxis(axis=axis, total=total, groups=tuple(groups) if len(groups) > 1 else ())
        entries.append(_rows(label, p, n, it, shape, shard, device, device_id, layer))
    return Part(name, "mamba", IndexKind.SLOT, tuple(entries), {}, i)


def _swa(args: Any, i: int, name: str, ptrs: list[int], lens: list[int], items: list[int],
         layers: list[int | None], tp_size: int, device: DeviceKind, device_id: int, window: int | None) -> Part:
    if len(ptrs) % 2:
        raise GeometryError(f"KVArgs: SWA state component {i} has {len(ptrs)} entries; it needs K and V pairs")
    page = int(args.page_size)
    heads = int(args.kv_head_num)
    total = int(_list(args, "total_kv_head_num", heads * tp_size))
    layout = getattr(args, "swa_kv_cache_layout", None)
    if layout is not None and str(layout).lower() not in ("nhd", "hnd"):
        raise GeometryError(f"KVArgs: SWA pool layout {layout!r} is not supported (only nhd and hnd)")
    head_major = _is_head_major(layout)
    shard = ShardAxis(axis=0 if head_major else 1, total=total)
    n = len(ptrs) // 2
    entries = []
    for j in range(len(ptrs)):
        tensor = "k" if j < n else "v"
        layer = layers[j] if layers[j] is not None else None
        label = f"{name}.{tensor}.{layer if layer is not None else j % n}"
        shape = _head_shape(label, int(items[j]), page, heads, head_major)
        entries.append(_rows(label, ptrs[j], lens[j], items[j], shape, shard, device, device_id, layer))
    return Part(name, "swa", IndexKind.PAGE, tuple(entries),
                {"window": int(window) if window else 2**31 - 1, "page_size": page}, i)


#: SGLang's MXFP8 pool: one UE8M0 scale per 32 elements; interleaved (FA4 atom layout) for 128-token pages
MXFP8_BLOCK, MXFP8_INTERLEAVED_PAGE = 32, 128


def _block_scales(args: Any, i: int, name: str, kind: str, ptrs: list[int], lens: list[int], items: list[int],
                  layers: list[int | None], tp_size: int, device: DeviceKind, device_id: int,
                  window: int | None) -> Part:
    """MXFP8 block scales (``MHATokenToKVPoolMXFP8.get_kv_scale_buf_infos``): K scales of every layer, then V,
    one item per page: ``[page, heads, dim // 32]`` bytes, or ``[heads, 32, page // 32, dim // 32]`` for
    128-token pages (SGLang's interleaved layout); resliced by KV head (kvbridge-fp8)."""
    if len(ptrs) % 2:
        raise GeometryError(f"KVArgs: block-scale state component {i} has {len(ptrs)} entries; it needs K and V")
    page = int(args.page_size)
    heads = int(args.kv_head_num)
    total = int(_list(args, "total_kv_head_num", heads * tp_size))
    interleaved = page == MXFP8_INTERLEAVED_PAGE
    shard = ShardAxis(axis=0 if interleaved else 1, total=total)
    n = len(ptrs) // 2
    entries = []
    for j in range(len(ptrs)):
        tensor = "k" if j < n else "v"
        layer = layers[j]
        label = f"{name}.{tensor}.{layer if layer is not None else j % n}"
        per_head = _split(label, int(items[j]), page * heads, f"tokens x {heads} heads")
        shape: tuple[int, ...] = ((heads, MXFP8_BLOCK, page // MXFP8_BLOCK, per_head) if interleaved
                                  else (page, heads, per_head))
        entries.append(_rows(label, ptrs[j], lens[j], items[j], shape, shard, device, device_id, layer))
    options: dict[str, int | str | float] = {"page_size": page, "scale_block": MXFP8_BLOCK,
                                             "layout": "interleaved" if interleaved else "token"}
    if kind == "block_scale_swa":
        options["window"] = int(window) if window else 2**31 - 1
    return Part(name, kind, IndexKind.PAGE, tuple(entries), options, i)


def rank_pool(args: Any, *, tp_size: int, tp_rank: int, is_mla: bool, device: DeviceKind = DeviceKind.CPU,
              device_id: int = 0, swa_window: int | None = None, with_aux: bool = True) -> RankPool:
    """Every component of one SGLang rank from its KVArgs (refusing unsupported state types)."""
    parts = [kv_part(args, tp_size=tp_size, is_mla=is_mla, device=device, device_id=device_id)]
    parts += state_parts(args, tp_size=tp_size, device=device, device_id=device_id, swa_window=swa_window)
    aux = aux_part(args) if with_aux else None
    if aux is not None:
        parts.append(aux)
    return RankPool(parts=tuple(parts), tp_size=tp_size, tp_rank=tp_rank, page_size=int(args.page_size),
                    model=f"sglang:{_dtype(args)}")

"""Peer compatibility: refuse a peer whose pool cannot be paired with ours, saying exactly why."""

from __future__ import annotations

from kvbridge.errors import IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import PoolLayout
from kvbridge.slicing import check_pairable, check_ratio


def check_compatible(prefill: PoolLayout, decode: PoolLayout) -> None:
    """Raise IncompatiblePeer naming the first difference that makes the two pools unpairable.

    Checked: model, page size, component list and order, state types, index kinds, options, buffer
    count, and per buffer the dtype, sharding (total KV heads, shard groups) and un-sharded dims
    (head_dim, page layout order); and that the TP sizes divide each other.
    """
    if prefill.model and decode.model and prefill.model != decode.model:
        raise IncompatiblePeer(f"model differs: prefill serves {prefill.model!r}, decode {decode.model!r}")
    if prefill.page_size != decode.page_size:
        raise IncompatiblePeer(f"page size differs: prefill {prefill.page_size}, decode {decode.page_size}")
    p_names, d_names = prefill.component_names, decode.component_names
    if p_names != d_names:
        raise IncompatiblePeer(f"component list or order differs: prefill {list(p_names)}, decode {list(d_names)}")
    try:
        check_ratio(prefill.tp_size, decode.tp_size)
    except UnsupportedTopology as exc:
        raise IncompatiblePeer(str(exc)) from None
    for pc, dc in zip(prefill.components, decode.components):
        where = f"component {pc.name!r}"
        if pc.state_type != dc.state_type:
            raise IncompatiblePeer(f"{where}: state type {pc.state_type!r} on prefill, {dc.state_type!r} on decode")
        if pc.index_kind != dc.index_kind:
            raise IncompatiblePeer(f"{where}: indexed by {pc.index_kind.value} on prefill, "
                                   f"{dc.index_kind.value} on decode")
        if pc.options != dc.options:
            raise IncompatiblePeer(f"{where}: options {pc.options} on prefill, {dc.options} on decode")
        if len(pc.buffers) != len(dc.buffers):
            raise IncompatiblePeer(f"{where}: {len(pc.buffers)} buffers on prefill, {len(dc.buffers)} on decode")
        for pb, db in zip(pc.buffers, dc.buffers):
            if pb.name != db.name:
                raise IncompatiblePeer(f"{where}: buffer order differs ({pb.name!r} on prefill, {db.name!r} on decode)")
            try:
                check_pairable(pb, db)
            except IncompatiblePeer as exc:
                raise IncompatiblePeer(f"{where}: {exc}") from None

"""Peer compatibility: refuse a peer whose pool cannot be paired with ours, saying exactly why."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from kvbridge.errors import IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import Component, IndexKind, PoolLayout, buffer_layer
from kvbridge.repaging import Repaging, check_repageable, repaged
from kvbridge.slicing import check_pairable, check_ratio
from kvbridge.state.base import StateType
from kvbridge.state.kv import KVState

#: The state types a bare check knows (an agent passes those it loaded).
BUILT_IN: Mapping[str, StateType] = {"kv": KVState()}


def check_compatible(prefill: PoolLayout, decode: PoolLayout,
                     state_types: Mapping[str, StateType] = BUILT_IN) -> None:
    """Raise IncompatiblePeer naming the first difference that makes the two pools unpairable.

    Checked: model, component list and order, state types, index kinds, options, buffer count, and per
    buffer the dtype, sharding (total KV heads, shard groups) and un-sharded dims (head_dim, page layout
    order); and that the TP sizes divide each other.

    The page sizes may differ when every paged component's state type (from ``state_types``) is ``repageable``
    and names the token planes of its pages (:mod:`kvbridge.repaging`): the buffers are then compared as pages
    of ``gcd(P, D)`` tokens.

    A decode rank of another pipeline split holds only some of the prefill's layers (:func:`is_partial`): its
    components are some of the prefill's, in order, each with the prefill's buffers of its layers
    (:func:`check_partial`), and it may leave out the rest.
    """
    if prefill.model and decode.model and prefill.model != decode.model:
        raise IncompatiblePeer(f"model differs: prefill serves {prefill.model!r}, decode {decode.model!r}")
    rp = Repaging.of(ours=prefill.page_size, theirs=decode.page_size)
    p_names, d_names = prefill.component_names, decode.component_names
    partial = is_partial(prefill, decode)
    in_order = [n for n in p_names if n in d_names] == list(d_names)
    if partial and in_order:
        check_partial(prefill, decode)
    if p_names != d_names and not (partial and in_order):
        raise IncompatiblePeer(f"component list or order differs: prefill {list(p_names)}, decode {list(d_names)}")
    try:
        check_ratio(prefill.tp_size, decode.tp_size)
    except UnsupportedTopology as exc:
        raise IncompatiblePeer(str(exc)) from None
    for dc in decode.components:
        pc = prefill.component(dc.name)
        where = f"component {pc.name!r}"
        if pc.state_type != dc.state_type:
            raise IncompatiblePeer(f"{where}: state type {pc.state_type!r} on prefill, {dc.state_type!r} on decode")
        if pc.index_kind != dc.index_kind:
            raise IncompatiblePeer(f"{where}: indexed by {pc.index_kind.value} on prefill, "
                                   f"{dc.index_kind.value} on decode")
        if rp.ours != rp.theirs and pc.index_kind is IndexKind.PAGE:
            st = state_types.get(pc.state_type)
            if st is None or not st.repageable:
                raise IncompatiblePeer(f"{where}: page size differs (prefill {prefill.page_size}, decode "
                                       f"{decode.page_size} tokens) and state type {pc.state_type!r} cannot pair "
                                       "pages of different sizes")
            check_repageable(pc, prefill.page_size, rp.granule, "prefill", st.token_planes)
            check_repageable(dc, decode.page_size, rp.granule, "decode", st.token_planes)
            smaller = min(prefill.page_size, decode.page_size)
            pc = repaged(pc, prefill.page_size, rp.granule, smaller)
            dc = repaged(dc, decode.page_size, rp.granule, smaller)
        if pc.options != dc.options:
            raise IncompatiblePeer(f"{where}: options {pc.options} on prefill, {dc.options} on decode")
        p_bufs = restricted(pc, dc).buffers if partial else pc.buffers
        if len(p_bufs) != len(dc.buffers):
            if partial:
                raise IncompatiblePeer(f"{where}: the decode's buffers {[b.name for b in dc.buffers][:8]} are not "
                                       "the prefill's, in its order")
            raise IncompatiblePeer(f"{where}: {len(pc.buffers)} buffers on prefill, {len(dc.buffers)} on decode")
        for pb, db in zip(p_bufs, dc.buffers):
            if pb.name != db.name:
                raise IncompatiblePeer(f"{where}: buffer order differs ({pb.name!r} on prefill, {db.name!r} on decode)")
            try:
                check_pairable(pb, db)
            except IncompatiblePeer as exc:
                raise IncompatiblePeer(f"{where}: {exc}") from None


def held_layers(layout: PoolLayout) -> set[int]:
    """The model layers a rank holds: those its paged components' buffer names end with."""
    return {layer for c in layout.components if c.index_kind is IndexKind.PAGE
            for b in c.buffers if (layer := buffer_layer(b.name)) is not None}


def is_partial(prefill: PoolLayout, decode: PoolLayout) -> bool:
    """Does ``decode`` hold only some of ``prefill``'s layers (another pipeline split)? True when the layers of its
    paged components (KV and the like) are a strict subset of the prefill's. It must then hold, of every prefill
    component, exactly the buffers of those layers (:func:`check_partial`); a decode holding every layer must hold
    every component and buffer (a missing state component is refused)."""
    return held_layers(decode) < held_layers(prefill)


def check_partial(prefill: PoolLayout, decode: PoolLayout) -> None:
    """Raise IncompatiblePeer unless a partial ``decode`` holds, of each paged prefill component, exactly the
    buffers of its layers. Slot components (Mamba state, request rows) may be left out or hold some of the
    prefill's buffers: their names need not count layers (SGLang numbers request rows 0..n)."""
    layers = held_layers(decode)
    mine = {c.name: c for c in decode.components}
    for pc in prefill.components:
        if pc.index_kind is not IndexKind.PAGE:
            continue                        # checked buffer by buffer by check_compatible (a subsequence)
        ids = [buffer_layer(b.name) for b in pc.buffers]
        dc = mine.get(pc.name)
        wanted = [b.name for b, i in zip(pc.buffers, ids) if i in layers]
        have = [b.name for b in dc.buffers] if dc is not None else []
        if have != wanted:
            raise IncompatiblePeer(f"component {pc.name!r}: a decode holding layers {sorted(layers)} must hold "
                                   f"exactly their buffers of it {wanted[:6]}, it holds {have[:6]}")


def restricted(component: Component, to: Component) -> Component:
    """``component`` with only the buffers ``to`` names, in ``component``'s order (what a partial peer holds)."""
    names = {b.name for b in to.buffers}
    if len(names) == len(component.buffers):
        return component
    kept = tuple(b for b in component.buffers if b.name in names)
    if not kept:
        raise IncompatiblePeer(f"component {component.name!r}: the peer holds none of its buffers")
    return msgspec.structs.replace(component, buffers=kept)

"""Per (peer, component) caches of what the prefill side of a pair writes: slices, buffer pairs, rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvbridge.agent.layers import LayerMap, layer_map
from kvbridge.device_digests import digest_buffers
from kvbridge.digests import Runs, readable, run_bytes
from kvbridge.errors import GeometryError
from kvbridge.geometry import Component, IndexKind, PoolLayout, Rank
from kvbridge.handshake import is_partial, restricted
from kvbridge.planner import BufferPair, PairGroups
from kvbridge.protocol.records import PeerInfo
from kvbridge.protocol.wire import Role
from kvbridge.repaging import Planes, Repaging, SidePages, compact_items, repaged, repaged_view, spread
from kvbridge.slicing import ComponentSlice, Segments
from kvbridge.staging import DEFAULT_DESCRIPTOR_COST_US, Rows, regular_rows, stage_threshold

if TYPE_CHECKING:
    from kvbridge.agent.context import AgentContext


class Peer(Protocol):
    """What the caches read of a peer record."""

    @property
    def agent(self) -> str: ...
    @property
    def layout(self) -> PoolLayout: ...
    @property
    def info(self) -> PeerInfo | None: ...


@dataclass(frozen=True, slots=True)
class StagePlan:
    """How one (peer, component) slice is staged. A staged piece holds some layers of some items: for each
    of its layers in order, each buffer of the layer (layer order), ``count x rows[b].nbytes`` bytes,
    item-major. A chunk of ``count`` items occupies ``count * per_item`` bytes of the reservation at
    ``first * per_item``, its layers one after the other (``layer_offset``)."""

    rows: tuple[Rows, ...]           # per buffer index
    layers: LayerMap
    layer_bytes: tuple[int, ...]     # staged bytes of one item in each layer
    uniform: Rows | None = None      # the run pattern of every buffer when they share one (batched CUDA copies)

    @property
    def per_item(self) -> int:
        return sum(self.layer_bytes)

    def layer_offset(self, layer: int) -> int:
        """Staged bytes of one item in the layers before ``layer``."""
        return sum(self.layer_bytes[:layer])

    def span(self, layers: range) -> int:
        """Staged bytes of one item in ``layers``."""
        return sum(self.layer_bytes[layers.start: layers.stop])


class PlanCache:
    """Pure functions of (our layout, the peer's layout), computed once per peer and component."""

    def __init__(self, ctx: AgentContext) -> None:
        self._ctx = ctx
        self._slices: dict[tuple[str, int], ComponentSlice] = {}
        self._pairs: dict[tuple[str, int], list[BufferPair]] = {}
        self._rows: dict[tuple[str, int], tuple[Rows, ...] | None] = {}
        self._stage: dict[tuple[str, int], StagePlan | None] = {}
        self._layer_pairs: dict[tuple[str, int, int, int], tuple[list[BufferPair], tuple[Segments, ...]]] = {}
        self._layer_groups: dict[tuple[str, int, int, int], tuple[PairGroups, tuple[Segments, ...]]] = {}
        self._layers: dict[int, LayerMap] = {}
        self._below: float | None = None
        self._run_bytes: dict[tuple[str, int, int, str], Runs] = {}
        self._partial: dict[str, bool] = {}
        self._repaging: dict[str, Repaging | None] = {}
        self._components: dict[tuple[str, int], tuple[Component, Component | None]] = {}
        self._spread: dict[tuple[str, int], bool] = {}

    def layers(self, comp_index: int) -> LayerMap:
        """The layers of one of our components (the peer's are the same: buffer names must match)."""
        found = self._layers.get(comp_index)
        if found is None:
            found = self._layers[comp_index] = layer_map(self._ctx.layout.components[comp_index])
        return found

    def stage_below_bytes(self) -> float:
        """The auto cost model's threshold: stage when the average descriptor would be smaller than this."""
        if self._below is None:
            ctx = self._ctx
            if ctx.config.staging_below_bytes is not None:
                self._below = float(ctx.config.staging_below_bytes)
            else:
                try:
                    cost = ctx.registry.backend_spec(ctx.backend_name).descriptor_cost_us
                except Exception:  # noqa: BLE001 - a backend built outside the registry: the default cost
                    cost = None
                staging = ctx.buffers.staging
                device = staging.device if staging is not None else None
                self._below = stage_threshold(DEFAULT_DESCRIPTOR_COST_US if cost is None else cost,
                                              device) if device is not None else 0.0
        return self._below

    def partial(self, peer: Peer) -> bool:
        """The decode side of this pair holds only some of the prefill's layers (another pipeline split): it is
        paired by buffer name, plain descriptors only (kvbridge.handshake.is_partial)."""
        found = self._partial.get(peer.agent)
        if found is None:
            ctx = self._ctx
            src, dst = (ctx.layout, peer.layout) if ctx.role is Role.PREFILL else (peer.layout, ctx.layout)
            found = self._partial[peer.agent] = is_partial(src, dst)
        return found

    def repaging(self, peer: Peer) -> Repaging | None:
        """The sub-pages of this pair when its page sizes differ (None: the same page size)."""
        if peer.agent not in self._repaging:
            ours, theirs = self._ctx.layout.page_size, peer.layout.page_size
            self._repaging[peer.agent] = None if ours == theirs else Repaging.of(ours=ours, theirs=theirs)
        return self._repaging[peer.agent]

    def _pair_components(self, peer: Peer, comp_index: int) -> tuple[Component, Component | None]:
        key = (peer.agent, comp_index)
        found = self._components.get(key)
        if found is None:
            ours = self._ctx.layout.components[comp_index]
            theirs = next((c for c in peer.layout.components if c.name == ours.name), None)
            rp = self.repaging(peer)
            if rp is not None:
                smaller = min(self._ctx.layout.page_size, peer.layout.page_size)
                ours = repaged(ours, self._ctx.layout.page_size, rp.granule, smaller)
                theirs = repaged(theirs, peer.layout.page_size, rp.granule, smaller) if theirs is not None else None
            found = self._components[key] = (ours, theirs)
        return found

    def own_component(self, peer: Peer, comp_index: int) -> Component:
        """Our component as this pair pairs it: in sub-pages when the page sizes differ."""
        return self._pair_components(peer, comp_index)[0]

    def peer_component(self, peer: Peer, comp_index: int) -> Component | None:
        """The peer's component of the same name as our ``comp_index`` (None: a partial peer holds none of it),
        in sub-pages when the page sizes differ."""
        return self._pair_components(peer, comp_index)[1]

    def factor(self, peer: Peer, comp_index: int) -> int:
        """How many of this pair's items one of our items is (1 unless the page sizes differ)."""
        rp = self.repaging(peer)
        paged = self._ctx.layout.components[comp_index].index_kind is IndexKind.PAGE
        return rp.ours if rp is not None and paged else 1

    def planes(self, layout: PoolLayout, comp_index: int) -> list[Planes]:
        """The token planes of each buffer of a component of ``layout`` (ours or a peer's, same state type)."""
        comp = layout.components[comp_index] if layout is self._ctx.layout else next(
            c for c in layout.components if c.name == self._ctx.layout.components[comp_index].name)
        st = self._ctx.state_types[comp_index]
        found = []
        for buf in comp.buffers:
            planes = st.token_planes(comp, buf, layout.page_size)
            if planes is None:
                raise GeometryError(f"component {comp.name!r} buffer {buf.name!r}: no token planes (checked at the "
                                    "handshake)")
            found.append(planes)
        return found

    def spread_out(self, peer: Peer, comp_index: int) -> bool:
        """Do this pair's sub-pages of the component span several planes of a page (head-major pages, NSA
        keys and scales)? Their bytes are then not one run of our memory: planned with per-plane strides,
        digested from a gathered copy, never posted in a backend's structured form."""
        key = (peer.agent, comp_index)
        found = self._spread.get(key)
        if found is None:
            found = False
            if self.factor(peer, comp_index) > 1 or (self.repaging(peer) is not None and
                                                      self._ctx.layout.components[comp_index].index_kind
                                                      is IndexKind.PAGE):
                theirs = self._pair_components(peer, comp_index)[1]
                found = any(len(p) > 1 for p in self.planes(self._ctx.layout, comp_index)) or (
                    theirs is not None and any(len(p) > 1 for p in self.planes(peer.layout, comp_index)))
            self._spread[key] = found
        return found

    def digests(self, peer: Peer, comp_index: int, buffers: Sequence[int], items: np.ndarray, side: str
                ) -> np.ndarray | None:
        """Digests of ``items`` (this pair's items) of some of our buffers, each over the runs of its slice on
        ``side``, buffer-major (``len(buffers) * len(items)``); None when the component has no readable view. On a
        GPU computed where the pages live, the host waiting once for all of them."""
        views = self._ctx.buffers.views.get(self._ctx.layout.components[comp_index].name) or []
        if not views or not readable(views[0]):
            return None
        runs = [self.run_bytes(peer, comp_index, b, side) for b in buffers]
        if not self.spread_out(peer, comp_index):
            factor = self.factor(peer, comp_index)
            return digest_buffers([repaged_view(views[b], factor) for b in buffers], items, runs)
        rp = self.repaging(peer)
        assert rp is not None
        planes = self.planes(self._ctx.layout, comp_index)
        gathered = [compact_items(views[b], items, planes[b], self._ctx.layout.page_size, rp.granule) for b in buffers]
        return digest_buffers(gathered, np.arange(len(items)), runs)

    def slice_for(self, peer: Peer, comp_index: int) -> ComponentSlice:
        """What the prefill side of this pair writes for one component, per buffer of ours (a buffer a partial
        peer does not hold: no segments)."""
        key = (peer.agent, comp_index)
        cached = self._slices.get(key)
        if cached is None:
            ctx = self._ctx
            ours, theirs = self._pair_components(peer, comp_index)
            src, dst = (ctx.layout, peer.layout) if ctx.role is Role.PREFILL else (peer.layout, ctx.layout)
            if theirs is None:
                cached = ComponentSlice(tuple(Segments.empty() for _ in ours.buffers))
            else:
                src_c, dst_c = (ours, theirs) if ctx.role is Role.PREFILL else (theirs, ours)
                if self.partial(peer):
                    src_c = restricted(src_c, dst_c)
                cached = ctx.registry.slice_state(ctx.state_types[comp_index], src_c, dst_c,
                                                  Rank(src.tp_rank, src.tp_size), Rank(dst.tp_rank, dst.tp_size))
                if len(cached.buffers) != len(ours.buffers):      # a partial peer, seen from the prefill
                    by_name = dict(zip((b.name for b in src_c.buffers), cached.buffers))
                    cached = ComponentSlice(tuple(by_name.get(b.name, Segments.empty()) for b in ours.buffers))
            self._slices[key] = cached
        return cached

    def peer_layers(self, peer: Peer, comp_index: int, layers: range) -> range | None:
        """``layers`` (ours) as the peer counts its layers: the same range, or for a partial peer the range of
        the ones it holds (None: it holds none of them)."""
        if not self.partial(peer):
            return layers
        ours = self.layers(comp_index)
        theirs_c = self.peer_component(peer, comp_index)
        if theirs_c is None:
            return None
        theirs = layer_map(theirs_c)
        held = [theirs.ids.index(i) for i in ours.ids[layers.start: layers.stop] if i in theirs.ids]
        if not held:
            return None
        if held != list(range(held[0], held[-1] + 1)):
            raise GeometryError(f"layers {layers.start}..{layers.stop - 1} of {theirs_c.name!r} are not consecutive "
                                f"among the layers peer {peer.agent} holds")
        return range(held[0], held[-1] + 1)

    def pairs_for(self, peer: Peer, comp_index: int, segs: ComponentSlice) -> list[BufferPair]:
        """Source/destination buffer pairs of one component towards ``peer`` (prefill side)."""
        key = (peer.agent, comp_index)
        pairs = self._pairs.get(key)
        if pairs is None:
            mine, theirs = self._pair_components(peer, comp_index)
            src_regions = self._ctx.buffers.registered[mine.name].regions
            if peer.info is None:
                raise AssertionError(f"peer {peer.agent} has no registered buffers on this side")
            if theirs is None:
                return []
            dst = dict(zip((b.name for b in theirs.buffers),
                           zip(peer.info.component(mine.name).regions, theirs.buffers)))
            pairs = []
            spread_out = self.spread_out(peer, comp_index)
            granule = 0
            if spread_out:
                rp = self.repaging(peer)
                assert rp is not None and self._ctx.role is Role.PREFILL
                granule = rp.granule
                mine_planes = dict(zip((b.name for b in self._ctx.layout.components[comp_index].buffers),
                                       self.planes(self._ctx.layout, comp_index)))
                peer_orig = next(c for c in peer.layout.components if c.name == mine.name)
                their_planes = dict(zip((b.name for b in peer_orig.buffers), self.planes(peer.layout, comp_index)))
            for s, sg, seg in zip(src_regions, mine.buffers, segs.buffers):
                d, dg = dst.get(sg.name, (None, None))
                pages: tuple[SidePages | None, SidePages | None] = (None, None)
                if spread_out and d is not None and len(seg):
                    seg, *sides = spread(seg, granule, (mine_planes[sg.name], self._ctx.layout.page_size),
                                         (their_planes[sg.name], peer.layout.page_size))
                    pages = (sides[0], sides[1])
                pairs.append(BufferPair(src_base=s.addr, src_item_nbytes=sg.item_nbytes, src_num_items=sg.num_items,
                                        dst_base=d.addr if d is not None else 0,
                                        dst_item_nbytes=dg.item_nbytes if dg is not None else sg.item_nbytes,
                                        dst_num_items=theirs.num_items, segments=seg if d is not None else
                                        Segments.empty(), src_pages=pages[0], dst_pages=pages[1]))
            self._pairs[key] = pairs
        return pairs

    def rows_for(self, peer: Peer, comp_index: int, segs: ComponentSlice, src: PoolLayout,
                 dst: PoolLayout) -> tuple[Rows, ...] | None:
        """The staging pattern of a (peer, component) slice, or None when plain descriptors are used."""
        key = (peer.agent, comp_index)
        if key not in self._rows and (self.partial(peer) or self.repaging(peer) is not None):
            # paired by name (staging pairs buffers by index), or in sub-pages: plain descriptors
            self._rows[key] = None
        if key not in self._rows:
            rows = [regular_rows(seg, sb.item_nbytes, db.item_nbytes) for seg, sb, db in
                    zip(segs.buffers, src.components[comp_index].buffers, dst.components[comp_index].buffers)]
            found = [r for r in rows if r is not None]
            self._rows[key] = tuple(found) if len(found) == len(rows) else None
        return self._rows[key]

    def stage_plan_for(self, peer: Peer, comp_index: int, segs: ComponentSlice, src: PoolLayout,
                       dst: PoolLayout) -> StagePlan | None:
        """The staging layout of a (peer, component) slice, or None when it is not regular."""
        key = (peer.agent, comp_index)
        if key not in self._stage:
            rows = self.rows_for(peer, comp_index, segs, src, dst)
            plan = None
            if rows is not None:
                lm = self.layers(comp_index)
                plan = StagePlan(rows=rows, layers=lm, uniform=rows[0] if len(set(rows)) == 1 else None,
                                 layer_bytes=tuple(
                    sum(rows[b].nbytes for b in lm.layer_buffers(layer)) for layer in range(lm.num_layers)))
            self._stage[key] = plan
        return self._stage[key]

    def layer_pairs(self, peer: Peer, comp_index: int, segs: ComponentSlice,
                    layers: range) -> tuple[list[BufferPair], tuple[Segments, ...]]:
        """Buffer pairs and segments of ``layers`` only (the other buffers' segments empty). The segments are the
        transfer's structured form; none when the sub-pages span several planes (a backend then posts the plan's
        descriptors)."""
        lm = self.layers(comp_index)
        structured = not self.spread_out(peer, comp_index)
        if layers.start == 0 and layers.stop == lm.num_layers:
            return self.pairs_for(peer, comp_index, segs), segs.buffers if structured else ()
        key = (peer.agent, comp_index, layers.start, layers.stop)
        found = self._layer_pairs.get(key)
        if found is None:
            keep = set(lm.buffers(layers))
            empty = Segments.empty()
            pairs = [p if b in keep else dataclasses.replace(p, segments=empty)
                     for b, p in enumerate(self.pairs_for(peer, comp_index, segs))]
            found = self._layer_pairs[key] = (pairs, tuple(s if b in keep else empty for b, s in
                                                            enumerate(segs.buffers)) if structured else ())
        return found

    def layer_groups(self, peer: Peer, comp_index: int, segs: ComponentSlice,
                     layers: range) -> tuple[PairGroups, tuple[Segments, ...]]:
        """:meth:`layer_pairs` grouped for the planner (grouping is a Python step per buffer: done once)."""
        key = (peer.agent, comp_index, layers.start, layers.stop)
        found = self._layer_groups.get(key)
        if found is None:
            pairs, segments = self.layer_pairs(peer, comp_index, segs, layers)
            found = self._layer_groups[key] = (PairGroups.of(pairs), segments)
        return found

    def sliced_buffers(self, peer: Peer, comp_index: int, layers: range) -> list[int]:
        """The buffers of ``layers`` this pair moves bytes of (those with a non-empty slice), in layer order:
        the order of a notice's digests."""
        segs = self.slice_for(peer, comp_index)
        return [b for b in self.layers(comp_index).buffers(layers) if len(segs.buffers[b])]

    def run_bytes(self, peer: Peer, comp_index: int, buffer: int, side: str) -> Runs:
        """Byte offsets, inside one item, of the runs of one buffer's slice on ``side`` (digest order)."""
        key = (peer.agent, comp_index, buffer, side)
        found = self._run_bytes.get(key)
        if found is None:
            found = self._run_bytes[key] = run_bytes(self.slice_for(peer, comp_index).buffers[buffer], side)
        return found

    def forget(self, agent: str) -> None:
        self._partial.pop(agent, None)
        self._repaging.pop(agent, None)
        for cache in (self._slices, self._pairs, self._rows, self._stage, self._components, self._spread):
            for key in [k for k in cache if k[0] == agent]:
                del cache[key]
        for lkey in [k for k in self._layer_pairs if k[0] == agent]:
            del self._layer_pairs[lkey]
        for gkey in [k for k in self._layer_groups if k[0] == agent]:
            del self._layer_groups[gkey]
        for rkey in [k for k in self._run_bytes if k[0] == agent]:
            del self._run_bytes[rkey]

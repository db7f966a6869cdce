"""Per (peer, component) caches of what the prefill side of a pair writes: slices, buffer pairs, rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvbridge.backends.base import PeerInfo
from kvbridge.geometry import PoolLayout, Rank
from kvbridge.planner import BufferPair
from kvbridge.slicing import ComponentSlice
from kvbridge.staging import Rows, regular_rows
from kvbridge.wire import Role

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


class PlanCache:
    """Pure functions of (our layout, the peer's layout), computed once per peer and component."""

    def __init__(self, ctx: AgentContext) -> None:
        self._ctx = ctx
        self._slices: dict[tuple[str, int], ComponentSlice] = {}
        self._pairs: dict[tuple[str, int], list[BufferPair]] = {}
        self._rows: dict[tuple[str, int], tuple[Rows, ...] | None] = {}

    def slice_for(self, peer: Peer, comp_index: int) -> ComponentSlice:
        """What the prefill side of this pair writes for one component."""
        key = (peer.agent, comp_index)
        cached = self._slices.get(key)
        if cached is None:
            ctx = self._ctx
            src, dst = (ctx.layout, peer.layout) if ctx.role is Role.PREFILL else (peer.layout, ctx.layout)
            cached = ctx.registry.slice_state(ctx.state_types[comp_index], src.components[comp_index],
                                              dst.components[comp_index], Rank(src.tp_rank, src.tp_size),
                                              Rank(dst.tp_rank, dst.tp_size))
            self._slices[key] = cached
        return cached

    def pairs_for(self, peer: Peer, comp_index: int, segs: ComponentSlice) -> list[BufferPair]:
        """Source/destination buffer pairs of one component towards ``peer`` (prefill side)."""
        key = (peer.agent, comp_index)
        pairs = self._pairs.get(key)
        if pairs is None:
            mine = self._ctx.layout.components[comp_index]
            theirs = peer.layout.components[comp_index]
            src_regions = self._ctx.buffers.registered[mine.name].regions
            if peer.info is None:
                raise AssertionError(f"peer {peer.agent} has no registered buffers on this side")
            dst_regions = peer.info.component(mine.name).regions
            pairs = [BufferPair(src_base=s.addr, src_item_nbytes=sg.item_nbytes, src_num_items=sg.num_items,
                                dst_base=d.addr, dst_item_nbytes=dg.item_nbytes, dst_num_items=dg.num_items,
                                segments=seg)
                     for s, sg, d, dg, seg in zip(src_regions, mine.buffers, dst_regions, theirs.buffers,
                                                  segs.buffers)]
            self._pairs[key] = pairs
        return pairs

    def rows_for(self, peer: Peer, comp_index: int, segs: ComponentSlice, src: PoolLayout,
                 dst: PoolLayout) -> tuple[Rows, ...] | None:
        """The staging pattern of a (peer, component) slice, or None when plain descriptors are used."""
        key = (peer.agent, comp_index)
        if key not in self._rows:
            rows = [regular_rows(seg, sb.item_nbytes, db.item_nbytes) for seg, sb, db in
                    zip(segs.buffers, src.components[comp_index].buffers, dst.components[comp_index].buffers)]
            self._rows[key] = tuple(r for r in rows if r is not None) if all(r is not None for r in rows) else None
        return self._rows[key]

    def forget(self, agent: str) -> None:
        for cache in (self._slices, self._pairs, self._rows):
            for key in [k for k in cache if k[0] == agent]:
                del cache[key]

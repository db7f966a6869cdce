"""Posting a prefill chunk: validate and pair every component for every decode rank, then post each
write (through our staging area when the pattern allows, else as planned descriptors) with its notice."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvbridge.agent.context import AgentContext
from kvbridge.agent.peers import Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.agent.send_room import InFlight, SendRoom
from kvbridge.backends.base import ComponentTransfer
from kvbridge.errors import GeometryError, RegionError
from kvbridge.planner import TransferPlan, check_indices, plan_transfer
from kvbridge.slicing import ComponentSlice
from kvbridge.staging import STAGING, gather, page_layout, synchronize
from kvbridge.wire import Notice

log = logging.getLogger("kvbridge.agent")

StateIndices = Mapping[str, tuple[np.ndarray, int]]


@dataclass(slots=True, kw_only=True)
class Write:
    """One component of one chunk towards one decode rank, validated and paired, not yet posted."""

    peer: Peer
    comp_index: int
    segs: ComponentSlice
    src: np.ndarray
    dst: np.ndarray
    first: int | None
    staged_at: int | None


def _position_in(dst_all: np.ndarray, d_idx: np.ndarray) -> int | None:
    """Where ``d_idx`` sits in the destination list as one contiguous run (None if it does not)."""
    if not d_idx.size:
        return 0
    hits = np.flatnonzero(dst_all == d_idx[0])
    if hits.size != 1:
        return None
    first = int(hits[0])
    return first if np.array_equal(dst_all[first: first + d_idx.size], d_idx) else None


def _coverage_start(dst_all: np.ndarray, d_idx: np.ndarray, where: str) -> int | None:
    """Where the paired destination items sit in the request (a contiguous run), for the notice's coverage.

    None when they are all of it in another order (the notice then covers the whole list)."""
    first = _position_in(dst_all, d_idx)
    if first is not None:
        return first
    if len(d_idx) == len(dst_all) and np.array_equal(np.sort(d_idx), np.sort(dst_all)):
        return None
    raise GeometryError(f"{where}: the state type paired destination items that are not one run of the request")


class Poster:
    """Turns a chunk of a send room into validated writes, then posts them (lock held by the caller)."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self._no_staging: set[str] = set()      # peers whose staging area the engine cannot reach

    def prepare(self, room: SendRoom, comp_index: int, pages: np.ndarray, last: bool,
                 state: StateIndices) -> list[Write]:
        ctx = self._ctx
        comp, st = ctx.layout.components[comp_index], ctx.state_types[comp_index]
        if not st.chunked and not last:
            return []
        if st.chunked:
            src, src_first = check_indices(pages, comp.num_items, f"room {room.room} {comp.name} source"), 0
        else:
            if comp.name not in state:
                raise GeometryError(f"room {room.room}: the last chunk must carry indices for {comp.name!r}")
            src_raw, src_first = state[comp.name]
            src = check_indices(src_raw, comp.num_items, f"room {room.room} {comp.name} source")
        writes = []
        for agent, req in room.requests.items():
            peer = self._peers[agent]
            segs = self._plans.slice_for(peer, comp_index)
            if segs.is_empty:
                continue
            packed = req.indices[comp.name]
            dst_all = packed.unpack()
            first: int | None
            if st.chunked:
                end = room.cursor + len(src)
                if end > len(dst_all):
                    raise GeometryError(f"room {room.room} {comp.name}: prefill sends items up to {end}, decode "
                                        f"{agent} asked for {len(dst_all)}")
                if last and end < len(dst_all):
                    raise GeometryError(f"room {room.room}: prefill sent {end} of {len(dst_all)} {comp.name} items "
                                        f"to decode {agent} with its last chunk")
                s_idx, d_idx, first = src, dst_all[room.cursor: end], room.cursor
            else:
                s_idx, d_idx = st.pair_indices(comp, src, src_first, dst_all, packed.first)
                first = _coverage_start(dst_all, d_idx, f"room {room.room} {comp.name}")
            writes.append(Write(peer=peer, comp_index=comp_index, segs=segs, src=s_idx, dst=d_idx, first=first,
                                 staged_at=req.staging.get(comp.name, {}).get(ctx.layout.tp_rank)))
        return writes

    def post(self, room: SendRoom, write: Write, chunk: int, last: bool) -> None:
        ctx, peer = self._ctx, write.peer
        comp = ctx.layout.components[write.comp_index]
        s_idx, d_idx, first = write.src, write.dst, write.first
        if write.staged_at is not None and first is not None and len(s_idx) and self._send_staged(
                room, peer, write.comp_index, write.segs, s_idx, write.staged_at, first, chunk, last):
            return
        if s_idx.size > 1 and np.any(s_idx[1:] < s_idx[:-1]):   # the structured form is sorted by source
            order = np.argsort(s_idx, kind="stable")
            s_idx, d_idx = s_idx[order], d_idx[order]
        plan = plan_transfer(self._plans.pairs_for(peer, write.comp_index, write.segs), s_idx, d_idx)
        notice = Notice(room=room.room, sender=ctx.layout.tp_rank, component=comp.name, chunk=chunk, last=last,
                        nbytes=plan.total_nbytes, first=first or 0, count=len(s_idx))
        frame = ctx.codec.encode(notice, to=peer.address, to_incarnation=peer.incarnation)
        if len(plan) == 0:
            self.notify(peer, frame)
            return
        if peer.info is None:
            raise AssertionError(f"peer {peer.agent} has no registered buffers")
        transfer = ComponentTransfer(room=room.room, component=comp.name, peer=peer.agent, chunk=chunk, last=last,
                                     src=ctx.buffers.registered[comp.name], dst=peer.info.component(comp.name),
                                     plan=plan, notice=frame, src_items=s_idx, dst_items=d_idx,
                                     segments=write.segs.buffers)
        handle = ctx.registry.send_component(ctx.backend, transfer)
        room.inflight.append(InFlight(handle=handle, peer=peer.agent, notice=notice, frame=frame))
        room.nbytes += plan.total_nbytes
        room.descriptors += len(plan)

    def _send_staged(self, room: SendRoom, peer: Peer, comp_index: int, segs: ComponentSlice, items: np.ndarray,
                     remote_offset: int, first: int, chunk: int, last: bool) -> bool:
        """Gather the chunk into our staging area and post one write into the peer's; False to fall back."""
        ctx = self._ctx
        staging, staging_reg = ctx.buffers.staging, ctx.buffers.staging_registration
        if peer.info is None:
            raise AssertionError(f"peer {peer.agent} has no registered buffers")
        rows = self._plans.rows_for(peer, comp_index, segs, ctx.layout, peer.layout)
        remote = next((b for b in peer.info.buffers if b.component == STAGING), None)
        if (rows is None or staging is None or staging_reg is None or remote is None
                or peer.agent in self._no_staging):
            return False
        _, per_item = page_layout(rows)
        nbytes = per_item * len(items)
        local = staging.alloc(nbytes)
        if local is None:
            return False        # our staging area is full: plain descriptors, the notice says so
        comp = ctx.layout.components[comp_index]
        area = staging.array[local: local + nbytes]
        out = area.reshape(len(items), per_item) if isinstance(area, np.ndarray) else area.view(len(items), per_item)
        gather(ctx.buffers.views[comp.name], rows, items, out)
        synchronize(out)          # device gathers must finish before the engine reads the area
        dst = remote.regions[0].addr + remote_offset + first * per_item
        u64 = np.uint64
        plan = TransferPlan(np.array([staging.region.addr + local], u64), np.array([dst], u64),
                            np.array([nbytes], u64), np.zeros(1, np.int32))
        notice = Notice(room=room.room, sender=ctx.layout.tp_rank, component=comp.name, chunk=chunk, last=last,
                        nbytes=nbytes, first=first, count=len(items), staged=True)
        frame = ctx.codec.encode(notice, to=peer.address, to_incarnation=peer.incarnation)
        transfer = ComponentTransfer(room=room.room, component=STAGING, peer=peer.agent, chunk=chunk, last=last,
                                     src=staging_reg, dst=remote, plan=plan, notice=frame)
        try:
            handle = ctx.registry.send_component(ctx.backend, transfer)
        except RegionError as exc:     # the engine cannot reach the peer's staging area: descriptors from now on
            staging.free(local, nbytes)
            log.warning("%s: staging to %s refused (%s); using plain descriptors for this peer", ctx.name,
                        peer.agent, exc)
            self._no_staging.add(peer.agent)
            return False
        except BaseException:
            staging.free(local, nbytes)
            raise
        room.inflight.append(InFlight(handle=handle, peer=peer.agent, notice=notice, frame=frame,
                                      staging=(local, nbytes)))
        room.nbytes += nbytes
        room.descriptors += 1
        return True

    def notify(self, peer: Peer, frame: bytes) -> None:
        """Hand an encoded notice to the backend; the control link carries it when the engine cannot."""
        ctx = self._ctx
        if not ctx.registry.notify_completion(ctx.backend, peer.agent, frame):
            ctx.send_frame(peer.address, frame, "notice")

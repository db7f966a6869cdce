"""Posting a prefill chunk: validate and pair every component for every decode rank, then post each write
(staged through our staging area in pieces when the decode reserved space for it, else as planned
descriptors) with its notice.

A staged write is cut into pieces (``AgentConfig.staging_piece_bytes``), each with its own notice naming
the items and layers it completes: the gather of piece k+1 runs while piece k is on the wire, and the
decode scatters piece k when it lands. On CUDA the gathers run on the agent's own stream, after the work the
engine had queued on its current stream when it called ``send``; a write is posted once its gather's event
completed (polled from the progress loop, never waited for). Plain writes of CUDA memory likewise wait for
the engine's event. Posting is deciding: the backend call itself is an action the runtime makes after the agent
lock's release (:mod:`kvbridge.agent.actions`), never past our write lease; the write is ``posting`` until the
backend's answer comes back (:meth:`Poster._posted`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.agent.actions import CallBackend, Lapsed
from kvbridge.agent.context import AgentContext
from kvbridge.agent.peers import Lease, Peer, PeerTable
from kvbridge.agent.plans import PlanCache, StagePlan
from kvbridge.agent.send_room import InFlight, Pending, Piece, SendRoom, StagingRing
from kvbridge.agent.unconfirmed import Unconfirmed
from kvbridge.backends.base import ComponentTransfer
from kvbridge.backends.calls import CallKind
from kvbridge.errors import GeometryError, KVBridgeError, RegionError
from kvbridge.geometry import Component, IndexKind
from kvbridge.planner import TransferPlan, check_indices, plan_transfer
from kvbridge.protocol.records import RemoteBuffers
from kvbridge.protocol.states import WriteEvent, WriteState
from kvbridge.protocol.wire import KVPoll, Notice
from kvbridge.repaging import Repaging, sub_pages
from kvbridge.slicing import ComponentSlice
from kvbridge.staging import STAGING, gather_rows, source_index
from kvbridge.state.base import StateType

log = logging.getLogger("kvbridge.agent")

MAX_RING_SLOTS = 64          # a ring uses at most this many slots of its reservation (each take() scans them)

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
    ring_bytes: int | None = None       # the reservation at ``staged_at`` is a ring of this many bytes


def _position_in(dst_all: np.ndarray, d_idx: np.ndarray) -> int | None:
    """Where ``d_idx`` sits in the destination list as one contiguous run (None if it does not)."""
    if not d_idx.size:
        return 0
    hits = np.flatnonzero(dst_all == d_idx[0])
    if hits.size != 1:
        return None
    first = int(hits[0])
    return first if np.array_equal(dst_all[first: first + d_idx.size], d_idx) else None


def _sub_paged_chunk(room: SendRoom, component: str, agent: str, src: np.ndarray, dst_pages: np.ndarray,
                     prefix_len: int, last: bool, rp: Repaging, *, prefill: int,
                     decode: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Pair a chunk of our pages with the decode's pages of another size, as sub-pages (:mod:`kvbridge.repaging`):
    sub-pages the decode has cached are left out, and so is padding of our last page past the decode's list; the
    decode's last page may keep padding of its own. Returns (source, destination, first position) in sub-pages."""
    dst = sub_pages(dst_pages, rp.theirs)
    ours = sub_pages(src, rp.ours)
    start = room.cursor * rp.ours + rp.lead(prefix_len, prefill=prefill, decode=decode)
    end = start + len(ours)
    where = f"room {room.room} {component}"
    # padding of our last page past the decode's list is left out; a layer-wise send learns which chunk was the
    # last only with its final layer group, so any chunk may end in it (a chunk after it then fails here)
    if end - len(dst) >= rp.ours:
        raise GeometryError(f"{where}: prefill sends {prefill}-token pages up to sub-page {end} of {rp.granule} "
                            f"tokens, decode {agent} asked for {len(dst)} ({len(dst_pages)} pages of {decode})")
    if last and len(dst) - end >= rp.theirs:
        raise GeometryError(f"{where}: prefill sent {end} of {len(dst)} sub-pages of {rp.granule} tokens to decode "
                            f"{agent} with its last chunk: more than the decode's last page is missing")
    lo = min(max(start, 0), len(dst))          # an empty list (a prefix past the request's pages): nothing to pair
    hi = max(min(end, len(dst)), lo)
    return ours[lo - start: hi - start], dst[lo:hi], lo


def _sub_paged_state(st: StateType, comp: Component, agent: str, src: np.ndarray, src_first: int,
                     dst_pages: np.ndarray, dst_first: int, rp: Repaging, where: str) -> tuple[np.ndarray, np.ndarray,
                                                                                                int | None]:
    """Pair the pages of a state component sent once (an SWA window, NSA indexer pages) with the decode's pages
    of another size, as sub-pages: the decode's sub-pages outside ours must lie within its first or its last page
    (tokens before the window, padding past the request), and are left out; the state type pairs the rest.
    Returns (source, destination, first position in the decode's list) in sub-pages."""
    ours, s_first = sub_pages(src, rp.ours), src_first * rp.ours
    dst, d_first = sub_pages(dst_pages, rp.theirs), dst_first * rp.theirs
    lo, hi = max(s_first, d_first), min(s_first + len(ours), d_first + len(dst))
    if len(dst) and (lo - d_first >= rp.theirs or d_first + len(dst) - hi >= rp.theirs):
        raise GeometryError(f"{where} {comp.name}: prefill sends sub-pages [{s_first}, {s_first + len(ours)}) of "
                            f"{rp.granule} tokens, decode {agent} asked for [{d_first}, {d_first + len(dst)}): more "
                            "than its first or last page lies outside ours")
    kept = dst[lo - d_first: hi - d_first] if len(dst) else dst
    s_idx, d_idx = st.pair_indices(comp, ours, s_first, kept, lo if len(dst) else d_first)
    return s_idx, d_idx, _coverage_start(dst, d_idx, f"{where} {comp.name}")


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

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache,
                 on_post_error: Callable[[SendRoom, BaseException], None]) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self.on_post_error = on_post_error      # a queued post the backend refused: the prefill side fails the room
        self._no_staging: set[str] = set()      # peers whose staging area the engine cannot reach
        self.unconfirmed = Unconfirmed()        # notices the backend took, sent again ahead of our Goodbye

    # ------------------------------------------------------------------ validation and pairing
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
            peer = self._peers.get(agent)
            if peer is None or peer.incarnation != room.incarnations.get(agent):
                raise KVBridgeError(f"room {room.room}: decode {agent} left or restarted since it asked for the room "
                                    "(a new incarnation never asked for it)")
            segs = self._plans.slice_for(peer, comp_index)
            if segs.is_empty:
                continue
            packed = req.indices[comp.name]
            dst_all = packed.unpack()
            first: int | None
            rp = self._plans.repaging(peer) if comp.index_kind is IndexKind.PAGE else None
            if st.chunked and rp is not None:
                s_idx, d_idx, first = _sub_paged_chunk(room, comp.name, agent, src, dst_all, req.prefix_len, last, rp,
                                                       prefill=ctx.layout.page_size, decode=peer.layout.page_size)
            elif st.chunked:
                end = room.cursor + len(src)
                if end > len(dst_all):
                    raise GeometryError(f"room {room.room} {comp.name}: prefill sends items up to {end}, decode "
                                        f"{agent} asked for {len(dst_all)}")
                if last and end < len(dst_all):
                    raise GeometryError(f"room {room.room}: prefill sent {end} of {len(dst_all)} {comp.name} items "
                                        f"to decode {agent} with its last chunk")
                s_idx, d_idx, first = src, dst_all[room.cursor: end], room.cursor
            elif rp is not None:
                s_idx, d_idx, first = _sub_paged_state(st, self._plans.own_component(peer, comp_index), agent, src,
                                                       src_first, dst_all, packed.first, rp, f"room {room.room}")
            else:
                s_idx, d_idx = st.pair_indices(comp, src, src_first, dst_all, packed.first)
                first = _coverage_start(dst_all, d_idx, f"room {room.room} {comp.name}")
            writes.append(Write(peer=peer, comp_index=comp_index, segs=segs, src=s_idx, dst=d_idx, first=first,
                                 staged_at=req.staging.get(comp.name, {}).get(ctx.layout.tp_rank),
                                 ring_bytes=req.staging_bytes.get(comp.name, {}).get(ctx.layout.tp_rank)))
        return writes

    # ------------------------------------------------------------------ posting
    def post(self, room: SendRoom, write: Write, layers: range | None, last: bool, after: Any) -> None:
        """Post (or queue) the write of ``layers`` (None: every layer) of one component to one peer.
        ``after``: the engine's CUDA event the write must follow (None for host memory)."""
        ctx, peer = self._ctx, write.peer
        comp = ctx.layout.components[write.comp_index]
        group = layers if layers is not None else self._plans.layers(write.comp_index).all
        theirs = self._plans.peer_layers(peer, write.comp_index, group)    # the peer's numbering of these layers
        if theirs is None:                  # a decode of another pipeline split holds none of them
            if not last:
                return
            theirs = range(0, 0)            # ... but the last chunk's marker goes to it all the same, without bytes
            write = dataclasses.replace(write, src=write.src[:0], dst=write.dst[:0])
        if self._post_staged(room, write, group, last, after):
            return
        seq = room.next_seq(peer.agent, comp.name)
        first = write.first
        notice = Notice(room=room.room, sender=ctx.layout.tp_rank, component=comp.name, chunk=seq, last=last,
                        first=first or 0, count=len(write.src), layer_first=theirs.start, layer_count=len(theirs))
        s_idx, d_idx = write.src, write.dst
        if first is None:       # all of the request's items in another order: put them in the request's order
            dst_all = room.requests[peer.agent].indices[comp.name].unpack()
            order = np.argsort(d_idx, kind="stable")
            pick = order[np.searchsorted(d_idx[order], dst_all)]
            s_idx, d_idx = s_idx[pick], d_idx[pick]
        self._post_plain(room, peer, write.comp_index, write.segs, group, s_idx, d_idx, notice, after)

    def _post_plain(self, room: SendRoom, peer: Peer, comp_index: int, segs: ComponentSlice, group: range,
                    s_idx: np.ndarray, d_idx: np.ndarray, notice: Notice, after: Any) -> None:
        ctx = self._ctx
        comp = ctx.layout.components[comp_index]
        if self._wants_digests(room, peer):
            notice = _with(notice, digests=self._digests(peer, comp_index, s_idx, group))
        if s_idx.size > 1 and np.any(s_idx[1:] < s_idx[:-1]):   # the structured form is sorted by source
            order = np.argsort(s_idx, kind="stable")
            s_idx, d_idx = s_idx[order], d_idx[order]
        grouped, segments = self._plans.layer_groups(peer, comp_index, segs, group)
        plan = plan_transfer(grouped, s_idx, d_idx)
        notice = _with(notice, nbytes=plan.total_nbytes, staged=False, offset=0)
        frame = ctx.codec.encode(notice, to=peer.address, to_incarnation=peer.incarnation)
        if len(plan) == 0:
            self.notify(peer, frame, room.room)
            return
        if peer.info is None:
            raise AssertionError(f"peer {peer.agent} has no registered buffers")
        transfer = ComponentTransfer(room=room.room, component=comp.name, peer=peer.agent, chunk=notice.chunk,
                                     last=notice.last, src=ctx.buffers.registered[comp.name],
                                     dst=peer.info.component(comp.name), plan=plan, notice=frame, src_items=s_idx,
                                     dst_items=d_idx, segments=segments)
        if (after is not None and not after.query()) or self._held_by_lease(peer.agent):
            room.pending.append(Pending(peer=peer.agent, notice=notice, frame=frame, transfer=transfer, after=after))
            return
        self._send(room, transfer, peer.agent, notice, frame, None)

    def _send(self, room: SendRoom, transfer: ComponentTransfer, agent: str, notice: Notice, frame: bytes,
              staging: tuple[int, int] | None, piece: Pending | None = None) -> None:
        """Queue the post of one write: an action the runtime runs after the lock's release (never past our write
        lease); the write is in flight from now, and what the backend said comes back to :meth:`_posted`."""
        self._check_lease(agent)
        item = InFlight(handle=None, peer=agent, notice=notice, frame=frame, staging=staging, state=WriteState.POSTING)
        room.inflight.append(item)
        self._ctx.act(CallBackend(kind=CallKind.SEND_COMPONENT, args=(transfer,),
                                  not_after=self._peers.lease_until(agent),
                                  then=functools.partial(self._posted, room, item, transfer, piece)))
        trace = room.traces.get(agent) if room.traces else None
        if trace is not None:
            trace.start(("write", notice.component, notice.chunk), "write", {
                "kvbridge.component": notice.component, "kvbridge.chunk": notice.chunk,
                "kvbridge.bytes": transfer.plan.total_nbytes, "kvbridge.descriptors": len(transfer.plan),
                "kvbridge.staged": staging is not None, "kvbridge.layer_first": notice.layer_first,
                "kvbridge.layer_count": notice.layer_count})

    def _posted(self, room: SendRoom, item: InFlight, transfer: ComponentTransfer, piece: Pending | None,
                handle: Any, error: BaseException | None) -> None:
        """What the backend said to a queued post (lock held): the handle to poll, or why it took nothing."""
        ctx = self._ctx
        if error is None:
            item.handle = handle
            item.step(WriteEvent.ACCEPTED)
            room.nbytes += transfer.plan.total_nbytes
            room.descriptors += len(transfer.plan)
            return
        room.inflight.remove(item)
        if isinstance(error, Lapsed):        # our lease ran out before it went: queued again, judged by the pump
            item.step(WriteEvent.LAPSED)
            room.pending.appendleft(Pending(peer=item.peer, notice=item.notice, frame=item.frame, transfer=transfer,
                                            local=item.staging, state=WriteState.READY))
            return
        item.step(WriteEvent.ERROR)
        trace = room.traces.get(item.peer) if room.traces else None
        if trace is not None:
            trace.finish(("write", item.notice.component, item.notice.chunk),
                         f"{ctx.backend_name}: {type(error).__name__}: {error}")
        peer = self._peers.get(item.peer)
        if (piece is not None and isinstance(error, RegionError) and peer is not None
                and room.status is not KVPoll.Failed):
            # the engine cannot reach the peer's staging area: descriptors from now on
            log.warning("%s: staging to %s refused (%s); using plain descriptors for this peer", ctx.name,
                        peer.agent, error)
            self._no_staging.add(peer.agent)
            try:
                self._unstage(room, peer, piece)
            except Exception as exc:  # noqa: BLE001 - the room fails with the reason
                self.on_post_error(room, exc)
            return
        if item.staging is not None and ctx.buffers.staging is not None:
            ctx.buffers.staging.free(*item.staging)
        self.on_post_error(room, error)

    def _check_lease(self, agent: str) -> None:
        """Raise when our write lease to ``agent`` ran out and a read of our inbox since brought no echo."""
        now = self._ctx.clock()      # the instant of the post itself, not of the event: a lease is a safety bound
        if self._peers.lease(agent, now) is Lease.EXPIRED:
            raise KVBridgeError(f"write lease to decode {agent} ran out {-self._peers.lease_left(agent, now):.1f} s "
                                "ago (no echo of our heartbeats since: it may have handed the destination pages "
                                "back): not writing")

    def _held_by_lease(self, agent: str) -> bool:
        """The lease ran out but our inbox was not read since: the write waits for the progress loop's read."""
        return self._peers.lease(agent, self._ctx.clock()) is Lease.UNCONFIRMED

    # ------------------------------------------------------------------ staging
    def _remote_staging(self, peer: Peer) -> RemoteBuffers | None:
        if peer.info is None:
            raise AssertionError(f"peer {peer.agent} has no registered buffers")
        return next((b for b in peer.info.buffers if b.component == STAGING), None)

    def _post_staged(self, room: SendRoom, write: Write, group: range, last: bool, after: Any) -> bool:
        """Cut the write into pieces and queue them (the first with its staging space); False to post plain
        descriptors (no reservation, not regular, our staging area full or too small)."""
        ctx, peer = self._ctx, write.peer
        staging = ctx.buffers.staging
        if (write.staged_at is None or write.first is None or not len(write.src) or staging is None
                or ctx.config.staging == "never" or ctx.buffers.staging_registration is None
                or peer.agent in self._no_staging or self._remote_staging(peer) is None):
            return False
        plan = self._plans.stage_plan_for(peer, write.comp_index, write.segs, ctx.layout, peer.layout)
        if plan is None:
            return False
        comp = ctx.layout.components[write.comp_index]
        largest = max(plan.layer_bytes[layer] for layer in group)
        # a piece takes at most half of our area: a second piece (of this write, or of a write to another decode
        # rank) can gather while one is in flight (whole-area pieces left TP 1 -> 2's second rank to per-token
        # descriptors: 64 MiB requests at 0.25 GB/s over the default 32 MiB area on 2x H100)
        limit = min(ctx.config.staging_piece_bytes, max(64, staging.nbytes // 2 // 64 * 64))
        ring = None
        if write.ring_bytes is not None:
            ring = self._ring(room, peer.agent, comp.name, write.staged_at, write.ring_bytes, limit, largest)
            if ring is None:
                return False                   # the ring cannot hold one item of one layer
            limit = ring.slot_bytes
        if largest > limit:
            return False                       # one item of one layer does not fit a piece
        pieces = _cut(plan, write, group, limit)
        local = staging.alloc(pieces[0].nbytes)
        if local is None:
            return False                       # our staging area is full: plain descriptors, the notice says so
        digests = self._wants_digests(room, peer)
        for i, piece in enumerate(pieces):
            notice = Notice(room=room.room, sender=ctx.layout.tp_rank, component=comp.name,
                            chunk=room.next_seq(peer.agent, comp.name), last=last and i == len(pieces) - 1,
                            nbytes=piece.nbytes, first=write.first + piece.start, count=len(piece.src),
                            staged=True, offset=piece.remote_offset - write.staged_at,
                            layer_first=piece.layers.start, layer_count=len(piece.layers),
                            digests=self._digests(peer, write.comp_index, piece.src, piece.layers) if digests
                            else b"")
            frame = b"" if ring is not None else ctx.codec.encode(notice, to=peer.address,
                                                                  to_incarnation=peer.incarnation)
            room.pending.append(Pending(peer=peer.agent, notice=notice, frame=frame, piece=piece, after=after,
                                        local=(local, piece.nbytes) if i == 0 else None, ring=ring,
                                        state=WriteState.ALLOCATED if i == 0 else WriteState.QUEUED))
        return True

    @staticmethod
    def _wants_digests(room: SendRoom, peer: Peer) -> bool:
        req = room.requests.get(peer.agent)
        return req is not None and req.digests

    def _digests(self, peer: Peer, comp_index: int, src_items: np.ndarray, layers: range) -> bytes:
        """Digests of what this write moves to ``peer``: each buffer of ``layers`` that has a slice, each source
        item in the order of the destination items the notice names (``kvbridge.digests``), where the pages live:
        on a GPU on the engine's current stream, after the work it queued (the source pages), which this call
        waits for. Raw regions without a view send none (the decode then fails the room saying so)."""
        buffers = self._plans.sliced_buffers(peer, comp_index, layers)
        if not buffers:
            return b""
        digests = self._plans.digests(peer, comp_index, buffers, src_items, "src")
        return b"" if digests is None else digests.astype("<u8").tobytes()

    @staticmethod
    def _ring(room: SendRoom, agent: str, component: str, base: int, ring_bytes: int, limit: int,
              largest: int) -> StagingRing | None:
        """The peer's ring for this component (made on first use: two slots or more when they hold a piece
        of at least one item of the largest layer, else one slot of the whole reservation)."""
        found = room.rings.get((agent, component))
        if found is None:
            slot = min(limit, ring_bytes // 2)
            if slot < largest:
                slot = ring_bytes
            if slot < largest or slot <= 0:
                return None
            found = room.rings[(agent, component)] = StagingRing(
                base=base, slot_bytes=slot, slots=[None] * min(MAX_RING_SLOTS, ring_bytes // slot))
        return found if found.slot_bytes >= largest else None

    def pump(self, room: SendRoom) -> None:
        """Move the room's queued writes on: allocate staging for pieces (in order, while there is room),
        queue their gathers (work run after the lock's release), and post from the head of the queue what is
        ready. Never waits.

        The head is posted as soon as its gather is done, between the launches of the later gathers: a
        launch costs ~0.15-0.5 ms of host time, and posting only after all of them kept the wire idle that
        much longer on every request of several pieces (45dc44d, reverted on suspicion of the host NIXL demo
        hang and re-applied once that hang's cause was found elsewhere: a late decode request dropped in
        silence)."""
        if not room.pending:
            return
        staging = self._ctx.buffers.staging
        for p in room.pending:
            if p.piece is not None and p.local is None:
                offset = staging.alloc(p.piece.nbytes) if staging is not None else None
                if offset is None:
                    break
                p.local = (offset, p.piece.nbytes)
                p.step(WriteEvent.ALLOCATE)
        self._post_ready(room)
        for p in list(room.pending):           # a snapshot: posting pops from the head
            if p.state is WriteState.ALLOCATED:
                p.step(WriteEvent.GATHER)
                trace = room.traces.get(p.peer) if room.traces else None
                if trace is not None:
                    trace.start(("gather", p.notice.component, p.notice.chunk), "gather", {
                        "kvbridge.component": p.notice.component, "kvbridge.chunk": p.notice.chunk,
                        "kvbridge.bytes": p.piece.nbytes if p.piece is not None else 0})
                self._ctx.work("gather", self._gather(p), functools.partial(self._gathered, room, p))

    def _post_ready(self, room: SendRoom) -> None:
        """Post from the head of the room's queue while its writes are ready (their gathers done)."""
        staging = self._ctx.buffers.staging
        while room.pending and _ready(room.pending[0], room):
            if room.pending[0].ring is not None and not self._place(room.pending[0]):
                break                          # every ring slot still holds a piece the peer has not scattered
            if self._held_by_lease(room.pending[0].peer):
                break                          # posted once our inbox was read (an echo may renew the lease)
            p = room.pending.popleft()
            try:
                self._post_pending(room, p)
            except BaseException:
                if p.local is not None and staging is not None:
                    staging.free(*p.local)
                raise

    def _place(self, p: Pending) -> bool:
        """Give a ring piece a free slot and encode its notice with that offset; False when none is free."""
        assert p.ring is not None and p.piece is not None
        peer = self._peers.get(p.peer)
        if peer is None:
            return True                        # the peer is gone: posting drops the piece
        offset = p.ring.take(p.notice.chunk)
        if offset is None:
            return False
        p.piece.remote_offset = p.ring.base + offset
        p.notice = _with(p.notice, offset=offset)
        p.frame = self._ctx.codec.encode(p.notice, to=peer.address, to_incarnation=peer.incarnation)
        p.ring = None
        return True

    def drop(self, room: SendRoom) -> None:
        """The room failed: forget its queued writes, once no queued gather still reads or writes memory."""
        staging = self._ctx.buffers.staging
        kept: deque[Pending] = deque()
        for p in room.pending:
            if p.state is WriteState.GATHERING and not _ready(p, room):
                kept.append(p)                 # its gather still reads the source and writes our staging
                continue
            p.step(WriteEvent.DROP)
            if p.local is not None and staging is not None:
                staging.free(*p.local)
        room.pending = kept

    def _gather(self, p: Pending) -> Callable[[], tuple[Any, list[Any]]]:
        """The work that gathers a staged piece into our staging space (decided under the lock; run after its
        release): a host copy (gives ``(True, [])``), or a launch on our CUDA stream after the engine's work
        (gives its event and the device tensors it reads)."""
        ctx = self._ctx
        piece, staging = p.piece, ctx.buffers.staging
        assert piece is not None and p.local is not None and staging is not None
        peer = self._peers[p.peer]
        comp = ctx.layout.components[piece.comp_index]
        plan = self._plans.stage_plan_for(peer, piece.comp_index, self._plans.slice_for(peer, piece.comp_index),
                                          ctx.layout, peer.layout)
        assert plan is not None
        n, src, after = len(piece.src), piece.src, p.after
        stager = ctx.buffers.stager() if ctx.buffers.is_cuda(comp.name) else None
        batched = ctx.buffers.batched(comp.name, piece.buffers, plan.uniform, "src")
        if stager is not None and batched is not None:     # one kernel for every buffer of the piece
            # the pieces of one write share their items on the device; works run one at a time, in order
            holder, staged = piece.src_on_device, staging.view(p.local[0], 1, piece.nbytes).view(-1)

            def batched_gather() -> tuple[Any, list[Any]]:
                if not holder:
                    holder.append(stager.to_device(src))
                items = holder[0]
                return stager.run(lambda: batched.gather(items[0], staged), after=after), [items, batched]

            return batched_gather
        views = ctx.buffers.views[comp.name]
        outs, cursor = [], p.local[0]
        for b in piece.buffers:
            size = plan.rows[b].nbytes
            outs.append((views[b], plan.rows[b], staging.view(cursor, n, size)))
            cursor += n * size
        if stager is None:
            def host_gather() -> tuple[Any, list[Any]]:
                for view, rows, out in outs:
                    gather_rows(view, rows, src, out)
                return True, []

            return host_gather

        def indexed_gather() -> tuple[Any, list[Any]]:
            indices: dict[Any, Any] = {}
            for _view, r, _out in outs:
                if (r.src_contiguous, r.rows) not in indices:
                    indices[r.src_contiguous, r.rows] = stager.to_device(source_index(r, src))

            def work() -> None:
                for view, r, out in outs:
                    gather_rows(view, r, src, out, index=indices[r.src_contiguous, r.rows][0])

            return stager.run(work, after=after), list(indices.values())

        return indexed_gather

    def _gathered(self, room: SendRoom, p: Pending, result: Any, error: BaseException | None) -> None:
        """A gather ran (lock held): the piece is ready once its event fired; post from the head what is ready."""
        if error is not None:
            p.gathered = True                  # nothing of it runs any more: the room fails and drops it
            self.on_post_error(room, KVBridgeError(f"room {room.room}: the gather of {p.notice.component} piece "
                                                   f"{p.notice.chunk} raised {type(error).__name__}: {error}"))
            return
        p.gathered, p.keep = result
        if room.status is KVPoll.Failed:
            return
        try:
            self._post_ready(room)
        except Exception as exc:  # noqa: BLE001 - the room fails with the reason
            self.on_post_error(room, exc)

    def _post_pending(self, room: SendRoom, p: Pending) -> None:
        ctx = self._ctx
        peer = self._peers.get(p.peer)
        if peer is None or peer.incarnation != room.incarnations.get(p.peer):
            p.step(WriteEvent.DROP)
            if p.local is not None and ctx.buffers.staging is not None:
                ctx.buffers.staging.free(*p.local)
            return                     # the peer is gone: its death already failed the room
        p.step(WriteEvent.POST)
        if p.transfer is not None:            # a plain write (or a staged piece queued again: it holds its space)
            self._send(room, p.transfer, p.peer, p.notice, p.frame, p.local)
            return
        piece, staging, reg = p.piece, ctx.buffers.staging, ctx.buffers.staging_registration
        assert piece is not None and p.local is not None and staging is not None and reg is not None
        remote = self._remote_staging(peer)
        if remote is not None and peer.agent not in self._no_staging:
            local, nbytes = p.local
            u64 = np.uint64
            plan = TransferPlan(np.array([staging.region.addr + local], u64),
                                np.array([remote.regions[0].addr + piece.remote_offset], u64),
                                np.array([nbytes], u64), np.zeros(1, np.int32))
            transfer = ComponentTransfer(room=room.room, component=STAGING, peer=peer.agent, chunk=p.notice.chunk,
                                         last=p.notice.last, src=reg, dst=remote, plan=plan, notice=p.frame)
            self._send(room, transfer, peer.agent, p.notice, p.frame, p.local, piece=p)
            return
        self._unstage(room, peer, p)

    def _unstage(self, room: SendRoom, peer: Peer, p: Pending) -> None:
        """Post a gathered piece as plain descriptors instead (its staging space is given back)."""
        ctx = self._ctx
        piece, staging = p.piece, ctx.buffers.staging
        assert piece is not None and p.local is not None and staging is not None
        staging.free(*p.local)
        p.local = None
        comp = ctx.layout.components[piece.comp_index]
        ring = room.rings.get((peer.agent, comp.name))
        if ring is not None:
            ring.release(p.notice.chunk)       # its slot was never written: no credit will come for it
        self._post_plain(room, peer, piece.comp_index, self._plans.slice_for(peer, piece.comp_index), piece.layers,
                         piece.src, piece.dst, p.notice, None)
        log.debug("%s: room %d %s piece %d went as descriptors", ctx.name, room.room, comp.name, p.notice.chunk)

    def notify(self, peer: Peer, frame: bytes, room: int) -> None:
        """Hand an encoded notice to the backend; the control link carries it when the engine cannot. One the
        backend took is kept until it cannot matter (:mod:`kvbridge.agent.unconfirmed`): our Goodbye must not
        overtake it."""
        ctx = self._ctx
        # kept when queued (a Goodbye queued meanwhile must find it); one the backend could not take goes by the
        # link and is dropped from what is kept
        self.unconfirmed.keep(peer.agent, peer.incarnation, room, frame, ctx.codec.last_seq(peer.address))
        ctx.act(CallBackend(kind=CallKind.NOTIFY_COMPLETION, args=(peer.agent, frame),
                            then=functools.partial(self._notified, peer.agent, peer.address, room, frame)))

    def _notified(self, agent: str, address: str, room: int, frame: bytes, took: Any,
                  error: BaseException | None) -> None:
        if error is not None:
            log.warning("%s: notify_completion to %s raised %s: %s (sent by the control link)", self._ctx.name,
                        agent, type(error).__name__, error)
        if error is not None or not took:
            self.unconfirmed.drop(agent, room, frame)     # not to be sent again before our Goodbye
            self._ctx.send_frame(address, frame, "notice")


def _ready(p: Pending, room: SendRoom) -> bool:
    """May the write be posted? A gathering piece or a plain write whose CUDA event fired becomes READY."""
    if p.state is WriteState.READY:
        return True
    if p.piece is not None:
        done = p.state is WriteState.GATHERING and p.gathered is not None and (p.gathered is True
                                                                           or bool(p.gathered.query()))
    else:
        done = p.after is None or bool(p.after.query())
    if done:
        p.step(WriteEvent.READY)
        trace = room.traces.get(p.peer) if room.traces and p.piece is not None else None
        if trace is not None:
            trace.finish(("gather", p.notice.component, p.notice.chunk))
    return done


def _with(notice: Notice, **changes: Any) -> Notice:
    import msgspec

    return msgspec.structs.replace(notice, **changes)


def _cut(plan: StagePlan, write: Write, group: range, limit: int) -> list[Piece]:
    """The pieces of ``layers`` of a chunk: whole layers while they fit ``limit``, a layer too large for one
    piece split by items. Laid out as :class:`StagePlan` says, starting at the chunk's slot."""
    assert write.staged_at is not None and write.first is not None
    n = len(write.src)
    base = write.staged_at + write.first * plan.per_item
    lm = plan.layers
    pieces: list[Piece] = []
    on_device: list[Any] = []             # shared by the pieces over all of the write's items
    layer = group.start
    while layer < group.stop:
        if n * plan.layer_bytes[layer] > limit:       # split this layer's items
            per = max(1, limit // plan.layer_bytes[layer])
            for a in range(0, n, per):
                b = min(n, a + per)
                pieces.append(Piece(comp_index=write.comp_index, layers=range(layer, layer + 1),
                                    buffers=lm.layer_buffers(layer), src=write.src[a:b], dst=write.dst[a:b], start=a,
                                    nbytes=(b - a) * plan.layer_bytes[layer],
                                    remote_offset=base + n * plan.layer_offset(layer) + a * plan.layer_bytes[layer]))
            layer += 1
            continue
        stop = layer + 1
        while stop < group.stop and n * plan.span(range(layer, stop + 1)) <= limit:
            stop += 1
        span = range(layer, stop)
        pieces.append(Piece(comp_index=write.comp_index, layers=span, buffers=lm.buffers(span), src=write.src,
                            dst=write.dst, start=0, nbytes=n * plan.span(span),
                            remote_offset=base + n * plan.layer_offset(layer), src_on_device=on_device))
        layer = stop
    return pieces

"""The prefill side: send rooms, decode requests, planning, staging, posting and completion of writes."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.agent.config import EARLY_ROOMS, TICK_S, TOMBSTONES
from kvbridge.agent.context import AgentContext, RoomTable, Tombstones
from kvbridge.agent.peers import Dropped, Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.backends.base import ComponentTransfer, HandleState, Poll
from kvbridge.errors import GeometryError, KVBridgeError, ProtocolError, RegionError, TransferError
from kvbridge.planner import TransferPlan, check_indices, plan_transfer
from kvbridge.slicing import ComponentSlice, served_ranks
from kvbridge.staging import STAGING, gather, page_layout, synchronize
from kvbridge.wire import Abort, Envelope, KVPoll, Notice, StatusPush, TransferRequest

log = logging.getLogger("kvbridge.agent")

StateIndices = Mapping[str, tuple[np.ndarray, int]]


@dataclass(slots=True, kw_only=True)
class InFlight:
    """One posted write and the notice that announces it once it completed."""

    handle: Any
    peer: str
    notice: Notice
    frame: bytes                               # the notice, encoded once
    staging: tuple[int, int] | None = None     # (offset, bytes) of our staging area to free when done


@dataclass(slots=True, kw_only=True)
class SendRoom:
    room: int
    created: float
    requests: dict[str, TransferRequest] = field(default_factory=dict)
    expected_requests: int | None = None
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    chunks: int = 0
    cursor: int = 0
    last_sent: bool = False
    inflight: list[InFlight] = field(default_factory=list)
    must_confirm: dict[str, tuple[str, int]] = field(default_factory=dict)   # owed an Abort(quiesced): agent ->
    #                                                                          (address, incarnation)
    nbytes: int = 0
    descriptors: int = 0


@dataclass(slots=True, kw_only=True)
class _Write:
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


class PrefillSide(RoomTable[SendRoom]):
    """Every send room of a prefill rank. Public methods take the agent lock themselves; ``on_*`` and
    ``poll_inflight``/``tick`` are called by the progress loop with the lock held."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self.rooms: dict[int, SendRoom] = {}
        self._early: OrderedDict[int, tuple[float, list[TransferRequest]]] = OrderedDict()   # before sender()
        self._early_by_agent: dict[str, OrderedDict[int, None]] = {}   # agent -> its early rooms, oldest first
        self._early_aborts: OrderedDict[int, str] = OrderedDict()
        self._active: set[int] = set()          # rooms with writes in flight or an acknowledgement owed
        self._next_timeouts = 0.0
        self._tombstones = Tombstones()
        self._no_staging: set[str] = set()
        peers.on_death(self._peer_died)
        peers.on_in_use(self._refers_to)

    # ---------------------------------------------------------------- engine-facing (Sender)
    def open(self, room: int) -> None:
        with self._ctx.lock:
            if room in self.rooms:
                raise KVBridgeError(f"room {room} already has a sender on {self._ctx.name}")
            self._tombstones.revive(room)
            state = self.rooms[room] = SendRoom(room=room, created=time.monotonic())
            for req in self._unqueue(room):
                self._accept_request(state, req)
            early_abort = self._early_aborts.pop(room, None)
            if early_abort is not None:
                self._fail(state, early_abort)

    def prefix_len(self, room: int) -> int:
        with self._ctx.lock:
            reqs = self.get(room).requests
            return next(iter(reqs.values())).prefix_len if reqs else 0

    def stats(self, room: int) -> tuple[int, int]:
        with self._ctx.lock:
            state = self.get(room)
            return state.nbytes, state.descriptors

    def send(self, room: int, pages: np.ndarray, last: bool, state: StateIndices) -> None:
        ctx = self._ctx
        with ctx.lock:
            record = self.get(room)
            if record.status is KVPoll.Failed:
                raise TransferError(room, record.reason)
            if record.status is KVPoll.Bootstrapping:
                raise KVBridgeError(f"room {room} is still bootstrapping: wait for WaitingForInput before send()")
            if record.last_sent:
                raise KVBridgeError(f"room {room}: the last chunk was already sent")
            try:
                self._send_chunk(record, pages, last, state)
            except KVBridgeError as exc:
                self._fail(record, str(exc))
                raise
            except Exception as exc:   # an engine's own exception: the room fails with the engine's words
                self._fail(record, f"{ctx.backend_name} send_component raised {type(exc).__name__}: {exc}")
                raise

    def abort(self, room: int, reason: str) -> None:
        with self._ctx.lock:
            self._fail(self.get(room), reason)

    def safe_to_reuse(self, room: int) -> bool:
        with self._ctx.lock:
            state = self.get(room)
            return state.status in (KVPoll.Success, KVPoll.Failed) and not state.inflight

    def clear(self, room: int) -> None:
        with self._ctx.lock:
            state = self.rooms.get(room)
            if state is not None and state.inflight:
                raise KVBridgeError(f"room {room}: {len(state.inflight)} writes still in flight; wait for "
                                    "safe_to_reuse before clear()")
            self.rooms.pop(room, None)
            self._active.discard(room)
            self._tombstones.bury(room)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_request(self, req: TransferRequest, peer: Peer | None) -> None:
        ctx = self._ctx
        if req.room in self._tombstones:
            return
        if peer is None:
            raise Dropped(f"transfer request for room {req.room} from {req.agent}, which never shook hands")
        room = self.rooms.get(req.room)
        try:
            _validate_request(peer, req)
        except (GeometryError, ProtocolError) as exc:
            log.error("%s: refused request for room %d from %s: %s", ctx.name, req.room, req.agent, exc)
            self._peers.post(peer, StatusPush(room=req.room, agent=ctx.name, status=KVPoll.Failed,
                                              reason=f"bad request: {exc}"))
            why = f"decode {req.agent} sent a bad request: {exc}"
            if room is not None:
                self._fail(room, why)
            else:       # remembered: the sender() that comes later fails at once with this reason
                self._remember_abort(req.room, why)
            return
        if room is not None:
            self._accept_request(room, req)
            return
        created, queued = self._early.get(req.room, (time.monotonic(), []))
        if any(q.agent == req.agent for q in queued):
            return
        queued.append(req)
        self._early[req.room] = (created, queued)
        self._early_by_agent.setdefault(req.agent, OrderedDict())[req.room] = None
        # bounded, and fair: the peer with the most queued requests loses its oldest one (a flooding peer
        # evicts its own requests, never those a quieter decode queued before it)
        while len(self._early) > EARLY_ROOMS:
            heaviest = max(self._early_by_agent, key=lambda agent: len(self._early_by_agent[agent]))
            dropped = next(iter(self._early_by_agent[heaviest]))
            self._unqueue(dropped, heaviest)
            log.warning("%s: more than %d rooms requested before their sender(); forgot %s's request for room %d",
                        ctx.name, EARLY_ROOMS, heaviest, dropped)

    def _unqueue(self, room: int, agent: str | None = None) -> list[TransferRequest]:
        """Take the early requests for ``room`` (only ``agent``'s when given) out of the queue."""
        entry = self._early.get(room)
        if entry is None:
            return []
        created, queued = entry
        taken = [q for q in queued if agent is None or q.agent == agent]
        kept = [q for q in queued if agent is not None and q.agent != agent]
        for q in taken:
            rooms = self._early_by_agent.get(q.agent)
            if rooms is not None:
                rooms.pop(room, None)
                if not rooms:
                    del self._early_by_agent[q.agent]
        if kept:
            self._early[room] = (created, kept)
        else:
            del self._early[room]
        return taken

    def _remember_abort(self, room: int, reason: str) -> None:
        self._unqueue(room)
        if room not in self._tombstones:
            self._early_aborts[room] = reason
            while len(self._early_aborts) > TOMBSTONES:
                self._early_aborts.popitem(last=False)

    def on_abort(self, abort: Abort, env: Envelope) -> None:
        ctx = self._ctx
        room = self.rooms.get(abort.room)
        ack = Abort(room=abort.room, agent=ctx.name, reason=abort.reason, quiesced=True)
        if room is None:   # nothing was written for it: confirm now, fail the sender if it comes later
            if abort.room not in self._tombstones and self._peers.get(abort.agent) is None:
                raise Dropped(f"abort of room {abort.room} from {abort.agent}, which is not a peer")
            if abort.room not in self._tombstones:
                queued = self._early.get(abort.room, (0.0, []))[1]
                if queued and all(q.agent != abort.agent for q in queued):
                    raise Dropped(f"abort of room {abort.room} from {abort.agent}, which did not request it")
                self._remember_abort(abort.room, f"aborted by decode {abort.agent}: {abort.reason}")
            ctx.post(env.address, ack, incarnation=env.incarnation)
            return
        if abort.agent not in room.requests:
            raise Dropped(f"abort of room {abort.room} from {abort.agent}, which is not a participant")
        self._fail(room, f"aborted by decode {abort.agent}: {abort.reason}")
        room.must_confirm[abort.agent] = (env.address, env.incarnation)
        self._active.add(room.room)

    def _accept_request(self, room: SendRoom, req: TransferRequest) -> None:
        if room.status is KVPoll.Failed:
            return
        if req.agent in room.requests:
            return  # duplicate: exactly-once per (room, decode rank)
        room.requests[req.agent] = req
        layout = self._ctx.layout
        room.expected_requests = len(served_ranks(layout.tp_size, req.dst_size, layout.tp_rank))
        if len(room.requests) >= room.expected_requests and room.status is KVPoll.Bootstrapping:
            room.status = KVPoll.WaitingForInput

    # ---------------------------------------------------------------- posting (lock held)
    def _send_chunk(self, room: SendRoom, pages: np.ndarray, last: bool, state: StateIndices) -> None:
        """Validate and pair every component of the chunk for every decode rank, then post: a bad index
        anywhere refuses the whole chunk before any byte moves."""
        writes = [w for comp_index in range(len(self._ctx.layout.components))
                  for w in self._prepare(room, comp_index, pages, last, state)]
        chunk = room.chunks
        for write in writes:
            self._post(room, write, chunk, last)
        room.chunks += 1
        room.cursor += len(pages)
        room.status = KVPoll.Transferring
        self._active.add(room.room)
        if last:
            room.last_sent = True

    def _prepare(self, room: SendRoom, comp_index: int, pages: np.ndarray, last: bool,
                 state: StateIndices) -> list[_Write]:
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
            writes.append(_Write(peer=peer, comp_index=comp_index, segs=segs, src=s_idx, dst=d_idx, first=first,
                                 staged_at=req.staging.get(comp.name, {}).get(ctx.layout.tp_rank)))
        return writes

    def _post(self, room: SendRoom, write: _Write, chunk: int, last: bool) -> None:
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
            self._notify(peer, frame)
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

    def _notify(self, peer: Peer, frame: bytes) -> None:
        """Hand an encoded notice to the backend; the control link carries it when the engine cannot."""
        ctx = self._ctx
        if not ctx.registry.notify_completion(ctx.backend, peer.agent, frame):
            ctx.send_frame(peer.address, frame, "notice")

    # ---------------------------------------------------------------- completion (lock held)
    def poll_inflight(self) -> None:
        """Poll the writes of rooms that have any (cost: the active rooms, not all of them)."""
        for room_id in list(self._active):
            room = self.rooms.get(room_id)
            if room is None:
                self._active.discard(room_id)
                continue
            if room.inflight:
                room.inflight = [item for item in room.inflight if not self._finished(room, item)]
            if room.inflight:
                continue
            if room.status is KVPoll.Transferring and room.last_sent:
                room.status = KVPoll.Success
            for address, incarnation in room.must_confirm.values():
                self._ctx.post(address, Abort(room=room.room, agent=self._ctx.name, reason=room.reason,
                                              quiesced=True), incarnation=incarnation)
            room.must_confirm.clear()
            self._active.discard(room_id)

    def _finished(self, room: SendRoom, item: InFlight) -> bool:
        """Poll one write; when it ended, release it, free its staging and notify or fail the room."""
        ctx = self._ctx
        result: Poll | None
        try:
            result = ctx.backend.poll(item.handle)
        except Exception as exc:  # noqa: BLE001 - engine errors become Failed with their text
            result, reason = None, f"{type(exc).__name__}: {exc}"
        else:
            reason = result.reason
        if result is not None and result.state is HandleState.PENDING:
            return False
        try:
            ctx.backend.release(item.handle)
        except Exception:
            log.exception("%s: releasing a transfer handle failed", ctx.name)
        if item.staging is not None and ctx.buffers.staging is not None:
            ctx.buffers.staging.free(*item.staging)
        peer = self._peers.get(item.peer)
        if result is not None and result.state is HandleState.DONE:
            if room.status is not KVPoll.Failed and peer is not None:
                self._notify(peer, item.frame)
        else:
            self._fail(room, f"{ctx.backend_name} write of {item.notice.component} chunk {item.notice.chunk} to "
                             f"{item.peer} failed: {reason}")
        return True

    def _fail(self, room: SendRoom, reason: str) -> None:
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return
        room.status, room.reason = KVPoll.Failed, reason
        for agent in room.requests:
            peer = self._peers.get(agent)
            if peer is not None and peer.alive:
                self._peers.post(peer, StatusPush(room=room.room, agent=self._ctx.name, status=KVPoll.Failed,
                                                  reason=reason))
                room.must_confirm[agent] = (peer.address, peer.incarnation)   # Abort(quiesced) once drained
        self._active.add(room.room)

    def tick(self, now: float) -> None:
        if now < self._next_timeouts:
            return
        self._next_timeouts = now + TICK_S
        timeout = self._ctx.config.bootstrap_timeout_s
        for room in self.rooms.values():
            if room.status is KVPoll.Bootstrapping and now - room.created > timeout:
                self._fail(room, f"bootstrap timeout: {len(room.requests)} of {room.expected_requests or '?'} "
                                 f"decode requests after {timeout} s")
        while self._early:                     # requests whose sender() never came
            room_id, (created, _) = next(iter(self._early.items()))
            if now - created <= timeout:
                break
            self._unqueue(room_id)

    def _peer_died(self, peer: Peer, reason: str) -> None:
        for room in self.rooms.values():
            if peer.agent in room.requests:
                self._fail(room, reason)
                room.must_confirm.pop(peer.agent, None)
        for room_id in list(self._early_by_agent.get(peer.agent, ())):
            self._unqueue(room_id, peer.agent)

    def _refers_to(self, agent: str) -> bool:
        return any(agent in room.requests for room in self.rooms.values())


def _coverage_start(dst_all: np.ndarray, d_idx: np.ndarray, where: str) -> int | None:
    """Where the paired destination items sit in the request (a contiguous run), for the notice's coverage.

    None when they are all of it in another order (the notice then covers the whole list)."""
    first = _position_in(dst_all, d_idx)
    if first is not None:
        return first
    if len(d_idx) == len(dst_all) and np.array_equal(np.sort(d_idx), np.sort(dst_all)):
        return None
    raise GeometryError(f"{where}: the state type paired destination items that are not one run of the request")


def _validate_request(peer: Peer, req: TransferRequest) -> None:
    if (req.dst_rank, req.dst_size) != (peer.layout.tp_rank, peer.layout.tp_size):
        raise ProtocolError(f"request says decode rank {req.dst_rank}/{req.dst_size}, handshake said "
                            f"{peer.layout.tp_rank}/{peer.layout.tp_size}")
    names = set(peer.layout.component_names)
    if set(req.indices) != names:
        raise ProtocolError(f"request names components {sorted(req.indices)}, the pool has {sorted(names)}")
    for comp in peer.layout.components:
        check_indices(req.indices[comp.name].unpack(), comp.num_items, f"room {req.room} {comp.name} destination")

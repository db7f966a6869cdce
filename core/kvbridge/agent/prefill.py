"""The prefill side: send rooms, decode requests, planning, staging, posting and completion of writes."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np

from kvbridge.agent.config import EARLY_ROOMS, TICK_S, TOMBSTONES
from kvbridge.agent.context import AgentContext, RoomTable, Tombstones
from kvbridge.agent.peers import Dropped, Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.agent.posting import Poster, StateIndices
from kvbridge.agent.send_room import InFlight, SendRoom
from kvbridge.backends.base import HandleState, Poll
from kvbridge.errors import GeometryError, KVBridgeError, ProtocolError, TransferError
from kvbridge.planner import check_indices
from kvbridge.slicing import served_ranks
from kvbridge.wire import Abort, Envelope, KVPoll, StatusPush, TransferRequest

log = logging.getLogger("kvbridge.agent")

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
        self._poster = Poster(ctx, peers, plans)
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
                  for w in self._poster.prepare(room, comp_index, pages, last, state)]
        chunk = room.chunks
        for write in writes:
            self._poster.post(room, write, chunk, last)
        room.chunks += 1
        room.cursor += len(pages)
        room.status = KVPoll.Transferring
        self._active.add(room.room)
        if last:
            room.last_sent = True

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
                self._poster.notify(peer, item.frame)
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


def _validate_request(peer: Peer, req: TransferRequest) -> None:
    if (req.dst_rank, req.dst_size) != (peer.layout.tp_rank, peer.layout.tp_size):
        raise ProtocolError(f"request says decode rank {req.dst_rank}/{req.dst_size}, handshake said "
                            f"{peer.layout.tp_rank}/{peer.layout.tp_size}")
    names = set(peer.layout.component_names)
    if set(req.indices) != names:
        raise ProtocolError(f"request names components {sorted(req.indices)}, the pool has {sorted(names)}")
    for comp in peer.layout.components:
        check_indices(req.indices[comp.name].unpack(), comp.num_items, f"room {req.room} {comp.name} destination")

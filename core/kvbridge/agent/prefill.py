"""The prefill side: send rooms, decode requests, planning, staging, posting and completion of writes."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvbridge import tracing
from kvbridge.agent.actions import CallBackend
from kvbridge.agent.config import EARLY_BYTES, EARLY_ROOMS, TICK_S, TOMBSTONES
from kvbridge.agent.context import AgentContext, RoomTable, Tombstones
from kvbridge.agent.lateness import Since
from kvbridge.agent.peers import Dropped, Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.agent.posting import Poster, StateIndices
from kvbridge.agent.send_room import HeldChunk, InFlight, OpenChunk, SendRoom, WriteEnded
from kvbridge.backends.base import HandleState
from kvbridge.backends.calls import CallKind
from kvbridge.errors import Draining, GeometryError, KVBridgeError, ProtocolError, TransferError
from kvbridge.planner import check_indices
from kvbridge.protocol.events import RoomEventKind
from kvbridge.protocol.states import (
    SAFE_SEND,
    SEND_ROOM,
    PeerState,
    SendEvent,
    SendState,
    WriteEvent,
    WriteState,
)
from kvbridge.protocol.wire import Abort, Credit, Envelope, KVPoll, StatusPush, TransferRequest
from kvbridge.slicing import served_ranks
from kvbridge.staging import STAGING

log = logging.getLogger("kvbridge.agent")

class PrefillSide(RoomTable[SendRoom]):
    """Every send room of a prefill rank. It takes no lock: the engine-facing methods are called by the runtime's
    handles with the agent lock held, ``on_*`` and ``poll_inflight``/``tick`` by the progress loop with it held,
    ``poll_writes`` without it (the backend's answers are applied under it). Posts, notices and releases are actions
    run after the lock's release (:mod:`kvbridge.agent.actions`)."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self.rooms: dict[int, SendRoom] = {}
        self._early: OrderedDict[int, tuple[Since, list[TransferRequest]]] = OrderedDict()   # before sender()
        self._early_by_agent: dict[str, OrderedDict[int, None]] = {}   # agent -> its early rooms, oldest first
        self._early_aborts: OrderedDict[int, str] = OrderedDict()
        self._early_bytes_by_agent: dict[str, int] = {}   # agent -> bytes of page ids its early requests hold
        self.early_bytes = 0                    # ... all of them
        self.early_bytes_limit = EARLY_BYTES
        self._active: set[int] = set()          # rooms with writes in flight or an acknowledgement owed
        self._clear_when_settled: set[int] = set()   # rooms the engine let go before they were over (cleared then)
        self._next_timeouts = 0.0
        self._tombstones = Tombstones()
        self._poster = Poster(ctx, peers, plans, self._post_failed)
        self._engine_call = threading.local()   # .errors: posts the backend refused during this thread's send()
        self._buffer_names = {(c.name, b.name) for c in ctx.layout.components for b in c.buffers}
        self.draining = ""                      # why new rooms are refused (TransferAgent.drain), "" when not
        # rooms that failed while a decode was judged dead by silence, by agent: told when it speaks again
        self._owed: dict[tuple[str, int], OrderedDict[int, tuple[str, int]]] = {}   # room -> (reason, nonce)
        peers.on_death(self._peer_died)
        peers.on_lease_reset(self._lease_reset)
        peers.on_revive(self._peer_revived)
        peers.on_in_use(self._refers_to)

    # ---------------------------------------------------------------- engine-facing (Sender; lock held)
    # The runtime's handles (kvbridge.agent.handles) call these with the agent lock held; none takes it.
    def open(self, room: int) -> None:
        self._ctx.holding("open()")
        if self.draining:
            raise Draining(f"{self._ctx.name} is draining ({self.draining}): no new rooms; route room {room} "
                           "to another prefill instance")
        if room in self.rooms:
            raise KVBridgeError(f"room {room} already has a sender on {self._ctx.name}")
        self._tombstones.revive(room)
        state = self.rooms[room] = SendRoom(room=room, created=self._ctx.lateness.since(self._ctx.now),
                                             opened_ns=tracing.wall_ns())
        for req in self._unqueue(room):
            self._accept_request(state, req, self._peers.get(req.agent))
        early_abort = self._early_aborts.pop(room, None)
        if early_abort is not None:
            self._fail(state, early_abort)

    def prefix_len(self, room: int) -> int:
        reqs = self.get(room).requests
        return next(iter(reqs.values())).prefix_len if reqs else 0

    def stats(self, room: int) -> tuple[int, int]:
        state = self.get(room)
        return state.nbytes, state.descriptors

    def engine_event(self) -> Any:
        """An event after the CUDA work the engine queued so far (None when no component is on a GPU). The runtime
        records it before taking the lock: only the engine's own stream is touched."""
        buffers = self._ctx.buffers
        if not any(buffers.is_cuda(c.name) for c in self._ctx.layout.components):
            return None
        stager = buffers.stager()
        return stager.engine_event() if stager is not None else None

    @contextlib.contextmanager
    def refusals(self) -> Iterator[list[BaseException]]:
        """Collects the posts the backend refuses while this thread runs its actions (at the lock's release, in
        this thread): the runtime raises the first to the engine from ``send()``."""
        errors: list[BaseException] = []
        self._engine_call.errors = errors
        try:
            yield errors
        finally:
            self._engine_call.errors = None

    def send(self, room: int, pages: np.ndarray, last: bool, state: StateIndices, layers: range | None = None,
             *, from_start: bool = False, after: Any = None) -> None:
        """One chunk of ``room`` (``after``: the engine's event the writes wait for, see :meth:`engine_event`)."""
        self._ctx.holding("send()")
        record = self.get(room)
        if record.status is KVPoll.Failed:
            raise TransferError(room, record.reason)
        if record.from_start is not None and record.from_start != from_start:
            raise KVBridgeError(f"room {room}: every chunk of a room is sent with the same from_start (the first "
                                f"had from_start={record.from_start})")
        if from_start and layers is not None:
            raise KVBridgeError(f"room {room}: from_start=True sends whole chunks; a layer-wise send (layers=) "
                                "starts at the decode's prefix: wait for WaitingForInput")
        if record.last_sent or (record.held and record.held[-1].last):
            raise KVBridgeError(f"room {room}: the last chunk was already sent")
        if record.status is KVPoll.Bootstrapping:
            if not from_start:
                raise KVBridgeError(f"room {room} is still bootstrapping: wait for WaitingForInput before send(), "
                                    "or send(from_start=True) to have the chunk held until then")
            record.from_start = True
            record.held.append(HeldChunk(pages=np.array(pages, dtype=np.int64, copy=True), last=last,
                                         state=state, after=after))
            self._step(record, SendEvent.HOLD)
            return
        record.from_start = from_start
        self._post_chunk(record, pages, last, state, layers, after)

    def _post_chunk(self, record: SendRoom, pages: np.ndarray, last: bool, state: StateIndices,
                    layers: range | None, after: Any) -> None:
        """Send one chunk of a room past Bootstrapping (lock held); a refusal fails the room and raises."""
        if record.from_start:
            pages = self._drop_prefix(record, pages)
            if not len(pages) and not last:
                return                         # wholly inside the decode's cached prefix
        try:
            self._send_chunk(record, pages, last, state, layers, after)
        except KVBridgeError as exc:
            self._fail(record, str(exc))
            raise
        except Exception as exc:   # an engine's own exception: the room fails with the engine's words
            self._fail(record, f"{self._ctx.backend_name} send_component raised {type(exc).__name__}: {exc}")
            raise

    def _drop_prefix(self, record: SendRoom, pages: np.ndarray) -> np.ndarray:
        """A from_start chunk's pages after the decode's cached prefix (chunks are consecutive from position 0)."""
        if record.skip_left is None:
            reqs = record.requests
            prefix = next(iter(reqs.values())).prefix_len if reqs else 0
            record.skip_left = prefix // self._ctx.layout.page_size
        skip = min(record.skip_left, len(pages))
        record.skip_left -= skip
        return pages[skip:]

    def _post_held(self, record: SendRoom) -> None:
        """Every request came: post the chunks the engine sent before, in order (a refusal fails the room)."""
        held, record.held = record.held, []
        for chunk in held:
            if record.status is KVPoll.Failed:
                return
            try:
                self._post_chunk(record, chunk.pages, chunk.last, chunk.state, None, chunk.after)
            except Exception as exc:  # noqa: BLE001 - the room failed with the reason; the engine polls it
                log.error("%s: room %d: a held chunk was refused: %s", self._ctx.name, record.room, exc)
                return

    def abort(self, room: int, reason: str) -> None:
        self._ctx.holding("abort()")
        self._fail(self.get(room), reason)

    def safe_to_reuse(self, room: int) -> bool:
        """A projection of the room's state (Success, or Failed and drained): its SAFE_TO_REUSE event was emitted
        by the transition that made it true."""
        return self.get(room).state in SAFE_SEND

    def clear(self, room: int) -> None:
        self._ctx.holding("clear()")
        state = self.rooms.get(room)
        if state is not None and state.busy:
            raise KVBridgeError(f"room {room}: {len(state.inflight) + len(state.pending)} writes still in flight "
                                "or queued; wait for safe_to_reuse before clear()")
        if state is not None:
            _end_traces(state, "cleared by the engine before it ended")
        self.rooms.pop(room, None)
        self._active.discard(room)
        self._clear_when_settled.discard(room)
        self._tombstones.bury(room)
        self._ctx.events.forget(room)

    def clear_when_safe(self, room: int) -> None:
        """The engine lets the room go: a room whose last chunk was not sent fails (nobody will send the rest), one
        whose last chunk went runs to its end; cleared now if it is over (safe to reuse, nothing owed to a decode),
        else by the progress step once it is; its events stop now. For engines that call ``clear()`` once, whatever
        the room's state (SGLang): no thread of theirs has to come back for it."""
        self._ctx.holding("clear_when_safe()")
        state = self.rooms.get(room)
        if state is None:
            return
        if not state.last_sent and not (state.held and state.held[-1].last):   # nobody will send the rest
            self._fail(state, "let go by the engine before its last chunk")
        if self._settled(state):
            self.clear(room)
            return
        self._clear_when_settled.add(room)
        self._ctx.events.mute(room)

    @staticmethod
    def _settled(room: SendRoom) -> bool:
        return room.state in SAFE_SEND and not room.busy and not room.must_confirm

    def _clear_settled(self) -> None:
        """Clear the rooms the engine let go that are over now (progress step; a few rooms at most)."""
        for room_id in list(self._clear_when_settled):
            state = self.rooms.get(room_id)
            if state is None or self._settled(state):
                self._clear_when_settled.discard(room_id)
                if state is not None:
                    self.clear(room_id)

    def end_traces(self, reason: str) -> None:
        """End the spans of every room still traced (the agent closes; call under the lock)."""
        for room in self.rooms.values():
            _end_traces(room, reason)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_request(self, req: TransferRequest, peer: Peer | None) -> None:
        ctx = self._ctx
        room = self.rooms.get(req.room)
        if room is None and req.room in self._tombstones:
            if peer is not None:     # the room ended and was cleared before this request came: say so
                self._refuse_late(peer, req, "it was cleared")
            return
        if peer is None:
            raise Dropped(f"transfer request for room {req.room} from {req.agent}, which never shook hands")
        if not peer.alive:      # departed (goodbye, declared gone, exited): a late frame of a dead incarnation
            raise Dropped(f"transfer request for room {req.room} from {req.agent}, which is {peer.state.value}")
        self._poster.unconfirmed.forget_room(req.agent, req.room)   # notices of an earlier use of the number
        if room is not None and room.status is KVPoll.Failed and req.agent not in room.requests:
            self._refuse_late(peer, req, room.reason)     # it failed (bootstrap timeout...) before this request
            return
        try:
            _validate_request(peer, req)
            self._check_whole_reservations(peer, req)
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
            self._accept_request(room, req, peer)
            return
        if self.draining:                      # no sender() will come: the decode hears it now, with the reason
            self._peers.post(peer, StatusPush(room=req.room, agent=ctx.name, status=KVPoll.Failed,
                                              reason=f"prefill {ctx.name} is draining ({self.draining})"))
            return
        created, queued = self._early.get(req.room, (self._ctx.lateness.since(self._ctx.now), []))
        if any(q.agent == req.agent for q in queued):
            return
        size = _request_bytes(req)
        if size > self.early_bytes_limit:
            self._evict_early(req.room, peer, f"a request of {size} bytes is more than the {self.early_bytes_limit} "
                                              "bytes of page ids kept for rooms before their sender()", queued=False,
                              nonce=req.nonce)
            return
        queued.append(req)
        self._early[req.room] = (created, queued)
        self._early_by_agent.setdefault(req.agent, OrderedDict())[req.room] = None
        self._early_bytes_by_agent[req.agent] = self._early_bytes_by_agent.get(req.agent, 0) + size
        self.early_bytes += size
        # bounded in count and in bytes, and fair: the peer with the most queued requests (or bytes) loses its
        # oldest one (a flooding peer evicts its own requests, never those a quieter decode queued before it)
        while len(self._early) > EARLY_ROOMS or self.early_bytes > self.early_bytes_limit:
            if len(self._early) > EARLY_ROOMS:
                heaviest = max(self._early_by_agent, key=lambda agent: len(self._early_by_agent[agent]))
                why = f"more than {EARLY_ROOMS} rooms requested before their sender()"
            else:
                heaviest = max(self._early_bytes_by_agent, key=lambda agent: self._early_bytes_by_agent[agent])
                why = (f"more than {self.early_bytes_limit} bytes of page ids requested for rooms before their "
                       "sender()")
            dropped = next(iter(self._early_by_agent[heaviest]))
            self._evict_early(dropped, self._peers.get(heaviest), why)

    def _evict_early(self, room: int, peer: Peer | None, why: str, *, queued: bool = True, nonce: int = 0) -> None:
        """Forget ``peer``'s early request for ``room`` (over a bound): the decode hears it (an acknowledged
        abort: nothing was written, its room fails and is safe at once), and the sender() that comes later
        fails with the reason; other decodes' requests for the room stay (they hear it from that failure)."""
        agent = peer.agent if peer is not None else ""
        if queued:
            nonce = next((q.nonce for q in self._unqueue(room, agent)), nonce)
        log.warning("%s: %s; forgot %s's request for room %d", self._ctx.name, why, agent, room)
        if peer is not None and peer.alive:
            self._peers.post(peer, Abort(room=room, agent=self._ctx.name, quiesced=True, nonce=nonce,
                                         reason=f"prefill {self._ctx.name} dropped the request: {why}"))
        if room not in self._tombstones:
            self._early_aborts[room] = f"the request of decode {agent} was dropped: {why}"
            while len(self._early_aborts) > TOMBSTONES:
                self._early_aborts.popitem(last=False)

    def _refuse_late(self, peer: Peer, req: TransferRequest, why: str) -> None:
        """A request for a room that ended without it: unless told, the decode waits for data that never comes
        (silently, until its waiting_timeout_s: the host NIXL demo's hang). Nothing was or will be written for
        this request, so the answer is an acknowledged abort: the decode's room fails and is safe at once."""
        log.warning("%s: request for room %d from %s came after the room ended: %s", self._ctx.name, req.room,
                    req.agent, why)
        self._peers.post(peer, Abort(room=req.room, agent=self._ctx.name, quiesced=True, nonce=req.nonce,
                                     reason=f"the request came after the room ended on this prefill rank: {why}"))

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
            size = _request_bytes(q)
            self.early_bytes -= size
            left = self._early_bytes_by_agent.get(q.agent, 0) - size
            if left > 0:
                self._early_bytes_by_agent[q.agent] = left
            else:
                self._early_bytes_by_agent.pop(q.agent, None)
        if kept:
            self._early[room] = (created, kept)
        else:
            del self._early[room]
        return taken

    def _remember_abort(self, room: int, reason: str, *, told: str = "") -> None:
        """The room failed before its sender() (an abort, a bad request, a timeout): the sender() that comes later
        fails at once with ``reason``, and every other decode rank whose request was queued for it hears it now
        (an acknowledged abort: nothing was written), not at its waiting timeout (simulator seed 5724)."""
        for req in self._unqueue(room):
            peer = self._peers.get(req.agent)
            if req.agent != told and peer is not None and peer.alive:
                self._peers.post(peer, Abort(room=room, agent=self._ctx.name, quiesced=True, nonce=req.nonce,
                                             reason=f"the room failed before this prefill rank opened it: {reason}"))
        if room not in self._tombstones:
            self._early_aborts[room] = reason
            while len(self._early_aborts) > TOMBSTONES:
                self._early_aborts.popitem(last=False)

    def on_abort(self, abort: Abort, env: Envelope) -> None:
        ctx = self._ctx
        self._poster.unconfirmed.forget_room(abort.agent, abort.room)     # the decode is done with that room
        room = self.rooms.get(abort.room)
        ack = Abort(room=abort.room, agent=ctx.name, reason=abort.reason, quiesced=True, nonce=abort.nonce)
        if room is None:   # nothing was written for it: confirm now, fail the sender if it comes later
            if self._peers.get(abort.agent) is None:
                # not (or no longer) a peer: nothing of ours can land in its memory; confirm, change nothing
                ctx.post(env.address, ack, incarnation=env.incarnation)
                return
            if abort.room not in self._tombstones:
                queued = self._early.get(abort.room, (0.0, []))[1]
                if queued and all(q.agent != abort.agent for q in queued):
                    raise Dropped(f"abort of room {abort.room} from {abort.agent}, which did not request it")
                self._remember_abort(abort.room, f"aborted by decode {abort.agent}: {abort.reason}", told=abort.agent)
            ctx.post(env.address, ack, incarnation=env.incarnation)
            return
        if abort.agent not in room.requests:
            raise Dropped(f"abort of room {abort.room} from {abort.agent}, which is not a participant")
        if abort.nonce and abort.nonce != room.requests[abort.agent].nonce:
            # another request of this room number (an earlier one, or a restarted decode's): nothing of it is in
            # flight here (a room is cleared only once drained): acknowledged, and this room's request goes on
            ctx.post(env.address, ack, incarnation=env.incarnation)
            return
        self._fail(room, f"aborted by decode {abort.agent}: {abort.reason}")
        room.must_confirm[abort.agent] = (env.address, env.incarnation)
        self._active.add(room.room)

    def on_credit(self, credit: Credit, env: Envelope) -> None:
        """A decode rank scattered a staged piece out of its ring: that slot may take the next piece."""
        room = self.rooms.get(credit.room)
        if room is None:
            return                             # the room ended: its ring went with it
        if credit.agent != env.sender or credit.agent not in room.requests:
            raise Dropped(f"credit for room {credit.room} from {env.sender!r}, which is not a participant")
        if credit.nonce != room.requests[credit.agent].nonce:
            raise Dropped(f"credit for room {credit.room} from {env.sender!r} names another request of that room "
                          "(an earlier one that used the same number)")
        ring = room.rings.get((credit.agent, credit.component))
        if ring is not None and ring.release(credit.chunk) and room.pending:
            self._active.add(room.room)        # the progress loop posts what waited for the slot

    def _check_whole_reservations(self, peer: Peer, req: TransferRequest) -> None:
        """A reservation without a ring holds this rank's whole slice: it must end inside the decode's area."""
        ctx = self._ctx
        size = _staging_size(peer)
        rank = ctx.layout.tp_rank
        for comp_index, comp in enumerate(ctx.layout.components):
            offset = req.staging.get(comp.name, {}).get(rank)
            if offset is None or rank in req.staging_bytes.get(comp.name, {}):
                continue
            plan = self._plans.stage_plan_for(peer, comp_index, self._plans.slice_for(peer, comp_index), ctx.layout,
                                              peer.layout)
            whole = plan.per_item * len(req.indices[comp.name].unpack()) if plan is not None else 0
            if offset + whole > size:
                raise ProtocolError(f"request reserves {whole} B of {comp.name} staging for prefill rank {rank} at "
                                    f"offset {offset}, past the end of the {size} B staging area the decode "
                                    "registered")

    def _accept_request(self, room: SendRoom, req: TransferRequest, peer: Peer | None) -> None:
        if room.status is KVPoll.Failed:
            return
        if req.agent in room.requests:
            return  # duplicate: exactly-once per (room, decode rank)
        if peer is None or not peer.alive:
            return  # its incarnation left before the room opened (its death unqueued it; this is a late copy)
        first = next(iter(room.requests.values()), None)
        room.requests[req.agent] = req
        room.incarnations[req.agent] = peer.incarnation
        if req.trace:
            self._trace(room, req)
        layout = self._ctx.layout
        if first is not None and self._other_prefix(first, req):
            self._fail(room, f"decode ranks disagree on the prefix they hold: {first.agent} {first.prefix_len} "
                             f"tokens, {req.agent} {req.prefix_len}: one chunk stream cannot start at both")
            return
        room.expected_requests = len(served_ranks(layout.tp_size, req.dst_size, layout.tp_rank))
        if self._requests_complete(room, req.dst_size) and room.state is SendState.BOOTSTRAPPING:
            self._step(room, SendEvent.REQUESTS_COMPLETE)
            if room.held:
                self._post_held(room)

    def _other_prefix(self, a: TransferRequest, b: TransferRequest) -> bool:
        """Do two decode ranks' prefixes start the request's pages at different places, on our pages or theirs?"""
        ours = self._ctx.layout.page_size
        pa, pb = self._peers.get(a.agent), self._peers.get(b.agent)
        theirs_a = pa.layout.page_size if pa is not None else ours
        theirs_b = pb.layout.page_size if pb is not None else ours
        return (a.prefix_len // ours != b.prefix_len // ours
                or a.prefix_len // theirs_a * theirs_a != b.prefix_len // theirs_b * theirs_b)

    def _requests_complete(self, room: SendRoom, dst_size: int) -> bool:
        """Every buffer we hold was asked for by every decode rank we serve: one request per rank, or, from decodes
        of another pipeline split (each holding some of our layers, stages possibly of different TP sizes), several
        whose buffers together are all of ours, for every rank of some decode TP size."""
        layout = self._ctx.layout
        if len(room.requests) < len(served_ranks(layout.tp_size, dst_size, layout.tp_rank)):
            return False
        held: dict[tuple[int, int], set[tuple[str, str]]] = {}
        for agent in room.requests:
            peer = self._peers.get(agent)
            if peer is not None:
                held.setdefault((peer.layout.tp_size, peer.layout.tp_rank), set()).update(
                    (c.name, b.name) for c in peer.layout.components for b in c.buffers)
        covered: set[tuple[str, str]] = set()
        for size in {size for size, _ in held}:
            ranks = [held.get((size, r), set()) for r in served_ranks(layout.tp_size, size, layout.tp_rank)]
            covered |= set.intersection(*ranks) if ranks else set()
        return covered >= self._buffer_names

    def _trace(self, room: SendRoom, req: TransferRequest) -> None:
        """Open this room's span towards ``req``'s decode under the decode room's span (kvbridge.tracing)."""
        ctx = self._ctx
        trace = tracing.send_trace(room=room.room, traceparent=req.trace, opened_ns=room.opened_ns, attributes={
            "kvbridge.agent": ctx.name, "kvbridge.role": "prefill", "kvbridge.backend": ctx.backend_name,
            "kvbridge.tp_rank": ctx.layout.tp_rank, "kvbridge.tp_size": ctx.layout.tp_size,
            "kvbridge.decode": req.agent, "kvbridge.decode_rank": req.dst_rank, "kvbridge.decode_tp": req.dst_size})
        if trace is not None:
            trace.phase(room.state.value, room.opened_ns)     # bootstrapping: the wait for the decode's request
            room.traces[req.agent] = trace

    # ---------------------------------------------------------------- posting (lock held)
    def _send_chunk(self, room: SendRoom, pages: np.ndarray, last: bool, state: StateIndices, layers: range | None,
                    after: Any) -> None:
        """Validate and pair every component of the chunk (or of its layer group) for every decode rank, then
        post: a bad index anywhere refuses the whole chunk before any byte moves."""
        ctx = self._ctx
        completes, open_chunk = self._layer_group(room, pages, last, layers)
        if last and completes:
            self._check_length(room, room.cursor + len(pages))
        writes = [w for comp_index in range(len(ctx.layout.components))
                  for w in self._poster.prepare(room, comp_index, pages, last, state)]
        for write in writes:
            chunked = ctx.state_types[write.comp_index].chunked
            self._poster.post(room, write, layers if chunked else None, last, after)
        if open_chunk is not None and layers is not None:
            open_chunk.sent[layers.start: layers.stop] = True
        room.open_chunk = None if completes else open_chunk
        if completes:
            room.chunks += 1
            room.cursor += len(pages)
        self._step(room, SendEvent.SEND)
        self._active.add(room.room)
        if last:
            room.last_sent = True
        self._poster.pump(room)

    def _check_length(self, room: SendRoom, sent: int) -> None:
        """The last chunk: ``sent`` pages from the one holding the decode's prefix end must end in the request's last
        page, for every decode that said the request's length (protocol 9), whatever its page size."""
        page = self._ctx.layout.page_size
        for agent, req in room.requests.items():
            if req.tokens:
                want = max(-(-req.tokens // page) - req.prefix_len // page, 0)
                if sent != want:
                    raise GeometryError(f"room {room.room}: the last chunk ends at {sent} pages of {page} tokens from "
                                        f"the decode's prefix page; decode {agent}'s request of {req.tokens} tokens "
                                        f"(prefix {req.prefix_len}) needs {want}")

    def _layer_group(self, room: SendRoom, pages: np.ndarray, last: bool,
                     layers: range | None) -> tuple[bool, OpenChunk | None]:
        """Check a send against the chunk being sent layer group by layer group: whether it completes the
        chunk, and the open chunk's record (changed only once the send is posted)."""
        ctx = self._ctx
        where = f"room {room.room}"
        open_chunk = room.open_chunk
        if layers is None:
            if open_chunk is not None:
                missing = np.flatnonzero(~open_chunk.sent).tolist()
                raise KVBridgeError(f"{where}: a whole chunk was sent while the layer-wise chunk before it still "
                                    f"misses layers {missing}")
            return True, None
        chunked = [i for i, st in enumerate(ctx.state_types) if st.chunked]
        maps = {self._plans.layers(i).num_layers: self._plans.layers(i) for i in chunked}
        if len(maps) > 1:
            raise GeometryError(f"{where}: layer-wise sends need the chunked components to have the same number of "
                                f"layers (they have {sorted(maps)})")
        if not maps:
            raise GeometryError(f"{where}: layer-wise send, but no component travels in chunks")
        lm = next(iter(maps.values()))
        lm.check(layers, where)
        if open_chunk is None:
            open_chunk = OpenChunk(pages=np.array(pages, copy=True), sent=np.zeros(lm.num_layers, dtype=bool))
        elif open_chunk.pages.shape != np.shape(pages) or not np.array_equal(open_chunk.pages, pages):
            missing = np.flatnonzero(~open_chunk.sent).tolist()
            raise KVBridgeError(f"{where}: layer group {layers.start}..{layers.stop - 1} names other pages than the "
                                f"chunk it belongs to, which still misses layers {missing}")
        if open_chunk.sent[layers.start: layers.stop].any():
            again = (np.flatnonzero(open_chunk.sent[layers.start: layers.stop]) + layers.start).tolist()
            raise KVBridgeError(f"{where}: layers {again} of this chunk were already sent")
        completes = int(open_chunk.sent.sum()) + len(layers) == lm.num_layers
        if last and not completes:
            missing = sorted(set(np.flatnonzero(~open_chunk.sent).tolist()) - set(layers))
            raise KVBridgeError(f"{where}: last=True goes with the final layer group of the last chunk; layers "
                                f"{missing} were not sent")
        return completes, open_chunk

    # ---------------------------------------------------------------- completion (lock held)
    @property
    def queued_work(self) -> bool:
        """Writes wait for a CUDA event or for staging space: the progress loop should come back soon (the
        next piece is posted only when it looks)."""
        return any(room.pending for room_id in self._active if (room := self.rooms.get(room_id)) is not None)

    def posted_writes(self) -> list[tuple[SendRoom, InFlight]]:
        """The writes the backend holds (lock held): the progress loop polls them outside the lock."""
        return [(room, item) for room_id in self._active if (room := self.rooms.get(room_id)) is not None
                for item in room.inflight if item.state is WriteState.POSTED]

    def poll_writes(self, writes: list[tuple[SendRoom, InFlight]]) -> list[WriteEnded]:
        """Poll ``writes`` (without the lock: a backend call); those that ended, with how."""
        calls, ended = self._ctx.calls, []
        for room, item in writes:
            try:
                result = calls.poll(item.handle)
            except Exception as exc:  # noqa: BLE001 - engine errors become Failed with their text
                ended.append(WriteEnded(room, item, False, f"{type(exc).__name__}: {exc}"))
                continue
            if result.state is not HandleState.PENDING:
                ended.append(WriteEnded(room, item, result.state is HandleState.DONE, result.reason))
        return ended

    def poll_inflight(self, ended: Sequence[WriteEnded] = ()) -> None:
        """Apply the writes that ended (polled outside the lock), move the rooms' queued writes on, and end the rooms
        whose writes all ended (cost: the active rooms, not all of them)."""
        for end in ended:
            if end.item.state is WriteState.POSTED and end.item in end.room.inflight:
                end.room.inflight.remove(end.item)
                self._finished(end.room, end.item, end.done, end.reason)
        for room_id in list(self._active):
            room = self.rooms.get(room_id)
            if room is None:
                self._active.discard(room_id)
                continue
            if room.pending:
                self._pump(room)
            if room.busy:
                continue
            if (room.state is SendState.TRANSFERRING and room.last_sent) or room.state is SendState.FAILING:
                self._step(room, SendEvent.DRAINED)
            for agent, (address, incarnation) in room.must_confirm.items():
                req = room.requests.get(agent)
                self._ctx.post(address, Abort(room=room.room, agent=self._ctx.name, reason=room.reason,
                                              quiesced=True, nonce=req.nonce if req is not None else 0),
                               incarnation=incarnation)
            room.must_confirm.clear()
            self._active.discard(room_id)

    def _finished(self, room: SendRoom, item: InFlight, done: bool, reason: str) -> None:
        """A write ended: release its handle, free its staging, and notify or fail the room."""
        ctx = self._ctx
        ctx.act(CallBackend(kind=CallKind.RELEASE, args=(item.handle,)))
        if item.staging is not None and ctx.buffers.staging is not None:
            ctx.buffers.staging.free(*item.staging)
        peer = self._peers.get(item.peer)
        item.step(WriteEvent.COMPLETE if done else WriteEvent.ERROR)
        trace = room.traces.get(item.peer) if room.traces else None
        if trace is not None:
            trace.finish(("write", item.notice.component, item.notice.chunk), "" if done
                         else f"{self._ctx.backend_name}: {reason}")
        if done:
            if room.status is not KVPoll.Failed and peer is not None:
                self._poster.notify(peer, item.frame, room.room)
        else:
            self._fail(room, f"{ctx.backend_name} write of {item.notice.component} chunk {item.notice.chunk} to "
                             f"{item.peer} failed: {reason}")

    def _post_failed(self, room: SendRoom, error: BaseException) -> None:
        """A queued post the backend refused or could not make (lock held): the room fails with its words, and an
        engine's send() that queued it raises the error."""
        what = str(error) if isinstance(error, KVBridgeError) else (f"{self._ctx.backend_name} send_component raised "
                                                                    f"{type(error).__name__}: {error}")
        log.error("%s: room %d: posting a write failed: %s", self._ctx.name, room.room, what)
        self._fail(room, what)
        self._poster.drop(room)
        errors = getattr(self._engine_call, "errors", None)
        if errors is not None:
            errors.append(error)

    def _pump(self, room: SendRoom) -> None:
        """Post the room's queued writes that became ready (from the progress loop: errors fail the room)."""
        if room.status is KVPoll.Failed:
            self._poster.drop(room)
            return
        try:
            self._poster.pump(room)
        except Exception as exc:  # noqa: BLE001 - the engine's words become the room's failure
            what = str(exc) if isinstance(exc, KVBridgeError) else (f"{self._ctx.backend_name} send_component raised "
                                                                    f"{type(exc).__name__}: {exc}")
            log.error("%s: room %d: posting a queued write failed: %s", self._ctx.name, room.room, what)
            self._fail(room, what)
            self._poster.drop(room)

    def _step(self, room: SendRoom, event: SendEvent) -> None:
        """The one place a send room changes state. An event the table does not allow raises in strict mode
        (tests) and otherwise fails the room naming the event and the state."""
        before = room.state
        room.state, illegal = SEND_ROOM.advance(before, event, f"{self._ctx.name} room {room.room}")
        if illegal:
            log.error("%s", illegal)
            self._fail(room, illegal)
            return
        if room.state is before:
            return
        for trace in room.traces.values():
            if room.state in (SendState.SUCCESS, SendState.FAILED):
                trace.end(room.reason if room.state is SendState.FAILED else "",
                          {"kvbridge.room_bytes": room.nbytes})
            else:
                trace.phase(room.state.value)
        if room.state in (SendState.SUCCESS, SendState.FAILED):
            room.traces.clear()
        events = self._ctx.events         # emitted with the transition, under the lock: poll() never sees it first
        if room.state is SendState.WAITING_FOR_INPUT:
            events.emit(room.room, RoomEventKind.READY)
        elif room.state is SendState.SUCCESS:
            events.emit(room.room, RoomEventKind.FINISHED)
        elif room.state is SendState.FAILING:
            events.emit(room.room, RoomEventKind.FAILED, room.reason)
        if room.state in SAFE_SEND:
            events.emit(room.room, RoomEventKind.SAFE_TO_REUSE)

    def _fail(self, room: SendRoom, reason: str) -> None:
        if room.state in (SendState.FAILING, SendState.FAILED, SendState.SUCCESS):
            self._step(room, SendEvent.FAIL)   # these keep their state (and the first reason)
            return
        room.reason = reason
        room.held.clear()                      # never posted: nothing of them was read or written
        self._step(room, SendEvent.FAIL)
        for agent in room.requests:
            peer = self._peers.get(agent)
            if peer is not None and peer.alive:
                self._peers.post(peer, StatusPush(room=room.room, agent=self._ctx.name, status=KVPoll.Failed,
                                                  reason=reason))
                room.must_confirm[agent] = (peer.address, peer.incarnation)   # Abort(quiesced) once drained
        self._active.add(room.room)
        if not room.busy:                      # nothing reads its pages: safe now, not at the next progress step
            self._step(room, SendEvent.DRAINED)

    def tick(self, now: float) -> None:
        if self._clear_when_settled:
            self._clear_settled()
        if now < self._next_timeouts:
            return
        self._next_timeouts = now + TICK_S
        timeout, lateness = self._ctx.config.bootstrap_timeout_s, self._ctx.lateness
        for room in self.rooms.values():        # timers count only time this rank ran (kvbridge.agent.lateness)
            if room.status is KVPoll.Bootstrapping and lateness.running(room.created, now, timeout) > timeout:
                self._fail(room, f"bootstrap timeout: {len(room.requests)} of {room.expected_requests or '?'} "
                                 f"decode requests after {timeout} s{lateness.unobserved(room.created, timeout)}")
        while self._early:                     # requests whose sender() never came: the decodes hear it
            room_id, (created, _) = next(iter(self._early.items()))
            if lateness.running(created, now, timeout) <= timeout:
                break
            why = f"no sender() for it on this prefill rank within {timeout} s"
            for req in self._unqueue(room_id):
                peer = self._peers.get(req.agent)
                if peer is not None and peer.alive:
                    self._refuse_late(peer, req, why)
            self._remember_abort(room_id, f"bootstrap timeout: the decode's request waited {timeout} s for sender()")

    def _peer_died(self, peer: Peer, reason: str) -> None:
        self._poster.unconfirmed.forget(peer.agent)
        owed = self._owed.setdefault((peer.agent, peer.incarnation), OrderedDict())
        for room in self.rooms.values():
            if peer.agent in room.requests:
                self._fail(room, reason)
                room.must_confirm.pop(peer.agent, None)
                if peer.state is PeerState.SILENT:      # it may only be slow: it must hear of the room later
                    owed[room.room] = (room.reason, room.requests[peer.agent].nonce)
                    while len(owed) > TOMBSTONES:
                        owed.popitem(last=False)
        if not owed or peer.state is not PeerState.SILENT:
            self._owed.pop((peer.agent, peer.incarnation), None)
        for room_id in list(self._early_by_agent.get(peer.agent, ())):
            self._unqueue(room_id, peer.agent)

    def _lease_reset(self, peer: Peer, reason: str) -> None:
        """Our write lease to ``peer`` ran out and a new one begins: its rooms fail (it hears of each), and so do
        the rooms its requests wait for whose sender() has not come yet: a request made under the old lease must
        never be written under the new one (the decode may have handed its pages to another room meanwhile)."""
        for room in self.rooms.values():
            if peer.agent in room.requests and room.incarnations.get(peer.agent) == peer.incarnation:
                self._fail(room, reason)
        for room_id in list(self._early_by_agent.get(peer.agent, ())):
            self._remember_abort(room_id, reason)

    def _peer_revived(self, peer: Peer) -> None:
        """A decode judged dead by silence spoke again: the rooms that failed meanwhile were never told to it
        (it waited its whole waiting timeout for them). A room still here is failed to it and acknowledged once
        its writes drained; a room already cleared gets its acknowledgement at once (nothing is in flight)."""
        for room_id, (reason, nonce) in self._owed.pop((peer.agent, peer.incarnation), {}).items():
            room = self.rooms.get(room_id)
            if room is not None and room.incarnations.get(peer.agent) == peer.incarnation:
                self._peers.post(peer, StatusPush(room=room_id, agent=self._ctx.name, status=KVPoll.Failed,
                                                  reason=reason))
                room.must_confirm[peer.agent] = (peer.address, peer.incarnation)
                self._active.add(room_id)
            elif room is None:
                self._peers.post(peer, Abort(room=room_id, agent=self._ctx.name, quiesced=True, reason=reason,
                                             nonce=nonce))

    def begin_drain(self, reason: str) -> None:
        """Refuse new rooms from now on; requests queued for rooms whose sender() never came fail at once."""
        self.draining = reason
        for room_id in list(self._early):
            for req in self._unqueue(room_id):
                peer = self._peers.get(req.agent)
                if peer is not None and peer.alive:
                    self._peers.post(peer, StatusPush(room=room_id, agent=self._ctx.name, status=KVPoll.Failed,
                                                      reason=f"prefill {self._ctx.name} is draining ({reason})"))

    @property
    def unconfirmed(self) -> int:
        """Notices the backend took that our Goodbye would send again (tests, diagnostics)."""
        return len(self._poster.unconfirmed)

    def resend_unconfirmed(self) -> int:
        """Before our Goodbye: send again over the control link every notice the backend took that a live decode
        may not have read yet (:mod:`kvbridge.agent.unconfirmed`); the link is ordered, so they arrive before
        the Goodbye. Returns how many frames went."""
        ctx, sent = self._ctx, 0
        for peer in list(self._peers.peers.values()):
            if not peer.alive:
                continue
            latest = ctx.codec.last_seq(peer.address)
            for frame in self._poster.unconfirmed.frames(peer.agent, peer.incarnation, latest):
                ctx.send_frame(peer.address, frame, "notice (again, before goodbye)")
                sent += 1
        return sent

    def unsettled(self) -> int:
        """Rooms not yet over: live, or with a write still reading our pages or an acknowledgement owed."""
        return sum(room.state not in (SendState.SUCCESS, SendState.FAILED) or room.busy or bool(room.must_confirm)
                   for room in self.rooms.values())

    def _refers_to(self, agent: str) -> bool:
        return any(agent in room.requests for room in self.rooms.values())


def _request_bytes(req: TransferRequest) -> int:
    """What an early request holds: its page ids' bytes, plus a fixed cost per request and component."""
    return sum(len(p.data) + 64 for p in req.indices.values()) + 256


def _validate_request(peer: Peer, req: TransferRequest) -> None:
    if (req.dst_rank, req.dst_size) != (peer.layout.tp_rank, peer.layout.tp_size):
        raise ProtocolError(f"request says decode rank {req.dst_rank}/{req.dst_size}, handshake said "
                            f"{peer.layout.tp_rank}/{peer.layout.tp_size}")
    names = set(peer.layout.component_names)
    if set(req.indices) != names:
        raise ProtocolError(f"request names components {sorted(req.indices)}, the pool has {sorted(names)}")
    for comp in peer.layout.components:
        check_indices(req.indices[comp.name].unpack(), comp.num_items, f"room {req.room} {comp.name} destination")
    _validate_staging(peer, req)


def _validate_staging(peer: Peer, req: TransferRequest) -> None:
    """Reservations must lie inside the staging area the decode registered (rings: a positive size)."""
    size = _staging_size(peer)
    names = set(peer.layout.component_names)
    for name in set(req.staging) | set(req.staging_bytes):
        if name not in names:
            raise ProtocolError(f"request reserves staging for {name!r}, the pool has {sorted(names)}")
        offsets, rings = req.staging.get(name, {}), req.staging_bytes.get(name, {})
        orphans = sorted(set(rings) - set(offsets))
        if orphans:
            raise ProtocolError(f"request gives {name} ring sizes for prefill ranks {orphans} without a reservation")
        for rank, offset in offsets.items():
            ring = rings.get(rank)
            if not 0 <= offset < size or (ring is not None and not 0 < ring <= size - offset):
                what = f"offset {offset}" + (f" and ring of {ring} B" if ring is not None else "")
                raise ProtocolError(f"request reserves {name} staging for prefill rank {rank} at {what}, outside "
                                    f"the {size} B staging area the decode registered")


def _staging_size(peer: Peer) -> int:
    """Bytes of the staging area the decode registered (0: none)."""
    area = next((b for b in peer.info.buffers if b.component == STAGING), None) if peer.info is not None else None
    return area.regions[0].nbytes if area is not None and area.regions else 0


def _end_traces(room: SendRoom, why: str) -> None:
    """End a room's spans that no transition will end (cleared or closed before SUCCESS/FAILED)."""
    for trace in room.traces.values():
        trace.end(room.reason or why, {"kvbridge.room_bytes": room.nbytes})
    room.traces.clear()

"""The decode side: receive rooms, requests to the prefill ranks, notices, coverage, fences.

A room succeeds only by coverage: for every component and every prefill rank the plan assigns to it,
every requested destination item was named by a notice of that rank, and every chunk up to the last
arrived. A room that failed is safe to reuse only once every writer acknowledged the abort after its
last write, or the backend proves the writer gone; silence proves nothing (a stopped process resumes).
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge import tracing
from kvbridge.agent.config import TICK_S
from kvbridge.agent.context import AgentContext, RoomTable, Tombstones
from kvbridge.agent.lateness import Since
from kvbridge.agent.peers import Dropped, Peer, PeerTable
from kvbridge.agent.plans import PlanCache, StagePlan
from kvbridge.errors import Draining, GeometryError, KVBridgeError, ProtocolError, TransferError
from kvbridge.geometry import IndexKind
from kvbridge.protocol.events import RoomEventKind
from kvbridge.protocol.states import (
    RECV_POLL,
    RECV_ROOM,
    RecvEvent,
    RecvState,
)
from kvbridge.protocol.wire import (
    Abort,
    Credit,
    Envelope,
    KVPoll,
    Notice,
    PackedIndices,
    StatusPush,
    TransferRequest,
)
from kvbridge.repaging import sub_pages
from kvbridge.staging import dest_index, scatter_rows, should_stage
from kvbridge.tracing import RoomTrace

log = logging.getLogger("kvbridge.agent")

Key = tuple[int, str]       # (prefill rank, component)


class Coverage:
    """Which (item, layer) cells of one (prefill rank, component) landed; a cell counts once, whatever the
    notices repeat or overlap. ``done``: items with every layer."""

    def __init__(self, items: int, layers: int, *, slack: int = 0, lead_slack: int = 0) -> None:
        self.items, self.layers = items, layers
        # items at the end (at the start) that may stay empty: padding past the request, tokens before a window,
        # in this rank's last (first) page when its pages are larger than the prefill's (kvbridge.repaging)
        self.slack, self.lead_slack = slack, lead_slack
        self.done = 0
        self._full = np.zeros(items, dtype=bool)
        self._cells: np.ndarray | None = None      # [items, layers], once a notice names only some layers

    def add(self, first: int, count: int, layers: range) -> None:
        if count <= 0:
            return
        block: np.ndarray
        if len(layers) == self.layers:
            block = np.ones(count, dtype=bool)
        else:
            if self._cells is None:
                self._cells = np.zeros((self.items, self.layers), dtype=bool)
            self._cells[first: first + count, layers.start: layers.stop] = True
            block = np.all(self._cells[first: first + count], axis=1, keepdims=False).astype(bool, copy=False)
        span = self._full[first: first + count]
        self.done += int(np.count_nonzero(block & ~span))
        span |= block

    @property
    def complete(self) -> bool:
        if self.done == self.items:
            return True
        if self.items - self.done > self.slack + self.lead_slack:
            return False
        held = np.flatnonzero(self._full)
        if not held.size:
            return False
        start, stop = int(held[0]), int(held[-1]) + 1
        return stop - start == held.size and start <= self.lead_slack and self.items - stop <= self.slack

    def missing_layers(self) -> list[int]:
        """Layers some item still lacks (every layer when nothing arrived layer-wise)."""
        if self._cells is None:
            return list(range(self.layers)) if self.done < self.items else []
        lacking = ~self._cells[~self._full]
        return np.flatnonzero(lacking.any(axis=0)).tolist()


@dataclass(slots=True, kw_only=True)
class Scatter:
    """A staged piece whose scatter was decided: queued as work (run after the agent lock's release), then on our
    CUDA stream until ``event`` completed (None: done on the host, or failed). It counts once finished."""

    key: Key
    notice: Notice
    event: Any = None
    keep: list[Any] = field(default_factory=list)
    ran: bool = False                          # the work ran (a CUDA scatter may still run on our stream)

    @property
    def finished(self) -> bool:
        return self.ran and (self.event is None or bool(self.event.query()))


@dataclass(slots=True, kw_only=True)
class RecvRoom:
    room: int
    instance: str
    created: Since                             # its bootstrap timer
    state: RecvState = RecvState.BOOTSTRAPPING    # changed only through ``RECV_ROOM`` (DecodeSide._step)
    reason: str = ""
    targets: dict[int, str] = field(default_factory=dict)            # prefill rank -> agent
    # agent -> its peer record when the room was bound: the one incarnation whose notices count and whose
    # acknowledgement fences the room (a replacement under the same name is another writer)
    writers: dict[str, Peer] = field(default_factory=dict)
    # agent -> the highest sequence number seen from its writer when the request went out: a frame numbered at
    # most this was made before the writer had the request (a late one of an earlier use of the room number)
    floor: dict[str, int] = field(default_factory=dict)
    expected: set[Key] = field(default_factory=set)
    arrived: dict[Key, set[int]] = field(default_factory=dict)       # notices seen (a scatter may still run)
    received: dict[Key, set[int]] = field(default_factory=dict)      # notices counted
    last_chunk: dict[Key, int] = field(default_factory=dict)
    covered: dict[Key, Coverage] = field(default_factory=dict)
    scattering: list[Scatter] = field(default_factory=list)
    quiesced: set[str] = field(default_factory=set)                  # prefill agents that can no longer write
    pending: tuple[dict[str, PackedIndices], int] | None = None      # metadata given while bootstrapping
    metadata_at: float | None = None
    tokens: int | None = None                                        # the request's length, when the engine gave it
    waiting: Since | None = None                                     # its waiting timer (from send_metadata)
    trace: RoomTrace | None = None                                   # its span (kvbridge.tracing), when traced
    failed_at: float | None = None                                   # when it failed (FENCING from then on)
    nbytes: int = 0
    indices: dict[str, np.ndarray] = field(default_factory=dict)
    # ``indices`` on our CUDA device (with the pinned copies they came from): uploaded by the first staged
    # piece of a component, sliced by the others (one upload a request, not one a piece)
    indices_on_device: dict[str, list[Any]] = field(default_factory=dict)   # component -> [its items on device]
    staged: dict[Key, tuple[int, int, StagePlan]] = field(default_factory=dict)     # reservation, layout
    rings: set[Key] = field(default_factory=set)       # reservations smaller than the slice: credits free slots
    nonce: int = field(default_factory=lambda: secrets.randbits(63))   # TransferRequest.nonce, in credits

    @property
    def status(self) -> KVPoll:
        """What the engine polls: a projection of ``state`` (fencing and fenced are both Failed)."""
        return RECV_POLL[self.state]


class DecodeSide(RoomTable[RecvRoom]):
    """Every receive room of a decode rank. It takes no lock: the engine-facing methods are called by the runtime's
    handles with the agent lock held, ``on_*`` and ``tick`` by the progress loop with it held."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache,
                 reconnect: Callable[[str], None]) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self._reconnect = reconnect
        self.rooms: dict[int, RecvRoom] = {}
        self._tombstones = Tombstones()
        self._waiting: set[int] = set()      # rooms bootstrapping until their instance is reachable again
        self._scattering: set[int] = set()   # rooms with a scatter running on our CUDA stream
        self._unsafe: set[int] = set()       # failed rooms whose writers have not all been fenced
        self._clear_when_safe: set[int] = set()   # rooms the engine let go before they were safe (cleared then)
        self._next_timeouts = 0.0
        self._next_fence = 0.0
        self.draining = ""                  # why new rooms are refused (TransferAgent.drain), "" when not
        peers.on_death(self._peer_died)
        peers.on_proven_gone(self._writer_proven_gone)
        peers.on_in_use(self._refers_to)

    # ---------------------------------------------------------------- engine-facing (Receiver; lock held)
    def open(self, room: int, instance: str) -> None:
        self._ctx.holding("open()")
        ctx = self._ctx
        if self.draining:
            raise Draining(f"{ctx.name} is draining ({self.draining}): no new rooms; route room {room} to "
                           "another decode instance")
        if instance not in self._peers.instances:
            raise KVBridgeError(f"not connected to prefill instance {instance!r}; call connect() first")
        if room in self.rooms:
            raise KVBridgeError(f"room {room} already has a receiver on {ctx.name}")
        self._tombstones.revive(room)
        state = self.rooms[room] = RecvRoom(room=room, instance=instance,
                                            created=self._ctx.lateness.since(self._ctx.now))
        state.trace = tracing.receive_trace(room=room, instance=instance, attributes={
            "kvbridge.agent": ctx.name, "kvbridge.role": "decode", "kvbridge.backend": ctx.backend_name,
            "kvbridge.tp_rank": ctx.layout.tp_rank, "kvbridge.tp_size": ctx.layout.tp_size,
            "kvbridge.instance": instance})
        if not self._bind_targets(state):
            self._waiting.add(room)           # a prefill rank is gone: reconnect, the room waits
            self._reconnect(instance)

    def _bind_targets(self, room: RecvRoom) -> bool:
        """Take the instance's current ranks if every one is alive; then the room waits for metadata."""
        targets = self._peers.instances.get(room.instance) or {}
        peers = [self._peers.get(agent) for agent in targets.values()]
        if not targets or any(p is None or not p.alive for p in peers):
            return False
        room.targets = dict(targets)
        room.writers = {agent: peer for agent, peer in zip(targets.values(), peers) if peer is not None}
        self._step(room, RecvEvent.TARGETS_BOUND)
        if room.pending is not None:
            indices, prefix_len = room.pending
            room.pending = None
            self._request(room, indices, prefix_len)
        return True

    def nbytes(self, room: int) -> int:
        return self.get(room).nbytes

    def send_metadata(self, room: int, indices: Mapping[str, PackedIndices], prefix_len: int,
                      tokens: int | None = None) -> None:
        self._ctx.holding("send_metadata()")
        if tokens is not None:
            self._check_length(room, indices, prefix_len, tokens)
        state = self.get(room)
        if state.status is KVPoll.Failed:
            raise TransferError(room, state.reason)
        if state.metadata_at is not None or state.pending is not None:
            raise KVBridgeError(f"room {room}: send_metadata() was already called")
        state.tokens = tokens
        if state.status is KVPoll.Bootstrapping:
            state.pending = (dict(indices), prefix_len)     # sent once the prefill ranks are back
            return
        self._request(state, indices, prefix_len)

    def _check_length(self, room: int, indices: Mapping[str, PackedIndices], prefix_len: int, tokens: int) -> None:
        """The request's length given: each chunked paged component must list exactly the pages from the one
        holding the prefix end to the one holding the last token (with pages of another size than the prefill's,
        no other check can tell a missing or extra page from padding)."""
        layout = self._ctx.layout
        if tokens < 0 or prefix_len > tokens:
            raise GeometryError(f"room {room}: a {tokens}-token request cannot have a prefix of {prefix_len} tokens")
        want = max(-(-tokens // layout.page_size) - prefix_len // layout.page_size, 0)
        for comp, st in zip(layout.components, self._ctx.state_types):
            if st.chunked and comp.index_kind is IndexKind.PAGE and comp.name in indices:
                got = len(indices[comp.name].unpack())
                if got != want:
                    raise GeometryError(f"room {room} {comp.name}: {got} pages listed, a {tokens}-token request "
                                        f"whose first {prefix_len} are held here needs {want} of "
                                        f"{layout.page_size} tokens")

    def abort(self, room: int, reason: str) -> None:
        self._ctx.holding("abort()")
        self._fail(self.get(room), reason)

    def safe_to_reuse(self, room: int) -> bool:
        """True when no write into the room's destination items can still happen: the room succeeded,
        nothing was ever requested, or every writer is fenced (acknowledged, or proven gone)."""
        state = self.get(room)
        if state.scattering:
            return False                         # a scatter still writes into the room's items
        return state.state in (RecvState.SUCCESS, RecvState.FAILED)     # FENCING: a writer may still write

    def clear(self, room: int, safe: bool) -> None:
        """Forget the room. Its staging reservations are freed only when ``safe`` (no write can land)."""
        self._ctx.holding("clear()")
        ctx = self._ctx
        state = self.rooms.pop(room, None)
        self._waiting.discard(room)
        self._unsafe.discard(room)
        self._clear_when_safe.discard(room)
        ctx.events.forget(room)
        if state is not None:
            end_trace(state, "cleared by the engine before it ended")
            if safe:
                self._release_staging(state)
            elif state.staged:
                log.warning("%s: room %d cleared before its senders confirmed quiescence; keeping its staging "
                            "reservations", ctx.name, room)
        self._tombstones.bury(room)

    def clear_when_safe(self, room: int) -> None:
        """The engine lets the room go: a room not over fails, and it is cleared now if it is safe to reuse, else by
        the progress step once it is (its staging reservations are freed then, not kept for good as by ``clear()``
        before it is safe); its events stop now."""
        self._ctx.holding("clear_when_safe()")
        state = self.rooms.get(room)
        if state is None:
            return
        # the engine wants nothing more of it: a live room fails now (its writers are told to stop; one that asked
        # nothing is safe at once) instead of waiting for a timeout that may never come (no metadata: none does)
        self._fail(state, "let go by the engine before it ended")
        if self.safe_to_reuse(room):
            self.clear(room, True)
            return
        self._clear_when_safe.add(room)
        self._ctx.events.mute(room)

    def _clear_safe(self) -> None:
        """Clear the rooms the engine let go that are safe now (progress step; a few rooms at most)."""
        for room_id in list(self._clear_when_safe):
            if room_id not in self.rooms or self.safe_to_reuse(room_id):
                self._clear_when_safe.discard(room_id)
                if room_id in self.rooms:
                    self.clear(room_id, True)

    # ---------------------------------------------------------------- requests (lock held)
    def _request(self, room: RecvRoom, indices: Mapping[str, PackedIndices], prefix_len: int) -> None:
        ctx = self._ctx
        replaced = sorted(agent for agent, peer in room.writers.items() if self._peers.get(agent) is not peer)
        if replaced:        # bound to an incarnation that restarted since: it cannot serve this room
            self._fail(room, f"prefill {replaced[0]} restarted or left before the request was sent")
            return
        peers = {rank: room.writers[agent] for rank, agent in room.targets.items()}
        src_layout = next(iter(peers.values())).layout
        staging_area = ctx.buffers.staging
        staging: dict[str, dict[int, int]] = {}
        rings: dict[str, dict[int, int]] = {}
        mode = ctx.config.staging
        if len({p.layout.page_size for p in peers.values()}) > 1:
            self._fail(room, f"the prefill ranks of {room.instance!r} use different page sizes "
                             f"{sorted({p.layout.page_size for p in peers.values()})}")
            return
        some = next(iter(peers.values()))
        rp = self._plans.repaging(some)
        for comp_index, comp in enumerate(ctx.layout.components):
            dst_items = indices[comp.name].unpack()
            factor = self._plans.factor(some, comp_index)
            if factor > 1:                      # pages of another size than the prefill's: sub-pages
                dst_items = sub_pages(dst_items, factor)
            room.indices[comp.name] = dst_items
            n_items = len(dst_items)
            layers = self._plans.layers(comp_index).num_layers
            for rank, peer in peers.items():
                segs = self._plans.slice_for(peer, comp_index)
                if segs.is_empty:
                    continue
                key = (rank, comp.name)
                room.expected.add(key)
                chunked = ctx.state_types[comp_index].chunked
                slack = factor - 1
                if chunked and rp is not None and room.tokens is not None:     # exactly the padding past the end
                    start = prefix_len // ctx.layout.page_size * ctx.layout.page_size
                    slack = max(n_items - (-(-(room.tokens - start) // rp.granule)), 0)
                room.covered[key] = Coverage(n_items, layers, slack=slack, lead_slack=0 if chunked else factor - 1)
                if rp is not None and ctx.state_types[comp_index].chunked and comp.index_kind is IndexKind.PAGE:
                    # the sub-pages before the prefill's first page: cached here (they hold the prefix)
                    lead = rp.lead(prefix_len, prefill=src_layout.page_size, decode=ctx.layout.page_size)
                    room.covered[key].add(0, min(max(lead, 0), n_items), range(layers))
                plan = self._plans.stage_plan_for(peer, comp_index, segs, src_layout, ctx.layout)
                if (plan is not None and staging_area is not None and n_items
                        and should_stage(plan.rows, dst_items, mode=mode, below_bytes=self._plans.stage_below_bytes())):
                    whole = plan.per_item * n_items
                    found = _reserve(staging_area, whole, plan, ctx.config.staging_piece_bytes,
                                     len(peers) - list(peers).index(rank))
                    if found is not None:            # none: plain descriptors for this one
                        offset, nbytes = found
                        staging.setdefault(comp.name, {})[rank] = offset
                        room.staged[key] = (offset, nbytes, plan)
                        if nbytes < whole:
                            rings.setdefault(comp.name, {})[rank] = nbytes
                            room.rings.add(key)
        request = TransferRequest(room=room.room, agent=ctx.name, dst_rank=ctx.layout.tp_rank,
                                  dst_size=ctx.layout.tp_size, indices=dict(indices), prefix_len=prefix_len,
                                  staging=staging, staging_bytes=rings, digests=ctx.config.checksums,
                                  nonce=room.nonce, trace=room.trace.traceparent() if room.trace is not None else "",
                                  tokens=room.tokens or 0)
        room.metadata_at = self._ctx.now
        room.waiting = self._ctx.lateness.since(room.metadata_at)
        if room.trace is not None:
            room.trace.event("request", {"kvbridge.prefill_ranks": len(peers), "kvbridge.prefix_len": prefix_len,
                                         "kvbridge.staged_components": len(staging)})
        for peer in peers.values():
            room.floor[peer.agent] = self._peers.seen_up_to(peer.agent, peer.incarnation)
            self._peers.post(peer, request)
        self._check_done(room)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_notice(self, notice: Notice, env: Envelope) -> None:
        room = self.rooms.get(notice.room)
        if room is None or room.status in (KVPoll.Failed, KVPoll.Success):
            log.debug("%s: dropped notice %s (room %s)", self._ctx.name, notice, room and room.status)
            return  # late or duplicate for a finished, failed or cleared room
        if room.targets.get(notice.sender) != env.sender or not self._from_writer(room, env):
            raise Dropped(f"notice for room {notice.room} rank {notice.sender} from {env.sender!r} (incarnation "
                          f"{env.incarnation:#x}), which is not that rank of the room")
        _after_request(room, env, "notice")
        key = (notice.sender, notice.component)
        if key not in room.expected:
            log.warning("%s: room %d: unexpected notice from rank %d for %s", self._ctx.name, notice.room,
                        notice.sender, notice.component)
            return
        seen = room.arrived.setdefault(key, set())
        if notice.chunk in seen:
            return
        covered = room.covered[key]
        first, count = notice.first, notice.count
        layers = _layers_of(notice, covered.layers)
        if first + count > covered.items:
            self._fail(room, f"prefill rank {notice.sender} announced {notice.component} items [{first}, "
                             f"{first + count}) of a request for {covered.items}")
            return
        if layers is None:
            self._fail(room, f"prefill rank {notice.sender} announced {notice.component} layers "
                             f"[{notice.layer_first}, {notice.layer_first + notice.layer_count}) of a component "
                             f"with {covered.layers}")
            return
        busy = self._slot_in_use(room, key, notice, layers) if notice.staged and key in room.rings else None
        if busy is not None:
            self._fail(room, f"prefill rank {notice.sender} wrote {notice.component} piece {notice.chunk} into the "
                             f"ring slot of piece {busy}, whose scatter had not finished (no credit was sent)")
            return
        try:
            work = self._scatter(room, notice, layers) if notice.staged else None
        except ProtocolError as exc:           # a piece outside the reservation: this room cannot complete
            self._fail(room, str(exc))
            return
        seen.add(notice.chunk)
        if room.trace is not None:
            room.trace.event("notice", {"kvbridge.prefill_rank": notice.sender, "kvbridge.component": notice.component,
                                        "kvbridge.chunk": notice.chunk, "kvbridge.items": notice.count,
                                        "kvbridge.staged": notice.staged})
            if work is not None:
                room.trace.start(("scatter", key, notice.chunk), "scatter", {
                    "kvbridge.prefill_rank": notice.sender, "kvbridge.component": notice.component,
                    "kvbridge.chunk": notice.chunk})
        self._step(room, RecvEvent.NOTICE)
        if work is not None:                   # counted (and its ring slot credited) once the scatter finished
            item = Scatter(key=key, notice=notice)
            room.scattering.append(item)
            self._scattering.add(room.room)
            self._ctx.work("scatter", work, functools.partial(self._scattered, room.room, item))
            return
        self._count(room, key, notice, layers)

    def _verified(self, room: RecvRoom, notice: Notice, layers: range) -> bool:
        """Check the landed bytes of a notice against its digests; a mismatch (or none sent) fails the room
        naming the component, the buffer and the destination page."""
        ctx = self._ctx
        agent = room.targets[notice.sender]
        peer = self._peers.get(agent)
        comp_index = ctx.layout.component_names.index(notice.component)
        comp = ctx.layout.components[comp_index]
        items = room.indices[notice.component][notice.first: notice.first + notice.count]
        if peer is None:
            return False
        buffers = self._plans.sliced_buffers(peer, comp_index, layers)
        expected = len(buffers) * len(items)
        if len(notice.digests) != 8 * expected:
            self._fail(room, f"prefill rank {notice.sender} sent {len(notice.digests)} B of digests for "
                             f"{notice.component} chunk {notice.chunk}; {len(buffers)} buffers x {len(items)} items "
                             f"landed, {8 * expected} B expected")
            return False
        want = np.frombuffer(notice.digests, dtype="<u8")
        factor = self._plans.factor(peer, comp_index)        # items are sub-pages when the page sizes differ
        if not buffers:
            return True
        got = self._plans.digests(peer, comp_index, buffers, items, "dst")
        if got is None:
            self._fail(room, f"checksums asked for, but {notice.component} buffer {comp.buffers[buffers[0]].name} has "
                             "no host-readable view on this rank")
            return False
        for k, b in enumerate(buffers):
            span = slice(k * len(items), (k + 1) * len(items))
            bad = np.flatnonzero(got[span] != want[span])
            if bad.size:
                self._fail(room, f"checksum mismatch: {notice.component} buffer {comp.buffers[b].name} "
                                 f"destination page {int(items[bad[0]]) // factor} ({bad.size} of {len(items)} items "
                                 "differ) "
                                 f"from prefill rank {notice.sender}, chunk {notice.chunk}")
                return False
        return True

    def _slot_in_use(self, room: RecvRoom, key: Key, notice: Notice, layers: range) -> int | None:
        """The chunk of a piece still being scattered from the bytes this staged notice's piece overwrote."""
        plan = room.staged[key][2]
        lo, hi = notice.offset, notice.offset + notice.count * plan.span(layers)
        for item in room.scattering:
            other = item.notice
            if item.key != key:
                continue
            o_layers = _layers_of(other, room.covered[key].layers) or range(0)
            o_lo = other.offset
            if lo < o_lo + other.count * plan.span(o_layers) and o_lo < hi:
                return other.chunk
        return None

    def _credit(self, room: RecvRoom, notice: Notice) -> None:
        """Tell the prefill rank that a staged piece left its ring slot."""
        agent = room.targets.get(notice.sender)
        peer = room.writers.get(agent) if agent is not None else None
        if peer is not None and peer.alive and self._peers.get(peer.agent) is peer:
            self._peers.post(peer, Credit(room=room.room, agent=self._ctx.name, component=notice.component,
                                          chunk=notice.chunk, nonce=room.nonce))

    def _count(self, room: RecvRoom, key: Key, notice: Notice, layers: range) -> None:
        """A notice's bytes sit in their items: cover them, and see whether the room is complete."""
        if self._ctx.config.checksums and notice.count:
            verified = self._verified(room, notice, layers)
            if room.trace is not None:
                room.trace.event("checksums verified" if verified else "checksums failed", {
                    "kvbridge.prefill_rank": notice.sender, "kvbridge.component": notice.component,
                    "kvbridge.chunk": notice.chunk})
            if not verified:
                return
        room.received.setdefault(key, set()).add(notice.chunk)
        room.covered[key].add(notice.first, notice.count, layers)
        room.nbytes += notice.nbytes
        if notice.last:
            room.last_chunk[key] = notice.chunk
        self._check_done(room)

    def on_status(self, push: StatusPush, env: Envelope) -> None:
        room = self.rooms.get(push.room)
        if room is None:
            return
        if push.agent != env.sender or not self._from_writer(room, env):
            raise Dropped(f"status of room {push.room} from {env.sender!r} naming {push.agent!r} (incarnation "
                          f"{env.incarnation:#x}), which is not a writer of the room")
        _after_request(room, env, "status")
        if push.status is KVPoll.Failed:
            self._fail(room, f"prefill {push.agent} failed the room: {push.reason}")

    def on_abort(self, abort: Abort, env: Envelope) -> None:
        room = self.rooms.get(abort.room)
        if room is None:
            return
        if abort.agent != env.sender or not self._from_writer(room, env):
            # an acknowledgement counts only from the incarnation the request went to: a replacement under
            # the same name never wrote here and cannot vouch for the old writer
            raise Dropped(f"abort of room {abort.room} from {env.sender!r} naming {abort.agent!r} (incarnation "
                          f"{env.incarnation:#x}), which is not a writer of the room")
        _after_request(room, env, "abort")
        if env.version >= 7 and abort.nonce != room.nonce:
            # a late answer about an earlier request that used this room number (a retry): it says nothing of
            # this request's writes, so it neither fails nor fences the room (protocols 5 and 6 name no request)
            raise Dropped(f"abort of room {abort.room} from {abort.agent!r} names another request of that room (an "
                          "earlier one that used the same number)")
        if abort.quiesced:
            room.quiesced.add(abort.agent)
        self._fail(room, f"aborted by prefill {abort.agent}: {abort.reason}")
        self._fenced_if_quiet(room)

    @staticmethod
    def _from_writer(room: RecvRoom, env: Envelope) -> bool:
        writer = room.writers.get(env.sender)
        return writer is not None and writer.incarnation == env.incarnation

    def _scatter(self, room: RecvRoom, notice: Notice, layers: range) -> Callable[[], tuple[Any, list[Any]]]:
        """The work that moves a staged piece from our staging area into its items, validated against the reservation
        now (under the lock); run after the lock's release: a host copy (gives ``(None, [])``), or a launch on our
        CUDA stream (gives its event and the tensors it reads)."""
        ctx = self._ctx
        reserved = room.staged.get((notice.sender, notice.component))
        dst = room.indices.get(notice.component)
        staging = ctx.buffers.staging
        if reserved is None or dst is None or staging is None:
            raise ProtocolError(f"room {room.room}: staged notice from rank {notice.sender} for {notice.component}, "
                                "which has no staging reservation")
        offset, nbytes, plan = reserved
        size = notice.count * plan.span(layers)
        if notice.first + notice.count > len(dst) or notice.offset < 0 or notice.offset + size > nbytes:
            raise ProtocolError(f"room {room.room}: staged piece [{notice.first}, +{notice.count}) x layers "
                                f"[{layers.start}, {layers.stop}) at {notice.offset} is outside the {nbytes} B "
                                "reserved")
        first, count = notice.first, notice.count
        items = dst[first: first + count]
        stager = ctx.buffers.stager() if ctx.buffers.is_cuda(notice.component) else None
        batched = ctx.buffers.batched(notice.component, plan.layers.buffers(layers), plan.uniform, "dst")
        if stager is not None and batched is not None:     # one kernel for every buffer of the piece
            # the room's items on the device, uploaded by its first scatter (works run one at a time, in order)
            holder = room.indices_on_device.setdefault(notice.component, [])
            staged = staging.view(offset + notice.offset, 1, size).view(-1)

            def batched_scatter() -> tuple[Any, list[Any]]:
                if not holder:
                    holder.append(stager.to_device(dst))
                uploaded = holder[0]
                where = uploaded[0][first: first + count]
                return stager.run(lambda: batched.scatter(where, staged)), [uploaded, batched]

            return batched_scatter
        views = ctx.buffers.views[notice.component]
        parts, cursor = [], offset + notice.offset
        for b in plan.layers.buffers(layers):
            r = plan.rows[b]
            parts.append((views[b], r, staging.view(cursor, count, r.nbytes)))
            cursor += count * r.nbytes
        if stager is None:
            def host_scatter() -> tuple[Any, list[Any]]:
                for view, r, part in parts:
                    scatter_rows(view, r, items, part)
                return None, []

            return host_scatter

        def indexed_scatter() -> tuple[Any, list[Any]]:
            indices: dict[tuple[bool, int], Any] = {}
            for _view, r, _part in parts:
                if (r.dst_contiguous, r.rows) not in indices:
                    indices[r.dst_contiguous, r.rows] = stager.to_device(dest_index(r, items))

            def work() -> None:
                for view, r, part in parts:
                    scatter_rows(view, r, items, part, index=indices[r.dst_contiguous, r.rows][0])

            return stager.run(work), list(indices.values())

        return indexed_scatter

    def _scattered(self, room_id: int, item: Scatter, result: Any, error: BaseException | None) -> None:
        """A scatter's work ran (lock held): count it now when it is done (host), or once its event fired."""
        item.ran = True
        room = self.rooms.get(room_id)
        if error is not None:
            if room is not None:
                self._fail(room, f"the scatter of {item.notice.component} piece {item.notice.chunk} from prefill rank "
                                 f"{item.notice.sender} raised {type(error).__name__}: {error}")
        else:
            item.event, item.keep = result
        self.poll_scatters()

    @property
    def queued_work(self) -> bool:
        """A scatter runs on our CUDA stream: its piece counts when the progress loop next looks."""
        return bool(self._scattering)

    def poll_scatters(self) -> None:
        """Count the staged pieces whose scatter finished (on the host, or on our CUDA stream; called by the progress
        loop and when a scatter's work ran)."""
        for room_id in list(self._scattering):
            room = self.rooms.get(room_id)
            if room is None:
                self._scattering.discard(room_id)
                continue
            was_over = room.state in (RecvState.SUCCESS, RecvState.FAILED)   # else a transition below announces it
            finished = [item.finished for item in room.scattering]
            done = [item for item, f in zip(room.scattering, finished) if f]
            room.scattering = [item for item, f in zip(room.scattering, finished) if not f]
            for item in done:
                if room.trace is not None:
                    room.trace.finish(("scatter", item.key, item.notice.chunk))
                if item.key in room.rings and room.status is not KVPoll.Failed:
                    self._credit(room, item.notice)
            if room.status not in (KVPoll.Failed, KVPoll.Success):
                for item in done:
                    layers = _layers_of(item.notice, room.covered[item.key].layers)
                    assert layers is not None                     # checked when the notice arrived
                    self._count(room, item.key, item.notice, layers)
            if not room.scattering:
                self._scattering.discard(room_id)
                if was_over and room.state in (RecvState.SUCCESS, RecvState.FAILED):
                    self._ctx.events.emit(room.room, RoomEventKind.SAFE_TO_REUSE)

    def _release_staging(self, room: RecvRoom) -> None:
        staging = self._ctx.buffers.staging
        if staging is not None:
            for offset, nbytes, _ in room.staged.values():
                staging.free(offset, nbytes)
        room.staged.clear()

    # ---------------------------------------------------------------- completion and failure (lock held)
    @staticmethod
    def _all_chunks(room: RecvRoom, key: Key) -> bool:
        """Were the notice marked last and every notice numbered before it counted?"""
        last = room.last_chunk.get(key)
        if last is None:
            return False
        received = room.received.get(key, set())
        return len(received) == last + 1 and max(received) == last

    def _delivered(self, room: RecvRoom, rank: int) -> bool:
        return all(self._all_chunks(room, key) and room.covered[key].complete
                   for key in room.expected if key[0] == rank)

    def _check_done(self, room: RecvRoom) -> None:
        if room.status is KVPoll.Failed or room.metadata_at is None:
            return
        short = [key for key in room.expected if self._all_chunks(room, key) and not room.covered[key].complete]
        if short:
            rank, comp = short[0]
            cov = room.covered[(rank, comp)]
            lacking = cov.missing_layers()
            layers = (f" (layers {lacking} missing)" if cov.layers > 1 and 0 < len(lacking) < cov.layers else "")
            self._fail(room, f"prefill rank {rank} sent {cov.done} of {cov.items} {comp} items{layers}")
            return
        if not room.scattering and all(self._delivered(room, rank) for rank in room.targets):
            self._step(room, RecvEvent.COVERED)

    def _step(self, room: RecvRoom, event: RecvEvent) -> None:
        """The one place a receive room changes state. An event the table does not allow raises in strict
        mode (tests) and otherwise fails the room naming the event and the state."""
        before = room.state
        room.state, illegal = RECV_ROOM.advance(before, event, f"{self._ctx.name} room {room.room}")
        if illegal:
            log.error("%s", illegal)
            self._fail(room, illegal)
            return
        if room.state is before:
            return
        if room.trace is not None:
            if room.state in (RecvState.SUCCESS, RecvState.FAILED):
                room.trace.end(room.reason if room.state is RecvState.FAILED else "", {"kvbridge.bytes": room.nbytes})
                room.trace = None
            else:
                room.trace.phase(room.state.value)
        events = self._ctx.events
        if room.state is RecvState.SUCCESS:
            events.emit(room.room, RoomEventKind.FINISHED)
        elif room.state in (RecvState.FENCING, RecvState.FAILED) and before is not RecvState.FENCING:
            events.emit(room.room, RoomEventKind.FAILED, room.reason)
        if room.state in (RecvState.SUCCESS, RecvState.FAILED) and not room.scattering:
            events.emit(room.room, RoomEventKind.SAFE_TO_REUSE)

    def end_traces(self, reason: str) -> None:
        """End the span of every room still traced (the agent closes; call under the lock)."""
        for room in self.rooms.values():
            end_trace(room, reason)

    def _fail(self, room: RecvRoom, reason: str) -> None:
        """Fail a room; every writer not yet fenced is asked to stop and acknowledge."""
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return                                   # the table keeps these (and the first reason)
        room.reason = reason
        room.failed_at = self._ctx.now
        self._waiting.discard(room.room)
        if room.metadata_at is None:                 # nothing was ever asked of the senders
            self._step(room, RecvEvent.FAIL_FENCED)
            return
        self._step(room, RecvEvent.FAIL)
        self._unsafe.add(room.room)
        self._fence(room, reason)

    def _fenced_if_quiet(self, room: RecvRoom) -> None:
        """A failing room whose every writer is fenced (acknowledged, or proven gone) becomes safe."""
        if room.state is RecvState.FENCING and set(room.targets.values()) <= room.quiesced:
            self._step(room, RecvEvent.FENCED)
            self._unsafe.discard(room.room)

    def _fence(self, room: RecvRoom, reason: str) -> None:
        ctx = self._ctx
        for agent in room.targets.values():
            if agent in room.quiesced:
                continue
            peer = room.writers.get(agent)
            if peer is None:
                continue
            if not peer.alive and self._peers.writer_gone(peer):
                room.quiesced.add(agent)
                continue
            if self._peers.get(agent) is peer:     # a replaced incarnation: only its exit (or the engine) fences
                self._peers.post(peer, Abort(room=room.room, agent=ctx.name, reason=reason, nonce=room.nonce))
        self._fenced_if_quiet(room)

    def tick(self, now: float) -> None:
        if self._scattering:
            self.poll_scatters()
        if self._clear_when_safe:
            self._clear_safe()
        if now >= self._next_fence and self._unsafe:     # writers not fenced yet: ask again
            self._next_fence = now + self._ctx.config.heartbeat_interval_s
            for room_id in list(self._unsafe):
                room = self.rooms.get(room_id)
                if room is None:
                    self._unsafe.discard(room_id)
                else:
                    self._fence(room, room.reason)
        for room_id in list(self._waiting):
            room = self.rooms[room_id]
            if self._bind_targets(room):
                self._waiting.discard(room_id)
        if now < self._next_timeouts:
            return
        self._next_timeouts = now + TICK_S
        cfg, lateness = self._ctx.config, self._ctx.lateness
        for room in self.rooms.values():        # timers count only time this rank ran (kvbridge.agent.lateness)
            bootstrap, waiting = cfg.bootstrap_timeout_s, cfg.waiting_timeout_s
            if room.status is KVPoll.Bootstrapping and lateness.running(room.created, now, bootstrap) > bootstrap:
                self._fail(room, f"bootstrap timeout: prefill instance {room.instance!r} not reachable after "
                                 f"{bootstrap} s{lateness.unobserved(room.created, bootstrap)}")
            elif (room.status in (KVPoll.WaitingForInput, KVPoll.Transferring) and room.waiting is not None
                    and lateness.running(room.waiting, now, waiting) > waiting):
                self._fail(room, f"waiting timeout: no complete transfer after {waiting} s"
                                 f"{lateness.unobserved(room.waiting, waiting)}")

    def _writer_proven_gone(self, peer: Peer) -> None:
        """The backend proved a dead writer can write no more: fence the unsafe rooms it wrote to again."""
        for room_id in list(self._unsafe):
            room = self.rooms.get(room_id)
            if room is not None and room.writers.get(peer.agent) is peer:
                self._fence(room, room.reason)

    def _peer_died(self, peer: Peer, reason: str) -> None:
        gone = self._peers.writer_gone(peer)
        for room in self.rooms.values():
            ranks = [rank for rank, agent in room.targets.items() if agent == peer.agent]
            if room.writers and room.writers.get(peer.agent) is not peer:
                continue                       # another incarnation of that name: not this room's writer
            if not ranks:
                continue
            if gone:
                room.quiesced.add(peer.agent)
            if room.metadata_at is None or not all(self._delivered(room, r) for r in ranks):
                self._fail(room, reason)
            self._fenced_if_quiet(room)

    def overdue_fences(self, now: float) -> int:
        """Failed rooms still not safe to reuse longer than the peer timeout after they failed: a writer that
        neither acknowledged nor was proven gone (a partition, a dead host: the engine's declare_gone is due)."""
        limit = self._ctx.config.peer_timeout_s
        return sum(room.state is RecvState.FENCING and room.failed_at is not None and now - room.failed_at > limit
                   for room in self.rooms.values())

    def unsettled(self) -> int:
        """Rooms not yet over: live, fencing, or with a scatter still writing into their items."""
        return sum(room.state not in (RecvState.SUCCESS, RecvState.FAILED) or bool(room.scattering)
                   for room in self.rooms.values())

    def _refers_to(self, agent: str) -> bool:
        return any(agent in room.targets.values() and (room.room in self._unsafe or room.status is not KVPoll.Failed)
                   for room in self.rooms.values())


def _after_request(room: RecvRoom, env: Envelope, what: str) -> None:
    """A writer's frame about a room counts only if made after the writer could have had the room's request: one
    numbered at or below the room's floor is about an earlier request of that room number (a backend's notice
    delivered late, once the engine retried the room), and would count that request's bytes for this one."""
    floor = room.floor.get(env.sender, 0)
    if env.seq <= floor:
        raise Dropped(f"{what} for room {room.room} from {env.sender!r} (sequence {env.seq}) was sent before this "
                      f"request reached it (sequence {floor} had come): it is about an earlier request of that "
                      "room number")


def _layers_of(notice: Notice, layers: int) -> range | None:
    """The layers a notice completes (``layer_count == 0``: all), None when outside the component's."""
    if notice.layer_count == 0:
        return range(0, layers)
    stop = notice.layer_first + notice.layer_count
    return range(notice.layer_first, stop) if stop <= layers else None


def _reserve(area: Any, whole: int, plan: StagePlan, piece_bytes: int, share: int) -> tuple[int, int] | None:
    """Staging space for one (prefill rank, component) slice: all of it when it fits in its fair share (the
    free space over the ``share`` slices of the request still to place), else a ring of up to four pieces (no
    more than that share), then of two, that the sender reuses as credits come back; (offset, bytes) or None
    when nothing fits. A ring holds at least two items of the largest layer (a piece is never smaller than one).
    The share keeps the first slice of a TP 2 -> 1 request from taking the whole area and sending the second
    to per-token descriptors (64 MiB requests over the default 32 MiB area: 0.21 GB/s on 2x H200)."""
    fair = area.free_bytes // max(1, share) // 64 * 64
    if whole <= fair and (offset := area.alloc(whole)) is not None:
        return offset, whole
    least = 2 * max(plan.layer_bytes, default=1)
    piece = max(min(piece_bytes, whole), least)
    for size in (min(4 * piece, max(fair, 2 * least)), 2 * least):
        if size < whole and (offset := area.alloc(size)) is not None:
            return offset, size
    offset = area.alloc(whole)          # no ring fits: all of it, where it fits at all, still beats descriptors
    return None if offset is None else (offset, whole)


def end_trace(room: RecvRoom, why: str) -> None:
    """End a room's span that no transition will end (cleared or closed before SUCCESS/FAILED): ERROR with the
    room's reason when it failed, else ``why``."""
    if room.trace is not None:
        room.trace.end(room.reason or why, {"kvbridge.bytes": room.nbytes})
        room.trace = None

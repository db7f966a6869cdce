"""The decode side: receive rooms, requests to the prefill ranks, notices, coverage, fences.

A room succeeds only by coverage: for every component and every prefill rank the plan assigns to it,
every requested destination item was named by a notice of that rank, and every chunk up to the last
arrived. A room that failed is safe to reuse only once every writer acknowledged the abort after its
last write, or the backend proves the writer gone; silence proves nothing (a stopped process resumes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.agent.config import TICK_S
from kvbridge.agent.context import AgentContext, RoomTable, Tombstones
from kvbridge.agent.peers import Dropped, Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.errors import KVBridgeError, ProtocolError, TransferError
from kvbridge.staging import Rows, page_layout, scatter, synchronize
from kvbridge.wire import Abort, Envelope, KVPoll, Notice, PackedIndices, StatusPush, TransferRequest

log = logging.getLogger("kvbridge.agent")

Key = tuple[int, str]       # (prefill rank, component)


@dataclass(slots=True, kw_only=True)
class RecvRoom:
    room: int
    instance: str
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    targets: dict[int, str] = field(default_factory=dict)            # prefill rank -> agent
    expected: set[Key] = field(default_factory=set)
    chunked: set[str] = field(default_factory=set)
    received: dict[Key, set[int]] = field(default_factory=dict)
    last_chunk: dict[Key, int] = field(default_factory=dict)
    covered: dict[Key, np.ndarray] = field(default_factory=dict)     # bool per requested item
    covered_count: dict[Key, int] = field(default_factory=dict)
    quiesced: set[str] = field(default_factory=set)                  # prefill agents that can no longer write
    pending: tuple[dict[str, PackedIndices], int] | None = None      # metadata given while bootstrapping
    metadata_at: float | None = None
    nbytes: int = 0
    indices: dict[str, np.ndarray] = field(default_factory=dict)
    staged: dict[Key, tuple[int, int, tuple[Rows, ...]]] = field(default_factory=dict)


class DecodeSide(RoomTable[RecvRoom]):
    """Every receive room of a decode rank. Public methods take the agent lock themselves; ``on_*`` and
    ``tick`` are called by the progress loop with the lock held."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache,
                 reconnect: Callable[[str], None]) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self._reconnect = reconnect
        self.rooms: dict[int, RecvRoom] = {}
        self._tombstones = Tombstones()
        self._waiting: set[int] = set()      # rooms bootstrapping until their instance is reachable again
        self._unsafe: set[int] = set()       # failed rooms whose writers have not all been fenced
        self._next_timeouts = 0.0
        self._next_fence = 0.0
        peers.on_death(self._peer_died)
        peers.on_in_use(self._refers_to)

    # ---------------------------------------------------------------- engine-facing (Receiver)
    def open(self, room: int, instance: str) -> None:
        ctx = self._ctx
        with ctx.lock:
            if instance not in self._peers.instances:
                raise KVBridgeError(f"not connected to prefill instance {instance!r}; call connect() first")
            if room in self.rooms:
                raise KVBridgeError(f"room {room} already has a receiver on {ctx.name}")
            self._tombstones.revive(room)
            state = self.rooms[room] = RecvRoom(room=room, instance=instance, created=time.monotonic())
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
        room.status = KVPoll.WaitingForInput
        if room.pending is not None:
            indices, prefix_len = room.pending
            room.pending = None
            self._request(room, indices, prefix_len)
        return True

    def nbytes(self, room: int) -> int:
        with self._ctx.lock:
            return self.get(room).nbytes

    def send_metadata(self, room: int, indices: Mapping[str, PackedIndices], prefix_len: int) -> None:
        with self._ctx.lock:
            state = self.get(room)
            if state.status is KVPoll.Failed:
                raise TransferError(room, state.reason)
            if state.metadata_at is not None or state.pending is not None:
                raise KVBridgeError(f"room {room}: send_metadata() was already called")
            if state.status is KVPoll.Bootstrapping:
                state.pending = (dict(indices), prefix_len)     # sent once the prefill ranks are back
                return
            self._request(state, indices, prefix_len)

    def abort(self, room: int, reason: str) -> None:
        with self._ctx.lock:
            self._fail(self.get(room), reason)

    def safe_to_reuse(self, room: int) -> bool:
        """True when no write into the room's destination items can still happen: the room succeeded,
        nothing was ever requested, or every writer is fenced (acknowledged, or proven gone)."""
        with self._ctx.lock:
            state = self.get(room)
            if state.status is KVPoll.Success:
                return True
            if state.status is not KVPoll.Failed:
                return False
            return state.metadata_at is None or set(state.targets.values()) <= state.quiesced

    def clear(self, room: int, safe: bool) -> None:
        """Forget the room. Its staging reservations are freed only when ``safe`` (no write can land)."""
        ctx = self._ctx
        with ctx.lock:
            state = self.rooms.pop(room, None)
            self._waiting.discard(room)
            self._unsafe.discard(room)
            if state is not None:
                if safe:
                    self._release_staging(state)
                elif state.staged:
                    log.warning("%s: room %d cleared before its senders confirmed quiescence; keeping its staging "
                                "reservations", ctx.name, room)
            self._tombstones.bury(room)

    # ---------------------------------------------------------------- requests (lock held)
    def _request(self, room: RecvRoom, indices: Mapping[str, PackedIndices], prefix_len: int) -> None:
        ctx = self._ctx
        peers = {rank: self._peers[agent] for rank, agent in room.targets.items()}
        src_layout = next(iter(peers.values())).layout
        staging_area = ctx.buffers.staging
        staging: dict[str, dict[int, int]] = {}
        for comp_index, (comp, st) in enumerate(zip(ctx.layout.components, ctx.state_types)):
            room.indices[comp.name] = indices[comp.name].unpack()
            n_items = len(room.indices[comp.name])
            if st.chunked:
                room.chunked.add(comp.name)
            for rank, peer in peers.items():
                segs = self._plans.slice_for(peer, comp_index)
                if segs.is_empty:
                    continue
                key = (rank, comp.name)
                room.expected.add(key)
                room.covered[key] = np.zeros(n_items, dtype=bool)
                room.covered_count[key] = 0
                rows = self._plans.rows_for(peer, comp_index, segs, src_layout, ctx.layout)
                if rows is not None and staging_area is not None and n_items:
                    nbytes = page_layout(rows)[1] * n_items
                    offset = staging_area.alloc(nbytes)
                    if offset is not None:
                        staging.setdefault(comp.name, {})[rank] = offset
                        room.staged[key] = (offset, nbytes, rows)
        request = TransferRequest(room=room.room, agent=ctx.name, dst_rank=ctx.layout.tp_rank,
                                  dst_size=ctx.layout.tp_size, indices=dict(indices), prefix_len=prefix_len,
                                  staging=staging)
        room.metadata_at = time.monotonic()
        for peer in peers.values():
            self._peers.post(peer, request)
        self._check_done(room)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_notice(self, notice: Notice, env: Envelope) -> None:
        room = self.rooms.get(notice.room)
        if room is None or room.status in (KVPoll.Failed, KVPoll.Success):
            log.debug("%s: dropped notice %s (room %s)", self._ctx.name, notice, room and room.status)
            return  # late or duplicate for a finished, failed or cleared room
        if room.targets.get(notice.sender) != env.sender:
            raise Dropped(f"notice for room {notice.room} rank {notice.sender} from {env.sender!r}, which is not "
                          "that rank of the room")
        key = (notice.sender, notice.component)
        if key not in room.expected:
            log.warning("%s: room %d: unexpected notice from rank %d for %s", self._ctx.name, notice.room,
                        notice.sender, notice.component)
            return
        chunks = room.received.setdefault(key, set())
        if notice.chunk in chunks:
            return
        covered = room.covered[key]
        first, count = notice.first, notice.count
        if first + count > len(covered):
            self._fail(room, f"prefill rank {notice.sender} announced {notice.component} items [{first}, "
                             f"{first + count}) of a request for {len(covered)}")
            return
        if notice.staged:
            self._scatter(room, notice)
        chunks.add(notice.chunk)
        span = covered[first: first + count]
        room.covered_count[key] += count - int(np.count_nonzero(span))
        span[:] = True
        room.nbytes += notice.nbytes
        if notice.last:
            room.last_chunk[key] = notice.chunk
        room.status = KVPoll.Transferring
        self._check_done(room)

    def on_status(self, push: StatusPush, env: Envelope) -> None:
        room = self.rooms.get(push.room)
        if room is None:
            return
        if push.agent not in room.targets.values():
            raise Dropped(f"status of room {push.room} from {push.agent}, which is not a participant")
        if push.status is KVPoll.Failed:
            self._fail(room, f"prefill {push.agent} failed the room: {push.reason}")

    def on_abort(self, abort: Abort, env: Envelope) -> None:
        room = self.rooms.get(abort.room)
        if room is None:
            return
        if abort.agent not in room.targets.values():
            raise Dropped(f"abort of room {abort.room} from {abort.agent}, which is not a participant")
        if abort.quiesced:
            room.quiesced.add(abort.agent)
        self._fail(room, f"aborted by prefill {abort.agent}: {abort.reason}")

    def _scatter(self, room: RecvRoom, notice: Notice) -> None:
        """Move a staged chunk from our staging area into its pages (validated against the reservation)."""
        ctx = self._ctx
        reserved = room.staged.get((notice.sender, notice.component))
        dst = room.indices.get(notice.component)
        if reserved is None or dst is None or ctx.buffers.staging is None:
            raise ProtocolError(f"room {room.room}: staged notice from rank {notice.sender} for {notice.component}, "
                                "which has no staging reservation")
        offset, nbytes, rows = reserved
        per_item = page_layout(rows)[1]
        if notice.first + notice.count > len(dst) or (notice.first + notice.count) * per_item > nbytes:
            raise ProtocolError(f"room {room.room}: staged chunk [{notice.first}, +{notice.count}) is outside the "
                                f"{len(dst)} reserved items")
        start = offset + notice.first * per_item
        area = ctx.buffers.staging.array[start: start + notice.count * per_item]
        staged = (area.reshape(notice.count, per_item) if isinstance(area, np.ndarray)
                  else area.view(notice.count, per_item))
        scatter(ctx.buffers.views[notice.component], rows, dst[notice.first: notice.first + notice.count], staged)
        synchronize(staged)       # the chunk counts as delivered only once it sits in its pages

    def _release_staging(self, room: RecvRoom) -> None:
        staging = self._ctx.buffers.staging
        if staging is not None:
            for offset, nbytes, _ in room.staged.values():
                staging.free(offset, nbytes)
        room.staged.clear()

    # ---------------------------------------------------------------- completion and failure (lock held)
    @staticmethod
    def _all_chunks(room: RecvRoom, key: Key) -> bool:
        """Did the last chunk (and, for chunked components, every chunk before it) arrive?"""
        last = room.last_chunk.get(key)
        if last is None:
            return False
        return key[1] not in room.chunked or len(room.received.get(key, ())) == last + 1

    def _delivered(self, room: RecvRoom, rank: int) -> bool:
        return all(self._all_chunks(room, key) and room.covered_count[key] == len(room.covered[key])
                   for key in room.expected if key[0] == rank)

    def _check_done(self, room: RecvRoom) -> None:
        if room.status is KVPoll.Failed or room.metadata_at is None:
            return
        short = [key for key in room.expected if self._all_chunks(room, key)
                 and room.covered_count[key] != len(room.covered[key])]
        if short:
            rank, comp = short[0]
            self._fail(room, f"prefill rank {rank} sent {room.covered_count[(rank, comp)]} of "
                             f"{len(room.covered[(rank, comp)])} {comp} items")
            return
        if all(self._delivered(room, rank) for rank in room.targets):
            room.status = KVPoll.Success

    def _fail(self, room: RecvRoom, reason: str) -> None:
        """Fail a room; every writer not yet fenced is asked to stop and acknowledge."""
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return
        room.status, room.reason = KVPoll.Failed, reason
        self._waiting.discard(room.room)
        if room.metadata_at is None:
            return                                   # nothing was ever asked of the senders
        self._unsafe.add(room.room)
        self._fence(room, reason)

    def _fence(self, room: RecvRoom, reason: str) -> None:
        ctx = self._ctx
        for agent in room.targets.values():
            if agent in room.quiesced:
                continue
            peer = self._peers.get(agent)
            if peer is None:
                continue
            if not peer.alive and self._peers.writer_gone(peer):
                room.quiesced.add(agent)
                continue
            self._peers.post(peer, Abort(room=room.room, agent=ctx.name, reason=reason))
        if set(room.targets.values()) <= room.quiesced:
            self._unsafe.discard(room.room)

    def tick(self, now: float) -> None:
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
        cfg = self._ctx.config
        for room in self.rooms.values():
            if room.status is KVPoll.Bootstrapping and now - room.created > cfg.bootstrap_timeout_s:
                self._fail(room, f"bootstrap timeout: prefill instance {room.instance!r} not reachable after "
                                 f"{cfg.bootstrap_timeout_s} s")
            elif (room.status in (KVPoll.WaitingForInput, KVPoll.Transferring) and room.metadata_at is not None
                    and now - room.metadata_at > cfg.waiting_timeout_s):
                self._fail(room, f"waiting timeout: no complete transfer after {cfg.waiting_timeout_s} s")

    def _peer_died(self, peer: Peer, reason: str) -> None:
        gone = self._peers.writer_gone(peer)
        for room in self.rooms.values():
            ranks = [rank for rank, agent in room.targets.items() if agent == peer.agent]
            if not ranks:
                continue
            if gone:
                room.quiesced.add(peer.agent)
            if room.metadata_at is None or not all(self._delivered(room, r) for r in ranks):
                self._fail(room, reason)

    def _refers_to(self, agent: str) -> bool:
        return any(agent in room.targets.values() and (room.room in self._unsafe or room.status is not KVPoll.Failed)
                   for room in self.rooms.values())

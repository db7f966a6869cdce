"""The decode side: receive rooms, requests to the prefill ranks, notices, staged scatter, completion."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.agent.context import AgentContext, Tombstones
from kvbridge.agent.peers import Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.errors import KVBridgeError, ProtocolError, TransferError
from kvbridge.staging import Rows, page_layout, scatter, synchronize
from kvbridge.wire import Abort, KVPoll, Notice, PackedIndices, StatusPush, TransferRequest

log = logging.getLogger("kvbridge.agent")


@dataclass(slots=True, kw_only=True)
class RecvRoom:
    room: int
    instance: str
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    targets: dict[int, str] = field(default_factory=dict)            # prefill rank -> agent
    expected: set[tuple[int, str]] = field(default_factory=set)      # (sender rank, component)
    chunked: set[str] = field(default_factory=set)
    received: dict[tuple[int, str], set[int]] = field(default_factory=dict)
    last_chunk: dict[tuple[int, str], int] = field(default_factory=dict)
    quiesced: set[str] = field(default_factory=set)                  # prefill agents that confirmed
    metadata_at: float | None = None
    nbytes: int = 0
    indices: dict[str, np.ndarray] = field(default_factory=dict)
    staged: dict[tuple[int, str], tuple[int, int, tuple[Rows, ...]]] = field(default_factory=dict)


class DecodeSide:
    """Every receive room of a decode rank. Public methods take the agent lock themselves; ``on_*`` and
    ``tick`` are called by the progress loop with the lock held."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self.rooms: dict[int, RecvRoom] = {}
        self._tombstones = Tombstones()
        peers.on_death(self._peer_died)

    # ---------------------------------------------------------------- engine-facing (Receiver)
    def open(self, room: int, instance: str) -> None:
        ctx = self._ctx
        with ctx.lock:
            targets = self._peers.instances.get(instance)
            if not targets:
                raise KVBridgeError(f"not connected to prefill instance {instance!r}; call connect() first")
            if room in self.rooms:
                raise KVBridgeError(f"room {room} already has a receiver on {ctx.name}")
            self._tombstones.revive(room)
            state = self.rooms[room] = RecvRoom(room=room, instance=instance, created=time.monotonic(),
                                                targets=dict(targets))
            dead = [a for a in state.targets.values() if not self._peers[a].alive]
            if dead:
                self._fail(state, f"prefill peer {dead[0]} is dead")
            else:
                state.status = KVPoll.WaitingForInput

    def get(self, room: int) -> RecvRoom:
        """The room's record (call under the lock); KVBridgeError once it was cleared."""
        state = self.rooms.get(room)
        if state is None:
            raise KVBridgeError(f"room {room} was cleared")
        return state

    def status(self, room: int) -> KVPoll:
        with self._ctx.lock:
            return self.get(room).status

    def reason(self, room: int) -> str:
        with self._ctx.lock:
            return self.get(room).reason

    def nbytes(self, room: int) -> int:
        with self._ctx.lock:
            return self.get(room).nbytes

    def send_metadata(self, room: int, indices: Mapping[str, PackedIndices], prefix_len: int) -> None:
        with self._ctx.lock:
            state = self.get(room)
            if state.status is KVPoll.Failed:
                raise TransferError(room, state.reason)
            if state.metadata_at is not None:
                raise KVBridgeError(f"room {room}: send_metadata() was already called")
            self._request(state, indices, prefix_len)

    def abort(self, room: int, reason: str) -> None:
        with self._ctx.lock:
            self._fail(self.get(room), reason)

    def safe_to_reuse(self, room: int) -> bool:
        """True when no write into the room's destination items can still happen: the room succeeded,
        or every sender confirmed quiescence (or is gone) after a failure or abort."""
        with self._ctx.lock:
            state = self.get(room)
            if state.status is KVPoll.Success:
                return True
            if state.status is not KVPoll.Failed:
                return False
            if state.metadata_at is None:
                return True
            return set(state.targets.values()) <= state.quiesced

    def clear(self, room: int, safe: bool) -> None:
        """Forget the room. Its staging reservations are freed only when ``safe`` (no write can land)."""
        ctx = self._ctx
        with ctx.lock:
            state = self.rooms.pop(room, None)
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
            if st.chunked:
                room.chunked.add(comp.name)
            for rank, peer in peers.items():
                segs = self._plans.slice_for(peer, comp_index)
                if segs.is_empty:
                    continue
                room.expected.add((rank, comp.name))
                n_items = len(room.indices[comp.name])
                rows = self._plans.rows_for(peer, comp_index, segs, src_layout, ctx.layout)
                if rows is not None and staging_area is not None and n_items:
                    nbytes = page_layout(rows)[1] * n_items
                    offset = staging_area.alloc(nbytes)
                    if offset is not None:
                        staging.setdefault(comp.name, {})[rank] = offset
                        room.staged[(rank, comp.name)] = (offset, nbytes, rows)
        request = TransferRequest(room.room, ctx.name, ctx.layout.tp_rank, ctx.layout.tp_size, dict(indices),
                                  prefix_len, staging)
        room.metadata_at = time.monotonic()
        for peer in peers.values():
            ctx.post(peer.address, request)
        self._check_done(room)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_notice(self, notice: Notice) -> None:
        room = self.rooms.get(notice.room)
        if room is None or room.status in (KVPoll.Failed, KVPoll.Success):
            log.debug("%s: dropped notice %s (room %s)", self._ctx.name, notice, room and room.status)
            return  # late or duplicate for a finished, failed or cleared room
        key = (notice.sender, notice.component)
        if key not in room.expected:
            log.warning("%s: room %d: unexpected notice from rank %d for %s", self._ctx.name, notice.room,
                        notice.sender, notice.component)
            return
        chunks = room.received.setdefault(key, set())
        if notice.chunk in chunks:
            return
        if notice.staged:
            self._scatter(room, notice)
        chunks.add(notice.chunk)
        room.nbytes += notice.nbytes
        if notice.last:
            room.last_chunk[key] = notice.chunk
        room.status = KVPoll.Transferring
        self._check_done(room)

    def on_status(self, push: StatusPush) -> None:
        room = self.rooms.get(push.room)
        if room is not None and push.status is KVPoll.Failed:
            self._fail(room, f"prefill {push.agent} failed the room: {push.reason}")

    def on_abort(self, abort: Abort) -> None:
        room = self.rooms.get(abort.room)
        if room is None:
            return
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
    def _delivered(room: RecvRoom, rank: int) -> bool:
        """Has prefill ``rank`` delivered everything it owes this room? A chunked component (KV pages) owes
        chunks 0..last; any other component owes the one notice of the last chunk."""
        for key in room.expected:
            if key[0] != rank:
                continue
            last = room.last_chunk.get(key)
            if last is None:
                return False
            if key[1] in room.chunked and len(room.received.get(key, ())) != last + 1:
                return False
        return True

    def _check_done(self, room: RecvRoom) -> None:
        if room.status is KVPoll.Failed or room.metadata_at is None:
            return
        if all(self._delivered(room, rank) for rank in room.targets):
            room.status = KVPoll.Success

    def _fail(self, room: RecvRoom, reason: str) -> None:
        """Fail a room; every sender still writing is asked to stop and confirm quiescence."""
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return
        room.status, room.reason = KVPoll.Failed, reason
        if room.metadata_at is None:
            room.quiesced.update(room.targets.values())   # nothing was ever asked of the senders
            return
        ctx = self._ctx
        for agent in room.targets.values():
            peer = self._peers.get(agent)
            if peer is not None and peer.alive and agent not in room.quiesced:
                ctx.post(peer.address, Abort(room.room, ctx.name, reason))

    def tick(self, now: float) -> None:
        timeout = self._ctx.config.waiting_timeout_s
        for room in self.rooms.values():
            if (room.status in (KVPoll.WaitingForInput, KVPoll.Transferring) and room.metadata_at is not None
                    and now - room.metadata_at > timeout):
                self._fail(room, f"waiting timeout: no complete transfer after {timeout} s")

    def _peer_died(self, peer: Peer, reason: str) -> None:
        for room in self.rooms.values():
            ranks = [rank for rank, agent in room.targets.items() if agent == peer.agent]
            if ranks:
                room.quiesced.add(peer.agent)
                if room.metadata_at is None or not all(self._delivered(room, r) for r in ranks):
                    self._fail(room, reason)

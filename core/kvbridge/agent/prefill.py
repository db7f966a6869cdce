"""The prefill side: send rooms, decode requests, planning, staging, posting and completion of writes."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.agent.config import TOMBSTONES
from kvbridge.agent.context import AgentContext, Tombstones
from kvbridge.agent.peers import Peer, PeerTable
from kvbridge.agent.plans import PlanCache
from kvbridge.backends.base import ComponentTransfer, HandleState
from kvbridge.errors import GeometryError, KVBridgeError, ProtocolError, RegionError, TransferError
from kvbridge.planner import TransferPlan, check_indices, plan_transfer
from kvbridge.slicing import ComponentSlice, served_ranks
from kvbridge.staging import STAGING, gather, page_layout, synchronize
from kvbridge.wire import Abort, KVPoll, Notice, StatusPush, TransferRequest

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
    must_confirm: set[str] = field(default_factory=set)   # decode agents owed an Abort(quiesced)
    nbytes: int = 0
    descriptors: int = 0


def _position_in(dst_all: np.ndarray, d_idx: np.ndarray) -> int | None:
    """Where ``d_idx`` sits in the destination list as one contiguous run (None if it does not)."""
    if not d_idx.size:
        return 0
    hits = np.flatnonzero(dst_all == d_idx[0])
    if hits.size != 1:
        return None
    first = int(hits[0])
    return first if np.array_equal(dst_all[first: first + d_idx.size], d_idx) else None


class PrefillSide:
    """Every send room of a prefill rank. Public methods take the agent lock themselves; ``on_*`` and
    ``poll_inflight``/``tick`` are called by the progress loop with the lock held."""

    def __init__(self, ctx: AgentContext, peers: PeerTable, plans: PlanCache) -> None:
        self._ctx, self._peers, self._plans = ctx, peers, plans
        self.rooms: dict[int, SendRoom] = {}
        self._early: dict[int, list[TransferRequest]] = {}
        self._early_aborts: OrderedDict[int, str] = OrderedDict()
        self._tombstones = Tombstones()
        self._no_staging: set[str] = set()
        peers.on_death(self._peer_died)

    # ---------------------------------------------------------------- engine-facing (Sender)
    def open(self, room: int) -> None:
        with self._ctx.lock:
            if room in self.rooms:
                raise KVBridgeError(f"room {room} already has a sender on {self._ctx.name}")
            self._tombstones.revive(room)
            state = self.rooms[room] = SendRoom(room=room, created=time.monotonic())
            for req in self._early.pop(room, []):
                self._accept_request(state, req)
            early_abort = self._early_aborts.pop(room, None)
            if early_abort is not None:
                self._fail(state, early_abort)

    def get(self, room: int) -> SendRoom:
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
            self._tombstones.bury(room)

    # ---------------------------------------------------------------- control frames (lock held)
    def on_request(self, req: TransferRequest) -> None:
        if req.room in self._tombstones:
            return
        peer = self._peers.get(req.agent)
        if peer is None:
            raise ProtocolError(f"transfer request for room {req.room} from {req.agent}, which never shook hands")
        try:
            _validate_request(peer, req)
        except (GeometryError, ProtocolError) as exc:
            log.error("%s: refused request for room %d from %s: %s", self._ctx.name, req.room, req.agent, exc)
            self._ctx.post(peer.address, StatusPush(req.room, self._ctx.name, KVPoll.Failed, f"bad request: {exc}"))
            room = self.rooms.get(req.room)
            if room is not None:
                self._fail(room, f"decode {req.agent} sent a bad request: {exc}")
            return
        room = self.rooms.get(req.room)
        if room is None:
            self._early.setdefault(req.room, []).append(req)
        else:
            self._accept_request(room, req)

    def on_abort(self, abort: Abort) -> None:
        ctx = self._ctx
        room = self.rooms.get(abort.room)
        if room is None:   # nothing was written for it: confirm now, fail the sender if it comes later
            self._early.pop(abort.room, None)
            if abort.room not in self._tombstones:
                self._early_aborts[abort.room] = f"aborted by decode {abort.agent}: {abort.reason}"
                while len(self._early_aborts) > TOMBSTONES:
                    self._early_aborts.popitem(last=False)
            peer = self._peers.get(abort.agent)
            if peer is not None:
                ctx.post(peer.address, Abort(abort.room, ctx.name, abort.reason, quiesced=True))
            return
        self._fail(room, f"aborted by decode {abort.agent}: {abort.reason}")
        room.must_confirm.add(abort.agent)

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
        ctx = self._ctx
        chunk = room.chunks
        for comp_index, (comp, st) in enumerate(zip(ctx.layout.components, ctx.state_types)):
            if not st.chunked and not last:
                continue
            if st.chunked:
                src = check_indices(pages, comp.num_items, f"room {room.room} {comp.name} source")
                src_first = 0
            else:
                if comp.name not in state:
                    raise GeometryError(f"room {room.room}: the last chunk must carry indices for {comp.name!r}")
                src_raw, src_first = state[comp.name]
                src = check_indices(src_raw, comp.num_items, f"room {room.room} {comp.name} source")
            for agent, req in room.requests.items():
                self._send_component(room, self._peers[agent], req, comp_index, src, src_first, chunk, last)
        room.chunks += 1
        room.cursor += len(pages)
        room.status = KVPoll.Transferring
        if last:
            room.last_sent = True

    def _send_component(self, room: SendRoom, peer: Peer, req: TransferRequest, comp_index: int,
                        src: np.ndarray, src_first: int, chunk: int, last: bool) -> None:
        ctx = self._ctx
        comp, st = ctx.layout.components[comp_index], ctx.state_types[comp_index]
        segs = self._plans.slice_for(peer, comp_index)
        if segs.is_empty:
            return
        packed = req.indices[comp.name]
        dst_all = packed.unpack()
        first: int | None
        if st.chunked:
            if room.cursor + len(src) > len(dst_all):
                raise GeometryError(f"room {room.room} {comp.name}: prefill sends pages up to "
                                    f"{room.cursor + len(src)}, decode {peer.agent} gave {len(dst_all)}")
            s_idx, d_idx, first = src, dst_all[room.cursor: room.cursor + len(src)], room.cursor
        else:
            s_idx, d_idx = st.pair_indices(comp, src, src_first, dst_all, packed.first)
            first = _position_in(dst_all, d_idx)
        staged_at = req.staging.get(comp.name, {}).get(ctx.layout.tp_rank)
        if staged_at is not None and first is not None and len(s_idx) and self._send_staged(
                room, peer, comp_index, segs, s_idx, staged_at, first, chunk, last):
            return
        if s_idx.size > 1 and np.any(s_idx[1:] < s_idx[:-1]):   # the structured form is sorted by source
            order = np.argsort(s_idx, kind="stable")
            s_idx, d_idx = s_idx[order], d_idx[order]
        plan = plan_transfer(self._plans.pairs_for(peer, comp_index, segs), s_idx, d_idx)
        notice = Notice(room.room, ctx.layout.tp_rank, comp.name, chunk, last, plan.total_nbytes, first or 0,
                        len(s_idx))
        frame = ctx.codec.encode(notice)
        if len(plan) == 0:
            self._notify(peer, frame)
            return
        if peer.info is None:
            raise AssertionError(f"peer {peer.agent} has no registered buffers")
        transfer = ComponentTransfer(room.room, comp.name, peer.agent, chunk, last, ctx.buffers.registered[comp.name],
                                     peer.info.component(comp.name), plan, frame, s_idx, d_idx, segs.buffers)
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
        notice = Notice(room.room, ctx.layout.tp_rank, comp.name, chunk, last, nbytes, first, len(items), True)
        frame = ctx.codec.encode(notice)
        transfer = ComponentTransfer(room.room, STAGING, peer.agent, chunk, last, staging_reg, remote, plan, frame)
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
        for room in list(self.rooms.values()):
            if room.inflight:
                room.inflight = [item for item in room.inflight if not self._finished(room, item)]
            if not room.inflight:
                if room.status is KVPoll.Transferring and room.last_sent:
                    room.status = KVPoll.Success
                if room.must_confirm:
                    for agent in room.must_confirm:
                        peer = self._peers.get(agent)
                        if peer is not None:
                            self._ctx.post(peer.address, Abort(room.room, self._ctx.name, room.reason, quiesced=True))
                    room.must_confirm.clear()

    def _finished(self, room: SendRoom, item: InFlight) -> bool:
        """Poll one write; when it ended, release it, free its staging and notify or fail the room."""
        ctx = self._ctx
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
        except Exception:  # noqa: BLE001 - a faulty release must not stop progress
            log.exception("%s: releasing a transfer handle failed", ctx.name)
        if item.staging is not None and ctx.buffers.staging is not None:
            ctx.buffers.staging.free(*item.staging)
        if result is not None and result.state is HandleState.DONE:
            if room.status is not KVPoll.Failed:
                self._notify(self._peers[item.peer], item.frame)
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
                self._ctx.post(peer.address, StatusPush(room.room, self._ctx.name, KVPoll.Failed, reason))
                room.must_confirm.add(agent)   # Abort(quiesced) follows once our writes drained

    def tick(self, now: float) -> None:
        timeout = self._ctx.config.bootstrap_timeout_s
        for room in self.rooms.values():
            if room.status is KVPoll.Bootstrapping and now - room.created > timeout:
                self._fail(room, f"bootstrap timeout: {len(room.requests)} of {room.expected_requests or '?'} "
                                 f"decode requests after {timeout} s")

    def _peer_died(self, peer: Peer, reason: str) -> None:
        for room in self.rooms.values():
            if peer.agent in room.requests:
                self._fail(room, reason)
                room.must_confirm.discard(peer.agent)


def _validate_request(peer: Peer, req: TransferRequest) -> None:
    if (req.dst_rank, req.dst_size) != (peer.layout.tp_rank, peer.layout.tp_size):
        raise ProtocolError(f"request says decode rank {req.dst_rank}/{req.dst_size}, handshake said "
                            f"{peer.layout.tp_rank}/{peer.layout.tp_size}")
    names = set(peer.layout.component_names)
    if set(req.indices) != names:
        raise ProtocolError(f"request names components {sorted(req.indices)}, the pool has {sorted(names)}")
    for comp in peer.layout.components:
        check_indices(req.indices[comp.name].unpack(), comp.num_items, f"room {req.room} {comp.name} destination")

"""One rank's transfer agent, and the per-request Sender (prefill) and Receiver (decode).

    hub = LocalHub()
    prefill = TransferAgent(layout=p_layout, buffers=p_arrays, role=Role.PREFILL, link=hub.link("p0"),
                            instance="llama")
    decode = TransferAgent(layout=d_layout, buffers=d_arrays, role=Role.DECODE, link=hub.link("d0"))
    decode.connect("llama")                              # handshake with the ranks the TP mapping assigns
    receiver = decode.receiver(room=42, instance="llama")
    receiver.send_metadata({"kv": dst_pages})
    sender = prefill.sender(room=42)
    sender.send(src_pages, last=True)
    while receiver.poll() < KVPoll.Success: ...          # Failed (0) < ... < Success (4)

The agent owns the backend, the registered buffers, the peers (handshaken once per decode/prefill
rank pair) and every room. Control frames go through a link (in-process hub or ZMQ); completion
notices go through the backend when it can deliver them, else through the link. ``progress()`` does
all the work (drain frames and notices, poll handles, heartbeats, timeouts); ``poll()`` calls it,
and ``start()`` runs it on a background thread for processes whose engine does not poll often.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.backends.base import (
    ComponentTransfer, HandleState, PeerInfo, RegisteredBuffers, RemoteBuffers, TransferBackend,
)
from kvbridge.errors import (
    GeometryError, IncompatiblePeer, KVBridgeError, ProtocolError, RegionError, TransferError,
)
from kvbridge.geometry import DeviceKind, MemoryRegion, PoolLayout, Rank, region_of
from kvbridge.handshake import check_compatible
from kvbridge.links import Link
from kvbridge.planner import BufferPair, TransferPlan, check_indices, plan_transfer
from kvbridge.registry import Registry
from kvbridge.slicing import ComponentSlice, served_ranks, target_ranks
from kvbridge.staging import (
    STAGING, Rows, StagingArea, device_view, gather, host_view, page_layout, regular_rows, scatter, synchronize,
)
from kvbridge.state.base import StateType
from kvbridge.wire import (
    PROTOCOL_VERSION, Abort, Codec, Goodbye, Heartbeat, Hello, KVPoll, Message, Notice, PackedIndices, Role,
    StatusPush, TransferRequest, VersionMismatch, Welcome,
)

log = logging.getLogger(__name__)

_TOMBSTONES = 1 << 16
_GOODBYE_GRACE_S = 1.0
_HELLO_RESEND_S = 1.0    # connect() repeats its Hello to targets that have not answered   # after a peer's goodbye, its notices on the engine's channel may still arrive


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Timeouts (seconds) and options. Defaults suit one host; raise them across a cluster."""

    heartbeat_interval_s: float = 0.5      # how often we tell each peer we are alive
    peer_timeout_s: float = 3.0            # a peer silent this long is dead: its rooms fail
    bootstrap_timeout_s: float = 30.0      # connect() / a prefill room waiting for its requests
    waiting_timeout_s: float = 120.0       # a decode room waiting for data after send_metadata
    secret: bytes | None = None            # shared secret: HMAC on every control frame
    staging_bytes: int = 32 << 20          # host staging area for the gather/one-write/scatter path (0: off)
    backend_options: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Peer:
    agent: str
    address: str
    layout: PoolLayout
    info: PeerInfo | None                  # set on the prefill side (where we write to)
    last_seen: float
    alive: bool = True
    goodbye_at: float | None = None        # notices on the engine's own channel may still be in flight


@dataclass(slots=True)
class _InFlight:
    handle: Any
    peer: str
    notice: Notice
    frame: bytes                               # the notice, encoded once
    staging: tuple[int, int] | None = None     # (offset, bytes) of our staging area to free when done


@dataclass(slots=True)
class _SendRoom:
    room: int
    created: float
    requests: dict[str, TransferRequest] = field(default_factory=dict)
    expected_requests: int | None = None
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    chunks: int = 0
    cursor: int = 0
    last_sent: bool = False
    inflight: list[_InFlight] = field(default_factory=list)
    must_confirm: set[str] = field(default_factory=set)   # decode agents owed an Abort(quiesced)
    nbytes: int = 0
    descriptors: int = 0


@dataclass(slots=True)
class _RecvRoom:
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


def _position_in(dst_all: np.ndarray, d_idx: np.ndarray) -> int | None:
    """Where ``d_idx`` sits in the destination list as one contiguous run (None if it does not)."""
    if not d_idx.size:
        return 0
    hits = np.flatnonzero(dst_all == d_idx[0])
    if hits.size != 1:
        return None
    first = int(hits[0])
    return first if np.array_equal(dst_all[first: first + d_idx.size], d_idx) else None


class TransferAgent:
    """A prefill or decode rank: backend, registered buffers, peers, rooms."""

    def __init__(self, *, layout: PoolLayout, buffers: Mapping[str, Sequence[Any]], role: Role, link: Link,
                 backend: str = "loopback", registry: Registry | None = None, instance: str = "",
                 name: str | None = None, config: AgentConfig | None = None,
                 staging: np.ndarray | None = None) -> None:
        self.layout = layout
        self.role = role
        self.link = link
        self.instance = instance
        self.config = config or AgentConfig()
        self.name = name or f"{role.value}-{layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.registry = registry or Registry.build()
        self.rank = Rank(layout.tp_rank, layout.tp_size)
        self.state_types: tuple[StateType, ...] = self.registry.compose(layout)
        self.backend_name = backend
        self.backend: TransferBackend = self.registry.create_backend(
            backend, name=self.name, options=dict(self.config.backend_options))
        self._codec = Codec(self.config.secret)
        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._send_rooms: dict[int, _SendRoom] = {}
        self._recv_rooms: dict[int, _RecvRoom] = {}
        self._early: dict[int, list[TransferRequest]] = {}
        self._early_aborts: OrderedDict[int, str] = OrderedDict()
        self._pending_welcome: dict[str, str] = {}
        self._tombstones: OrderedDict[int, None] = OrderedDict()
        self._instances: dict[str, dict[int, str]] = {}
        self._last_beat = 0.0
        self._beats_threaded = False
        self._beat_targets: dict[str, str] = {}      # agent -> address of live peers (read by the beat thread)
        self._beat_seq = 0
        self._slices: dict[tuple[str, int], ComponentSlice] = {}
        self._pairs: dict[tuple[str, int], list[BufferPair]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.rejected_frames = 0
        self.registered: dict[str, RegisteredBuffers] = {}
        self._keepalive: list[Any] = []
        self._views: dict[str, list[Any]] = {}        # uint8 [items, item_nbytes] views (numpy or torch)
        self._rows: dict[tuple[str, int], tuple[Rows, ...] | None] = {}
        self._no_staging: set[str] = set()
        self.staging: StagingArea | None = None
        self._staging_reg: RegisteredBuffers | None = None
        try:
            self._register(buffers)
            self._setup_staging(staging)
        except BaseException:
            self.backend.close()
            raise
        if role is Role.PREFILL and instance:
            link.publish(instance, layout.tp_size, layout.tp_rank)

    # ------------------------------------------------------------------ setup
    def _register(self, buffers: Mapping[str, Sequence[Any]]) -> None:
        missing = [c.name for c in self.layout.components if c.name not in buffers]
        extra = sorted(set(buffers) - set(self.layout.component_names))
        if missing or extra:
            raise GeometryError(f"buffers given for {sorted(buffers)}; the layout needs exactly "
                                f"{list(self.layout.component_names)} (missing {missing}, unknown {extra})")
        for comp in self.layout.components:
            given = buffers[comp.name]
            if len(given) != len(comp.buffers):
                raise GeometryError(f"component {comp.name!r}: {len(given)} buffers given, layout has "
                                    f"{len(comp.buffers)}")
            regions = []
            self._keepalive.extend(given)   # registered memory must outlive the registration
            for geom, buf in zip(comp.buffers, given):
                region = buf if isinstance(buf, MemoryRegion) else region_of(buf)
                geom.check_region(region)
                regions.append(region)
            self.registered[comp.name] = self.registry.register_buffers(self.backend, comp.name, regions)
            if all(r.device is DeviceKind.CPU for r in regions):
                self._views[comp.name] = [host_view(r).reshape(g.num_items, g.item_nbytes)
                                          for r, g in zip(regions, comp.buffers)]
            elif all(r.device is DeviceKind.CUDA for r in regions):
                views = [device_view(b, g.num_items, g.item_nbytes) for b, g in zip(given, comp.buffers)]
                if all(v is not None for v in views):
                    self._views[comp.name] = views

    def _setup_staging(self, staging: Any | None) -> None:
        """Register the staging area (given, e.g. in /dev/shm for loopback peers in other processes, or
        allocated here: host memory, or on the GPU of CUDA buffers) when every buffer has a view."""
        if len(self._views) != len(self.layout.components):
            return
        if staging is None:
            if self.config.staging_bytes <= 0:
                return
            first = next(iter(self._views.values()))[0]
            if isinstance(first, np.ndarray):
                staging = np.zeros(self.config.staging_bytes, np.uint8)   # zeros: pre-touched before registering
            else:
                import torch

                staging = torch.zeros(self.config.staging_bytes, dtype=torch.uint8, device=first.device)
        self._keepalive.append(staging)
        self.staging = StagingArea(staging.reshape(-1).view(np.uint8) if isinstance(staging, np.ndarray) else staging)
        self._staging_reg = self.registry.register_buffers(self.backend, STAGING, [self.staging.region])

    def _remote_buffers(self) -> tuple[RemoteBuffers, ...]:
        regs = list(self.registered.values()) + ([self._staging_reg] if self._staging_reg else [])
        return tuple(reg.remote() for reg in regs)

    # ------------------------------------------------------------------ messaging
    def _post(self, address: str, message: Message) -> None:
        try:
            self.link.send(address, self._codec.encode(message))
        except Exception as exc:  # noqa: BLE001 - a dead peer must not kill the caller
            log.warning("%s: could not send %s to %s: %s", self.name, type(message).__name__, address, exc)

    def connect(self, instance: str, timeout_s: float | None = None) -> None:
        """Handshake with the prefill ranks of ``instance`` that our TP rank reads from (decode only).

        Blocks until every target accepted, refused (IncompatiblePeer with the reason) or timed out.
        """
        if self.role is not Role.DECODE:
            raise KVBridgeError("connect() is for decode ranks; prefill ranks wait for their decode peers")
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.bootstrap_timeout_s)
        info = self.link.lookup(instance)
        while info is None or not info.complete:
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill instance {instance!r} did not publish all its ranks in time "
                                   f"(have {sorted(info.addresses) if info else []})")
            time.sleep(0.01)
            info = self.link.lookup(instance)
        targets = target_ranks(info.tp_size, self.layout.tp_size, self.layout.tp_rank)
        hello = Hello(PROTOCOL_VERSION, self.name, self.link.address, self.role, self.layout, self.backend_name,
                      self.backend.endpoint, self._remote_buffers())
        with self._lock:
            self._instances.setdefault(instance, {})
            self._pending_welcome = {info.addresses[p]: "" for p in targets}
        next_hello = 0.0
        while True:
            now = time.monotonic()
            if now >= next_hello:   # (again) to every target that has not answered: a link may drop a frame
                with self._lock:    # while its connection is still being set up
                    silent = [address for address, answer in self._pending_welcome.items() if not answer]
                for address in silent:
                    self._post(address, hello)
                next_hello = now + _HELLO_RESEND_S
            self.progress()
            with self._lock:
                refused = [r for r in self._pending_welcome.values() if r.startswith("refused:")]
                done = all(self._pending_welcome.values())
            if refused:
                raise IncompatiblePeer(refused[0].removeprefix("refused:"))
            if done:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill instance {instance!r} did not answer the handshake in time")
            self.link_wait(0.005)
        with self._lock:
            by_addr = {p.address: p for p in self._peers.values()}
            self._instances[instance] = {p: by_addr[info.addresses[p]].agent for p in targets}

    def link_wait(self, timeout_s: float) -> None:
        frames = self.link.recv(timeout_s)
        if frames:
            with self._lock:
                for frame in frames:
                    self._handle_frame(frame)

    # ------------------------------------------------------------------ rooms
    def sender(self, room: int) -> Sender:
        if self.role is not Role.PREFILL:
            raise KVBridgeError("sender() is for prefill ranks")
        with self._lock:
            if room in self._send_rooms:
                raise KVBridgeError(f"room {room} already has a sender on {self.name}")
            self._tombstones.pop(room, None)
            state = self._send_rooms[room] = _SendRoom(room, time.monotonic())
            for req in self._early.pop(room, []):
                self._accept_request(state, req)
            early_abort = self._early_aborts.pop(room, None)
            if early_abort is not None:
                self._fail_send(state, early_abort)
        return Sender(self, room)

    def receiver(self, room: int, instance: str) -> Receiver:
        if self.role is not Role.DECODE:
            raise KVBridgeError("receiver() is for decode ranks")
        with self._lock:
            if instance not in self._instances or not self._instances[instance]:
                raise KVBridgeError(f"not connected to prefill instance {instance!r}; call connect() first")
            if room in self._recv_rooms:
                raise KVBridgeError(f"room {room} already has a receiver on {self.name}")
            self._tombstones.pop(room, None)
            state = self._recv_rooms[room] = _RecvRoom(room, instance, time.monotonic())
            state.targets = dict(self._instances[instance])
            dead = [a for a in state.targets.values() if not self._peers[a].alive]
            if dead:
                self._fail_recv(state, f"prefill peer {dead[0]} is dead")
            else:
                state.status = KVPoll.WaitingForInput
        return Receiver(self, room)

    def _bury(self, room: int) -> None:
        self._tombstones[room] = None
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    # ------------------------------------------------------------------ progress
    def progress(self) -> None:
        """Drain control frames and backend notices, poll in-flight writes, heartbeats and timeouts."""
        notices = self.backend.drain_notifications()
        undelivered = self._drain_notify_failures()
        with self._lock:
            # drained under the lock, right before the liveness check: frames that queued up while another
            # thread held the lock (a long send) must count before a peer is judged silent
            frames = self.link.recv(0.0)
            for peer_id, notice in undelivered:   # the engine took them but could not deliver: the link can
                peer = self._peers.get(peer_id)
                if peer is not None and peer.alive:
                    try:
                        self.link.send(peer.address, notice)
                    except Exception as exc:  # noqa: BLE001 - liveness will notice a dead peer
                        log.warning("%s: could not resend a notice to %s: %s", self.name, peer_id, exc)
            for frame in frames:
                self._handle_frame(frame)
            for _peer, blob in notices:
                self._handle_frame(blob)
            self._poll_inflight()
            self._tick(time.monotonic())

    def _drain_notify_failures(self) -> list[tuple[str, bytes]]:
        """Optional backend method ``drain_notify_failures() -> [obj with .peer, .notice]``."""
        drain = getattr(self.backend, "drain_notify_failures", None)
        if drain is None:
            return []
        try:
            return [(item.peer, item.notice) for item in drain()]
        except Exception:  # noqa: BLE001 - a faulty engine hook must not stop progress
            log.exception("%s: drain_notify_failures failed", self.name)
            return []

    def _handle_frame(self, frame: bytes) -> None:
        try:
            message = self._codec.decode(frame)
            self._dispatch(message)
        except VersionMismatch as exc:
            self.rejected_frames += 1
            log.error("%s: rejected control frame: %s", self.name, exc)
            self._refuse_other_version(exc)
        except ProtocolError as exc:
            self.rejected_frames += 1
            log.error("%s: rejected control frame: %s", self.name, exc)
        except Exception:  # noqa: BLE001 - never let a bad frame kill the progress thread
            self.rejected_frames += 1
            log.exception("%s: error while handling a control frame", self.name)

    def _refuse_other_version(self, exc: VersionMismatch) -> None:
        """A Hello of another protocol version gets a refusal naming both versions; a refusal of ours by
        a peer of another version still ends our handshake with its reason."""
        tag, address = exc.field("type"), exc.field("address")
        reason = f"protocol version differs: prefill speaks {PROTOCOL_VERSION}, decode {exc.peer_version}"
        if tag == "hello" and isinstance(address, str) and self.role is Role.PREFILL:
            self._post(address, Welcome(PROTOCOL_VERSION, self.name, self.link.address, False, reason))
        elif tag == "welcome" and address in self._pending_welcome:
            theirs = exc.field("reason") or f"peer speaks protocol version {exc.peer_version}, we speak {PROTOCOL_VERSION}"
            self._pending_welcome[str(address)] = f"refused:{theirs}"

    def _dispatch(self, message: Message) -> None:
        peer = self._peers.get(getattr(message, "agent", ""))
        if peer is not None:
            peer.last_seen = time.monotonic()
        if isinstance(message, Hello):
            self._on_hello(message)
        elif isinstance(message, Welcome):
            self._on_welcome(message)
        elif isinstance(message, TransferRequest):
            self._on_request(message)
        elif isinstance(message, Notice):
            self._on_notice(message)
        elif isinstance(message, StatusPush):
            room = self._recv_rooms.get(message.room)
            if room is not None and message.status is KVPoll.Failed:
                self._fail_recv(room, f"prefill {message.agent} failed the room: {message.reason}")
        elif isinstance(message, Abort):
            self._on_abort(message)
        elif isinstance(message, Heartbeat):
            if peer is None:
                log.debug("%s: heartbeat from unknown agent %s", self.name, message.agent)
        elif isinstance(message, Goodbye) and peer is not None:
            peer.goodbye_at = time.monotonic()
            self._beat_targets.pop(peer.agent, None)

    # -- handshake
    def _on_hello(self, hello: Hello) -> None:
        if self.role is not Role.PREFILL:
            raise ProtocolError(f"{self.name} is a decode rank and got a Hello from {hello.agent}")
        reason = ""
        if hello.backend != self.backend_name:
            reason = f"backend differs: prefill uses {self.backend_name!r}, decode {hello.backend!r}"
        else:
            try:
                check_compatible(self.layout, hello.layout)
                if self.layout.tp_rank not in target_ranks(self.layout.tp_size, hello.layout.tp_size,
                                                           hello.layout.tp_rank):
                    reason = (f"decode rank {hello.layout.tp_rank}/{hello.layout.tp_size} does not read from prefill "
                              f"rank {self.layout.tp_rank}/{self.layout.tp_size}")
            except IncompatiblePeer as exc:
                reason = str(exc)
        if reason:
            log.error("%s: refused %s: %s", self.name, hello.agent, reason)
            self._post(hello.address, Welcome(PROTOCOL_VERSION, self.name, self.link.address, False, reason))
            return
        info = PeerInfo(hello.agent, hello.endpoint, hello.buffers)
        self._check_remote_buffers(hello.layout, info)
        old = self._peers.get(hello.agent)
        welcome = Welcome(PROTOCOL_VERSION, self.name, self.link.address, True, "", self.layout, self.backend_name,
                          self.backend.endpoint, ())
        if old is not None and old.alive and old.info == info and old.layout == hello.layout:
            self._post(hello.address, welcome)     # a repeated Hello: answer again, keep the peer as it is
            return
        if old is not None:
            self._drop_peer_caches(hello.agent)
            self.backend.remove_peer(hello.agent)
        self.backend.add_peer(info)
        self._peers[hello.agent] = _Peer(hello.agent, hello.address, hello.layout, info, time.monotonic())
        self._beat_targets[hello.agent] = hello.address
        self._post(hello.address, welcome)

    @staticmethod
    def _check_remote_buffers(layout: PoolLayout, info: PeerInfo) -> None:
        for comp in layout.components:
            remote = info.component(comp.name)
            if len(remote.regions) != len(comp.buffers):
                raise ProtocolError(f"peer {info.name} registered {len(remote.regions)} regions for {comp.name}, "
                                    f"its layout has {len(comp.buffers)} buffers")
            for geom, region in zip(comp.buffers, remote.regions):
                if region.nbytes != geom.nbytes:
                    raise ProtocolError(f"peer {info.name}: region of {geom.name} is {region.nbytes} B, its geometry "
                                        f"says {geom.nbytes} B")

    def _on_welcome(self, welcome: Welcome) -> None:
        pending = self._pending_welcome
        if welcome.address not in pending:
            raise ProtocolError(f"unexpected Welcome from {welcome.agent} at {welcome.address}")
        if not welcome.accepted or welcome.layout is None:
            pending[welcome.address] = f"refused:prefill {welcome.agent} refused the handshake: {welcome.reason}"
            return
        try:
            check_compatible(welcome.layout, self.layout)
        except IncompatiblePeer as exc:
            pending[welcome.address] = f"refused:{exc}"
            return
        self._peers[welcome.agent] = _Peer(welcome.agent, welcome.address, welcome.layout, None, time.monotonic())
        self._beat_targets[welcome.agent] = welcome.address
        pending[welcome.address] = welcome.agent

    # -- requests (prefill side)
    def _on_request(self, req: TransferRequest) -> None:
        if req.room in self._tombstones:
            return
        peer = self._peers.get(req.agent)
        if peer is None:
            raise ProtocolError(f"transfer request for room {req.room} from {req.agent}, which never shook hands")
        try:
            self._validate_request(peer, req)
        except (GeometryError, ProtocolError) as exc:
            log.error("%s: refused request for room %d from %s: %s", self.name, req.room, req.agent, exc)
            self._post(peer.address, StatusPush(req.room, self.name, KVPoll.Failed, f"bad request: {exc}"))
            room = self._send_rooms.get(req.room)
            if room is not None:
                self._fail_send(room, f"decode {req.agent} sent a bad request: {exc}")
            return
        room = self._send_rooms.get(req.room)
        if room is None:
            self._early.setdefault(req.room, []).append(req)
        else:
            self._accept_request(room, req)

    def _validate_request(self, peer: _Peer, req: TransferRequest) -> None:
        if (req.dst_rank, req.dst_size) != (peer.layout.tp_rank, peer.layout.tp_size):
            raise ProtocolError(f"request says decode rank {req.dst_rank}/{req.dst_size}, handshake said "
                                f"{peer.layout.tp_rank}/{peer.layout.tp_size}")
        names = set(peer.layout.component_names)
        if set(req.indices) != names:
            raise ProtocolError(f"request names components {sorted(req.indices)}, the pool has {sorted(names)}")
        for comp in peer.layout.components:
            check_indices(req.indices[comp.name].unpack(), comp.num_items, f"room {req.room} {comp.name} destination")

    def _accept_request(self, room: _SendRoom, req: TransferRequest) -> None:
        if room.status is KVPoll.Failed:
            return
        if req.agent in room.requests:
            return  # duplicate: exactly-once per (room, decode rank)
        room.requests[req.agent] = req
        room.expected_requests = len(served_ranks(self.layout.tp_size, req.dst_size, self.layout.tp_rank))
        if len(room.requests) >= room.expected_requests and room.status is KVPoll.Bootstrapping:
            room.status = KVPoll.WaitingForInput

    # -- sending (prefill side)
    def _slice_for(self, peer: _Peer, comp_index: int) -> ComponentSlice:
        """What the prefill side of this pair writes for one component (pure; cached per peer)."""
        key = (peer.agent, comp_index)
        cached = self._slices.get(key)
        if cached is None:
            src, dst = (self.layout, peer.layout) if self.role is Role.PREFILL else (peer.layout, self.layout)
            cached = self.registry.slice_state(self.state_types[comp_index], src.components[comp_index],
                                               dst.components[comp_index], Rank(src.tp_rank, src.tp_size),
                                               Rank(dst.tp_rank, dst.tp_size))
            self._slices[key] = cached
        return cached

    def _pairs_for(self, peer: _Peer, comp_index: int, segs: ComponentSlice) -> list[BufferPair]:
        key = (peer.agent, comp_index)
        pairs = self._pairs.get(key)
        if pairs is None:
            mine = self.layout.components[comp_index]
            theirs = peer.layout.components[comp_index]
            src_regions = self.registered[mine.name].regions
            assert peer.info is not None
            dst_regions = peer.info.component(mine.name).regions
            pairs = [BufferPair(s.addr, sg.item_nbytes, sg.num_items, d.addr, dg.item_nbytes, dg.num_items, seg)
                     for s, sg, d, dg, seg in zip(src_regions, mine.buffers, dst_regions, theirs.buffers, segs.buffers)]
            self._pairs[key] = pairs
        return pairs

    def _rows_for(self, peer: _Peer, comp_index: int, segs: ComponentSlice, src: PoolLayout,
                  dst: PoolLayout) -> tuple[Rows, ...] | None:
        """The staging pattern of a (peer, component) slice, or None when plain descriptors are used."""
        key = (peer.agent, comp_index)
        if key not in self._rows:
            rows = [regular_rows(seg, sb.item_nbytes, db.item_nbytes) for seg, sb, db in
                    zip(segs.buffers, src.components[comp_index].buffers, dst.components[comp_index].buffers)]
            self._rows[key] = tuple(rows) if all(r is not None for r in rows) else None  # type: ignore[misc]
        return self._rows[key]

    def _drop_peer_caches(self, agent: str) -> None:
        for cache in (self._slices, self._pairs, self._rows):
            for key in [k for k in cache if k[0] == agent]:
                del cache[key]

    def _send_chunk(self, room: _SendRoom, pages: np.ndarray, last: bool,
                    state: Mapping[str, tuple[np.ndarray, int]]) -> None:
        chunk = room.chunks
        for comp_index, (comp, st) in enumerate(zip(self.layout.components, self.state_types)):
            if not st.chunked and not last:
                continue
            if st.chunked:
                src = check_indices(pages, comp.num_items, f"room {room.room} {comp.name} source")
            else:
                if comp.name not in state:
                    raise GeometryError(f"room {room.room}: the last chunk must carry indices for {comp.name!r}")
                src_raw, src_first = state[comp.name]
                src = check_indices(src_raw, comp.num_items, f"room {room.room} {comp.name} source")
            for agent, req in room.requests.items():
                peer = self._peers[agent]
                segs = self._slice_for(peer, comp_index)
                if segs.is_empty:
                    continue
                packed = req.indices[comp.name]
                dst_all = packed.unpack()
                if st.chunked:
                    if room.cursor + len(src) > len(dst_all):
                        raise GeometryError(f"room {room.room} {comp.name}: prefill sends pages up to "
                                            f"{room.cursor + len(src)}, decode {agent} gave {len(dst_all)}")
                    s_idx, d_idx, first = src, dst_all[room.cursor: room.cursor + len(src)], room.cursor
                else:
                    s_idx, d_idx = st.pair_indices(comp, src, src_first, dst_all, packed.first)
                    first = _position_in(dst_all, d_idx)
                staged_at = req.staging.get(comp.name, {}).get(self.layout.tp_rank)
                if staged_at is not None and first is not None and len(s_idx) and self._send_staged(
                        room, peer, comp_index, segs, s_idx, staged_at, first, chunk, last):
                    continue
                if s_idx.size > 1 and np.any(s_idx[1:] < s_idx[:-1]):   # the structured form is sorted by source
                    order = np.argsort(s_idx, kind="stable")
                    s_idx, d_idx = s_idx[order], d_idx[order]
                plan = plan_transfer(self._pairs_for(peer, comp_index, segs), s_idx, d_idx)
                notice = Notice(room.room, self.layout.tp_rank, comp.name, chunk, last, plan.total_nbytes,
                                first or 0, len(s_idx))
                frame = self._codec.encode(notice)
                if len(plan) == 0:
                    self._notify(peer, frame)
                    continue
                transfer = ComponentTransfer(room.room, comp.name, agent, chunk, last, self.registered[comp.name],
                                             peer.info.component(comp.name), plan,  # type: ignore[union-attr]
                                             frame, s_idx, d_idx, segs.buffers)
                handle = self.registry.send_component(self.backend, transfer)
                room.inflight.append(_InFlight(handle, agent, notice, frame))
                room.nbytes += plan.total_nbytes
                room.descriptors += len(plan)
        room.chunks += 1
        room.cursor += len(pages)
        room.status = KVPoll.Transferring
        if last:
            room.last_sent = True

    def _send_staged(self, room: _SendRoom, peer: _Peer, comp_index: int, segs: ComponentSlice, items: np.ndarray,
                     remote_offset: int, first: int, chunk: int, last: bool) -> bool:
        """Gather the chunk into our staging area and post one write into the peer's; False to fall back."""
        assert peer.info is not None
        rows = self._rows_for(peer, comp_index, segs, self.layout, peer.layout)
        remote = next((b for b in peer.info.buffers if b.component == STAGING), None)
        if (rows is None or self.staging is None or self._staging_reg is None or remote is None
                or peer.agent in self._no_staging):
            return False
        _, per_item = page_layout(rows)
        nbytes = per_item * len(items)
        local = self.staging.alloc(nbytes)
        if local is None:
            return False        # our staging area is full: plain descriptors, the notice says so
        comp = self.layout.components[comp_index]
        out = self.staging.array[local: local + nbytes].view(len(items), per_item) \
            if not isinstance(self.staging.array, np.ndarray) else \
            self.staging.array[local: local + nbytes].reshape(len(items), per_item)
        gather(self._views[comp.name], rows, items, out)
        synchronize(out)          # device gathers must finish before the engine reads the area
        dst = remote.regions[0].addr + remote_offset + first * per_item
        u64 = np.uint64
        plan = TransferPlan(np.array([self.staging.region.addr + local], u64), np.array([dst], u64),
                            np.array([nbytes], u64), np.zeros(1, np.int32))
        notice = Notice(room.room, self.layout.tp_rank, comp.name, chunk, last, nbytes, first, len(items), True)
        frame = self._codec.encode(notice)
        transfer = ComponentTransfer(room.room, STAGING, peer.agent, chunk, last, self._staging_reg, remote, plan,
                                     frame)
        try:
            handle = self.registry.send_component(self.backend, transfer)
        except RegionError as exc:     # the engine cannot reach the peer's staging area: descriptors from now on
            self.staging.free(local, nbytes)
            log.warning("%s: staging to %s refused (%s); using plain descriptors for this peer", self.name,
                        peer.agent, exc)
            self._no_staging.add(peer.agent)
            return False
        except BaseException:
            self.staging.free(local, nbytes)
            raise
        room.inflight.append(_InFlight(handle, peer.agent, notice, frame, (local, nbytes)))
        room.nbytes += nbytes
        room.descriptors += 1
        return True

    def _notify(self, peer: _Peer, frame: bytes) -> None:
        """Hand an encoded notice to the backend; the control link carries it when the engine cannot."""
        if not self.registry.notify_completion(self.backend, peer.agent, frame):
            try:
                self.link.send(peer.address, frame)
            except Exception as exc:  # noqa: BLE001 - liveness deals with a dead peer
                log.warning("%s: could not send a notice to %s: %s", self.name, peer.agent, exc)

    def _poll_inflight(self) -> None:
        for room in list(self._send_rooms.values()):
            if room.inflight:
                still: list[_InFlight] = []
                for item in room.inflight:
                    try:
                        result = self.backend.poll(item.handle)
                    except Exception as exc:  # noqa: BLE001 - engine errors become Failed with their text
                        result = None
                        reason = f"{type(exc).__name__}: {exc}"
                    else:
                        reason = result.reason
                    if result is not None and result.state is HandleState.PENDING:
                        still.append(item)
                        continue
                    self._release(item.handle)
                    if item.staging is not None and self.staging is not None:
                        self.staging.free(*item.staging)
                    if result is not None and result.state is HandleState.DONE:
                        if room.status is not KVPoll.Failed:
                            self._notify(self._peers[item.peer], item.frame)
                    else:
                        self._fail_send(room, f"{self.backend_name} write of {item.notice.component} chunk "
                                              f"{item.notice.chunk} to {item.peer} failed: {reason}")
                room.inflight = still
            if not room.inflight:
                if room.status is KVPoll.Transferring and room.last_sent:
                    room.status = KVPoll.Success
                if room.must_confirm:
                    for agent in room.must_confirm:
                        peer = self._peers.get(agent)
                        if peer is not None:
                            self._post(peer.address, Abort(room.room, self.name, room.reason, quiesced=True))
                    room.must_confirm.clear()

    def _release(self, handle: Any) -> None:
        try:
            self.backend.release(handle)
        except Exception:  # noqa: BLE001
            log.exception("%s: releasing a transfer handle failed", self.name)

    def _fail_send(self, room: _SendRoom, reason: str) -> None:
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return
        room.status, room.reason = KVPoll.Failed, reason
        for agent in room.requests:
            peer = self._peers.get(agent)
            if peer is not None and peer.alive:
                self._post(peer.address, StatusPush(room.room, self.name, KVPoll.Failed, reason))
                room.must_confirm.add(agent)   # Abort(quiesced) follows once our writes drained

    # -- receiving (decode side)
    def _send_metadata(self, room: _RecvRoom, indices: Mapping[str, PackedIndices], prefix_len: int) -> None:
        peers = {rank: self._peers[agent] for rank, agent in room.targets.items()}
        any_peer = next(iter(peers.values()))
        src_layout = any_peer.layout
        staging: dict[str, dict[int, int]] = {}
        for comp_index, (comp, st) in enumerate(zip(self.layout.components, self.state_types)):
            room.indices[comp.name] = indices[comp.name].unpack()
            if st.chunked:
                room.chunked.add(comp.name)
            for rank, peer in peers.items():
                segs = self._slice_for(peer, comp_index)
                if segs.is_empty:
                    continue
                room.expected.add((rank, comp.name))
                n_items = len(room.indices[comp.name])
                rows = self._rows_for(peer, comp_index, segs, src_layout, self.layout)
                if rows is not None and self.staging is not None and n_items:
                    nbytes = page_layout(rows)[1] * n_items
                    offset = self.staging.alloc(nbytes)
                    if offset is not None:
                        staging.setdefault(comp.name, {})[rank] = offset
                        room.staged[(rank, comp.name)] = (offset, nbytes, rows)
        request = TransferRequest(room.room, self.name, self.layout.tp_rank, self.layout.tp_size, dict(indices),
                                  prefix_len, staging)
        room.metadata_at = time.monotonic()
        for peer in peers.values():
            self._post(peer.address, request)
        self._check_done(room)

    def _on_notice(self, notice: Notice) -> None:
        room = self._recv_rooms.get(notice.room)
        if room is None or room.status in (KVPoll.Failed, KVPoll.Success):
            log.debug("%s: dropped notice %s (room %s)", self.name, notice, room and room.status)
            return  # late or duplicate for a finished, failed or cleared room
        key = (notice.sender, notice.component)
        if key not in room.expected:
            log.warning("%s: room %d: unexpected notice from rank %d for %s", self.name, notice.room, notice.sender,
                        notice.component)
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

    def _scatter(self, room: _RecvRoom, notice: Notice) -> None:
        """Move a staged chunk from our staging area into its pages (validated against the reservation)."""
        reserved = room.staged.get((notice.sender, notice.component))
        dst = room.indices.get(notice.component)
        if reserved is None or dst is None or self.staging is None:
            raise ProtocolError(f"room {room.room}: staged notice from rank {notice.sender} for {notice.component}, "
                                "which has no staging reservation")
        offset, nbytes, rows = reserved
        per_item = page_layout(rows)[1]
        if notice.first + notice.count > len(dst) or (notice.first + notice.count) * per_item > nbytes:
            raise ProtocolError(f"room {room.room}: staged chunk [{notice.first}, +{notice.count}) is outside the "
                                f"{len(dst)} reserved items")
        start = offset + notice.first * per_item
        area = self.staging.array[start: start + notice.count * per_item]
        staged = area.reshape(notice.count, per_item) if isinstance(area, np.ndarray) else area.view(notice.count,
                                                                                                     per_item)
        scatter(self._views[notice.component], rows, dst[notice.first: notice.first + notice.count], staged)
        synchronize(staged)       # the chunk counts as delivered only once it sits in its pages

    def _release_staging(self, room: _RecvRoom) -> None:
        if self.staging is not None:
            for offset, nbytes, _ in room.staged.values():
                self.staging.free(offset, nbytes)
        room.staged.clear()

    @staticmethod
    def _delivered(room: _RecvRoom, rank: int) -> bool:
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

    def _check_done(self, room: _RecvRoom) -> None:
        if room.status is KVPoll.Failed or room.metadata_at is None:
            return
        if all(self._delivered(room, rank) for rank in room.targets):
            room.status = KVPoll.Success

    def _fail_recv(self, room: _RecvRoom, reason: str) -> None:
        """Fail a decode room; every sender still writing is asked to stop and confirm quiescence."""
        if room.status in (KVPoll.Failed, KVPoll.Success):
            return
        room.status, room.reason = KVPoll.Failed, reason
        if room.metadata_at is None:
            room.quiesced.update(room.targets.values())   # nothing was ever asked of the senders
        else:
            self._abort_recv(room, reason)

    # -- abort
    def _on_abort(self, abort: Abort) -> None:
        if self.role is Role.PREFILL:
            room = self._send_rooms.get(abort.room)
            if room is None:   # nothing was written for it: confirm now, fail the sender if it comes later
                self._early.pop(abort.room, None)
                if abort.room not in self._tombstones:
                    self._early_aborts[abort.room] = f"aborted by decode {abort.agent}: {abort.reason}"
                    while len(self._early_aborts) > _TOMBSTONES:
                        self._early_aborts.popitem(last=False)
                peer = self._peers.get(abort.agent)
                if peer is not None:
                    self._post(peer.address, Abort(abort.room, self.name, abort.reason, quiesced=True))
                return
            self._fail_send(room, f"aborted by decode {abort.agent}: {abort.reason}")
            room.must_confirm.add(abort.agent)
        else:
            room = self._recv_rooms.get(abort.room)
            if room is None:
                return
            if abort.quiesced:
                room.quiesced.add(abort.agent)
            self._fail_recv(room, f"aborted by prefill {abort.agent}: {abort.reason}")

    # -- liveness
    def _tick(self, now: float) -> None:
        if not self._beats_threaded and now - self._last_beat >= self.config.heartbeat_interval_s:
            self._last_beat = now
            self._beat_seq += 1
            beat = Heartbeat(self.name, self.link.address, self._beat_seq)
            for peer in self._peers.values():
                if peer.alive and peer.goodbye_at is None:
                    self._post(peer.address, beat)
        grace = min(_GOODBYE_GRACE_S, self.config.peer_timeout_s)
        for peer in list(self._peers.values()):
            if not peer.alive:
                continue
            if peer.goodbye_at is not None and now - peer.goodbye_at > grace:
                self._peer_died(peer, "said goodbye")
            elif peer.goodbye_at is None and now - peer.last_seen > self.config.peer_timeout_s:
                self._peer_died(peer, f"no message for {now - peer.last_seen:.1f} s")
        for room in self._send_rooms.values():
            if room.status is KVPoll.Bootstrapping and now - room.created > self.config.bootstrap_timeout_s:
                self._fail_send(room, f"bootstrap timeout: {len(room.requests)} of "
                                      f"{room.expected_requests or '?'} decode requests after "
                                      f"{self.config.bootstrap_timeout_s} s")
        for room in self._recv_rooms.values():
            if (room.status in (KVPoll.WaitingForInput, KVPoll.Transferring) and room.metadata_at is not None
                    and now - room.metadata_at > self.config.waiting_timeout_s):
                self._fail_recv(room, f"waiting timeout: no complete transfer after {self.config.waiting_timeout_s} s")

    def _peer_died(self, peer: _Peer, why: str) -> None:
        peer.alive = False
        self._beat_targets.pop(peer.agent, None)
        reason = f"peer {peer.agent} at {peer.address} is gone ({why})"
        log.log(logging.INFO if why == "said goodbye" else logging.ERROR, "%s: %s", self.name, reason)
        for room in self._send_rooms.values():
            if peer.agent in room.requests:
                self._fail_send(room, reason)
                room.must_confirm.discard(peer.agent)
        for room in self._recv_rooms.values():
            ranks = [rank for rank, agent in room.targets.items() if agent == peer.agent]
            if ranks:
                room.quiesced.add(peer.agent)
                if room.metadata_at is None or not all(self._delivered(room, r) for r in ranks):
                    self._fail_recv(room, reason)

    def _abort_recv(self, room: _RecvRoom, reason: str) -> None:
        for agent in room.targets.values():
            peer = self._peers.get(agent)
            if peer is not None and peer.alive and agent not in room.quiesced:
                self._post(peer.address, Abort(room.room, self.name, reason))

    # ------------------------------------------------------------------ lifecycle
    def _beat_forever(self) -> None:
        """Heartbeats from their own thread, never behind the agent lock: a long send (millions of
        descriptors) must not make this rank look dead to its peers."""
        seq = 0
        while not self._stop.wait(self.config.heartbeat_interval_s):
            seq += 1
            beat = self._codec.encode(Heartbeat(self.name, self.link.address, seq))
            for address in list(self._beat_targets.values()):
                try:
                    self.link.send(address, beat)
                except Exception:  # noqa: BLE001 - a gone peer is the liveness check's business
                    log.debug("%s: heartbeat to %s not sent", self.name, address)

    def start(self, interval_s: float = 0.005) -> None:
        """Run progress() on a background thread (for processes whose engine polls rarely), and send
        heartbeats from a second one."""
        if self._thread is not None:
            return
        self._beats_threaded = True
        threading.Thread(target=self._beat_forever, name=f"kvbridge-beat-{self.name}", daemon=True).start()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.progress()
                    frames = self.link.recv(interval_s)
                    if frames:
                        with self._lock:
                            for frame in frames:
                                self._handle_frame(frame)
                except Exception:  # noqa: BLE001 - keep the progress thread alive
                    log.exception("%s: progress failed", self.name)
                    time.sleep(interval_s)

        self._thread = threading.Thread(target=loop, name=f"kvbridge-{self.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for peer in self._peers.values():
                if peer.alive:
                    try:   # best effort: a peer that already left cannot hear it
                        self.link.send(peer.address, self._codec.encode(Goodbye(self.name)))
                    except Exception:  # noqa: BLE001
                        log.debug("%s: %s left before our goodbye", self.name, peer.agent)
            for reg in self.registered.values():
                try:
                    self.backend.deregister_buffers(reg)
                except Exception:  # noqa: BLE001
                    log.exception("%s: deregistering %s failed", self.name, reg.component)
            self.registered.clear()
        self.backend.close()
        self.link.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sender:
    """The prefill side of one request on one rank."""

    def __init__(self, agent: TransferAgent, room: int) -> None:
        self._agent, self.room = agent, room

    def _state(self) -> _SendRoom:
        state = self._agent._send_rooms.get(self.room)
        if state is None:
            raise KVBridgeError(f"room {self.room} was cleared")
        return state

    def poll(self) -> KVPoll:
        self._agent.progress()
        with self._agent._lock:
            return self._state().status

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode side already holds (the first request's prefix length)."""
        with self._agent._lock:
            reqs = self._state().requests
            return next(iter(reqs.values())).prefix_len if reqs else 0

    def send(self, pages: np.ndarray, *, last: bool = False,
             state: Mapping[str, np.ndarray | tuple[np.ndarray, int]] | None = None) -> None:
        """Send one chunk: KV ``pages`` (source page ids), and on the last chunk every state component's
        indices (``{name: indices}`` or ``{name: (indices, first_position)}``)."""
        normalized = {k: (v if isinstance(v, tuple) else (v, 0)) for k, v in (state or {}).items()}
        with self._agent._lock:
            room = self._state()
            if room.status is KVPoll.Failed:
                raise TransferError(self.room, room.reason)
            if room.status is KVPoll.Bootstrapping:
                raise KVBridgeError(f"room {self.room} is still bootstrapping: wait for WaitingForInput before send()")
            if room.last_sent:
                raise KVBridgeError(f"room {self.room}: the last chunk was already sent")
            try:
                self._agent._send_chunk(room, np.asarray(pages), last, normalized)
            except KVBridgeError as exc:
                self._agent._fail_send(room, str(exc))
                raise
            except Exception as exc:   # an engine's own exception: the room fails with the engine's words
                reason = f"{self._agent.backend_name} send_component raised {type(exc).__name__}: {exc}"
                self._agent._fail_send(room, reason)
                raise
        self._agent.progress()

    @property
    def failure_reason(self) -> str:
        with self._agent._lock:
            return self._state().reason

    @property
    def stats(self) -> tuple[int, int]:
        """(bytes posted, descriptors posted) so far."""
        with self._agent._lock:
            room = self._state()
            return room.nbytes, room.descriptors

    def abort(self, reason: str = "aborted by prefill") -> None:
        with self._agent._lock:
            self._agent._fail_send(self._state(), reason)
        self._agent.progress()

    @property
    def safe_to_reuse(self) -> bool:
        """True once no write from this room's source pages is in flight (after Success or Failed)."""
        self._agent.progress()
        with self._agent._lock:
            room = self._state()
            return room.status in (KVPoll.Success, KVPoll.Failed) and not room.inflight

    def clear(self) -> None:
        with self._agent._lock:
            room = self._agent._send_rooms.get(self.room)
            if room is not None and room.inflight:
                raise KVBridgeError(f"room {self.room}: {len(room.inflight)} writes still in flight; wait for "
                                    "safe_to_reuse before clear()")
            self._agent._send_rooms.pop(self.room, None)
            self._agent._bury(self.room)


class Receiver:
    """The decode side of one request on one rank."""

    def __init__(self, agent: TransferAgent, room: int) -> None:
        self._agent, self.room = agent, room

    def _state(self) -> _RecvRoom:
        state = self._agent._recv_rooms.get(self.room)
        if state is None:
            raise KVBridgeError(f"room {self.room} was cleared")
        return state

    def send_metadata(self, indices: Mapping[str, np.ndarray | tuple[np.ndarray, int]], *, prefix_len: int = 0) -> None:
        """Give the destination items of every component (``{name: ids}`` or ``{name: (ids, first)}``)."""
        agent = self._agent
        packed: dict[str, PackedIndices] = {}
        for comp in agent.layout.components:
            if comp.name not in indices:
                raise GeometryError(f"room {self.room}: no destination indices for component {comp.name!r}")
            value = indices[comp.name]
            ids, first = value if isinstance(value, tuple) else (value, 0)
            checked = check_indices(ids, comp.num_items, f"room {self.room} {comp.name} destination")
            packed[comp.name] = PackedIndices.pack(checked, first)
        unknown = sorted(set(indices) - set(agent.layout.component_names))
        if unknown:
            raise GeometryError(f"room {self.room}: indices for unknown components {unknown}")
        with agent._lock:
            room = self._state()
            if room.status is KVPoll.Failed:
                raise TransferError(self.room, room.reason)
            if room.metadata_at is not None:
                raise KVBridgeError(f"room {self.room}: send_metadata() was already called")
            agent._send_metadata(room, packed, prefix_len)

    def poll(self) -> KVPoll:
        self._agent.progress()
        with self._agent._lock:
            return self._state().status

    @property
    def failure_reason(self) -> str:
        with self._agent._lock:
            return self._state().reason

    @property
    def nbytes(self) -> int:
        with self._agent._lock:
            return self._state().nbytes

    def abort(self, reason: str = "aborted by decode") -> None:
        with self._agent._lock:
            self._agent._fail_recv(self._state(), reason)

    @property
    def safe_to_reuse(self) -> bool:
        """True when no write into this room's destination items can still happen: the room succeeded,
        or every sender confirmed quiescence (or is dead) after a failure or abort."""
        self._agent.progress()
        with self._agent._lock:
            room = self._state()
            if room.status is KVPoll.Success:
                return True
            if room.status is not KVPoll.Failed:
                return False
            if room.metadata_at is None:
                return True
            return set(room.targets.values()) <= room.quiesced

    def clear(self) -> None:
        """Forget the room. Its staging reservations are freed only once no write can still land in them."""
        safe = self.safe_to_reuse if self.room in self._agent._recv_rooms else True
        with self._agent._lock:
            room = self._agent._recv_rooms.pop(self.room, None)
            if room is not None:
                if safe:
                    self._agent._release_staging(room)
                elif room.staged:
                    log.warning("%s: room %d cleared before its senders confirmed quiescence; keeping its staging "
                                "reservations", self._agent.name, self.room)
            self._agent._bury(self.room)

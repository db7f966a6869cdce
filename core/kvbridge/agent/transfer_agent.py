"""``TransferAgent``: one rank's lifecycle and progress loop, composed of the peer table and one role side."""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.agent.buffers import LocalBuffers
from kvbridge.agent.config import HELLO_RESEND_S, AgentConfig
from kvbridge.agent.context import AgentContext
from kvbridge.agent.decode import DecodeSide
from kvbridge.agent.handles import Receiver, Sender
from kvbridge.agent.handshake import HelloBudget
from kvbridge.agent.liveness import LivenessListener, host_of
from kvbridge.agent.peers import Dropped, Handshake, Peer, PeerTable, heartbeat
from kvbridge.agent.plans import PlanCache
from kvbridge.agent.prefill import PrefillSide
from kvbridge.agent.send_room import WriteEnded
from kvbridge.backends.base import RegisteredBuffers, TransferBackend
from kvbridge.digests import readable
from kvbridge.errors import IncompatiblePeer, InsecureSetup, KVBridgeError, ProtocolError
from kvbridge.geometry import PoolLayout, Rank
from kvbridge.links import Link, SharedSecretLink
from kvbridge.logs import LineBudget, RateLimitedLog
from kvbridge.protocol.events import RoomEvent
from kvbridge.protocol.wire import (
    HANDSHAKES,
    Abort,
    Codec,
    Credit,
    Envelope,
    Goodbye,
    Heartbeat,
    Hello,
    KVPoll,
    Notice,
    RefusedHandshake,
    Role,
    StatusPush,
    TransferRequest,
    VersionMismatch,
    Welcome,
)
from kvbridge.registry import Registry
from kvbridge.slicing import target_ranks
from kvbridge.staging import StagingArea

log = logging.getLogger("kvbridge.agent")

BUSY_INTERVAL_S = 0.0002     # the progress thread's wait between steps while a transfer is under way
BUSY_WINDOW_S = 0.05         # how long frames, notices or a request's metadata keep it that fast
HANDSHAKE_BYTES_PER_S = 16 << 20    # Hello/Welcome bytes decoded per second (checked before decoding) ...
HANDSHAKE_BYTES_BURST = 64 << 20    # ... with this burst; beyond it they are dropped undecoded
SMALL_FRAME_BYTES = 64 << 10        # frames that arrive while the progress step waits for the lock are decoded
#                                     under it only up to this size (never a handshake); larger ones next step


class TransferAgent:
    """A prefill or decode rank: backend, registered buffers, peers, rooms.

    ``progress()`` drains control frames and backend notices, polls in-flight writes and runs heartbeats
    and timeouts; ``poll()`` of a Sender/Receiver calls it, and ``start()`` runs it on a background thread.
    """

    def __init__(self, *, layout: PoolLayout, buffers: Mapping[str, Sequence[Any]], role: Role, link: Link,
                 backend: str = "loopback", registry: Registry | None = None, instance: str = "",
                 name: str | None = None, config: AgentConfig | None = None,
                 staging: np.ndarray | None = None, clock: Callable[[], float] = time.monotonic,
                 incarnation: int | None = None) -> None:
        config = config or AgentConfig()
        registry = registry or Registry.build()
        self.name = name or f"{role.value}-{layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        if isinstance(link, SharedSecretLink) and (why := link.secret_mismatch(config.secret)):
            raise InsecureSetup(f"{self.name}: {why}")
        self.instance = instance
        # this start of the agent (never 0); a simulator passes its own seeded one
        self.incarnation = incarnation if incarnation else secrets.randbits(64) | 1
        self._clock = clock
        engine: TransferBackend = registry.create_backend(backend, name=self.name,
                                                          options=dict(config.backend_options))
        calls = registry.backend_calls(engine, backend, agent=self.name)
        self.buffers = LocalBuffers(layout=layout, calls=calls)
        self.context = AgentContext(name=self.name, role=role, layout=layout, config=config, registry=registry,
                                    state_types=registry.compose(layout), backend=engine, backend_name=backend,
                                    calls=calls, link=link, buffers=self.buffers,
                                    codec=Codec(config.secret, sender=self.name, address=link.address,
                                                incarnation=self.incarnation),
                                    incarnation=self.incarnation, clock=clock)
        plans = PlanCache(self.context)
        self.peers = PeerTable(self.context, plans)
        self.prefill = PrefillSide(self.context, self.peers, plans) if role is Role.PREFILL else None
        self.decode = DecodeSide(self.context, self.peers, plans, self._reconnect) if role is Role.DECODE else None
        self._reconnecting: dict[str, threading.Thread] = {}
        self.rejected_frames = 0             # frames refused, dropped or failing (metric kvbridge_rejected_frames)
        self._counter_lock = threading.Lock()
        self._log_budget = LineBudget()
        # Hellos/Welcomes are decoded outside the agent lock, within a byte budget checked before decoding
        self._handshake_bytes = HelloBudget(HANDSHAKE_BYTES_PER_S, HANDSHAKE_BYTES_BURST, clock, locked=True)
        self._deferred: deque[bytes] = deque()      # frames left for the next progress step (see progress())
        self._poll_gate = threading.Lock()          # held by the thread polling the backend (see progress())
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._busy_until = 0.0          # the progress thread polls fast until then (see start())
        self._engine_step_at = 0.0      # the next instant an engine's call runs a progress step (see poll_progress)
        self._closed = False
        try:
            self.buffers.register(buffers)
            self.buffers.setup_staging(staging, config.staging_bytes)
            unreadable = [c.name for c in layout.components
                          if not all(readable(v) for v in self.buffers.views.get(c.name) or [None])]
            if config.checksums and role is Role.DECODE and unreadable:
                raise KVBridgeError(f"AgentConfig.checksums verifies memory it can read (numpy arrays, torch tensors "
                                    f"on any device): this decode rank's buffers of {unreadable} are raw regions or "
                                    "other objects")
        except BaseException:
            calls.close()
            raise
        # a prefill rank's liveness listener: the decodes it writes to hold a connection its kernel closes
        # when this process ends (kvbridge.agent.liveness)
        self._liveness: LivenessListener | None = None
        # what the decode's liveness poll read outside the lock, until a progress step hands it to the peer table
        self._exits_read: deque[tuple[list[tuple[str, int]], list[tuple[tuple[str, int], str]]]] = deque()
        if role is Role.PREFILL and config.prove_writer_death:
            try:
                self._liveness = LivenessListener(host_of(link.address))
            except OSError as exc:
                log.warning("%s: no liveness listener (%s): decode ranks cannot prove this rank's exit", self.name,
                            exc)
            else:
                self.peers.liveness_address = self._liveness.address
        if role is Role.PREFILL and instance:
            link.publish(instance, layout.tp_size, layout.tp_rank)

    # ------------------------------------------------------------------ what engines and tests read
    @property
    def layout(self) -> PoolLayout:
        return self.context.layout

    @property
    def role(self) -> Role:
        return self.context.role

    @property
    def link(self) -> Link:
        return self.context.link

    @property
    def config(self) -> AgentConfig:
        return self.context.config

    @property
    def registry(self) -> Registry:
        return self.context.registry

    @property
    def backend(self) -> TransferBackend:
        return self.context.backend

    @property
    def backend_name(self) -> str:
        return self.context.backend_name

    @property
    def rank(self) -> Rank:
        return self.context.rank

    @property
    def state_types(self) -> tuple[Any, ...]:
        return self.context.state_types

    @property
    def registered(self) -> dict[str, RegisteredBuffers]:
        return self.buffers.registered

    @property
    def staging(self) -> StagingArea | None:
        return self.buffers.staging

    # ------------------------------------------------------------------ handshake
    def connect(self, instance: str, timeout_s: float | None = None) -> None:
        """Handshake with the prefill ranks of ``instance`` that our TP rank reads from (decode only).

        Blocks until every target accepted, refused (IncompatiblePeer with the reason) or timed out. A
        prefill rank that dies later is reconnected without a call (rooms opened meanwhile wait).
        """
        if self.role is not Role.DECODE:
            raise KVBridgeError("connect() is for decode ranks; prefill ranks wait for their decode peers")
        ctx = self.context
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else ctx.config.bootstrap_timeout_s)
        shake = self.connect_async(instance, deadline - time.monotonic())
        while True:
            self._progress_or_wait(0.005)
            with ctx.lock:
                refused, done = shake.refused, shake.done
            if refused is not None:
                raise IncompatiblePeer(refused.reason)
            if done:
                return
            if time.monotonic() > deadline:
                what = "publish all its ranks" if not shake.targets else "answer the handshake"
                raise TimeoutError(f"prefill instance {instance!r} did not {what} in time")

    def connect_async(self, instance: str, timeout_s: float | None = None) -> Handshake:
        """Start a handshake and return its record at once; the progress loop completes it."""
        if self.role is not Role.DECODE:
            raise KVBridgeError("connect() is for decode ranks; prefill ranks wait for their decode peers")
        ctx = self.context
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else ctx.config.bootstrap_timeout_s)
        with ctx.lock:
            shake = self.peers.begin(instance, {}, [])
        def look_up() -> None:
            info = ctx.link.lookup(instance)
            while (info is None or not info.complete) and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.01)
                info = ctx.link.lookup(instance)
            if info is None or not info.complete:
                log.warning("%s: prefill instance %r did not publish all its ranks in time (have %s)", self.name,
                            instance, sorted(info.addresses) if info else [])
                with ctx.lock:
                    self.peers.finish(shake)
                return
            ranks = target_ranks(info.tp_size, ctx.layout.tp_size, ctx.layout.tp_rank)
            with ctx.lock:
                self.peers.fill(shake, dict(info.addresses), list(ranks))
        threading.Thread(target=look_up, name=f"kvbridge-lookup-{self.name}", daemon=True).start()
        return shake

    def _reconnect(self, instance: str) -> None:
        """A room found a prefill rank of ``instance`` gone: look it up and shake hands again (once at a time)."""
        if any(s.instance == instance for s in self.peers.handshakes):
            return
        self.connect_async(instance)

    def _progress_or_wait(self, timeout_s: float) -> None:
        if self._thread is None:
            self.progress()
            self.link_wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def declare_gone(self, agent: str) -> None:
        """Tell the agent that peer ``agent`` no longer exists (its process or pod is gone for good), for
        backends that cannot prove it themselves: rooms it was writing into become safe to reuse.

        Only an engine that knows it (an orchestrator's word) should call this; silence is not proof.
        """
        with self.context.lock:
            self.peers.declare_gone(agent)

    def peer_versions(self) -> dict[str, int]:
        """The protocol version negotiated with each live peer, by agent name (5: the previous release, spoken
        to it with 6's features off; see docs/integrity.md, "Version skew")."""
        with self.context.lock:
            return {peer.agent: peer.version for peer in self.peers.peers.values() if peer.alive}

    def link_wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for control frames and handle them (each decoded outside the lock)."""
        for frame in self.context.link.recv(timeout_s):
            self.handle_frame(frame)

    # ------------------------------------------------------------------ rooms
    def sender(self, room: int) -> Sender:
        if self.prefill is None:
            raise KVBridgeError("sender() is for prefill ranks")
        with self.context.lock:
            self.prefill.open(room)
            record = self.prefill.rooms[room]
        return Sender(self.prefill, self.context.lock, self.poll_progress, room, record)

    def receiver(self, room: int, instance: str) -> Receiver:
        if self.decode is None:
            raise KVBridgeError("receiver() is for decode ranks")
        with self.context.lock:
            self.decode.open(room, instance)
            record = self.decode.rooms[room]
        return Receiver(self.decode, self.context.lock, self.poll_progress, self.layout, room, record)

    def events(self) -> list[RoomEvent]:
        """Rooms that became ready (prefill: every decode request came), finished, failed or became safe to reuse
        since the last call (each event once per room, a room's in order); one progress step first unless the
        progress thread runs. Instead of polling every room: ``for e in agent.events(): ...``. An event is queued
        by the transition that makes it true, so a state a handle's ``poll()``/``safe_to_reuse`` shows was
        announced by then. Events of cleared rooms are dropped."""
        self.poll_progress()
        with self.context.lock:
            return self.context.events.take()

    def poll_progress(self) -> None:
        """What a handle's poll() and ``events()`` run first: one progress step without a progress thread; beside
        one, nothing (so polling N rooms costs N dictionary reads), or with ``engine_progress_s`` set one step
        at most that often. The engine's thread holds the GIL while the progress thread waits for it, up to the
        interpreter's switch interval (5 ms) for each completion, notice or scatter it would handle; with the
        setting the engine's own calls handle them as they come, paying their CPU in its thread."""
        if self._thread is None:
            self.progress()
            return
        every = self.config.engine_progress_s
        if every is not None:
            now = time.monotonic()
            if now >= self._engine_step_at:
                self._engine_step_at = now + every
                self.progress()

    # ------------------------------------------------------------------ progress
    def _busy(self) -> bool:
        """A transfer is under way: frames (not heartbeats) or notices came within ``BUSY_WINDOW_S``, a prefill
        write is in flight or queued (CUDA event, staging space), a staged scatter runs, or a decode request's
        data is awaited (metadata sent within the window, or data arriving)."""
        now = self._clock()
        if now < self._busy_until:
            return True
        with self.context.lock:
            if self.prefill is not None and (self.prefill.queued_work
                                             or any(room.inflight for room in self.prefill.rooms.values())):
                return True
            if self.decode is not None:
                if self.decode.queued_work:
                    return True
                for room in self.decode.rooms.values():
                    if room.status is KVPoll.Transferring or (
                            room.metadata_at is not None and room.status is KVPoll.WaitingForInput
                            and now - room.metadata_at < BUSY_WINDOW_S):
                        return True
        return False

    def progress(self) -> None:
        """Drain control frames and backend notices, poll in-flight writes, heartbeats and timeouts."""
        ctx = self.context
        notices = ctx.calls.drain_notifications()
        undelivered = self._drain_notify_failures()
        if notices:
            self._busy_until = self._clock() + BUSY_WINDOW_S
        # each frame is decoded before the lock is taken (a large Hello must not stall the engine's calls),
        # then acts under it
        frames = self._take_deferred() + ctx.link.recv(0.0)
        for frame in frames:
            self.handle_frame(frame)
        for _peer, blob in notices:
            self.handle_frame(blob)
        # one thread at a time polls the backend for writes, from its list through the releases that its results
        # queue (they run when its hold below ends): a handle is never polled after another thread released it
        polling = self._poll_gate.acquire(blocking=False)
        try:
            if polling:
                self._poll_liveness()
            self._progress_step(self._poll_writes() if polling else [], undelivered)
        finally:
            if polling:
                self._poll_gate.release()

    def _poll_liveness(self) -> None:
        """Outside the lock: accept the decodes' liveness connections (a prefill rank's listener) and read which of
        ours to the prefill ranks closed (a decode rank's). What was read waits in ``_exits_read`` until a step
        hands it to the peer table under the lock (a step that fails before that loses none of it)."""
        if self._liveness is not None:
            self._liveness.poll()
        watch = self.peers.liveness
        if watch is not None:
            closed, unproven = watch.changes()
            if closed or unproven:
                self._exits_read.append((closed, unproven))

    def _progress_step(self, ended: list[WriteEnded], undelivered: list[tuple[str, bytes]]) -> None:
        """The part of a progress step under the agent lock: frames that queued meanwhile, notices to resend, the
        writes that ended, the liveness connections that closed, heartbeats and timers."""
        ctx = self.context
        with ctx.lock:
            # drained again under the lock, right before the liveness check: frames that queued up while
            # another thread held the lock (a long send) must count before a peer is judged silent; small
            # ones are handled here, handshakes and large ones are left for the next step (outside the lock)
            read_at = self._clock()
            for frame in ctx.link.recv(0.0):
                if len(frame) <= SMALL_FRAME_BYTES and not self._is_handshake(frame):
                    self.handle_frame(frame)
                else:
                    self._deferred.append(frame)
            self.peers.inbox_read_at = read_at     # every heartbeat that came before it was handled
            for peer_id, notice in undelivered:   # the engine took them but could not deliver: the link can
                peer = self.peers.get(peer_id)
                if peer is not None and peer.alive:
                    ctx.send_frame(peer.address, notice, "resent notice")
            now = self._clock()
            while self._exits_read:
                self.peers.on_liveness(*self._exits_read.popleft(), now)
            if self.prefill is not None:
                self.prefill.poll_inflight(ended)
            self.peers.tick(now, HELLO_RESEND_S)
            if self.prefill is not None:
                self.prefill.tick(now)
            if self.decode is not None:
                self.decode.tick(now)

    def _poll_writes(self) -> list[WriteEnded]:
        """Poll the backend for the writes it holds, outside the lock (the list of them is taken under it)."""
        if self.prefill is None:
            return []
        with self.context.lock:
            writes = self.prefill.posted_writes()
        return self.prefill.poll_writes(writes) if writes else []

    def _drain_notify_failures(self) -> list[tuple[str, bytes]]:
        """Optional backend method ``drain_notify_failures() -> [obj with .peer, .notice]``, called only when
        the backend declares ``Capability.NOTIFY_FAILURES``."""
        try:
            return self.context.calls.drain_notify_failures()
        except Exception:
            log.exception("%s: drain_notify_failures failed", self.name)
            return []

    def _take_deferred(self) -> list[bytes]:
        if not self._deferred:
            return []
        out = []
        while True:
            try:
                out.append(self._deferred.popleft())
            except IndexError:
                return out

    def _is_handshake(self, frame: bytes) -> bool:
        """Does ``frame`` (unauthenticated: used only to decide where it is decoded) carry a Hello/Welcome?"""
        return self.context.codec.kind(frame) in HANDSHAKES

    def _open(self, frame: bytes) -> Envelope | Exception:
        """Check and decode one frame; needs no lock (call it without holding one). A handshake counts
        against a byte budget before it is decoded. The exception instead of the envelope when it fails."""
        codec = self.context.codec
        try:
            sealed = codec.check(frame)
            if sealed.kind in HANDSHAKES and not self._handshake_bytes.take(len(frame)):
                raise Dropped(f"{sealed.kind} of {len(frame)} bytes from {sealed.head.sender!r}: more than "
                              f"{HANDSHAKE_BYTES_PER_S} handshake bytes per second (not decoded)")
            return codec.unseal(sealed)
        except Exception as exc:  # noqa: BLE001 - counted and logged under the lock by _act
            return exc

    def handle_frame(self, frame: bytes) -> None:
        """Authenticate, decode, admit and act on one control frame; never raises: a bad frame is logged
        and counted. The frame is decoded before the agent lock is taken (unless the caller holds it)."""
        opened = self._open(frame)
        if isinstance(opened, ProtocolError) and not isinstance(opened, (RefusedHandshake, VersionMismatch)):
            self._count_rejected()          # forged or malformed: counted and logged without the agent lock
            self._log_rejected(logging.WARNING if isinstance(opened, Dropped) else logging.ERROR,
                               "dropped control frame" if isinstance(opened, Dropped) else "rejected control frame",
                               opened)
            return
        with self.context.lock:
            self._act(opened)

    def _count_rejected(self) -> None:
        with self._counter_lock:
            self.rejected_frames += 1

    def _act(self, opened: Envelope | Exception) -> None:
        """Admit and act on a decoded frame, or count and log why it was not (call with the lock held)."""
        try:
            if isinstance(opened, Exception):
                raise opened
            env = opened
            peer = self.peers.admit(env)
            self._dispatch(env, peer)
        except RefusedHandshake as exc:
            self._count_rejected()
            self._log_rejected(logging.ERROR, "refused handshake", exc)
            self.peers.refuse_handshake(exc)
        except VersionMismatch as exc:
            self._count_rejected()
            self._log_rejected(logging.ERROR, "rejected control frame", exc)
            self.peers.refuse_other_version(exc)
        except Dropped as exc:
            self._count_rejected()
            # a notice can reach us twice by design (with the data and over the link): not worth a warning
            if exc.duplicate_notice:
                log.debug("%s: dropped control frame: %s", self.name, exc)
            else:
                self._log_rejected(logging.WARNING, "dropped control frame", exc)
        except ProtocolError as exc:
            self._count_rejected()
            self._log_rejected(logging.ERROR, "rejected control frame", exc)
        except Exception as exc:           # logged (rate-limited, with its traceback), never raised
            self._count_rejected()
            with self._counter_lock:
                logged = self._log_budget.take("error")
                note = self._log_budget.suppressed_note("error") if logged else ""
            if logged:
                log.error("%s: error while handling a control frame%s", self.name, note, exc_info=exc)

    def _log_rejected(self, level: int, what: str, exc: Exception) -> None:
        """One line per rejected frame, at most 20 per 10 s per kind: a flood of forged frames must not
        become a flood of log lines (``rejected_frames`` counts them all)."""
        with self._counter_lock:
            if not self._log_budget.take(what):
                return
            note = self._log_budget.suppressed_note(what)
        log.log(level, "%s: %s: %s%s", self.name, what, exc, note)

    def _dispatch(self, env: Envelope, peer: Peer | None) -> None:
        message = env.body
        if not isinstance(message, Heartbeat):     # heartbeats alone do not make the progress thread poll fast
            self._busy_until = self._clock() + BUSY_WINDOW_S
        if isinstance(message, Hello):
            self.peers.on_hello(message, env)
        elif isinstance(message, Welcome):
            self.peers.on_welcome(message, env)
        elif isinstance(message, Abort) and peer is None and self.prefill is not None:
            # a decode we forgot (silent for twice the peer timeout, e.g. a long partition) asks whether our
            # writes into its room are over: we hold nothing for it any more, so it gets its acknowledgement
            self.prefill.on_abort(message, env)
        elif peer is None and isinstance(message, Heartbeat) and self.peers.awaits_welcome_from(env.address):
            # a prefill of an earlier release may beat before its Welcome left (it made us a beat target on our
            # Hello): early, not foreign; the Welcome behind it admits the peer and its next beats count
            log.debug("%s: heartbeat from %s came before its Welcome (an older release's order)", self.name,
                      env.sender)
        elif peer is None:
            raise Dropped(f"{type(message).__name__} from {env.sender!r}, which is not a peer")
        elif isinstance(message, Heartbeat):
            self.peers.on_heartbeat(message, peer)
        elif isinstance(message, Goodbye):
            self.peers.on_goodbye(peer)
        elif isinstance(message, TransferRequest):
            if self.prefill is None:
                raise ProtocolError(f"{self.name} is a decode rank and got a transfer request from {message.agent}")
            self.prefill.on_request(message, peer)
        elif isinstance(message, Abort):
            if self.prefill is not None:
                self.prefill.on_abort(message, env)
            elif self.decode is not None:
                self.decode.on_abort(message, env)
        elif isinstance(message, Notice):
            if self.decode is not None:
                self.decode.on_notice(message, env)
        elif isinstance(message, Credit):
            if self.prefill is None:
                raise ProtocolError(f"{self.name} is a decode rank and got a staging credit from {message.agent}")
            self.prefill.on_credit(message, env)
        elif isinstance(message, StatusPush):
            if self.decode is not None:
                self.decode.on_status(message, env)

    # ------------------------------------------------------------------ lifecycle
    def _beat_forever(self) -> None:
        """Heartbeats from their own thread, never behind the agent lock: a long send (millions of
        descriptors) must not make this rank look dead to its peers."""
        ctx = self.context
        seq = 0
        interval = ctx.config.heartbeat_interval_s
        late_after = max(1.0, ctx.config.peer_timeout_s / 3)
        woke = time.monotonic()
        while not self._stop.wait(interval):
            seq += 1
            last, woke = woke, time.monotonic()
            if woke - last - interval > late_after:     # the peers heard nothing from us meanwhile
                log.warning("%s: the heartbeat thread ran %.1f s late (this process got no CPU, or something held "
                            "the GIL that long); peers judge a rank dead after %.1f s of silence", self.name,
                            woke - last - interval, ctx.config.peer_timeout_s)
            for _agent, target in self.peers.beat_targets():
                now = ctx.clock()         # the clock our write leases are counted on (an echo comes back in it)
                message = heartbeat(agent=self.name, address=ctx.link.address, seq=seq, now=now,
                                    last_beat=target.last_beat)
                beat = ctx.codec.encode(message, to=target.address, to_incarnation=target.incarnation)
                try:
                    ctx.link.send(target.address, beat)
                except Exception:  # noqa: BLE001 - a gone peer is the liveness check's business
                    log.debug("%s: heartbeat to %s not sent", self.name, target.address)

    def start(self, interval_s: float = 0.005, busy_interval_s: float = BUSY_INTERVAL_S) -> None:
        """Run progress() on a background thread (for processes whose engine polls rarely), and send
        heartbeats from a second one.

        The thread waits ``interval_s`` for control frames between steps, and only ``busy_interval_s``
        while a transfer is under way (writes in flight, a request's data awaited, frames or notices just
        handled): backends deliver completion notices that must be polled, and a 5 ms tick would add up
        to 5 ms to every request (it did: 3.8 ms p50 for 128 tokens on H100s)."""
        if self._thread is not None:
            return
        self.peers.beats_threaded = True
        threading.Thread(target=self._beat_forever, name=f"kvbridge-beat-{self.name}", daemon=True).start()

        errors = RateLimitedLog(log, "%s: progress failed", self.name)   # not a traceback every interval_s

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.progress()
                    errors.clear()
                    self.link_wait(busy_interval_s if self._busy() else interval_s)
                except Exception as exc:  # noqa: BLE001 - logged, at a bounded rate
                    errors.error(exc)
                    time.sleep(interval_s)

        self._thread = threading.Thread(target=loop, name=f"kvbridge-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ drain
    def begin_drain(self, reason: str = "shutting down") -> None:
        """Take no new rooms from now on (``sender()``/``receiver()`` raise :class:`~kvbridge.Draining`, a
        decode's request for a room we have no sender for is answered Failed with the reason, so the engine
        can route it elsewhere); rooms in flight go on. ``drained`` says when they are all over."""
        with self.context.lock:
            if self.prefill is not None:
                self.prefill.begin_drain(reason)
            if self.decode is not None:
                self.decode.draining = reason

    @property
    def drained(self) -> bool:
        """Every room is over (Success or Failed) and safe to reuse: closing now loses nothing."""
        self.poll_progress()
        with self.context.lock:
            return self._side().unsettled() == 0

    def _side(self) -> PrefillSide | DecodeSide:
        side = self.prefill if self.prefill is not None else self.decode
        assert side is not None
        return side

    def drain(self, timeout_s: float, reason: str = "shutting down") -> dict[str, int]:
        """Stop taking rooms, let every room in flight finish (the engine keeps sending and polling meanwhile),
        fail what is left after ``timeout_s`` and wait (up to the peer timeout) until nothing of it can be
        written or read any more, then tell the peers goodbye and close. Returns counts of the rooms:
        ``{"success": n, "failed": n, "unsafe": n}`` (unsafe: still not safe to reuse when we closed).

            signal.signal(signal.SIGTERM, lambda *_: agent.drain(30.0))
        """
        self.begin_drain(reason)
        deadline = time.monotonic() + timeout_s
        while not self.drained and time.monotonic() < deadline:
            self._progress_or_wait(0.005)
        side = self._side()
        if not self.drained:
            with self.context.lock:         # the role object decides under the lock; the aborts leave at its release
                for room_id in list(side.rooms):
                    if side.status(room_id) not in (KVPoll.Success, KVPoll.Failed):
                        side.abort(room_id, f"drain timeout: {self.name} stopped after {timeout_s} s ({reason})")
            settle = time.monotonic() + self.config.peer_timeout_s
            while not self.drained and time.monotonic() < settle:
                self._progress_or_wait(0.005)
        with self.context.lock:
            statuses = [room.status for room in side.rooms.values()]
            report = {"success": statuses.count(KVPoll.Success), "failed": statuses.count(KVPoll.Failed),
                      "unsafe": side.unsettled()}
        if report["unsafe"]:
            log.error("%s: drained with rooms still unsafe to reuse (%s)", self.name, report)
        self.close()
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        ctx = self.context
        with ctx.lock:
            self._side().end_traces(f"{self.name} closed before the room ended")
            if self.prefill is not None:    # the notices the backend took go again over the link, before the goodbye
                again = self.prefill.resend_unconfirmed()
                if again:
                    log.debug("%s: sent %d notices again over the control link before its goodbye", self.name, again)
            self.peers.say_goodbye()
        self.buffers.deregister_all(self.name)     # after the lock's release: the goodbyes left first
        ctx.calls.close()
        ctx.link.close()
        if self._liveness is not None:
            self._liveness.close()          # after the backend: the decodes may count us gone from here on
        if self.peers.liveness is not None:
            self.peers.liveness.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

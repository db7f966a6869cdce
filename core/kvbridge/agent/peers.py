"""Peers: admission of control frames, the handshake (Hello/Welcome), incarnations, liveness, departure.

Every frame passes :meth:`PeerTable.admit` first: it must be for this incarnation of us, not a replay,
and from the current incarnation of a known peer (a Hello or Welcome may introduce a new one). A peer
that restarts under the same name is a new incarnation: the old one's rooms fail before anything else.
The decode side sends Hellos from ``connect()``; each call owns one :class:`Handshake` record.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.agent.actions import CallBackend, SendFrame
from kvbridge.agent.config import GOODBYE_GRACE_S
from kvbridge.agent.context import AgentContext
from kvbridge.agent.handshake import (
    Handshake,
    HandshakeState,
    HandshakeTarget,
    HelloBudget,
    check_remote_buffers,
    refusal,
)
from kvbridge.agent.lateness import Since
from kvbridge.agent.liveness import LivenessWatch
from kvbridge.agent.plans import PlanCache
from kvbridge.backends.calls import CallKind
from kvbridge.errors import IncompatiblePeer, ProtocolError
from kvbridge.geometry import PoolLayout
from kvbridge.handshake import check_compatible
from kvbridge.links import PeerQueues
from kvbridge.protocol.records import PeerInfo
from kvbridge.protocol.states import (
    LIVE_PEER,
    PEER,
    PeerEvent,
    PeerState,
)
from kvbridge.protocol.wire import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Envelope,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    Notice,
    RefusedHandshake,
    ReplayWindow,
    Role,
    VersionMismatch,
    Welcome,
    noted_version,
    speaks_note,
)
from kvbridge.specs import Capability

log = logging.getLogger("kvbridge.agent")

_WINDOWS = 4096              # replay windows remembered (sender incarnation x channel), oldest forgotten
_NEW_PEERS_PER_S = 50.0      # Hellos that would admit a new peer (or incarnation), per second ...
_NEW_PEERS_BURST = 200.0     # ... with this burst
_REFUSED_GRACE_S = 2.0       # a refusal sent where we hold no peer gets this long to leave, then the link forgets
_REFUSED_KEPT = 256          # ... the address (its queue and socket); at most this many wait at once
_DOWNGRADE_NOTE = {      # what protocol 5 lacks, as each side sees it
    Role.DECODE: ("it names no liveness listener: if that prefill process dies, the rooms it wrote to fail at the "
                  "peer timeout but become safe to reuse only by its acknowledgement, declare_gone, or a backend that "
                  "proves its exit (loopback does)"),
    Role.PREFILL: ("it holds no liveness connection: if this process dies, that decode's rooms fail at its peer "
                   "timeout but become safe to reuse there only by declare_gone or a backend that proves our exit"),
}


def writer_lease_s(ctx: AgentContext) -> float:
    """How long a prefill keeps writing to a decode without news of it: twice the peer timeout past the sent_at
    of its last heartbeat the decode echoed (a decode fails the rooms at one peer timeout of silence, and, where
    it knows the fabric's flight bound, makes them safe at the lease plus that bound; docs/integrity.md, "Write
    leases")."""
    return 2.0 * ctx.config.peer_timeout_s


class Lease(enum.Enum):
    """A prefill's write lease to one decode, as a post finds it."""

    VALID = "valid"               # an echo of our heartbeats came within the lease: post
    UNCONFIRMED = "unconfirmed"   # it ran out, but our inbox was not read since (this rank held its lock, a long
    #                               send) or the decode still talks to us: the write waits for a renewing echo
    EXPIRED = "expired"           # it ran out, a read since brought no echo and the decode is silent: it may have
    #                               handed the pages back, nothing more is posted to it


class Dropped(ProtocolError):
    """A well-formed frame that must not act: stale incarnation, replay, non-participant."""

    def __init__(self, message: str, *, duplicate_notice: bool = False) -> None:
        super().__init__(message)
        self.duplicate_notice = duplicate_notice


@dataclass(slots=True, kw_only=True)
class Peer:
    """An agent we shook hands with, in one incarnation."""

    agent: str
    address: str
    incarnation: int
    layout: PoolLayout
    endpoint: bytes                        # its backend endpoint (a backend may confirm it is gone)
    info: PeerInfo | None                  # set on the prefill side (where we write to)
    last_seen: float
    state: PeerState = PeerState.ALIVE     # changed only through ``PEER`` (kvbridge.protocol.states)
    goodbye_at: float | None = None        # notices on the engine's own channel may still be in flight
    died_at: float | None = None
    # its last heartbeat's sent_at (its clock, echoed back to it) and when we got it (our clock): one tuple, replaced
    # whole, because the heartbeat thread reads it without the agent lock
    last_beat: tuple[float, float] = (0.0, 0.0)
    rtt_s: float | None = None             # heartbeat round trip, from the echo of our own sent_at
    version: int = PROTOCOL_VERSION        # the protocol version negotiated at its handshake (every frame's)
    writer_lease_s: float = 0.0            # the prefill of this pair posts no write once this long passed since
    #                                        the sent_at of its last heartbeat the decode echoed (0: no lease)
    lease_until: float = math.inf          # prefill side: posting to this decode is allowed until then (our clock)
    lease_epoch: int = 0                   # the prefill's count of leases granted, as of this record's Welcome
    lease_over: bool = False               # decode side: silent past its lease: this record can write no more
    backend_gone: bool = False             # decode side: the backend proved it can write no more (writer_gone)
    gone_asked: bool = False               # ... a writer_gone call about it is queued or running
    seen: Since = Since(at=0.0, mark=0.0)  # last_seen as a timer of the rank's own lateness (agent/lateness.py):
    #                                        time this rank itself was not running is not the peer's silence

    @property
    def alive(self) -> bool:
        """Still a peer: alive, or leaving after its goodbye (its last notices may still come)."""
        return self.state in LIVE_PEER

    def step(self, event: PeerEvent) -> PeerState:
        """Move through the peer table; an illegal event raises in strict mode, else is logged and ignored
        (a peer has no room to fail: its rooms learn of it through the death callbacks)."""
        self.state, illegal = PEER.advance(self.state, event, f"peer {self.agent}")
        if illegal:
            log.error("%s", illegal)
        return self.state

    def beat(self, *, agent: str, address: str, seq: int, now: float) -> Heartbeat:
        """Our next heartbeat to this peer, echoing the last one it sent us."""
        return heartbeat(agent=agent, address=address, seq=seq, now=now, last_beat=self.last_beat)


def heartbeat(*, agent: str, address: str, seq: int, now: float, last_beat: tuple[float, float]) -> Heartbeat:
    """A heartbeat sent at ``now`` echoing the peer's last one (``last_beat``: its send time on its clock, and when
    we read it on ours; (0, 0) when none came yet)."""
    sent_at, received_at = last_beat
    held = now - received_at if sent_at else 0.0
    return Heartbeat(agent=agent, address=address, seq=seq, sent_at=now, echo=sent_at, echo_held=held)


@dataclass(frozen=True, slots=True)
class BeatTarget:
    """What the heartbeat thread needs of one peer, kept apart from the peer table (it never takes the agent lock,
    so that a long decision under it cannot make this rank look dead): where, which incarnation, the echo."""

    address: str
    incarnation: int
    last_beat: tuple[float, float] = (0.0, 0.0)


def _ignored(_result: object, _error: BaseException | None) -> None:
    """A liveness connection closed: nothing to hand back (closing a socket does not fail in a way we act on)."""


PeerDied = Callable[[Peer, str], None]
InUse = Callable[[str], bool]


class PeerTable:
    """Every peer of one agent; frame admission, handshakes, heartbeats, silence, departure."""

    def __init__(self, ctx: AgentContext, plans: PlanCache) -> None:
        self._ctx = ctx
        self._plans = plans
        self.peers: dict[str, Peer] = {}
        self.handshakes: list[Handshake] = []
        self.instances: dict[str, dict[int, str]] = {}        # prefill instance -> rank -> agent
        self._beat_targets: dict[str, BeatTarget] = {}         # the heartbeat thread's, under _beat_lock
        self._beat_lock = threading.Lock()
        self._windows: OrderedDict[tuple[str, int, bool], ReplayWindow] = OrderedDict()
        self._on_death: list[PeerDied] = []
        self._in_use: list[InUse] = []
        self._on_revive: list[Callable[[Peer], None]] = []
        self._on_lease_reset: list[PeerDied] = []
        self._on_proven_gone: list[Callable[[Peer], None]] = []
        self._last_beat = 0.0
        self._beat_seq = 0
        self._hellos = HelloBudget(_NEW_PEERS_PER_S, _NEW_PEERS_BURST, ctx.clock)
        self.beats_threaded = False
        #: when the last read of the link whose small frames were all handled began (prefill: a write lease that
        #: ran out before it may still be renewed by an echo that was waiting in the inbox)
        self.inbox_read_at = -math.inf
        self._lease_epochs = 0           # prefill: leases granted (each Welcome that admits a peer starts one)
        self.dropped_frames = 0
        self._declared_gone: set[tuple[str, int]] = set()
        # decode: one connection to each prefill rank (kvbridge.agent.liveness), exits seen but in their grace
        self.liveness = LivenessWatch() if ctx.role is Role.DECODE and ctx.config.prove_writer_death else None
        self._exits: dict[tuple[str, int], float] = {}
        self.liveness_address = ""              # prefill: our listener, named in every Welcome
        self._refused: OrderedDict[str, float] = OrderedDict()   # addresses answered with a refusal, when
        self._queues_of: object = None          # the link ``_queues`` was last answered for
        self._queues: PeerQueues | None = None

    def _peer_queues(self) -> PeerQueues | None:
        """The link when it queues per address (:class:`PeerQueues`), else None; the runtime protocol check is
        slow (tens of microseconds), so it runs once per link object."""
        link = self._ctx.link
        if link is not self._queues_of:
            self._queues_of, self._queues = link, link if isinstance(link, PeerQueues) else None
        return self._queues

    def on_death(self, callback: PeerDied) -> None:
        self._on_death.append(callback)

    def on_lease_reset(self, callback: PeerDied) -> None:
        """Prefill: ``callback(peer, reason)`` when a decode says Hello again after our write lease to it ran out:
        its rooms here must fail (telling it) before a new lease begins."""
        self._on_lease_reset.append(callback)

    def on_revive(self, callback: Callable[[Peer], None]) -> None:
        """``callback(peer)`` when a peer judged dead by silence speaks again in the same incarnation."""
        self._on_revive.append(callback)

    def on_proven_gone(self, callback: Callable[[Peer], None]) -> None:
        """Decode: ``callback(peer)`` when the backend answered that a dead writer can write no more."""
        self._on_proven_gone.append(callback)

    def on_in_use(self, callback: InUse) -> None:
        """``callback(agent)`` says whether rooms still refer to a peer (it is kept until they do not)."""
        self._in_use.append(callback)

    def get(self, agent: str) -> Peer | None:
        return self.peers.get(agent)

    def __getitem__(self, agent: str) -> Peer:
        return self.peers[agent]

    def post(self, peer: Peer, message: Message) -> None:
        self._ctx.post(peer.address, message, incarnation=peer.incarnation)

    # ---------------------------------------------------------------- admission of every frame
    def admit(self, env: Envelope) -> Peer | None:
        """Check a decoded frame against incarnations and replays; the sender's peer record if known.

        Raises :class:`Dropped` for a frame that must not act (it is logged and counted by the caller).
        """
        body, ctx = env.body, self._ctx
        introduces = isinstance(body, Hello) or (isinstance(body, Welcome) and not body.accepted)
        if env.to_incarnation != ctx.incarnation and not (introduces and env.to_incarnation == 0):
            raise Dropped(f"{type(body).__name__} from {env.sender!r} is for incarnation {env.to_incarnation:#x}, "
                          f"this agent is {ctx.incarnation:#x} (a predecessor's frame)")
        key = (env.sender, env.incarnation, isinstance(body, Notice))
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = ReplayWindow()
            while len(self._windows) > _WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        if not window.accept(env.seq):
            raise Dropped(f"replayed {type(body).__name__} from {env.sender!r} (sequence {env.seq})",
                          duplicate_notice=isinstance(body, Notice))
        peer = self.peers.get(env.sender)
        if peer is None:
            return None
        if peer.incarnation != env.incarnation:
            if isinstance(body, (Hello, Welcome)):
                return None            # a new incarnation introduces itself: the handlers replace the peer
            raise Dropped(f"{type(body).__name__} from incarnation {env.incarnation:#x} of {env.sender!r}, "
                          f"which is known as {peer.incarnation:#x}")
        if env.version != peer.version and not isinstance(body, (Hello, Welcome)):
            raise Dropped(f"{type(body).__name__} of protocol {env.version} from {env.sender!r}, which negotiated "
                          f"{peer.version}")
        # the instant the frame is handled, read now: a frame drained after the lock was taken came after ctx.now,
        # and the silence fence (and the write lease the decode echoes) must not count from before it arrived
        seen = self._ctx.clock()
        peer.last_seen, peer.seen = seen, self._ctx.lateness.since(seen)
        if isinstance(body, Goodbye):
            return peer
        if peer.state is PeerState.SILENT:
            self._revive(peer)
        else:
            peer.step(PeerEvent.FRAME)
        return peer

    def _beat_to(self, peer: Peer) -> None:
        with self._beat_lock:
            self._beat_targets[peer.agent] = BeatTarget(peer.address, peer.incarnation, peer.last_beat)

    def _stop_beats(self, agent: str) -> None:
        with self._beat_lock:
            self._beat_targets.pop(agent, None)

    def beat_targets(self) -> list[tuple[str, BeatTarget]]:
        """The peers the heartbeat thread beats to, with their echoes (a snapshot; takes only the beat lock)."""
        with self._beat_lock:
            return list(self._beat_targets.items())

    def seen_up_to(self, agent: str, incarnation: int) -> int:
        """The highest sequence number admitted from that incarnation of ``agent``, notices or not (0: none). A
        sender numbers its frames to us in the order it makes them, so a frame numbered at most this was made
        before we sent anything that comes after this call."""
        tops = [w.top for key in ((agent, incarnation, False), (agent, incarnation, True))
                if (w := self._windows.get(key)) is not None]
        return max(tops, default=0)

    def _revive(self, peer: Peer) -> None:
        """A peer judged dead by silence spoke again in the same incarnation: it is a peer again (its
        failed rooms stay failed)."""
        log.warning("%s: peer %s is back after being judged dead; re-admitted", self._ctx.name, peer.agent)
        peer.step(PeerEvent.FRAME)
        peer.died_at = None
        for callback in self._on_revive:
            callback(peer)
        self._beat_to(peer)
        self._link_up(peer.address)

    def _retire(self, old: Peer, why: str) -> None:
        """End an old record of a peer that comes back changed: its rooms fail, its resources go."""
        if old.alive:
            self._died(old, why, PeerEvent.RETIRE)
        else:                   # already dead: its rooms still hear that this incarnation is over for good
            for callback in self._on_death:
                callback(old, f"peer {old.agent} {why}")
        self._drop(old, keep_watch=True)

    def _insert(self, new: Peer, *, beat: bool = True) -> None:
        """Admit a peer record; ``beat=False`` leaves it off the heartbeat thread's targets (a decode whose Welcome
        has not left yet: the thread sends outside the ordered batches, and a beat before the Welcome is a frame
        from a stranger to the decode)."""
        self.peers[new.agent] = new
        if beat:
            self._beat_to(new)
        self._link_up(new.address)
        self._ctx.codec.speak(new.address, new.incarnation, new.version)
        if new.version < PROTOCOL_VERSION:
            log.warning("%s: peer %s (incarnation %#x) speaks protocol %d, the previous release's; talking %d to it "
                        "(%s)", self._ctx.name, new.agent, new.incarnation, new.version, new.version,
                        _DOWNGRADE_NOTE[self._ctx.role])
        else:
            log.debug("%s: peer %s (incarnation %#x) speaks protocol %d", self._ctx.name, new.agent, new.incarnation,
                      new.version)

    def _link_up(self, address: str) -> None:
        link = self._peer_queues()
        if link is not None:
            link.peer_up(address)

    def _link_down(self, peer: Peer) -> None:
        """``peer`` died or left: the link drops the frames queued to its address and bounds later ones (the
        fence's abort requests to a dead writer would otherwise pile up), unless a live peer listens there."""
        link = self._peer_queues()
        if link is None or any(p.alive and p.address == peer.address for p in self.peers.values()):
            return
        lost = link.peer_down(peer.address)
        if lost:
            log.info("%s: dropped %d frames queued to %s at %s (gone)", self._ctx.name, lost, peer.agent,
                     peer.address)

    def _drop(self, peer: Peer, *, keep_watch: bool = False) -> None:
        """Release everything held for a peer record (backend peer, caches, link socket); ``keep_watch``: a
        replaced incarnation's liveness connection stays (its exit still fences the rooms it wrote to)."""
        ctx = self._ctx
        self._plans.forget(peer.agent)
        if peer.info is not None:
            ctx.act(CallBackend(kind=CallKind.REMOVE_PEER, args=(peer.agent,)))    # a failure is logged
        if peer.state is not PeerState.RETIRED:
            peer.step(PeerEvent.RETIRE)
        if self.liveness is not None and not keep_watch:
            ctx.work("liveness forget", functools.partial(self.liveness.forget, (peer.agent, peer.incarnation)),
                     _ignored)
        ctx.codec.forget(peer.address, peer.incarnation)
        if self.peers.get(peer.agent) is peer:
            del self.peers[peer.agent]
            self._stop_beats(peer.agent)
        self._forget_address(peer.address)

    def _forget_address(self, address: str) -> None:
        """Let the link release what it holds for an address no peer of ours listens at (optional link
        method ``forget``: queue and socket)."""
        if not any(p.address == address for p in self.peers.values()):
            queues = self._peer_queues()
            forget = queues.forget if queues is not None else getattr(self._ctx.link, "forget", None)
            if forget is not None:
                forget(address)

    def _refuse(self, address: str, welcome: Welcome, incarnation: int = 0, version: int | None = None) -> None:
        """Send a refusal; the link forgets the address a little later unless a peer listens there (a Hello
        may name any reply address: unanswered ones must not keep a queue and a socket each for good)."""
        self._ctx.post(address, welcome, incarnation=incarnation, version=version)
        if any(p.address == address for p in self.peers.values()):
            return
        self._refused[address] = self._ctx.now
        self._refused.move_to_end(address)
        while len(self._refused) > _REFUSED_KEPT:
            self._forget_address(self._refused.popitem(last=False)[0])

    def _forget_refused(self, now: float) -> None:
        while self._refused:
            address, at = next(iter(self._refused.items()))
            if now - at < _REFUSED_GRACE_S:
                return
            del self._refused[address]
            self._forget_address(address)

    # ---------------------------------------------------------------- decode side: connect()
    def hello(self) -> Hello:
        ctx = self._ctx
        return Hello(version=PROTOCOL_VERSION, agent=ctx.name, address=ctx.link.address, role=ctx.role,
                     layout=ctx.layout, backend=ctx.backend_name, endpoint=ctx.backend.endpoint,
                     buffers=ctx.buffers.remote())

    def begin(self, instance: str, addresses: dict[int, str], ranks: list[int]) -> Handshake:
        """Start a handshake with ``ranks`` of ``instance`` (decode side; call under the lock)."""
        shake = Handshake(instance=instance,
                          targets={addresses[r]: HandshakeTarget(rank=r, address=addresses[r]) for r in ranks})
        self.instances.setdefault(instance, {})
        self.handshakes.append(shake)
        return shake

    def fill(self, shake: Handshake, addresses: dict[int, str], ranks: list[int]) -> None:
        """Give a handshake started before its instance was looked up its targets (call under the lock)."""
        shake.targets = {addresses[r]: HandshakeTarget(rank=r, address=addresses[r]) for r in ranks}
        shake.next_hello = 0.0

    def finish(self, shake: Handshake) -> None:
        """Record the instance's rank -> agent map of a completed handshake (call under the lock)."""
        if shake in self.handshakes:
            self.handshakes.remove(shake)
        if shake.done:
            self.instances[shake.instance] = {t.rank: t.agent for t in shake.targets.values()}

    def _send_hellos(self, now: float, resend_s: float) -> None:
        """(Re)send our Hello to every handshake target that has not answered: a link may drop a frame
        while its connection is still being set up."""
        if not self.handshakes:
            return
        due = [s for s in self.handshakes if now >= s.next_hello and s.silent]
        if not due:
            return
        hello = self.hello()
        for shake in due:
            shake.next_hello = now + resend_s
            for address in shake.silent:
                self._ctx.post(address, hello, version=shake.targets[address].version)

    def _targets_at(self, address: object) -> list[HandshakeTarget]:
        return [s.targets[address] for s in self.handshakes if isinstance(address, str) and address in s.targets]

    def awaits_welcome_from(self, address: object) -> bool:
        """Whether a handshake of ours waits for the Welcome of the agent at ``address``."""
        return any(t.state is HandshakeState.WAITING for t in self._targets_at(address))

    def on_welcome(self, welcome: Welcome, env: Envelope) -> None:
        targets = self._targets_at(env.address)
        known = self.peers.get(welcome.agent)
        if not targets and known is not None and known.address == env.address:
            return       # the answer to a Hello repeated while the first answer was on its way
        if not targets:
            raise Dropped(f"unexpected Welcome from {welcome.agent} at {env.address}")
        if not welcome.accepted and self._speak_older(targets, welcome, env):
            return
        if welcome.accepted and self._speak_newest(targets, welcome, env):
            return
        reason = ""
        minimum = self._ctx.config.min_protocol_version
        if env.version < minimum:
            reason = (f"prefill {welcome.agent} at {env.address} speaks protocol {env.version}, below this "
                      f"agent's min_protocol_version {minimum} (this release speaks {PROTOCOL_VERSION})"
                      + ("" if welcome.accepted else f"; it refused our Hello: {welcome.reason}"))
        elif not welcome.accepted or welcome.layout is None:
            reason = f"prefill {welcome.agent} refused the handshake: {welcome.reason}"
        else:
            try:
                check_compatible(welcome.layout, self._ctx.layout, self._ctx.state_by_name)
            except IncompatiblePeer as exc:
                reason = str(exc)
        for target in targets:
            if reason:
                target.state, target.reason = HandshakeState.REFUSED, reason
            else:
                target.state, target.agent = HandshakeState.ACCEPTED, welcome.agent
        if not reason and welcome.layout is not None:
            renewed = (known is not None and known.incarnation == env.incarnation and known.lease_over
                       and welcome.lease_epoch > known.lease_epoch)
            if known is not None and known.incarnation == env.incarnation and not renewed:
                known.lease_epoch = max(known.lease_epoch, welcome.lease_epoch)
                if known.state is PeerState.SILENT:
                    self._revive(known)
            else:
                if known is not None:
                    self._retire(known, f"restarted as incarnation {env.incarnation:#x}" if not renewed else
                                 f"granted a new write lease (epoch {welcome.lease_epoch}) after its last ran out")
                fresh = Peer(agent=welcome.agent, address=env.address, incarnation=env.incarnation,
                             layout=welcome.layout, endpoint=welcome.endpoint, info=None, last_seen=self._ctx.clock(),
                             seen=self._ctx.lateness.since(self._ctx.clock()),
                             version=env.version, writer_lease_s=welcome.writer_lease_s,
                             lease_epoch=welcome.lease_epoch)
                self._insert(fresh)
                self.watch_exit(fresh, welcome.liveness, targets)
        self._finish_answered()

    def _finish_answered(self) -> None:
        """End the handshakes every target answered (accepted, its liveness connection tried) or one refused."""
        for shake in self.handshakes:
            if shake.done:
                self._check_one_page_size(shake)
        for shake in [s for s in self.handshakes if s.done or s.refused is not None]:
            self.finish(shake)

    def _check_one_page_size(self, shake: Handshake) -> None:
        """The prefill ranks a decode rank reads one request from must share one page size (each pairs with ours
        whatever it is, but a request's pages are one list for all of them): else every target is refused, naming
        each rank's size, and ``connect()`` raises instead of every request failing later."""
        sizes = {t.rank: p.layout.page_size for t in shake.targets.values()
                 if (p := self.peers.get(t.agent)) is not None and p.layout is not None}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"rank {rank}: {size}" for rank, size in sorted(sizes.items()))
            reason = (f"the prefill ranks of {shake.instance!r} use different page sizes ({listed} tokens); the ranks "
                      "of one instance must share one")
            for target in shake.targets.values():
                target.state, target.reason = HandshakeState.REFUSED, reason

    def _speak_older(self, targets: list[HandshakeTarget], welcome: Welcome, env: Envelope) -> bool:
        """A refusal in an older version we still speak, of a Hello we sent in a newer one: the prefill is of the
        previous release, which cannot read our Hello and refuses every other version (it names only its own:
        the frame's). Say Hello again in its version, once per target; True when that is what happens."""
        lower = [t for t in targets if env.version < t.version and not t.restored]
        if not lower or env.version < self._ctx.config.min_protocol_version:
            return False                                    # below our minimum: the refusal stands
        for target in lower:
            target.version, target.fell_back = env.version, True
        log.warning("%s: prefill %s at %s speaks protocol %d (refused our %d: %s); saying Hello again in %d",
                    self._ctx.name, welcome.agent, env.address, env.version, PROTOCOL_VERSION, welcome.reason,
                    env.version)
        for shake in self.handshakes:
            if any(t in lower for t in shake.targets.values()):
                shake.next_hello = 0.0
        return True

    def _speak_newest(self, targets: list[HandshakeTarget], welcome: Welcome, env: Envelope) -> bool:
        """We fell back to an older version on a refusal in it, and the prefill accepts in that version saying it
        speaks ours (:func:`~kvbridge.protocol.wire.speaks_note`): the refusal was not its own but a replayed
        (a captured refusal of the previous release at that address, sealed with the secret) or forged one.
        Say Hello again in our version, once per target; True when that is what happens."""
        lowered = [t for t in targets if t.fell_back and not t.restored]
        if not lowered or env.version >= PROTOCOL_VERSION or noted_version(welcome.reason) < PROTOCOL_VERSION:
            return False
        for target in lowered:
            target.version, target.fell_back, target.restored = PROTOCOL_VERSION, False, True
        log.warning("%s: prefill %s at %s accepted our Hello in %d but speaks %d: the refusal in %d that made us fall "
                    "back was not its own (replayed or forged); saying Hello again in %d", self._ctx.name,
                    welcome.agent, env.address, env.version, PROTOCOL_VERSION, env.version, PROTOCOL_VERSION)
        for shake in self.handshakes:
            if any(t in lowered for t in shake.targets.values()):
                shake.next_hello = 0.0
        return True

    # ---------------------------------------------------------------- prefill side: Hellos
    def on_hello(self, hello: Hello, env: Envelope) -> None:
        ctx = self._ctx
        if ctx.role is not Role.PREFILL:
            raise ProtocolError(f"{ctx.name} is a decode rank and got a Hello from {hello.agent}")
        if hello.address != env.address:
            raise ProtocolError(f"Hello from {hello.agent} names address {hello.address}, its frame {env.address}")
        old = self.peers.get(hello.agent)
        info = PeerInfo(hello.agent, hello.endpoint, hello.buffers)
        now = self._ctx.clock()        # the lease granted below counts from the Hello's arrival
        same = (old is not None and old.incarnation == env.incarnation and old.info == info
                and old.layout == hello.layout and old.version == env.version)
        if not same and not self._hellos.take():
            raise Dropped(f"Hello from {hello.agent}: more than {_NEW_PEERS_PER_S:.0f} new peers per second")
        reason = refusal(self._ctx, hello)
        if not reason and env.version < ctx.config.min_protocol_version:
            reason = (f"protocol {env.version} is below this prefill's min_protocol_version "
                      f"{ctx.config.min_protocol_version} (it speaks {PROTOCOL_VERSION}); upgrade the decode")
        if not reason:
            try:
                check_remote_buffers(hello.layout, info)
            except ProtocolError as exc:
                reason = str(exc)
        if reason:
            log.error("%s: refused %s: %s", ctx.name, hello.agent, reason)
            self._refuse(env.address, Welcome(version=PROTOCOL_VERSION, agent=ctx.name, address=ctx.link.address,
                                              accepted=False, reason=reason), env.incarnation, env.version)
            return
        lease = writer_lease_s(ctx) if env.version >= 7 else 0.0    # before 7 a decode knows of no lease
        # a Hello after our lease to that decode ran out starts a new lease, of a newer epoch: the rooms it had
        # here fail first (none of their writes may go now: it may have handed their pages back)
        renew = same and old is not None and old.state is not PeerState.DEPARTED and now > old.lease_until
        epoch = old.lease_epoch if same and old is not None and not renew else self._lease_epochs + 1
        welcome = Welcome(version=PROTOCOL_VERSION, agent=ctx.name, address=ctx.link.address, accepted=True,
                          reason=speaks_note() if env.version < PROTOCOL_VERSION else "", layout=ctx.layout,
                          backend=ctx.backend_name, endpoint=ctx.backend.endpoint, liveness=self.liveness_address,
                          writer_lease_s=lease, lease_epoch=epoch if lease else 0)
        if same and old is not None and old.state is not PeerState.DEPARTED:   # a departed record is never revived
            if old.state is PeerState.SILENT:
                self._revive(old)
            if renew:
                for callback in self._on_lease_reset:
                    callback(old, f"our write lease to decode {old.agent} ran out {now - old.lease_until:.1f} s "
                                  "before it said Hello again (it may have handed the pages back)")
                self._lease_epochs = epoch
                old.lease_until, old.lease_epoch = now + lease, epoch
            ctx.post(env.address, welcome, incarnation=env.incarnation)   # a repeated Hello: answer again
            return
        # the decode chose the version (the highest both speak): we answer in it, and speak it from now on
        if old is not None:
            self._retire(old, f"restarted as incarnation {env.incarnation:#x}" if old.incarnation != env.incarnation
                         else f"handshook again in protocol {env.version}" if old.version != env.version
                         else "handshook again with other buffers")
        self._lease_epochs = epoch
        # read before the Welcome leaves: the decode counts the lease from its arrival
        self._insert(Peer(agent=hello.agent, address=env.address, incarnation=env.incarnation, layout=hello.layout,
                          endpoint=hello.endpoint, info=info, last_seen=now, seen=ctx.lateness.since(now),
                          version=env.version, writer_lease_s=lease,
                          lease_until=now + lease if lease else math.inf, lease_epoch=epoch), beat=False)
        # the backend learns the peer after the lock's release; the Welcome follows it only if it could, and the
        # heartbeats follow the Welcome (_added)
        frame = ctx.codec.encode(welcome, to=env.address, to_incarnation=env.incarnation)
        ctx.act(CallBackend(kind=CallKind.ADD_PEER, args=(info,), then_send=SendFrame(env.address, frame, "Welcome"),
                            then=functools.partial(self._added, hello.agent, env.incarnation)))

    def _added(self, agent: str, incarnation: int, _result: object, error: BaseException | None) -> None:
        """The backend added a decode we welcomed (its Welcome left: heartbeats may follow), or could not: then it
        is refused, saying why (lock held)."""
        peer = self.peers.get(agent)
        if peer is None or peer.incarnation != incarnation:
            return
        if error is None:
            if peer.alive and peer.goodbye_at is None:
                self._beat_to(peer)
            return
        reason = f"the prefill's backend could not add this decode: {type(error).__name__}: {error}"
        log.error("%s: refused %s: %s", self._ctx.name, agent, reason)
        peer.info = None                        # nothing to remove from the backend
        self._retire(peer, reason)
        self._refuse(peer.address, Welcome(version=PROTOCOL_VERSION, agent=self._ctx.name,
                                           address=self._ctx.link.address, accepted=False, reason=reason),
                     incarnation, peer.version)

    def refuse_handshake(self, exc: RefusedHandshake) -> None:
        """A Hello we cannot use (above a bound, impossible geometry) is answered with the reason, within the
        Hello rate limit; a Welcome we cannot use ends the handshake with its address, with the reason."""
        ctx, head = self._ctx, exc.head
        if exc.kind == "hello" and ctx.role is Role.PREFILL:
            if not self._hellos.take():
                return
            self._refuse(head.address, Welcome(version=PROTOCOL_VERSION, agent=ctx.name, address=ctx.link.address,
                                               accepted=False, reason=f"Hello refused: {exc.reason}"),
                         head.incarnation)
        elif exc.kind == "welcome":
            for target in self._targets_at(head.address):
                if target.state is HandshakeState.WAITING:
                    target.state = HandshakeState.REFUSED
                    target.reason = f"prefill at {head.address} sent a Welcome we cannot use: {exc.reason}"

    def refuse_other_version(self, exc: VersionMismatch) -> None:
        """A Hello of another protocol version gets a refusal naming both versions; a refusal of ours by
        a peer of another version still ends our handshake with its reason."""
        ctx = self._ctx
        tag, address = exc.field("type"), exc.field("address")
        if tag == "hello" and isinstance(address, str) and ctx.role is Role.PREFILL:
            if not self._hellos.take():
                return
            reason = (f"protocol version differs: prefill speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, "
                      f"decode {exc.peer_version}")
            # in our newest version: a newer decode that still speaks it may say Hello again in it
            self._refuse(address, Welcome(version=PROTOCOL_VERSION, agent=ctx.name, address=ctx.link.address,
                                          accepted=False, reason=reason), version=PROTOCOL_VERSION)
        elif tag == "welcome":
            theirs = exc.field("reason") or (f"peer speaks protocol version {exc.peer_version}, we speak "
                                             f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}")
            for target in self._targets_at(address):
                target.state, target.reason = HandshakeState.REFUSED, str(theirs)

    # ---------------------------------------------------------------- liveness
    def lease(self, agent: str, now: float) -> Lease:
        """Prefill side: may we post to decode ``agent`` (:class:`Lease`)? A lease that ran out while the decode
        still talks to us (a frame within the peer timeout: it was only slow to echo, e.g. after both sides judged
        each other silent on a starved host) holds the write instead of failing it: nothing is posted until an
        echo renews the lease, and a decode that fenced us by its lease drops our frames and never echoes."""
        peer = self.peers.get(agent)
        if peer is None or now <= peer.lease_until:
            return Lease.VALID
        if self.inbox_read_at < peer.lease_until or (
                peer.alive and now - peer.last_seen < self._ctx.config.peer_timeout_s):
            return Lease.UNCONFIRMED
        return Lease.EXPIRED

    def lease_until(self, agent: str) -> float:
        """Prefill side: the instant (our clock) our write lease to decode ``agent`` runs until (inf without one)."""
        peer = self.peers.get(agent)
        return math.inf if peer is None else peer.lease_until

    def lease_left(self, agent: str, now: float) -> float:
        """Prefill side: seconds our write lease to decode ``agent`` still runs (inf without a lease)."""
        peer = self.peers.get(agent)
        return math.inf if peer is None else peer.lease_until - now

    def on_goodbye(self, peer: Peer | None) -> None:
        if peer is not None and peer.goodbye_at is None:
            peer.goodbye_at = self._ctx.now
            self._stop_beats(peer.agent)
            if peer.state is PeerState.SILENT:       # judged dead by silence, then its goodbye arrived
                peer.step(PeerEvent.GOODBYE)
            elif peer.state is PeerState.ALIVE:
                peer.step(PeerEvent.GOODBYE)

    def on_heartbeat(self, beat: Heartbeat, peer: Peer | None) -> None:
        if peer is None:
            log.debug("%s: heartbeat from unknown agent %s", self._ctx.name, beat.agent)
            return
        now = self._ctx.clock()        # when this heartbeat was read (see admit): its echo must not predate it
        peer.last_beat = (beat.sent_at, now)
        with self._beat_lock:
            target = self._beat_targets.get(peer.agent)
            if target is not None and target.incarnation == peer.incarnation:
                self._beat_targets[peer.agent] = BeatTarget(target.address, target.incarnation, peer.last_beat)
        if beat.echo > 0 and peer.writer_lease_s and self._ctx.role is Role.PREFILL:
            # the decode got our heartbeat of ``echo`` (our clock) before it sent this one: it counts our lease
            # from then or later, so ours may run from ``echo``
            peer.lease_until = max(peer.lease_until, beat.echo + peer.writer_lease_s)
        if beat.echo > 0:
            rtt = now - beat.echo - beat.echo_held
            if 0 <= rtt < self._ctx.config.peer_timeout_s:
                peer.rtt_s = rtt

    def tick(self, now: float, hello_resend_s: float) -> None:
        """Hellos, heartbeats (unless a thread sends them), the silence/goodbye check and the release of
        departed peers (call under the lock)."""
        ctx = self._ctx
        self._send_hellos(now, hello_resend_s)
        if not self.beats_threaded and now - self._last_beat >= ctx.config.heartbeat_interval_s:
            self._last_beat = now
            self._beat_seq += 1
            for peer in self.peers.values():
                if peer.alive and peer.goodbye_at is None:
                    self.post(peer, peer.beat(agent=ctx.name, address=ctx.link.address, seq=self._beat_seq, now=now))
        grace = min(GOODBYE_GRACE_S, ctx.config.peer_timeout_s)
        timeout = ctx.config.peer_timeout_s
        ctx.lateness.note(now)             # before the silence check and the rooms' timers, which read the total
        for peer in list(self.peers.values()):     # only a live peer (ALIVE or LEAVING: LIVE_PEER) can die here
            state = peer.state
            if state is PeerState.LEAVING and peer.goodbye_at is not None and now - peer.goodbye_at > grace:
                self._died(peer, "said goodbye", PeerEvent.GRACE_OVER)
            elif state is PeerState.ALIVE and ctx.lateness.running(peer.seen, now, timeout) > timeout:
                excused = ctx.lateness.excused(peer.seen, timeout)
                unobserved = f", {excused:.1f} s of it while this rank was not running" if excused >= 0.05 else ""
                self._died(peer, f"no message for {now - peer.last_seen:.1f} s{unobserved}", PeerEvent.SILENCE)
            elif (state is PeerState.SILENT and peer.writer_lease_s and ctx.role is Role.DECODE
                  and (bound := ctx.config.write_flight_bound_s) is not None
                  and now - peer.last_seen >= peer.writer_lease_s + bound):
                # its lease ran out on its own clock no later than on ours (it runs from a heartbeat we received
                # before last_seen), and what it posted before that had the fabric's flight bound to land
                self._gone(peer, f"silent for {now - peer.last_seen:.1f} s, past its write lease of "
                                 f"{peer.writer_lease_s:.1f} s: it posts nothing more to us", PeerEvent.LEASE_OVER)
        if self._exits:
            self._check_exits(now)
        self._reap(now)
        if self._refused:
            self._forget_refused(now)

    def _reap(self, now: float) -> None:
        """Forget peers that are gone and no room refers to any more: sockets, mappings, caches."""
        linger = max(2 * self._ctx.config.peer_timeout_s, 1.0)
        for peer in list(self.peers.values()):
            if (peer.died_at is not None and now - peer.died_at > linger and not peer.alive
                    and not any(in_use(peer.agent) for in_use in self._in_use)):
                self._drop(peer)

    def _died(self, peer: Peer, why: str, event: PeerEvent) -> None:
        planned = peer.state is PeerState.LEAVING       # it said goodbye first (a drain, a clean shutdown)
        peer.step(event)
        peer.died_at = self._ctx.now
        self._stop_beats(peer.agent)
        self._link_down(peer)
        reason = f"peer {peer.agent} at {peer.address} is gone ({why})"
        log.log(logging.INFO if planned else logging.ERROR, "%s: %s", self._ctx.name, reason)
        for callback in self._on_death:
            callback(peer, reason)

    def declare_gone(self, agent: str) -> None:
        """The engine asserts that ``agent`` (its current incarnation) is gone for good (call under the lock)."""
        peer = self.peers.get(agent)
        if peer is not None:
            self._gone(peer, "declared gone by the engine", PeerEvent.DECLARED_GONE)

    def _gone(self, peer: Peer, why: str, event: PeerEvent) -> None:
        """``peer`` (this incarnation; after its lease ran out, this record of it) can no longer write: its rooms
        fail and their fences count it."""
        if event is PeerEvent.LEASE_OVER:
            peer.lease_over = True       # a newer lease of the same process (a new Welcome) is another record
        else:
            self._declared_gone.add((peer.agent, peer.incarnation))
        if peer.alive:
            self._died(peer, why, event)
            return
        if peer.state is not PeerState.RETIRED:
            peer.step(event)
        self._link_down(peer)
        for callback in self._on_death:
            callback(peer, f"peer {peer.agent} {why}")

    # ---------------------------------------------------------------- proof of a writer's exit (decode side)
    def watch_exit(self, peer: Peer, address: str, targets: Sequence[HandshakeTarget] = ()) -> None:
        """Hold a liveness connection to a prefill rank (``Welcome.liveness``): its EOF proves its exit. Connected
        by an action, after the lock's release (a non-blocking connect; what became of it, :meth:`on_liveness`);
        the handshake ``targets`` it answers are done only once it was tried, so a rank ``connect()`` returned for
        can have its exit proven."""
        if self.liveness is None or not address:
            return
        ctx = self._ctx
        for target in targets:
            target.watching = True

        def tried(_result: object, error: BaseException | None) -> None:
            if error is not None:
                log.warning("%s: cannot watch %s's liveness listener %r (%s); its death needs declare_gone",
                            ctx.name, peer.agent, address, error)
            for target in targets:
                target.watching = False
            self._finish_answered()

        key = (peer.agent, peer.incarnation)
        ctx.work("liveness watch", functools.partial(self.liveness.watch, key, address), tried)

    def on_liveness(self, closed: list[tuple[str, int]], unproven: list[tuple[tuple[str, int], str]],
                    now: float) -> None:
        """What the runtime's poll of the liveness connections found (outside the lock): connections that could not
        be made (no proof either way) and connections the writer's kernel closed (its exit: gone once the grace
        for its last writes passed, :meth:`_check_exits`)."""
        for (agent, _incarnation), error in unproven:
            log.warning("%s: cannot reach %s's liveness listener (%s): its exit cannot be proven, only declare_gone "
                        "fences its rooms if it dies", self._ctx.name, agent, error)
        for key in closed:
            log.info("%s: peer %s (incarnation %#x): its process exited (its kernel closed our liveness "
                     "connection)", self._ctx.name, key[0], key[1])
            self._exits[key] = now

    def _check_exits(self, now: float) -> None:
        """Writers whose liveness connection closed: gone once the grace for their last writes passed."""
        grace = self._ctx.config.writer_exit_grace_s
        for (agent, incarnation), at in list(self._exits.items()):
            if now - at < grace:
                continue
            del self._exits[(agent, incarnation)]
            peer = self.peers.get(agent)
            if peer is not None and peer.incarnation == incarnation:
                self._gone(peer, "exited: its kernel closed our liveness connection", PeerEvent.EXITED)
            else:                               # a replaced incarnation: its rooms' fence rounds see the proof
                self._declared_gone.add((agent, incarnation))

    def writer_gone(self, peer: Peer) -> bool:
        """Can ``peer`` no longer write into our memory? Its lease ran out, the engine declared it gone, or the
        backend proved it (optional backend method ``writer_gone(endpoint) -> bool``, declared by
        ``Capability.WRITER_GONE``). The backend is asked by an action, after the lock's release; its answer comes
        back through :meth:`on_proven_gone` (the fence then runs again). Silence alone never proves it."""
        if peer.lease_over or peer.backend_gone or (peer.agent, peer.incarnation) in self._declared_gone:
            return True
        ctx = self._ctx
        if not peer.gone_asked and Capability.WRITER_GONE in ctx.calls.capabilities:
            peer.gone_asked = True
            ctx.act(CallBackend(kind=CallKind.WRITER_GONE, args=(peer.endpoint,),
                                then=functools.partial(self._gone_answer, peer)))
        return False

    def _gone_answer(self, peer: Peer, gone: object, error: BaseException | None) -> None:
        peer.gone_asked = False
        if error is not None:
            log.error("%s: writer_gone(%s) raised %s: %s", self._ctx.name, peer.agent, type(error).__name__, error)
        elif gone:
            peer.backend_gone = True
            for callback in self._on_proven_gone:
                callback(peer)

    def say_goodbye(self) -> None:
        ctx = self._ctx
        for peer in self.peers.values():
            if peer.alive:   # best effort: a peer that already left cannot hear it
                self.post(peer, Goodbye(agent=ctx.name))

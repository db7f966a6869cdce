"""Peers: the handshake (Hello/Welcome), liveness (heartbeats, silence, goodbye) and peer death.

The prefill side accepts Hellos; the decode side sends them from ``connect()`` and reads the Welcomes.
Each ``connect()`` call owns one :class:`Handshake` record, so concurrent calls never share state.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.agent.config import GOODBYE_GRACE_S
from kvbridge.agent.context import AgentContext
from kvbridge.agent.plans import PlanCache
from kvbridge.backends.base import PeerInfo
from kvbridge.errors import IncompatiblePeer, ProtocolError
from kvbridge.geometry import PoolLayout
from kvbridge.handshake import check_compatible
from kvbridge.slicing import target_ranks
from kvbridge.wire import PROTOCOL_VERSION, Goodbye, Heartbeat, Hello, Role, VersionMismatch, Welcome

log = logging.getLogger("kvbridge.agent")


@dataclass(slots=True, kw_only=True)
class Peer:
    """An agent we shook hands with."""

    agent: str
    address: str
    layout: PoolLayout
    info: PeerInfo | None                  # set on the prefill side (where we write to)
    last_seen: float
    alive: bool = True
    goodbye_at: float | None = None        # notices on the engine's own channel may still be in flight


class HandshakeState(enum.Enum):
    WAITING = "waiting"
    ACCEPTED = "accepted"
    REFUSED = "refused"


@dataclass(slots=True, kw_only=True)
class HandshakeTarget:
    """One prefill rank a ``connect()`` call shakes hands with."""

    rank: int
    address: str
    state: HandshakeState = HandshakeState.WAITING
    agent: str = ""          # the prefill agent's name once accepted
    reason: str = ""         # why it refused


@dataclass(slots=True, kw_only=True)
class Handshake:
    """The state of one ``connect()`` call: its targets by address."""

    instance: str
    targets: dict[str, HandshakeTarget] = field(default_factory=dict)

    @property
    def refused(self) -> HandshakeTarget | None:
        return next((t for t in self.targets.values() if t.state is HandshakeState.REFUSED), None)

    @property
    def done(self) -> bool:
        return all(t.state is HandshakeState.ACCEPTED for t in self.targets.values())

    @property
    def silent(self) -> list[str]:
        return [a for a, t in self.targets.items() if t.state is HandshakeState.WAITING]


PeerDied = Callable[[Peer, str], None]


class PeerTable:
    """Every peer of one agent; handshakes, heartbeats and the silence check."""

    def __init__(self, ctx: AgentContext, plans: PlanCache) -> None:
        self._ctx = ctx
        self._plans = plans
        self.peers: dict[str, Peer] = {}
        self.handshakes: list[Handshake] = []
        self.instances: dict[str, dict[int, str]] = {}        # prefill instance -> rank -> agent
        self.beat_targets: dict[str, str] = {}                 # agent -> address of live peers (beat thread)
        self._on_death: list[PeerDied] = []
        self._last_beat = 0.0
        self._beat_seq = 0
        self.beats_threaded = False

    def on_death(self, callback: PeerDied) -> None:
        self._on_death.append(callback)

    def get(self, agent: str) -> Peer | None:
        return self.peers.get(agent)

    def __getitem__(self, agent: str) -> Peer:
        return self.peers[agent]

    def touch(self, agent: str) -> None:
        peer = self.peers.get(agent)
        if peer is not None:
            peer.last_seen = time.monotonic()

    # ---------------------------------------------------------------- decode side: connect()
    def hello(self) -> Hello:
        ctx = self._ctx
        return Hello(PROTOCOL_VERSION, ctx.name, ctx.link.address, ctx.role, ctx.layout, ctx.backend_name,
                     ctx.backend.endpoint, ctx.buffers.remote())

    def begin(self, instance: str, addresses: dict[int, str], ranks: list[int]) -> Handshake:
        """Start a handshake with ``ranks`` of ``instance`` (decode side; call under the lock)."""
        shake = Handshake(instance=instance,
                          targets={addresses[r]: HandshakeTarget(rank=r, address=addresses[r]) for r in ranks})
        self.instances.setdefault(instance, {})
        self.handshakes.append(shake)
        return shake

    def finish(self, shake: Handshake) -> None:
        """Record the instance's rank -> agent map of a completed handshake (call under the lock)."""
        if shake in self.handshakes:
            self.handshakes.remove(shake)
        if shake.done:
            self.instances[shake.instance] = {t.rank: t.agent for t in shake.targets.values()}

    def _targets_at(self, address: object) -> list[HandshakeTarget]:
        return [s.targets[address] for s in self.handshakes if isinstance(address, str) and address in s.targets]

    def on_welcome(self, welcome: Welcome) -> None:
        targets = self._targets_at(welcome.address)
        known = self.peers.get(welcome.agent)
        if not targets and known is not None and known.address == welcome.address:
            return       # the answer to a Hello repeated while the first answer was on its way
        if not targets:
            raise ProtocolError(f"unexpected Welcome from {welcome.agent} at {welcome.address}")
        reason = ""
        if not welcome.accepted or welcome.layout is None:
            reason = f"prefill {welcome.agent} refused the handshake: {welcome.reason}"
        else:
            try:
                check_compatible(welcome.layout, self._ctx.layout)
            except IncompatiblePeer as exc:
                reason = str(exc)
        for target in targets:
            if reason:
                target.state, target.reason = HandshakeState.REFUSED, reason
            else:
                target.state, target.agent = HandshakeState.ACCEPTED, welcome.agent
        if reason or welcome.layout is None:
            return
        self.peers[welcome.agent] = Peer(agent=welcome.agent, address=welcome.address, layout=welcome.layout,
                                         info=None, last_seen=time.monotonic())
        self.beat_targets[welcome.agent] = welcome.address

    # ---------------------------------------------------------------- prefill side: Hellos
    def on_hello(self, hello: Hello) -> None:
        ctx = self._ctx
        if ctx.role is not Role.PREFILL:
            raise ProtocolError(f"{ctx.name} is a decode rank and got a Hello from {hello.agent}")
        reason = self._refusal(hello)
        if reason:
            log.error("%s: refused %s: %s", ctx.name, hello.agent, reason)
            ctx.post(hello.address, Welcome(PROTOCOL_VERSION, ctx.name, ctx.link.address, False, reason))
            return
        info = PeerInfo(hello.agent, hello.endpoint, hello.buffers)
        _check_remote_buffers(hello.layout, info)
        old = self.peers.get(hello.agent)
        welcome = Welcome(PROTOCOL_VERSION, ctx.name, ctx.link.address, True, "", ctx.layout, ctx.backend_name,
                          ctx.backend.endpoint, ())
        if old is not None and old.alive and old.info == info and old.layout == hello.layout:
            ctx.post(hello.address, welcome)     # a repeated Hello: answer again, keep the peer as it is
            return
        if old is not None:
            self._plans.forget(hello.agent)
            ctx.backend.remove_peer(hello.agent)
        ctx.backend.add_peer(info)
        self.peers[hello.agent] = Peer(agent=hello.agent, address=hello.address, layout=hello.layout, info=info,
                                       last_seen=time.monotonic())
        self.beat_targets[hello.agent] = hello.address
        ctx.post(hello.address, welcome)

    def _refusal(self, hello: Hello) -> str:
        ctx = self._ctx
        if hello.backend != ctx.backend_name:
            return f"backend differs: prefill uses {ctx.backend_name!r}, decode {hello.backend!r}"
        try:
            check_compatible(ctx.layout, hello.layout)
        except IncompatiblePeer as exc:
            return str(exc)
        if ctx.layout.tp_rank not in target_ranks(ctx.layout.tp_size, hello.layout.tp_size, hello.layout.tp_rank):
            return (f"decode rank {hello.layout.tp_rank}/{hello.layout.tp_size} does not read from prefill "
                    f"rank {ctx.layout.tp_rank}/{ctx.layout.tp_size}")
        return ""

    def refuse_other_version(self, exc: VersionMismatch) -> None:
        """A Hello of another protocol version gets a refusal naming both versions; a refusal of ours by
        a peer of another version still ends our handshake with its reason."""
        ctx = self._ctx
        tag, address = exc.field("type"), exc.field("address")
        if tag == "hello" and isinstance(address, str) and ctx.role is Role.PREFILL:
            reason = f"protocol version differs: prefill speaks {PROTOCOL_VERSION}, decode {exc.peer_version}"
            ctx.post(address, Welcome(PROTOCOL_VERSION, ctx.name, ctx.link.address, False, reason))
        elif tag == "welcome":
            theirs = exc.field("reason") or (f"peer speaks protocol version {exc.peer_version}, we speak "
                                             f"{PROTOCOL_VERSION}")
            for target in self._targets_at(address):
                target.state, target.reason = HandshakeState.REFUSED, str(theirs)

    # ---------------------------------------------------------------- liveness
    def on_goodbye(self, goodbye: Goodbye) -> None:
        peer = self.peers.get(goodbye.agent)
        if peer is not None:
            peer.goodbye_at = time.monotonic()
            self.beat_targets.pop(peer.agent, None)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.agent not in self.peers:
            log.debug("%s: heartbeat from unknown agent %s", self._ctx.name, beat.agent)

    def tick(self, now: float) -> None:
        """Heartbeats (unless a thread sends them) and the silence/goodbye check (call under the lock)."""
        ctx = self._ctx
        if not self.beats_threaded and now - self._last_beat >= ctx.config.heartbeat_interval_s:
            self._last_beat = now
            self._beat_seq += 1
            beat = Heartbeat(ctx.name, ctx.link.address, self._beat_seq)
            for peer in self.peers.values():
                if peer.alive and peer.goodbye_at is None:
                    ctx.post(peer.address, beat)
        grace = min(GOODBYE_GRACE_S, ctx.config.peer_timeout_s)
        for peer in list(self.peers.values()):
            if not peer.alive:
                continue
            if peer.goodbye_at is not None and now - peer.goodbye_at > grace:
                self._died(peer, "said goodbye")
            elif peer.goodbye_at is None and now - peer.last_seen > ctx.config.peer_timeout_s:
                self._died(peer, f"no message for {now - peer.last_seen:.1f} s")

    def _died(self, peer: Peer, why: str) -> None:
        peer.alive = False
        self.beat_targets.pop(peer.agent, None)
        reason = f"peer {peer.agent} at {peer.address} is gone ({why})"
        log.log(logging.INFO if why == "said goodbye" else logging.ERROR, "%s: %s", self._ctx.name, reason)
        for callback in self._on_death:
            callback(peer, reason)

    def say_goodbye(self) -> None:
        ctx = self._ctx
        for peer in self.peers.values():
            if peer.alive:   # best effort: a peer that already left cannot hear it
                ctx.post(peer.address, Goodbye(ctx.name))


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

"""The handshake: one record per ``connect()`` call, why a Hello is refused, checks of what a peer
registered, and the rate limit on Hellos that would admit a new peer."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.agent.context import AgentContext
from kvbridge.errors import IncompatiblePeer, ProtocolError
from kvbridge.geometry import PoolLayout
from kvbridge.handshake import check_compatible
from kvbridge.protocol.records import PeerInfo
from kvbridge.protocol.wire import PROTOCOL_VERSION, Hello
from kvbridge.slicing import target_ranks


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
    version: int = PROTOCOL_VERSION   # our Hello's protocol version: lowered once if the peer speaks an older one
    fell_back: bool = False  # lowered on a refusal in the older version
    restored: bool = False   # lowered, then raised again: the prefill said it speaks ours (the refusal was not its)
    watching: bool = False   # accepted; its liveness connection is being made (an action): not done until tried


@dataclass(slots=True, kw_only=True)
class Handshake:
    """The state of one ``connect()`` call: its targets by address."""

    instance: str
    targets: dict[str, HandshakeTarget] = field(default_factory=dict)
    next_hello: float = 0.0

    @property
    def refused(self) -> HandshakeTarget | None:
        return next((t for t in self.targets.values() if t.state is HandshakeState.REFUSED), None)

    @property
    def done(self) -> bool:
        return bool(self.targets) and all(t.state is HandshakeState.ACCEPTED and not t.watching
                                          for t in self.targets.values())

    @property
    def silent(self) -> list[str]:
        return [a for a, t in self.targets.items() if t.state is HandshakeState.WAITING]


class HelloBudget:
    """A token bucket: Hellos that would admit a new peer (or incarnation), or handshake bytes, ``per_s``
    with a ``burst``; ``locked``: safe to call from several threads."""

    def __init__(self, per_s: float, burst: float, clock: Callable[[], float] = time.monotonic, *,
                 locked: bool = False) -> None:
        self.per_s, self._burst, self._clock = per_s, burst, clock
        self._tokens, self._refill = burst, clock()
        self._lock = threading.Lock() if locked else None

    def take(self, amount: float = 1.0) -> bool:
        if self._lock is None:
            return self._take(amount)
        with self._lock:
            return self._take(amount)

    def _take(self, amount: float) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refill) * self.per_s)
        self._refill = now
        if self._tokens < amount:
            return False
        self._tokens -= amount
        return True


def refusal(ctx: AgentContext, hello: Hello) -> str:
    """Why a prefill rank refuses a decode's Hello, or "" to accept it."""
    if hello.backend != ctx.backend_name:
        return f"backend differs: prefill uses {ctx.backend_name!r}, decode {hello.backend!r}"
    try:
        check_compatible(ctx.layout, hello.layout, ctx.state_by_name)
    except IncompatiblePeer as exc:
        return str(exc)
    if ctx.layout.tp_rank not in target_ranks(ctx.layout.tp_size, hello.layout.tp_size, hello.layout.tp_rank):
        return (f"decode rank {hello.layout.tp_rank}/{hello.layout.tp_size} does not read from prefill "
                f"rank {ctx.layout.tp_rank}/{ctx.layout.tp_size}")
    return ""


def check_remote_buffers(layout: PoolLayout, info: PeerInfo) -> None:
    """Raise ProtocolError unless the peer registered one region of the right size per buffer of its layout."""
    for comp in layout.components:
        remote = next((b for b in info.buffers if b.component == comp.name), None)
        if remote is None:
            raise ProtocolError(f"peer {info.name!r} registered no buffers for {comp.name!r}")
        if len(remote.regions) != len(comp.buffers):
            raise ProtocolError(f"peer {info.name} registered {len(remote.regions)} regions for {comp.name}, "
                                f"its layout has {len(comp.buffers)} buffers")
        for geom, region in zip(comp.buffers, remote.regions):
            if region.nbytes != geom.nbytes:
                raise ProtocolError(f"peer {info.name}: region of {geom.name} is {region.nbytes} B, its geometry "
                                    f"says {geom.nbytes} B")

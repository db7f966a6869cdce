"""What every part of one agent shares: identity, layout, backend, link, codec and the agent lock."""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvbridge.agent.actions import AgentLock, CallBackend, Lapsed, Work
from kvbridge.agent.buffers import LocalBuffers
from kvbridge.agent.config import TOMBSTONES, AgentConfig
from kvbridge.agent.lateness import OwnLateness
from kvbridge.backends.base import TransferBackend
from kvbridge.backends.calls import BackendCalls, CallKind
from kvbridge.errors import KVBridgeError
from kvbridge.geometry import PoolLayout, Rank
from kvbridge.links import Link
from kvbridge.protocol.events import RoomEvents
from kvbridge.protocol.states import record_illegal, strict
from kvbridge.protocol.wire import Codec, KVPoll, Message, Role
from kvbridge.registry import Registry
from kvbridge.state.base import StateType

log = logging.getLogger("kvbridge.agent")

# backend calls a handler still makes under the agent lock: none (every call is an action run after its release)
INLINE_CALLS: frozenset[CallKind] = frozenset()


class CallUnderLock(AssertionError):
    """A backend call made while the agent lock was held (strict mode: handlers queue calls as actions)."""


class LockNotHeld(AssertionError):
    """A role object's engine-facing method called without the agent lock (strict mode: the runtime's handles take
    it; a handler run without it would run its actions in the middle of its decision)."""


@dataclass(kw_only=True, slots=True, eq=False)
class AgentContext:
    """One rank's shared dependencies; the role objects and the peer table hold a reference to it.

    ``lock`` guards every room and peer record; whoever mutates them holds it. Handlers under it read the event's
    instant from ``lock.now`` (not the clock) and queue their frames (:meth:`post`), which go out when the lock is
    released (:mod:`kvbridge.agent.actions`).
    """

    name: str
    role: Role
    layout: PoolLayout
    config: AgentConfig
    registry: Registry
    state_types: tuple[StateType, ...]
    backend: TransferBackend              # for its endpoint only: every call goes through ``calls``
    backend_name: str
    calls: BackendCalls                   # the one seam to the backend (kvbridge.backends.calls)
    link: Link
    codec: Codec
    buffers: LocalBuffers
    incarnation: int                      # random per agent start; frames for another one are dropped
    clock: Callable[[], float] = time.monotonic   # every protocol time reading (a simulator injects its own)
    events: RoomEvents = field(default_factory=RoomEvents)   # finished / failed / safe rooms, for events()
    lateness: OwnLateness = field(init=False)   # time this rank was not running: excused by every timer
    lock: AgentLock = field(init=False)
    state_by_name: dict[str, StateType] = field(init=False)   # our state types by name (the handshake's checks)
    strict: bool = field(init=False)      # KVBRIDGE_STRICT_STATES: misuse raises (tests) instead of failing a room

    def __post_init__(self) -> None:
        self.lateness = OwnLateness(self.config.heartbeat_interval_s)
        self.lock = AgentLock(clock=self.clock, deliver=self._deliver, execute=self._execute)
        self.state_by_name = {c.state_type: st for c, st in zip(self.layout.components, self.state_types)}
        self.strict = strict()
        if self.strict:
            self.calls.guard = self._refuse_under_lock

    def holding(self, what: str) -> None:
        """Strict mode: raise unless the calling thread holds the agent lock (the role objects' engine-facing
        methods change rooms; the runtime's handles call them under it)."""
        if self.strict and not self.lock.held_here():
            raise LockNotHeld(f"{self.name}: {what} called without the agent lock (use the Sender/Receiver handle, "
                              "or hold agent.context.lock)")

    @property
    def now(self) -> float:
        """The instant of the event being handled: read once, when the lock was taken (the clock itself for a caller
        that does not hold it)."""
        return self.lock.now if self.lock.held_here() else self.clock()

    @property
    def rank(self) -> Rank:
        return Rank(self.layout.tp_rank, self.layout.tp_size)

    def post(self, address: str, message: Message, *, incarnation: int = 0, version: int | None = None) -> None:
        """Encode one control frame for the agent at ``address`` (its ``incarnation`` when known; in protocol
        ``version``, default: the one negotiated with it) and queue it: it leaves when the lock is released. A dead
        peer is logged, never raised (liveness handles it)."""
        self.send_frame(address, self.codec.encode(message, to=address, to_incarnation=incarnation, version=version),
                        type(message).__name__)

    def send_frame(self, address: str, frame: bytes, what: str = "frame") -> None:
        """Queue an encoded frame (see :meth:`post`)."""
        self.lock.send(address, frame, what)

    def act(self, action: CallBackend) -> None:
        """Queue a backend call: it runs when the lock is released, and what it gave comes back to ``action.then``
        under the lock (:mod:`kvbridge.agent.actions`)."""
        self.lock.act(action)

    def work(self, what: str, run: Callable[[], object], then: Callable[[object, BaseException | None], None]) -> None:
        """Queue memory work (a gather or scatter): ``run()`` after the lock's release, ``then`` under it after."""
        self.lock.act(Work(what=what, run=run, then=then))

    def _execute(self, action: CallBackend | Work) -> Callable[[], None] | None:
        """Make one queued backend call or piece of memory work (outside the lock); its result or error is handed
        to ``then`` under it."""
        result: object = None
        error: BaseException | None = None
        if isinstance(action, Work):
            try:
                result = action.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the handler (KeyboardInterrupt too: its send
                error = exc               # raises it, once the work is accounted for)
            work_then = action.then
            return lambda: work_then(result, error)
        if action.not_after < math.inf and (now := self.clock()) > action.not_after:
            error = Lapsed(f"{action.kind.value} not made: its deadline passed {now - action.not_after:.3f} s before")
        else:
            try:
                result = self.calls.invoke(action.kind, *action.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the handler that asked for the call (an
                error = exc               # interrupt too: the write is accounted for, the engine's send raises it)
            else:
                if action.then_send is not None:
                    self._deliver(action.then_send.address, action.then_send.frame, action.then_send.what)
        then = action.then
        if then is None:
            if error is not None:
                log.error("%s: backend %s failed: %s: %s", self.name, action.kind.value, type(error).__name__, error)
            return None
        return lambda: then(result, error)

    def _refuse_under_lock(self, kind: CallKind) -> None:
        if kind not in INLINE_CALLS and self.lock.held_here():
            what = (f"{self.name}: backend {kind.value} called under the agent lock (a handler must queue it as an "
                    "action)")
            record_illegal(what)
            raise CallUnderLock(what)

    def _deliver(self, address: str, frame: bytes, what: str) -> None:
        try:
            self.link.send(address, frame)
        except Exception as exc:  # noqa: BLE001 - a dead peer must not kill the caller
            log.warning("%s: could not send %s to %s: %s", self.name, what, address, exc)


class Tombstones:
    """Rooms cleared recently (bounded, oldest forgotten first): late frames for them are ignored."""

    def __init__(self, capacity: int = TOMBSTONES) -> None:
        self._rooms: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def bury(self, room: int) -> None:
        self._rooms[room] = None
        while len(self._rooms) > self._capacity:
            self._rooms.popitem(last=False)

    def revive(self, room: int) -> None:
        self._rooms.pop(room, None)

    def __contains__(self, room: object) -> bool:
        return room in self._rooms


class _Room(Protocol):
    reason: str

    @property
    def status(self) -> KVPoll: ...


RoomT = TypeVar("RoomT", bound=_Room)


class RoomTable(Generic[RoomT]):
    """The rooms of one role by id, shared by the prefill and the decode side."""

    _ctx: AgentContext
    rooms: dict[int, RoomT]

    def get(self, room: int) -> RoomT:
        """The room's record (call under the lock); KVBridgeError once it was cleared."""
        state = self.rooms.get(room)
        if state is None:
            raise KVBridgeError(f"room {room} was cleared")
        return state

    def status(self, room: int) -> KVPoll:
        return self.get(room).status

    def reason(self, room: int) -> str:
        return self.get(room).reason

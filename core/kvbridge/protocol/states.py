"""The four state machines of the protocol: send room, receive room, write and peer.

Each is an enum of states, an enum of events and **one transition table** mapping ``(state, event)`` to
the next state. Every change of a room's, a write's or a peer's state goes through :meth:`Machine.step`;
a pair missing from the table is an illegal event. :func:`strict` says what happens then: tests (and
``KVBRIDGE_STRICT_STATES=1``) raise :class:`IllegalTransition`; production fails the room with the
reason (a peer or a write logs it and keeps its state) — never ignored silently.

``KVPoll`` and ``safe_to_reuse`` are projections of a state (:data:`SEND_POLL`, :data:`RECV_POLL`), not
stored flags.

    >>> SEND_ROOM.step(SendState.BOOTSTRAPPING, SendEvent.REQUESTS_COMPLETE)
    <SendState.WAITING_FOR_INPUT: 'waiting_for_input'>
    >>> SEND_ROOM.allows(SendState.SUCCESS, SendEvent.SEND)
    False

``python -m kvbridge.protocol.states`` prints the tables (docs/protocol-states.md is that output).
"""

from __future__ import annotations

import enum
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvbridge.errors import ProtocolError
from kvbridge.protocol.wire import KVPoll

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(ProtocolError):
    """An event that the transition table does not allow in the current state."""

    def __init__(self, machine: str, state: enum.Enum, event: enum.Enum, where: str) -> None:
        self.machine, self.state, self.event = machine, state, event
        super().__init__(f"{where}: {machine} event {event.value!r} is illegal in state {state.value!r}")


_ILLEGAL: deque[str] = deque(maxlen=256)


def record_illegal(exc: IllegalTransition | str) -> None:
    """Remember an illegal event (or another broken rule of the protocol core, named) of this process (tests assert
    none happened; bounded)."""
    _ILLEGAL.append(str(exc))


def illegal_events(clear: bool = False) -> list[str]:
    """The illegal events this process saw (newest last), optionally forgetting them."""
    seen = list(_ILLEGAL)
    if clear:
        _ILLEGAL.clear()
    return seen


def strict() -> bool:
    """Raise on an illegal event (tests) instead of failing the room with the reason (production)."""
    return os.environ.get("KVBRIDGE_STRICT_STATES", "") not in ("", "0")


@dataclass(frozen=True, slots=True)
class Machine(Generic[S, E]):
    """A named transition table."""

    name: str
    table: Mapping[tuple[S, E], S]

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self.table

    def step(self, state: S, event: E, where: str = "") -> S:
        """The state after ``event``; :class:`IllegalTransition` when the table has no such pair."""
        after = self.table.get((state, event))
        if after is None:
            raise IllegalTransition(self.name, state, event, where or self.name)
        return after

    def advance(self, state: S, event: E, where: str) -> tuple[S, str]:
        """(next state, "") or, for an illegal event, (``state`` unchanged, the reason): the event is recorded
        (:func:`illegal_events`) and raised in strict mode; the caller fails what it owns with the reason."""
        try:
            return self.step(state, event, where), ""
        except IllegalTransition as exc:
            record_illegal(exc)
            if strict():
                raise
            return state, str(exc)

    def rows(self) -> list[tuple[str, str, str]]:
        """(state, event, next state) for the docs, in declaration order."""
        return [(s.value, e.value, n.value) for (s, e), n in self.table.items()]


# ---------------------------------------------------------------------------------------------- send room
class SendState(enum.Enum):
    """A prefill rank's room (one request, every decode rank it serves)."""

    BOOTSTRAPPING = "bootstrapping"          # waiting for the request of every decode rank it serves
    WAITING_FOR_INPUT = "waiting_for_input"  # every request arrived: the engine may send
    TRANSFERRING = "transferring"            # chunks sent; writes queued or in flight, or more chunks to come
    SUCCESS = "success"                      # the last chunk was sent and every write completed and was notified
    FAILING = "failing"                      # failed (reason kept); writes still in flight or queued read the pages
    FAILED = "failed"                        # failed, and no write of it is in flight or queued any more


class SendEvent(enum.Enum):
    REQUESTS_COMPLETE = "requests_complete"  # the last expected decode request was accepted
    HOLD = "hold"                            # send(from_start=True) before every request came: chunk held
    SEND = "send"                            # the engine's chunk was validated and posted or queued
    DRAINED = "drained"                      # no write is queued or in flight (after the last chunk, or failing)
    FAIL = "fail"                            # a bad request, a failed write, a dead peer, an abort, a timeout


SEND_ROOM: Machine[SendState, SendEvent] = Machine("send room", {
    (SendState.BOOTSTRAPPING, SendEvent.REQUESTS_COMPLETE): SendState.WAITING_FOR_INPUT,
    (SendState.BOOTSTRAPPING, SendEvent.HOLD): SendState.BOOTSTRAPPING,
    (SendState.BOOTSTRAPPING, SendEvent.FAIL): SendState.FAILING,
    (SendState.WAITING_FOR_INPUT, SendEvent.SEND): SendState.TRANSFERRING,
    (SendState.WAITING_FOR_INPUT, SendEvent.FAIL): SendState.FAILING,
    (SendState.TRANSFERRING, SendEvent.SEND): SendState.TRANSFERRING,
    (SendState.TRANSFERRING, SendEvent.DRAINED): SendState.SUCCESS,
    (SendState.TRANSFERRING, SendEvent.FAIL): SendState.FAILING,
    # a decode's abort (or a dead peer) after every write landed and was notified: the room stays Success,
    # the decode gets its acknowledgement all the same
    (SendState.SUCCESS, SendEvent.FAIL): SendState.SUCCESS,
    # failing drains at once when nothing is in flight or queued (the same step as FAIL), else when the last
    # write ends: safe to reuse, and its SAFE_TO_REUSE event, come with this transition and no later
    (SendState.FAILING, SendEvent.DRAINED): SendState.FAILED,
    (SendState.FAILING, SendEvent.FAIL): SendState.FAILING,          # the first reason is kept
    (SendState.FAILED, SendEvent.FAIL): SendState.FAILED,
})

SEND_POLL: Mapping[SendState, KVPoll] = {
    SendState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SendState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    SendState.TRANSFERRING: KVPoll.Transferring,
    SendState.SUCCESS: KVPoll.Success,
    SendState.FAILING: KVPoll.Failed,
    SendState.FAILED: KVPoll.Failed,
}

#: a send room in these states is safe to reuse: no write reads its source pages any more
SAFE_SEND = frozenset({SendState.SUCCESS, SendState.FAILED})


# ------------------------------------------------------------------------------------------- receive room
class RecvState(enum.Enum):
    """A decode rank's room (one request, every prefill rank that writes a slice of it)."""

    BOOTSTRAPPING = "bootstrapping"          # a prefill rank of the instance is not reachable yet
    WAITING_FOR_INPUT = "waiting_for_input"  # targets bound; metadata (the request) may be sent
    TRANSFERRING = "transferring"            # a notice arrived
    SUCCESS = "success"                      # every requested item of every slice is covered
    FENCING = "fencing"                      # failed; a writer may still write: aborts until all acknowledge
    FAILED = "failed"                        # failed and fenced: no writer can write any more


class RecvEvent(enum.Enum):
    TARGETS_BOUND = "targets_bound"          # every prefill rank of the instance is a live peer
    NOTICE = "notice"                        # a notice was accepted (its bytes counted, or being scattered)
    COVERED = "covered"                      # every slice complete, no scatter running
    FAIL = "fail"                            # with writers that may still write (the request went out)
    FAIL_FENCED = "fail_fenced"              # with no writer that can write (no request sent, or all fenced)
    FENCED = "fenced"                        # the last writer acknowledged the abort or was proven gone


RECV_ROOM: Machine[RecvState, RecvEvent] = Machine("receive room", {
    (RecvState.BOOTSTRAPPING, RecvEvent.TARGETS_BOUND): RecvState.WAITING_FOR_INPUT,
    (RecvState.BOOTSTRAPPING, RecvEvent.FAIL_FENCED): RecvState.FAILED,
    (RecvState.WAITING_FOR_INPUT, RecvEvent.NOTICE): RecvState.TRANSFERRING,
    (RecvState.WAITING_FOR_INPUT, RecvEvent.COVERED): RecvState.SUCCESS,   # nothing to move (full prefix hit)
    (RecvState.WAITING_FOR_INPUT, RecvEvent.FAIL): RecvState.FENCING,
    (RecvState.WAITING_FOR_INPUT, RecvEvent.FAIL_FENCED): RecvState.FAILED,
    (RecvState.TRANSFERRING, RecvEvent.NOTICE): RecvState.TRANSFERRING,
    (RecvState.TRANSFERRING, RecvEvent.COVERED): RecvState.SUCCESS,
    (RecvState.TRANSFERRING, RecvEvent.FAIL): RecvState.FENCING,
    (RecvState.TRANSFERRING, RecvEvent.FAIL_FENCED): RecvState.FAILED,
    (RecvState.FENCING, RecvEvent.FENCED): RecvState.FAILED,
    # late failures of a finished room change nothing (the first reason is kept)
    (RecvState.SUCCESS, RecvEvent.FAIL): RecvState.SUCCESS,
    (RecvState.SUCCESS, RecvEvent.FAIL_FENCED): RecvState.SUCCESS,
    (RecvState.FENCING, RecvEvent.FAIL): RecvState.FENCING,
    (RecvState.FENCING, RecvEvent.FAIL_FENCED): RecvState.FAILED,
    (RecvState.FAILED, RecvEvent.FAIL): RecvState.FAILED,
    (RecvState.FAILED, RecvEvent.FAIL_FENCED): RecvState.FAILED,
    (RecvState.FAILED, RecvEvent.FENCED): RecvState.FAILED,
})

RECV_POLL: Mapping[RecvState, KVPoll] = {
    RecvState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RecvState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    RecvState.TRANSFERRING: KVPoll.Transferring,
    RecvState.SUCCESS: KVPoll.Success,
    RecvState.FENCING: KVPoll.Failed,
    RecvState.FAILED: KVPoll.Failed,
}

TERMINAL_RECV = frozenset({RecvState.SUCCESS, RecvState.FENCING, RecvState.FAILED})


# ---------------------------------------------------------------------------------------------------- write
class WriteState(enum.Enum):
    """One write of a send room: a plain write (planned descriptors) or a staged piece."""

    QUEUED = "queued"          # waiting for the engine's CUDA work, or for space in our staging area
    ALLOCATED = "allocated"    # a staged piece holds its staging space, its gather not started
    GATHERING = "gathering"    # its gather runs (on our CUDA stream; on the host it ends at once)
    READY = "ready"            # gathered, or the engine's work done: may be posted (a ring piece: needs a slot)
    POSTING = "posting"        # its post is an action queued for the runtime (after the agent lock's release)
    POSTED = "posted"          # the backend took it
    DONE = "done"              # the backend completed it; the notice went out (unless the room failed)
    FAILED = "failed"          # the backend reported an error or raised
    DROPPED = "dropped"        # never posted: the room failed or the peer left


class WriteEvent(enum.Enum):
    ALLOCATE = "allocate"
    GATHER = "gather"
    READY = "ready"
    POST = "post"
    ACCEPTED = "accepted"      # the backend's send_component returned a handle
    LAPSED = "lapsed"          # our write lease ran out before the runtime posted it: queued again, re-judged
    COMPLETE = "complete"
    ERROR = "error"
    DROP = "drop"


WRITE: Machine[WriteState, WriteEvent] = Machine("write", {
    (WriteState.QUEUED, WriteEvent.ALLOCATE): WriteState.ALLOCATED,
    (WriteState.QUEUED, WriteEvent.READY): WriteState.READY,           # a plain write whose CUDA event fired
    (WriteState.QUEUED, WriteEvent.POST): WriteState.POSTING,          # a plain write with nothing to wait for
    (WriteState.QUEUED, WriteEvent.DROP): WriteState.DROPPED,
    (WriteState.ALLOCATED, WriteEvent.GATHER): WriteState.GATHERING,
    (WriteState.ALLOCATED, WriteEvent.DROP): WriteState.DROPPED,
    (WriteState.GATHERING, WriteEvent.READY): WriteState.READY,
    (WriteState.READY, WriteEvent.POST): WriteState.POSTING,
    (WriteState.READY, WriteEvent.DROP): WriteState.DROPPED,
    (WriteState.POSTING, WriteEvent.ACCEPTED): WriteState.POSTED,
    (WriteState.POSTING, WriteEvent.ERROR): WriteState.FAILED,         # send_component raised: nothing was taken
    (WriteState.POSTING, WriteEvent.LAPSED): WriteState.DROPPED,       # not posted; a new write record is queued
    (WriteState.POSTED, WriteEvent.COMPLETE): WriteState.DONE,
    (WriteState.POSTED, WriteEvent.ERROR): WriteState.FAILED,
    # a gathering piece is never dropped: its gather still reads and writes memory (kept until READY)
})


# ----------------------------------------------------------------------------------------------------- peer
class PeerState(enum.Enum):
    """An agent we shook hands with, in one incarnation."""

    ALIVE = "alive"
    LEAVING = "leaving"        # said goodbye: notices on the engine's own channel may still arrive (a grace)
    SILENT = "silent"          # judged dead by silence: its rooms failed; it is a peer again if it speaks
    DEPARTED = "departed"      # gone after its goodbye, or declared gone by the engine
    RETIRED = "retired"        # replaced by a new incarnation, or forgotten: the record is dropped


class PeerEvent(enum.Enum):
    FRAME = "frame"            # a frame of its current incarnation was admitted
    GOODBYE = "goodbye"
    GRACE_OVER = "grace_over"
    SILENCE = "silence"        # nothing heard for the peer timeout
    DECLARED_GONE = "declared_gone"
    EXITED = "exited"          # its kernel closed our liveness connection, and the grace passed
    LEASE_OVER = "lease_over"  # silent past its write lease (+ the exit grace): it posts nothing more to us
    RETIRE = "retire"          # a new incarnation under the same name, or reaped once no room refers to it


PEER: Machine[PeerState, PeerEvent] = Machine("peer", {
    (PeerState.ALIVE, PeerEvent.FRAME): PeerState.ALIVE,
    (PeerState.ALIVE, PeerEvent.GOODBYE): PeerState.LEAVING,
    (PeerState.ALIVE, PeerEvent.SILENCE): PeerState.SILENT,
    (PeerState.ALIVE, PeerEvent.DECLARED_GONE): PeerState.DEPARTED,
    (PeerState.ALIVE, PeerEvent.EXITED): PeerState.DEPARTED,
    (PeerState.ALIVE, PeerEvent.RETIRE): PeerState.RETIRED,
    (PeerState.LEAVING, PeerEvent.FRAME): PeerState.LEAVING,          # a notice sent before its goodbye
    (PeerState.LEAVING, PeerEvent.GOODBYE): PeerState.LEAVING,
    (PeerState.LEAVING, PeerEvent.GRACE_OVER): PeerState.DEPARTED,
    (PeerState.LEAVING, PeerEvent.DECLARED_GONE): PeerState.DEPARTED,
    (PeerState.LEAVING, PeerEvent.EXITED): PeerState.DEPARTED,
    (PeerState.LEAVING, PeerEvent.RETIRE): PeerState.RETIRED,
    (PeerState.SILENT, PeerEvent.FRAME): PeerState.ALIVE,             # it was only slow: a peer again
    (PeerState.SILENT, PeerEvent.GOODBYE): PeerState.DEPARTED,
    (PeerState.SILENT, PeerEvent.DECLARED_GONE): PeerState.DEPARTED,
    (PeerState.SILENT, PeerEvent.EXITED): PeerState.DEPARTED,
    (PeerState.SILENT, PeerEvent.LEASE_OVER): PeerState.DEPARTED,
    (PeerState.SILENT, PeerEvent.RETIRE): PeerState.RETIRED,
    (PeerState.DEPARTED, PeerEvent.FRAME): PeerState.DEPARTED,        # stragglers change nothing
    (PeerState.DEPARTED, PeerEvent.GOODBYE): PeerState.DEPARTED,
    (PeerState.DEPARTED, PeerEvent.DECLARED_GONE): PeerState.DEPARTED,
    (PeerState.DEPARTED, PeerEvent.EXITED): PeerState.DEPARTED,
    (PeerState.DEPARTED, PeerEvent.RETIRE): PeerState.RETIRED,
})

LIVE_PEER = frozenset({PeerState.ALIVE, PeerState.LEAVING})

MACHINES: tuple[Machine, ...] = (SEND_ROOM, RECV_ROOM, WRITE, PEER)


def markdown() -> str:
    """The four tables as Markdown (state, event, next state)."""
    out = []
    for machine in MACHINES:
        out += [f"## {machine.name}", "", "| state | event | next state |", "|---|---|---|"]
        out += [f"| {s} | {e} | {n} |" for s, e, n in machine.rows()]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())

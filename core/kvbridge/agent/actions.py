"""The agent lock, and the actions the protocol handlers queue while they hold it.

A handler (a frame received, an engine call, a timer, a backend completion) runs under the lock and decides; it
does not do the I/O. What it wants done is an **action** queued on the lock: a frame to send (:class:`SendFrame`),
a backend call (:class:`CallBackend`: post a write, notify, release a handle, add or remove a peer) or memory work
(:class:`Work`: a staged piece's gather or scatter, on the host or launched on our CUDA stream). When the
outermost holder releases the lock, its actions run in the order they were queued, outside the lock (a slow socket
or post never stalls the engine's calls or the other peers), and in that order across threads (the next holder's
actions wait until these ran). What a backend call gave comes back as an event: its ``then`` runs under the lock
once the batch ran (what a piece of work gave, right after it ran: a gathered piece is posted before the next
gather is launched). The instant of the event is read once, when the outermost holder takes the lock: handlers read
:attr:`AgentLock.now` and never the clock::

    lock = AgentLock(clock=time.monotonic, deliver=lambda address, frame, what: link.send(address, frame),
                     execute=runtime.execute)
    with lock:
        lock.send("tcp://10.0.0.2:17600", frame, "Welcome")                    # queued
        lock.act(CallBackend(kind=CallKind.RELEASE, args=(handle,)))            # queued
        started = lock.now
    # sent and called here, after the lock was released
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbridge.backends.calls import CallKind

Deliver = Callable[[str, bytes, str], None]
Then = Callable[[Any, "BaseException | None"], None]


@dataclass(frozen=True, slots=True)
class SendFrame:
    """Hand an encoded control frame to the link."""

    address: str
    frame: bytes
    what: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallBackend:
    """Call the backend (``kind`` with ``args``, through the agent's one call seam); ``then(result, error)`` runs
    under the lock after the batch (None: an error is logged). A call not made by ``not_after`` (the agent's clock;
    a write lease's end) is not made at all: ``then`` gets :class:`Lapsed`. ``then_send`` (a Welcome after the
    peer was added) leaves in the batch's order, and only when the call succeeded."""

    kind: CallKind
    args: tuple[Any, ...]
    then: Then | None = None
    not_after: float = math.inf
    then_send: SendFrame | None = None      # sent right after the call succeeded, in the batch's order


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """Memory work a handler decided on: a staged piece's gather or scatter (a host copy, or a launch on our CUDA
    stream). ``run()`` runs outside the lock and reads only what the handler captured for it (never a room or peer
    table); ``then(result, error)`` runs under the lock after the batch."""

    what: str
    run: Callable[[], Any]
    then: Then


class Lapsed(Exception):
    """A backend call's deadline passed before the runtime could make it (it was not made)."""


Action = SendFrame | CallBackend | Work
Execute = Callable[["CallBackend | Work"], "Callable[[], None] | None"]


class AgentLock:
    """A re-entrant lock that runs the handlers' sends after its outermost release (see the module)."""

    def __init__(self, *, clock: Callable[[], float], deliver: Deliver, execute: Execute | None = None) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._deliver = deliver
        self._execute = execute                 # runs a backend call; returns what must run under the lock after
        self._depth = 0                         # written only by the holder
        self._owner: int | None = None
        self._outbox: list[Action] = []
        # batches leave in the order of their holds without holding the agent lock: each takes a ticket when its
        # hold ends and waits for its turn; a send from inside a delivery (a link that delivers synchronously
        # into this agent) goes at once
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._delivering = threading.local()
        self.now = 0.0                          # the instant of the event being handled

    def __enter__(self) -> AgentLock:
        self._lock.acquire()
        if not self._depth:
            self._owner = threading.get_ident()
            self.now = self._clock()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            self._lock.release()
            return
        self._owner = None
        batch, self._outbox = self._outbox, []
        ticket = self._take_ticket() if batch and not self._inside_delivery() else None
        self._lock.release()
        if batch:
            self._send_batch(batch, ticket)

    def _inside_delivery(self) -> bool:
        return bool(getattr(self._delivering, "active", False))

    def _take_ticket(self) -> int:
        with self._turns:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def _send_batch(self, batch: list[Action], ticket: int | None) -> None:
        if ticket is None:                      # inside a delivery of this thread: its turn is now
            self._run(batch)
            return
        with self._turns:
            while self._serving != ticket:
                self._turns.wait()
        self._delivering.active = True
        try:
            self._run(batch)
        finally:
            self._delivering.active = False
            with self._turns:
                self._serving += 1
                self._turns.notify_all()

    def _run(self, batch: list[Action]) -> None:
        """Run one batch in order; then, under the lock, what the backend calls gave (their actions, in turn, run
        at once: this thread's turn is now)."""
        results: list[Callable[[], None]] = []
        failed: list[BaseException] = []
        for action in batch:                    # every one runs: a lost action would leave its write hanging
            try:
                if isinstance(action, SendFrame):
                    self._deliver(action.address, action.frame, action.what)
                    continue
                if self._execute is None:
                    raise AssertionError(f"{action}: this lock runs no backend calls or work (no execute=)")
                result = self._execute(action)
            except BaseException as exc:  # noqa: BLE001 - raised once the batch ran
                failed.append(exc)
                continue
            if result is not None:
                results.append(result)
            if type(action) is Work:        # a gathered piece may be posted before the next gather is launched
                self._apply(results, failed)
        self._apply(results, failed)
        if failed:
            raise failed[0]

    def _apply(self, results: list[Callable[[], None]], failed: list[BaseException]) -> None:
        """Run what the actions so far gave, in order, under the lock (and what they queue, at once)."""
        if not results:
            return
        batch = results[:]
        results.clear()
        with self:
            for result in batch:                # every one runs: a lost result would leave its write hanging
                try:
                    result()
                except BaseException as exc:  # noqa: BLE001 - raised by _run (strict mode's illegal events)
                    failed.append(exc)

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def send(self, address: str, frame: bytes, what: str) -> None:
        """Send ``frame`` to ``address`` once the lock is released (now, when the caller does not hold it)."""
        self.act(SendFrame(address, frame, what))

    def act(self, action: Action) -> None:
        """Run ``action`` once the lock is released (now, when the caller does not hold it)."""
        if self.held_here():
            self._outbox.append(action)
            return
        self._send_batch([action], None if self._inside_delivery() else self._take_ticket())

    @property
    def queued(self) -> int:
        """Actions waiting for the lock's release (call with the lock held)."""
        return len(self._outbox)

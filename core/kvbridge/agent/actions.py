"""The agent lock, and the actions the protocol handlers queue while they hold it.

A handler (a frame received, an engine call, a timer) runs under the lock and decides; it does not do the I/O.
Frames it sends go to the lock's outbox; when the outermost holder releases the lock, the frames go out in the
order they were queued, outside the lock (a slow socket never stalls the engine's calls or the other peers), and
in that order across threads (the next holder's frames wait until these left). The instant of the event is read
once, when the outermost holder takes the lock: handlers read :attr:`AgentLock.now` and never the clock::

    lock = AgentLock(clock=time.monotonic, deliver=lambda address, frame, what: link.send(address, frame))
    with lock:
        lock.send("tcp://10.0.0.2:17600", frame, "Welcome")     # queued
        started = lock.now
    # sent here, after the lock was released
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Deliver = Callable[[str, bytes, str], None]


class AgentLock:
    """A re-entrant lock that runs the handlers' sends after its outermost release (see the module)."""

    def __init__(self, *, clock: Callable[[], float], deliver: Deliver) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._deliver = deliver
        self._depth = 0                         # written only by the holder
        self._owner: int | None = None
        self._outbox: list[tuple[str, bytes, str]] = []
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

    def _send_batch(self, batch: list[tuple[str, bytes, str]], ticket: int | None) -> None:
        if ticket is None:                      # inside a delivery of this thread: its turn is now
            for address, frame, what in batch:
                self._deliver(address, frame, what)
            return
        with self._turns:
            while self._serving != ticket:
                self._turns.wait()
        self._delivering.active = True
        try:
            for address, frame, what in batch:
                self._deliver(address, frame, what)
        finally:
            self._delivering.active = False
            with self._turns:
                self._serving += 1
                self._turns.notify_all()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def send(self, address: str, frame: bytes, what: str) -> None:
        """Send ``frame`` to ``address`` once the lock is released (now, when the caller does not hold it)."""
        if self.held_here():
            self._outbox.append((address, frame, what))
            return
        self._send_batch([(address, frame, what)], None if self._inside_delivery() else self._take_ticket())

    @property
    def queued(self) -> int:
        """Frames waiting for the lock's release (call with the lock held)."""
        return len(self._outbox)

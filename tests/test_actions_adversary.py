"""An adversarial helper's probes of the agent lock (session 11; both failed before their fixes): a slow send of
one thread must not stall another thread on the lock, and a frame handled after the lock was taken must not count
as seen before it arrived (the silence fence would then release pages inside the writer's echoed lease)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import test_write_lease
from test_write_lease import FLIGHT_BOUND_S, LEASE_S, ManualClock, _landed, _open, _run

from kvbridge.agent import TransferAgent
from kvbridge.agent.actions import AgentLock


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    yield from test_write_lease.make_pair(staging="never")      # plain writes: they land in the decode's pages


def test_a_slow_send_of_one_thread_does_not_stall_a_third_thread_on_the_lock() -> None:
    """actions.py: frames go out "outside the lock (a slow socket never stalls the engine's calls or the other
    peers)". Thread A's batch is slow on the wire; thread B held the lock meanwhile, queued one frame and released
    it; an engine thread C then only wants the lock (no frame at all): C must not wait for A's socket."""
    release, a_on_wire = threading.Event(), threading.Event()

    def deliver(address: str, frame: bytes, what: str) -> None:
        if frame == b"A1":
            a_on_wire.set()
            release.wait(10)

    lock = AgentLock(clock=time.monotonic, deliver=deliver)
    b_queued = threading.Event()

    def holder(frame: bytes) -> None:
        with lock:
            lock.send("x", frame, "f")
            if frame == b"B1":
                b_queued.set()

    ta = threading.Thread(target=holder, args=(b"A1",), daemon=True)
    tb = threading.Thread(target=holder, args=(b"B1",), daemon=True)
    took = threading.Event()

    def engine() -> None:
        with lock:
            took.set()

    tc = threading.Thread(target=engine, daemon=True)
    try:
        ta.start()
        assert a_on_wire.wait(5)                 # A released the lock and is stuck on the wire
        tb.start()
        assert b_queued.wait(5)
        deadline = time.monotonic() + 5
        while not (lock._depth == 0 and lock._owner is None and lock.queued == 0 and tb.is_alive()):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(0.05)                         # B took the lock, queued B1, took its batch: it is releasing
        tc.start()
        assert took.wait(1.0), "the engine thread waited for another thread's slow socket: the lock was held"
    finally:
        release.set()
        for t in (ta, tb, tc):
            if t.ident is not None:
                t.join(5)


class _StoppedBeforeRead:
    """The decode's link: its locked read (the progress step's second drain) happens after the process was stopped
    for ``stop_s``, during which ``meanwhile`` runs (the prefill)."""

    def __init__(self, inner: Any, agent: TransferAgent, clock: ManualClock, stop_s: float, meanwhile: Any) -> None:
        self._inner, self._agent, self._clock, self._stop_s, self._meanwhile = inner, agent, clock, stop_s, meanwhile
        self.armed = False

    def recv(self, timeout_s: float = 0.0) -> list[bytes]:
        if self.armed and self._agent.context.lock.held_here():
            self.armed = False
            end = self._clock.now + self._stop_s
            while self._clock.now < end:
                self._clock.now = min(end, self._clock.now + 0.05)
                self._meanwhile()
        return self._inner.recv(timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Cut:
    """A link that drops everything it is given once ``cut`` (a partition)."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.cut = inner, False

    def send(self, address: str, frame: bytes) -> None:
        if not self.cut:
            self._inner.send(address, frame)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_decode_never_fences_a_writer_before_the_writer_lease_it_echoed_ends(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The decode's progress step takes its lock (ctx.now = T) and is then stopped for 0.9 s before it reads its
    link; the prefill's heartbeats of that time wait there and are handled with ``now`` = T, so the decode's
    ``last_seen`` of the prefill precedes their receipt. The decode echoes the last one (sent at about T + 0.9), which
    extends the prefill's write lease to T + 0.9 + lease; then a partition. The decode makes the room safe at
    last_seen + lease + flight bound = T + lease + bound, while the prefill may still post (its lease is valid): a
    write lands in pages handed back. peers.py tick's bound assumes "a heartbeat we received before last_seen"."""
    pre, dec, clock = pair
    assert dec.decode is not None
    sender, receiver = _open(pre, dec, clock, 1, [3])
    dec.progress()
    pre_link = _Cut(pre.context.link)
    pre.context.link = pre_link
    stopped = _StoppedBeforeRead(dec.context.link, dec, clock, 0.9, pre.progress)
    dec.context.link = stopped
    stopped.armed = True
    dec.progress()                         # the stop happens inside, between taking the lock and reading the link
    assert not stopped.armed
    pre_link.cut = True                    # partition: nothing more of the prefill's reaches the decode
    pre.progress()                         # ... but the decode's echo had already reached the prefill
    _run(clock, LEASE_S + FLIGHT_BOUND_S + 1.5, dec, until=lambda: dec.decode.safe_to_reuse(1))
    assert dec.decode.safe_to_reuse(1)
    left, last_seen = pre.peers.lease_left("d0", clock()), dec.peers.peers["p0"].last_seen
    sender.send(np.array([1]), last=True)
    assert not _landed(dec, [3]), (
        f"a write landed in page 3, which the decode made safe to reuse at {clock():.2f}: the prefill's write lease "
        f"to it still ran {left:.2f} s (the decode's last_seen of it: {last_seen:.2f}, the lock's instant before the "
        "heartbeats it had read at 1000.90)")

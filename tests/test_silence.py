"""Silence is judged only over time the judging rank itself ran its liveness check.

A rank that was not running (the host starved it, SIGSTOP, a GC pause, an engine step between two polls) read no
frame meanwhile, and on a shared host its peers were starved as well: counting that time as their silence failed
healthy rooms (a clean-clone CI run on a 2-core host: "peer prefill-1 ... is gone (no message for 1.8 s)" with a
1.5 s timeout, in the first room of a netns test, before any fault). A check that runs late counts its lateness
past one heartbeat interval as unobserved; a dead peer is still found, by a rank that checks rarely too.
Manual clock, as in test_write_lease.py: a stopped rank is one whose ``progress()`` is not called.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import test_write_lease
from test_write_lease import TIMEOUT_S, ManualClock, _landed, _open, _run

from kvbridge.agent import TransferAgent
from kvbridge.protocol.states import PeerState
from kvbridge.protocol.wire import KVPoll

pair = test_write_lease.pair       # the fixture: a prefill and a decode rank on one manual clock


def test_ranks_stopped_together_past_the_timeout_do_not_judge_each_other_dead(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The whole host stops for 1.5 peer timeouts (both ranks), then both run again: every peer stays alive and
    the room open across the stop succeeds byte-exact. Failed before: the first rank to run judged the other
    dead. (Of a longer stop, one timeout is excused: see the next tests.)"""
    pre, dec, clock = pair
    sender, receiver = _open(pre, dec, clock, 1, [1, 2])
    dec.progress()                  # every frame the prefill sent is read: none waits in the decode's link
    clock.now += 1.5 * TIMEOUT_S                            # nobody runs
    _run(clock, 3 * TIMEOUT_S, dec, pre)                    # the decode happens to run first
    assert dec.peers.peers["p0"].state is PeerState.ALIVE
    assert pre.peers.peers["d0"].state is PeerState.ALIVE
    assert receiver.poll() is KVPoll.WaitingForInput
    sender.send(np.array([1, 2]), last=True)
    _run(clock, 1.0, pre, dec, until=lambda: receiver.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success and _landed(dec, [1, 2])


def test_a_rank_stopped_alone_still_finds_a_peer_that_died_meanwhile(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The decode stops for 0.8 timeouts and its prefill never runs again: once the decode runs, it judges the
    prefill dead within about one timeout of its own running, the reason saying what was not counted; stopped
    for 5 timeouts, at its first check (one timeout at most is excused)."""
    pre, dec, clock = pair
    _sender, receiver = _open(pre, dec, clock, 1, [1])
    dec.progress()
    last = dec.peers.peers["p0"].last_seen
    clock.now += 0.8 * TIMEOUT_S
    resumed = clock()
    _run(clock, 2 * TIMEOUT_S, dec, until=lambda: receiver.poll() is KVPoll.Failed)
    assert receiver.poll() is KVPoll.Failed
    assert 0.5 * TIMEOUT_S <= clock() - resumed <= TIMEOUT_S + 0.1
    assert "while this rank was not running" in receiver.failure_reason
    assert dec.peers.peers["p0"].last_seen == last
    _sender, receiver = _open(pre, dec, clock, 2, [2])
    dec.progress()                  # nothing of the prefill's waits in the decode's link
    clock.now += 5 * TIMEOUT_S
    dec.progress()
    assert receiver.poll() is KVPoll.Failed


def test_a_rank_that_checks_rarely_still_finds_a_dead_peer(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """A rank whose engine polls only every 0.5 s (2.5 heartbeat intervals) with no progress thread: at most one
    timeout of its lateness is excused, so a dead peer is found within 2 timeouts (plus one check gap)."""
    pre, dec, clock = pair
    _sender, receiver = _open(pre, dec, clock, 1, [1])
    start = clock()
    _run(clock, 4 * TIMEOUT_S, dec, step_s=0.5, until=lambda: receiver.poll() is KVPoll.Failed)
    assert receiver.poll() is KVPoll.Failed
    assert clock() - start <= 2 * TIMEOUT_S + 0.5


def test_a_decode_that_was_itself_stopped_still_fences_a_silent_writer_by_its_lease(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The excuse never delays a fence past its bound: the decode stops for 1.5 timeouts while its writer stops
    for good; the room fails, and becomes safe by the write lease at ``last_seen + lease + flight bound`` (the
    lease counts from the last frame, never excused), as when the decode had run throughout."""
    from test_write_lease import FLIGHT_BOUND_S, LEASE_S

    pre, dec, clock = pair
    assert dec.decode is not None
    _sender, receiver = _open(pre, dec, clock, 1, [1])
    dec.progress()
    last = dec.peers.peers["p0"].last_seen
    clock.now += 1.5 * TIMEOUT_S                            # both stop; only the decode comes back
    _run(clock, LEASE_S + FLIGHT_BOUND_S + TIMEOUT_S, dec, until=lambda: dec.decode.safe_to_reuse(1))
    assert receiver.poll() is KVPoll.Failed and dec.decode.safe_to_reuse(1)
    assert clock() - last <= LEASE_S + FLIGHT_BOUND_S + 0.1
    assert dec.peers.peers["p0"].state is PeerState.DEPARTED


WAITING_S = 0.8      # below the peer timeout: a stop that keeps every peer alive can outlast a room's wait


@pytest.fixture
def short_wait() -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    yield from test_write_lease.make_pair(waiting_timeout_s=WAITING_S, bootstrap_timeout_s=WAITING_S)


def test_a_room_wait_does_not_count_the_time_its_ranks_were_stopped(
        short_wait: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """Both ranks stop for 1.5 waiting timeouts while a room waits for its data (a whole test process starved
    for 80 s failed a NIXL kit room this way: "waiting timeout: no complete transfer after 8.0 s" right after it
    resumed, the transfer resuming too); once they run again the room completes byte-exact. A prefill room's
    bootstrap timer and the early-request queue excuse the stop likewise. Failed before: the decode's first
    check failed the room."""
    pre, dec, clock = short_wait
    sender, receiver = _open(pre, dec, clock, 1, [1, 2])
    early = dec.receiver(2, "inst")                 # a request whose sender() has not come yet
    early.send_metadata({"kv": np.array([3])})
    _run(clock, 0.1, pre, dec)
    waiting = pre.sender(3)                          # a prefill room no decode asked for yet
    clock.now += 1.5 * WAITING_S                     # nobody runs
    _run(clock, 0.1, dec, pre)
    assert receiver.poll() is KVPoll.WaitingForInput and early.poll() is KVPoll.WaitingForInput
    assert waiting.poll() is KVPoll.Bootstrapping
    sender.send(np.array([1, 2]), last=True)
    late = pre.sender(2)
    late.send(np.array([3]), last=True)
    _run(clock, 0.3, pre, dec, until=lambda: receiver.poll() is KVPoll.Success and early.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success and early.poll() is KVPoll.Success and _landed(dec, [1, 2, 3])


def test_a_room_wait_excuses_at_most_its_own_bound(
        short_wait: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """A decode stopped for 5 waiting timeouts fails its waiting room at its first check, naming the excused
    time: a room ends within twice its bound however rarely its rank runs (the simulator's liveness bound)."""
    pre, dec, clock = short_wait
    _sender, receiver = _open(pre, dec, clock, 1, [1])
    dec.progress()
    clock.now += 5 * WAITING_S
    pre.progress()
    dec.progress()
    assert receiver.poll() is KVPoll.Failed
    assert "waiting timeout" in receiver.failure_reason and "while this rank was not running" in receiver.failure_reason


def test_a_heartbeat_thread_that_ran_late_says_so(pair: tuple[TransferAgent, TransferAgent, ManualClock],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The rank's own side of a silence: when its heartbeat thread wakes far past its interval (the process got no
    CPU, something held the GIL), it logs how late it ran and the peers' timeout, so a peer's "no message for
    N s" can be matched with this rank's log (a clean-clone CI run judged a live vLLM prefill dead once, with
    nothing in the prefill's log to say why). A thread that wakes on time says nothing."""
    import logging
    import threading
    import time

    pre, _dec, _clock = pair
    waits: list[float] = []

    class Stalls:
        """The thread's stop event: the first wait is on time, the second stalls 1.3 s past it, then stop."""

        def wait(self, timeout: float) -> bool:
            waits.append(timeout)
            time.sleep(timeout + (1.3 if len(waits) == 2 else 0.0))
            return len(waits) >= 3

    pre._stop = Stalls()            # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="kvbridge.agent"):
        beats = threading.Thread(target=pre._beat_forever)
        beats.start()
        beats.join(10)
    late = [r.getMessage() for r in caplog.records if "ran" in r.getMessage() and "late" in r.getMessage()]
    assert len(late) == 1, late
    assert "the heartbeat thread ran 1." in late[0] and "after 1.0 s of silence" in late[0], late[0]
    pre._stop = threading.Event()   # type: ignore[assignment]

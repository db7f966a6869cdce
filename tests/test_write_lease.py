"""Write leases (protocol 7): a prefill posts no write to a decode once its lease ran out, and the decode makes
the rooms of a writer silent past that lease safe to reuse on its own, without ``declare_gone``.

The case that breaks a fence without them: a prefill stopped (SIGSTOP, a long pause, a partition) past the
peer timeout, whose decode hands the pages back, then resumes and writes. Both agents run on one manual clock
here; a stopped process is one whose ``progress()`` is not called while the clock moves (its monotonic clock
runs on while it is stopped, as the kernel's does). A rank that held its own lock past its lease while the
decode echoed on (a long send) holds its next write until its inbox is read, then posts:
``test_agent.py::test_a_long_send_does_not_make_a_live_rank_look_dead`` (it failed its room before the hold).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from test_agent import kv_buffers, kv_layout

from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.agent.handles import Receiver, Sender
from kvbridge.agent.peers import Lease
from kvbridge.links import LocalHub
from kvbridge.protocol.states import PeerState
from kvbridge.protocol.wire import KVPoll, Welcome, spoken_as

TIMEOUT_S = 1.0
LEASE_S = 2 * TIMEOUT_S
FLIGHT_BOUND_S = 0.5


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    yield from make_pair()


def make_pair(**config_fields: object) -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    """A connected prefill and decode rank on one manual clock (``config_fields`` override the config)."""
    clock, hub = ManualClock(), LocalHub()
    fields: dict[str, object] = dict(peer_timeout_s=TIMEOUT_S, heartbeat_interval_s=0.2,
                                     write_flight_bound_s=FLIGHT_BOUND_S,
                                     prove_writer_death=False)      # no kernel proof: only the lease ends a fence
    config = AgentConfig(**{**fields, **config_fields})  # type: ignore[arg-type]
    source = kv_buffers(kv_layout(1, 0))
    rng = np.random.default_rng(7)
    for buffer in source:
        buffer[:] = rng.integers(1, 256, buffer.shape, dtype=np.uint8)     # no zero byte: a landed page shows
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": source}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=config, name="p0", clock=clock)
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))},
                        role=Role.DECODE, link=hub.link("d0"), config=config, name="d0", clock=clock)
    shake = dec.connect_async("inst")
    _run(clock, 0.0, pre, dec, until=lambda: shake.done)
    assert shake.done
    yield pre, dec, clock
    pre.close()
    dec.close()


def _run(clock: ManualClock, seconds: float, *agents: TransferAgent, step_s: float = 0.05,
         until: object = None, real_s: float = 20.0) -> None:
    """Step ``agents`` (the others are stopped) while the clock moves ``seconds`` (at least 200 steps). With
    ``until``, once the clock has moved that far, go on stepping at the same time for up to ``real_s`` of real
    time until it holds: a decode's instance lookup runs on a thread, which a loaded host may start late."""
    end = clock.now + seconds
    for _ in range(max(200, int(seconds / step_s) + 1)):
        for agent in agents:
            agent.progress()
        if callable(until) and until():
            return
        clock.now = min(end, clock.now + step_s)
    deadline = time.monotonic() + real_s
    while callable(until) and not until() and time.monotonic() < deadline:
        time.sleep(0.002)
        for agent in agents:
            agent.progress()


def _open(pre: TransferAgent, dec: TransferAgent, clock: ManualClock, room: int,
          pages: list[int]) -> tuple[Sender, Receiver]:
    sender = pre.sender(room)
    receiver = dec.receiver(room, "inst")
    receiver.send_metadata({"kv": np.array(pages)})
    _run(clock, 3.0, pre, dec, until=lambda: sender.poll() is KVPoll.WaitingForInput)
    assert sender.poll() is KVPoll.WaitingForInput
    return sender, receiver


def _landed(dec: TransferAgent, pages: list[int]) -> bool:
    return any(bool(view[pages].any()) for view in dec.buffers.views["kv"])


def test_a_healthy_pair_keeps_its_lease_across_many_lease_lengths(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """Heartbeats and their echoes renew the lease: a pair idle for 5 lease lengths still writes."""
    pre, dec, clock = pair
    sender, receiver = _open(pre, dec, clock, 1, [1, 2])
    _run(clock, 5 * LEASE_S, pre, dec)
    assert pre.peers.lease_left("d0", clock()) > LEASE_S - 4 * 0.2     # renewed within about two beats
    sender.send(np.array([1, 2]), last=True)
    _run(clock, 0.5, pre, dec, until=lambda: receiver.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success and _landed(dec, [1, 2])


def test_a_writer_stopped_past_its_lease_writes_nothing_on_resume_and_its_rooms_are_safe_without_declare_gone(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """Stopped and cut off: the decode's abort never reaches it, so only the lease keeps it from writing."""
    pre, dec, clock = pair
    assert dec.decode is not None and pre.prefill is not None
    sender, receiver = _open(pre, dec, clock, 7, [3, 4])
    stopped_at = clock()
    # the prefill stops; the decode runs on
    _run(clock, TIMEOUT_S + 0.3, dec)
    assert receiver.poll() is KVPoll.Failed
    assert not dec.decode.safe_to_reuse(7), "one peer timeout of silence proves nothing: still fencing"
    peer = dec.peers.peers["p0"]
    assert peer.state is PeerState.SILENT
    _run(clock, LEASE_S + FLIGHT_BOUND_S, dec, until=lambda: dec.decode.safe_to_reuse(7))
    assert dec.decode.safe_to_reuse(7), "silent past its lease + grace: the writer can post nothing more"
    assert peer.state is PeerState.DEPARTED
    safe_after = clock() - stopped_at
    assert LEASE_S <= safe_after <= LEASE_S + FLIGHT_BOUND_S + TIMEOUT_S
    # the prefill resumes inside the engine's send: its lease ran out on its own clock, and its inbox was not
    # read since, so the write waits for the progress loop's read instead of posting
    room = pre.prefill.rooms[7]
    lost = pre.link.recv(0.0)                          # and the decode's frames (its abort) were lost meanwhile
    assert lost
    with pre.context.lock:
        pre.prefill.send(7, np.array([3, 4]), True, {})     # the side's send: no progress step after it
        assert room.pending and not room.inflight and room.nbytes == 0
    pre.progress()                                     # the read brings no echo: the room fails, nothing posted
    assert sender.poll() is KVPoll.Failed
    assert "write lease to decode d0 ran out" in sender.failure_reason
    _run(clock, 0.5, pre, dec)
    assert room.nbytes == 0, "no byte was posted after the lease ran out"
    assert not _landed(dec, [3, 4])
    # the pair works again: the decode's next room shakes hands anew and is granted a lease of a newer epoch
    # (the old record stays over: its rooms can never write)
    sender2, receiver2 = _open(pre, dec, clock, 17, [8, 9])
    fresh = dec.peers.peers["p0"]
    assert fresh is not peer and fresh.lease_epoch > peer.lease_epoch and not fresh.lease_over
    sender2.send(np.array([8, 9]), last=True)
    _run(clock, 1.0, pre, dec, until=lambda: receiver2.poll() is KVPoll.Success)
    assert receiver2.poll() is KVPoll.Success and _landed(dec, [8, 9])
    assert not _landed(dec, [3, 4]), "the old room wrote nothing, before or after the new lease"


def test_a_slow_but_talking_writer_is_never_released_by_the_lease(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """Silence past the peer timeout then frames again (a slow process, not a stopped one): the decode revives
    it; the lease releases nothing while it talks."""
    pre, dec, clock = pair
    assert dec.decode is not None
    _sender, receiver = _open(pre, dec, clock, 9, [5])
    _run(clock, TIMEOUT_S + 0.2, dec)
    assert receiver.poll() is KVPoll.Failed
    _run(clock, 1.0, pre, dec)                         # it speaks again inside its lease
    assert dec.peers.peers["p0"].state is PeerState.ALIVE
    _run(clock, 3 * LEASE_S, pre, dec)
    assert dec.peers.peers["p0"].state is PeerState.ALIVE


def test_a_decode_of_protocol_6_gets_no_lease_and_the_writer_holds_none() -> None:
    """Before 7 a decode knows of no lease: the Welcome it reads has no such field, and the prefill does not
    stop writing to it (that decode's fence still waits for an acknowledgement or declare_gone)."""
    welcome = Welcome(version=7, agent="p0", address="tcp://x", accepted=True, reason="", writer_lease_s=6.0)
    assert not hasattr(spoken_as(welcome, 6), "writer_lease_s")
    assert spoken_as(welcome, 7).writer_lease_s == 6.0


def test_without_a_flight_bound_silence_past_the_lease_still_proves_nothing() -> None:
    """The default (no flight bound known: a write may sit in a NIC's retransmissions for as long as a partition
    lasts): the decode keeps fencing a silent writer, the writer still posts nothing past its lease."""
    clock, hub = ManualClock(), LocalHub()
    config = AgentConfig(peer_timeout_s=TIMEOUT_S, heartbeat_interval_s=0.2, prove_writer_death=False)
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=config, name="p0", clock=clock)
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                        link=hub.link("d0"), config=config, name="d0", clock=clock)
    try:
        shake = dec.connect_async("inst")
        _run(clock, 0.0, pre, dec, until=lambda: shake.done)
        sender, receiver = _open(pre, dec, clock, 3, [1])
        assert dec.decode is not None and pre.prefill is not None
        _run(clock, 10 * LEASE_S, dec)
        assert receiver.poll() is KVPoll.Failed and not dec.decode.safe_to_reuse(3)
        assert pre.peers.lease_left("d0", clock()) < 0
        pre.link.recv(0.0)                             # cut off: the decode's abort is lost
        with pre.context.lock:
            pre.prefill.send(3, np.array([1]), True, {})
        pre.progress()
        assert sender.poll() is KVPoll.Failed and pre.prefill.rooms[3].nbytes == 0
    finally:
        pre.close()
        dec.close()


def test_a_request_queued_before_its_sender_is_never_written_under_a_newer_lease(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """An adversarial pass's finding: the decode's request waited for the prefill's sender() (an early request),
    the prefill stopped past its lease, the decode fenced the room and its abort was lost, then the pair shook
    hands anew and the decode gave the pages to another room. The old request survived the lease reset, and the
    late sender() wrote it into the new room's pages. Now the reset fails the early room too."""
    pre, dec, clock = pair
    assert pre.prefill is not None and dec.decode is not None
    receiver = dec.receiver(7, "inst")
    receiver.send_metadata({"kv": np.array([3, 4])})
    _run(clock, 0.2, pre, dec)
    assert 7 in pre.prefill._early
    _run(clock, TIMEOUT_S + LEASE_S + FLIGHT_BOUND_S + 0.5, dec, until=lambda: dec.decode.safe_to_reuse(7))
    assert dec.decode.safe_to_reuse(7)
    assert pre.link.recv(0.0)                          # the abort was lost with everything else
    receiver.clear()
    receiver2 = dec.receiver(17, "inst")               # the same pages, another room
    receiver2.send_metadata({"kv": np.array([3, 4])})
    _run(clock, 0.1, dec)
    _run(clock, 2.0, pre, dec, until=lambda: receiver2.poll() is KVPoll.WaitingForInput)
    assert receiver2.poll() is KVPoll.WaitingForInput and dec.peers.peers["p0"].lease_epoch == 2
    late = pre.sender(7)                               # the engine gets to the old request only now
    _run(clock, 0.3, pre, dec)
    if late.poll() is KVPoll.WaitingForInput:
        late.send(np.array([3, 4]), last=True)
        _run(clock, 1.0, pre, dec)
    # failed by the reset, or (when the prefill judged the decode dead by silence first and dropped the request)
    # waiting for a request that never comes: either way nothing of it is written (before the fix: Success)
    assert late.poll() in (KVPoll.Failed, KVPoll.Bootstrapping), late.poll()
    assert pre.prefill.rooms[7].nbytes == 0 and not _landed(dec, [3, 4])


def test_a_lease_that_ran_out_while_the_decode_still_talks_holds_the_write_until_an_echo(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """A CI run on a starved host: both sides judged each other silent, then talked again, and the prefill's
    sends failed "write lease ... ran out" before the first new echo came back. A decode that talks to us has not
    fenced us (it drops a fenced writer's frames and never echoes): the write waits for the echo, then goes."""
    pre, dec, clock = pair
    assert pre.prefill is not None
    sender, receiver = _open(pre, dec, clock, 5, [6, 7])
    pre.peers.peers["d0"].lease_until = clock() - 0.1      # its echoes were late: the lease ran out
    pre.progress()                                          # the inbox was read since, the decode talks
    assert pre.peers.lease("d0", clock()) is Lease.UNCONFIRMED
    with pre.context.lock:
        pre.prefill.send(5, np.array([6, 7]), True, {})
        assert pre.prefill.rooms[5].pending and pre.prefill.rooms[5].nbytes == 0, "held, not posted, not failed"
    _run(clock, 1.0, pre, dec, until=lambda: receiver.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success and _landed(dec, [6, 7])

"""Adversarial probes of ``clear_when_safe()`` (4ec53b1, e5f66c5): an engine lets a room go once, whatever its state,
and kvbridge forgets it once safe. Written by an adversarial helper; each test names the promise it attacks:

1. a let-go room is never forgotten while a write can still read its source pages (prefill) or land in its
   destination pages (decode); a decode's staging reservations are freed exactly once, when safe;
2. every let-go room IS forgotten, across faults (declare_gone, a same-name restart, silence then back, a write
   lease running out, drain, an abort racing from another thread, calls twice, clear() after it, reopening);
3. no event of a let-go room after the call; other rooms' events unaffected; a reopened number reports again;
4. all of it in strict mode (the pytest plugin sets KVBRIDGE_STRICT_STATES=1 and fails a test on illegal events).

Writes are made late here on purpose (``_Late``): the loopback copy happens when the write completes (the Nth poll
after the post), reading the prefill's source pages and writing the decode's pages then, as an RDMA read may
anywhere in flight. A room forgotten too early is then seen in the bytes: the engine hands the pages back (writes a
marker into them) the moment kvbridge forgot the room, and a later read or landing shows up.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from test_agent import hand_pair, wait
from test_runtime_calls_adversary import _agent, _Async, _registry
from test_write_lease import FLIGHT_BOUND_S, LEASE_S, TIMEOUT_S, ManualClock, _landed, _open, _run, make_pair

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.backends.base import Poll
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.errors import KVBridgeError
from kvbridge.links import LocalHub
from kvbridge.protocol.events import RoomEvent, RoomEventKind
from kvbridge.protocol.states import RecvState, SendState
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry


# ---------------------------------------------------------------------------------------------------- helpers
class _Late(LoopbackBackend):
    """Loopback whose copy is made when the write completes: ``polls`` polls after the post (pending meanwhile),
    the source pages are read and the destination written, then DONE (FAILED when the copy raises, e.g. the peer
    was removed meanwhile)."""

    polls = 4

    def send_component(self, transfer: Any) -> Any:
        return [transfer, _Late.polls, None]

    def poll(self, handle: Any) -> Poll:
        if not isinstance(handle, list):
            return super().poll(handle)
        if handle[2] is None:
            if handle[1] > 0:
                handle[1] -= 1
                return Poll.pending()
            try:
                handle[2] = super().send_component(handle[0])
            except Exception as exc:  # noqa: BLE001 - the write fails with the words
                handle[2] = Poll.failed(f"{type(exc).__name__}: {exc}")
        return handle[2]

    def release(self, handle: Any) -> None:
        return None


def _connect(pre: TransferAgent, dec: TransferAgent) -> None:
    shake = dec.connect_async("inst")
    deadline = time.monotonic() + 8
    while not shake.done and time.monotonic() < deadline:
        pre.progress()
        dec.progress()
        time.sleep(0.0005)
    assert shake.done, "the in-process handshake did not complete"


def _late_agents(config: AgentConfig | None = None, *,
                 polls: int = 4) -> tuple[TransferAgent, TransferAgent, LocalHub, Registry]:
    """p0 (instance "inst", random source bytes) and d0 over a LocalHub, on ``_Late``, hand-driven."""
    _Late.polls = polls
    registry, hub = _registry("late", _Late), LocalHub()
    kw: dict[str, Any] = {"config": config} if config is not None else {}
    pre = _agent(hub, Role.PREFILL, "p0", registry, "late", **kw)
    dec = _agent(hub, Role.DECODE, "d0", registry, "late", **kw)
    _connect(pre, dec)
    return pre, dec, hub, registry


def _late_pair(config: AgentConfig | None = None, *, polls: int = 4) -> tuple[TransferAgent, TransferAgent]:
    pre, dec, _hub, _registry_ = _late_agents(config, polls=polls)
    return pre, dec


def _spin(*agents: TransferAgent, until: Callable[[], bool], steps: int = 2000, real_s: float = 8.0,
          each: Callable[[], None] | None = None) -> bool:
    """Progress ``agents`` in turn until ``until`` holds (bounded in steps and in time); ``each`` after every round."""
    deadline = time.monotonic() + real_s
    for _ in range(steps):
        if until():
            return True
        for agent in agents:
            agent.progress()
        if each is not None:
            each()
        if time.monotonic() > deadline:
            break
    return until()


def _of(events: list[RoomEvent], room: int) -> list[RoomEventKind]:
    return [e.kind for e in events if e.room == room]


def _ready(pre: TransferAgent, dec: TransferAgent, room: int, dst: list[int]) -> tuple[Any, Any]:
    sender, receiver = pre.sender(room), dec.receiver(room, "inst")
    receiver.send_metadata({"kv": np.array(dst)})
    assert _spin(pre, dec, until=lambda: sender.poll() == KVPoll.WaitingForInput)
    return sender, receiver


def _pages(agent: TransferAgent, pages: list[int]) -> list[np.ndarray]:
    return [v[pages].copy() for v in agent.buffers.views["kv"]]


def _fill(agent: TransferAgent, pages: list[int], byte: int) -> None:
    for v in agent.buffers.views["kv"]:
        v[pages] = byte


@contextlib.contextmanager
def _clocked(**config: object) -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    """test_write_lease's pair on a manual clock (closed on exit)."""
    gen = make_pair(**config)
    pre, dec, clock = next(gen)
    try:
        yield pre, dec, clock
    finally:
        next(gen, None)


def test_strict_mode_is_on() -> None:
    """Promise 4 is only tested if the plugin's strict mode is on in this module."""
    assert os.environ.get("KVBRIDGE_STRICT_STATES") not in (None, "", "0")


# ------------------------------------------------------------------ promise 1: prefill source pages
def test_a_prefill_room_let_go_mid_transfer_is_forgotten_only_after_its_late_write_read_the_pages() -> None:
    """Not aborted: the last chunk's write is in flight (its copy is made when it completes). The room stays until
    then; the engine overwrites the source pages the moment kvbridge forgot the room; the decode must hold the
    original bytes (a room forgotten before its write read the pages would ship the overwrite). Reopening the room
    number while it is pending raises; once forgotten it works. Nothing of the room is reported after the call."""
    pre, dec = _late_pair(polls=6)
    try:
        assert pre.prefill is not None
        sender, receiver = _ready(pre, dec, 1, [1, 2])
        want = _pages(pre, [3, 4])
        sender.send(np.array([3, 4]), last=True)
        sender.clear_when_safe()
        with pre.context.lock:
            assert 1 in pre.prefill.rooms and pre.prefill.rooms[1].busy, "forgotten with its write in flight"
        with pytest.raises(KVBridgeError, match="room 1"):
            pre.sender(1)                             # still pending: the number is not free yet
        seen: list[RoomEvent] = []
        handed_back = []

        def engine() -> None:
            seen.extend(pre.events())
            if not handed_back and 1 not in pre.prefill.rooms:   # type: ignore[union-attr]
                _fill(pre, [3, 4], 0xEE)               # the pages go to another request at once
                handed_back.append(True)

        assert _spin(pre, dec, until=lambda: bool(handed_back) and receiver.poll() == KVPoll.Success, each=engine)
        assert all(np.array_equal(a, b) for a, b in zip(want, _pages(dec, [1, 2]))), \
            "the decode got bytes written into the source pages after kvbridge forgot the room"
        assert _of(seen, 1) == [], seen
        again = pre.sender(1)
        assert again.poll() == KVPoll.Bootstrapping
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 1: decode destination pages, staging
@pytest.mark.parametrize("staging", ["never", "always"])
def test_a_decode_room_let_go_with_a_late_write_in_flight_is_forgotten_after_it_landed_and_staging_freed_once(
        staging: str) -> None:
    """The decode aborts and lets the room go while the prefill's write is in flight (it lands when it completes).
    The decode room must stay until the prefill acknowledged quiescence; the engine writes a marker into the pages
    the moment kvbridge forgot the room: nothing may overwrite it later. With staging, every reservation is freed
    exactly once, only then (never before, never twice)."""
    config = AgentConfig(staging=staging, staging_bytes=1 << 20, peer_timeout_s=30.0, heartbeat_interval_s=0.5)
    pre, dec = _late_pair(config, polls=8)
    try:
        assert dec.decode is not None and pre.prefill is not None
        area = dec.staging
        free0 = area.free_bytes if area is not None else 0
        frees: list[tuple[int, int]] = []
        if area is not None:
            real_free = area.free

            def counted(offset: int, nbytes: int) -> None:
                frees.append((offset, nbytes))
                real_free(offset, nbytes)

            area.free = counted  # type: ignore[method-assign]
        sender, receiver = _ready(pre, dec, 1, [1, 2, 3])
        with dec.context.lock:
            reserved = [(o, n) for o, n, _ in dec.decode.rooms[1].staged.values()]
        assert bool(reserved) == (staging == "always"), reserved
        sender.send(np.array([4, 5, 6]), last=True)
        receiver.abort("request cancelled")
        receiver.clear_when_safe()
        receiver.clear_when_safe()                    # twice: nothing more
        with dec.context.lock:
            assert 1 in dec.decode.rooms and not dec.decode.safe_to_reuse(1)
        gone_at: list[int] = []
        steps = [0]
        early: list[str] = []

        def engine() -> None:
            steps[0] += 1
            if gone_at:
                return
            if 1 in dec.decode.rooms:                 # type: ignore[union-attr]
                if frees:
                    early.append(f"staging freed at step {steps[0]} while the room was kept")
                return
            gone_at.append(steps[0])
            with pre.context.lock:
                room = pre.prefill.rooms.get(1)        # type: ignore[union-attr]
                if room is not None and room.busy:
                    early.append("the decode room was forgotten while the prefill's write was still in flight")
            _fill(dec, [1, 2, 3], 0x77)               # the pages go to another request

        assert _spin(pre, dec, until=lambda: bool(gone_at) and steps[0] > gone_at[0] + 40, each=engine), \
            "the let-go room was never forgotten"
        assert not early, early
        assert all(bool((v[[1, 2, 3]] == 0x77).all()) for v in dec.buffers.views["kv"]), \
            "a write landed in the pages after kvbridge forgot the room"
        if area is not None:
            assert sorted(frees) == sorted(reserved), f"freed {frees}, reserved {reserved}"
            assert area.free_bytes == free0
        assert dec.drained and pre.drained
        assert _of(dec.events(), 1) == []
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 3: events
def test_events_of_a_let_go_room_stop_at_once_others_flow_and_a_reopened_number_reports_again() -> None:
    """Two rooms ready; room 1's READY is queued (not taken) when it is let go with a write in flight: the queued
    READY goes, and neither FINISHED nor SAFE_TO_REUSE of it ever comes; room 2's events all come. On the decode,
    room 2 let go once Success is forgotten at once and says nothing more; room 1 reports on. Room 1 reopened on
    the prefill once forgotten reports READY again."""
    pre, dec = _late_pair(polls=5)
    try:
        assert pre.prefill is not None and dec.decode is not None
        s1, r1 = pre.sender(1), dec.receiver(1, "inst")
        s2, r2 = pre.sender(2), dec.receiver(2, "inst")
        r1.send_metadata({"kv": np.array([1, 2])})
        r2.send_metadata({"kv": np.array([5, 6])})
        assert _spin(pre, dec, until=lambda: s1.poll() == s2.poll() == KVPoll.WaitingForInput)
        s1.send(np.array([3, 4]), last=True)
        s1.clear_when_safe()
        first = pre.events()
        assert _of(first, 1) == [], "a queued event of the let-go room was reported"
        assert _of(first, 2) == [RoomEventKind.READY], first
        s2.send(np.array([7, 8]), last=True)
        seen: list[RoomEvent] = []
        seen_dec: list[RoomEvent] = []
        assert _spin(pre, dec, until=lambda: r1.poll() == r2.poll() == KVPoll.Success and 1 not in pre.prefill.rooms
                     and s2.poll() == KVPoll.Success, each=lambda: (seen.extend(pre.events()),
                                                                     seen_dec.extend(dec.events())))
        seen.extend(pre.events())
        assert _of(seen, 1) == [], seen
        assert _of(seen, 2) == [RoomEventKind.FINISHED, RoomEventKind.SAFE_TO_REUSE], seen
        r2.clear_when_safe()
        assert 2 not in dec.decode.rooms, "a decode room that is safe is forgotten at once"
        seen_dec.extend(dec.events())
        assert RoomEventKind.FINISHED in _of(seen_dec, 1) and RoomEventKind.FINISHED in _of(seen_dec, 2)
        assert _of(dec.events(), 2) == []
        r1.clear()
        again_s, again_r = pre.sender(1), dec.receiver(1, "inst")
        again_r.send_metadata({"kv": np.array([9, 10])})
        assert _spin(pre, dec, until=lambda: again_s.poll() == KVPoll.WaitingForInput)
        assert _of(pre.events(), 1) == [RoomEventKind.READY], "a reopened room number reports no more events"
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 2: calls twice, clear() after
def test_clear_when_safe_twice_and_clear_after_it_leave_nothing_behind() -> None:
    """Prefill: let go twice while busy (no error), a plain clear() then still refuses, the room is forgotten once
    settled and no entry is left to clear a later room of that number. Decode: let go while fencing, then a plain
    clear() forgets it at once (keeping staging, as clear() documents) and leaves no entry behind either: a later
    room of that number is not cleared by a leftover, and staging is never freed twice."""
    config = AgentConfig(staging="always", staging_bytes=1 << 20, peer_timeout_s=30.0, heartbeat_interval_s=0.5)
    pre, dec = _late_pair(config, polls=5)
    try:
        assert pre.prefill is not None and dec.decode is not None and dec.staging is not None
        sender, receiver = _ready(pre, dec, 1, [1, 2])
        sender.send(np.array([3, 4]), last=True)
        sender.abort("the client went away")
        sender.clear_when_safe()
        sender.clear_when_safe()
        with pytest.raises(KVBridgeError, match="still in flight"):
            sender.clear()
        assert _spin(pre, dec, until=lambda: 1 not in pre.prefill.rooms)
        assert not pre.prefill._clear_when_settled
        sender.clear_when_safe()                      # after it was forgotten: nothing
        sender.clear()
        # the decode: the prefill is held still, so the room fences
        free0 = dec.staging.free_bytes
        s2, r2 = _ready(pre, dec, 2, [5, 6])
        assert dec.staging.free_bytes < free0
        r2.abort("cancelled")
        r2.clear_when_safe()
        r2.clear_when_safe()
        for _ in range(20):
            dec.progress()
        with dec.context.lock:
            assert 2 in dec.decode.rooms and dec.decode.rooms[2].state is RecvState.FENCING
        r2.clear()                                    # the engine changes its mind: forgotten now, staging kept
        assert 2 not in dec.decode.rooms and not dec.decode._clear_when_safe
        kept = dec.staging.free_bytes
        assert kept < free0
        r3 = dec.receiver(2, "inst")                  # the number again, a new request
        r3.send_metadata({"kv": np.array([7, 8])})
        assert _spin(pre, dec, until=lambda: pre.prefill.rooms.get(2) is not None
                     and pre.prefill.rooms[2].state is SendState.FAILED)
        for _ in range(50):
            pre.progress()
            dec.progress()
        assert 2 in dec.decode.rooms, "a leftover of the old room's clear_when_safe cleared the new one"
        assert dec.staging.free_bytes <= kept, "staging of the cleared room freed after all (or twice)"
    finally:
        pre.close()
        dec.close()


# Found by the adversarial pass (fixed: a handle acts only on the room it opened). A second clear_when_safe() of a
# handle whose room was forgotten and its number reopened by another request let the NEW room go (its events vanished,
# it was forgotten when it ended under its engine's feet).
def test_a_second_clear_when_safe_of_a_stale_handle_does_not_let_a_reopened_room_go() -> None:
    pre, dec = _late_pair(polls=3)
    try:
        assert pre.prefill is not None
        old, receiver = _ready(pre, dec, 1, [1, 2])
        old.send(np.array([3, 4]), last=True)
        old.clear_when_safe()
        assert _spin(pre, dec, until=lambda: 1 not in pre.prefill.rooms and receiver.poll() == KVPoll.Success)
        receiver.clear()
        new = pre.sender(1)                           # another request gets the number
        old.clear_when_safe()                         # the first engine's second call, as the author's test makes
        r_new = dec.receiver(1, "inst")
        r_new.send_metadata({"kv": np.array([5, 6])})
        assert _spin(pre, dec, until=lambda: new.poll() == KVPoll.WaitingForInput)
        assert _of(pre.events(), 1) == [RoomEventKind.READY], "the new room's READY was muted by the old handle"
        with pre.context.lock:
            assert 1 not in pre.prefill._clear_when_settled
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 2: the defect of a room never requested
# Found by the adversarial pass (fixed: a room let go before it ended fails at once). It kept a room not yet
# safe_to_reuse; a room whose targets are
# bound (WAITING_FOR_INPUT) but whose send_metadata() never came has no waiting timer (RecvRoom.waiting is None
# until send_metadata) and no bootstrap timer (only Bootstrapping counts), and no writer that could fence it:
# nothing ever makes it safe, so it is never forgotten, its number is never free again and drained stays False.
def test_a_decode_room_let_go_before_its_metadata_is_forgotten() -> None:
    with _clocked(bootstrap_timeout_s=2.0, waiting_timeout_s=2.0, peer_timeout_s=5.0,
                  heartbeat_interval_s=0.5) as (pre, dec, clock):
        assert dec.decode is not None
        receiver = dec.receiver(4, "inst")            # SGLang: the request was aborted before init()/send_metadata
        assert receiver.poll() == KVPoll.WaitingForInput
        receiver.clear_when_safe()
        _run(clock, 20.0, pre, dec, step_s=0.25, until=lambda: 4 not in dec.decode.rooms, real_s=0.5)   # 10 x timeouts
        assert 4 not in dec.decode.rooms, (f"never forgotten: {dec.decode.rooms[4].state}, "
                                           f"drained={dec.drained}")


def test_rooms_let_go_live_without_abort_fail_and_are_forgotten() -> None:
    """Let go while live, no abort: a prefill room still Bootstrapping (no request came) and a pair of rooms both
    let go in WaitingForInput (metadata sent, nothing sent yet) fail at once (nobody will send the rest, nobody
    wants it) and are forgotten without waiting for a timeout; none reports anything, nothing lands."""
    with _clocked(bootstrap_timeout_s=2.0, waiting_timeout_s=2.0, peer_timeout_s=5.0,
                  heartbeat_interval_s=0.5) as (pre, dec, clock):
        assert pre.prefill is not None and dec.decode is not None
        lonely = pre.sender(8)
        sender, receiver = _open(pre, dec, clock, 9, [1, 2])
        pre.events()
        dec.events()
        lonely.clear_when_safe()
        sender.clear_when_safe()
        receiver.clear_when_safe()
        _run(clock, 1.0, pre, dec, step_s=0.25,          # within a heartbeat: no timeout is needed
             until=lambda: not pre.prefill.rooms and not dec.decode.rooms)
        assert not pre.prefill.rooms and not dec.decode.rooms
        assert _of(pre.events(), 8) == _of(pre.events(), 9) == _of(dec.events(), 9) == []
        assert not _landed(dec, [1, 2])


# ------------------------------------------------------------------ promise 2: a writer killed (declare_gone)
def test_a_let_go_decode_room_fencing_a_writer_declared_gone_is_forgotten_and_its_staging_freed() -> None:
    config = AgentConfig(staging="always", staging_bytes=1 << 20, peer_timeout_s=30.0, heartbeat_interval_s=0.5)
    pre, dec = hand_pair(config)
    try:
        assert dec.decode is not None and dec.staging is not None
        free0 = dec.staging.free_bytes
        pre.sender(3)
        receiver = dec.receiver(3, "inst")
        receiver.send_metadata({"kv": np.array([1, 2, 3])})
        for _ in range(20):
            dec.progress()                            # the prefill never answers: it is "killed"
        receiver.abort("cancelled")
        receiver.clear_when_safe()
        for _ in range(20):
            dec.progress()
        with dec.context.lock:
            assert 3 in dec.decode.rooms and dec.staging.free_bytes < free0
        dec.declare_gone("p0")
        assert _spin(dec, until=lambda: 3 not in dec.decode.rooms, steps=50), "fenced by declare_gone, never forgotten"
        assert dec.staging.free_bytes == free0 and dec.drained
        assert _of(dec.events(), 3) == []
    finally:
        pre.close()
        dec.close()


def test_a_let_go_prefill_room_whose_decode_is_declared_gone_mid_write_is_forgotten_once_the_write_ended() -> None:
    pre, dec = _late_pair(polls=10)
    try:
        assert pre.prefill is not None
        sender, _receiver = _ready(pre, dec, 5, [1, 2])
        sender.send(np.array([3, 4]), last=True)
        sender.clear_when_safe()
        pre.declare_gone("d0")
        with pre.context.lock:
            assert 5 in pre.prefill.rooms, "forgotten with its write in flight"
        want = _pages(pre, [3, 4])
        handed: list[bool] = []

        def engine() -> None:
            if not handed and 5 not in pre.prefill.rooms:   # type: ignore[union-attr]
                handed.append(True)
                _fill(pre, [3, 4], 0xEE)

        assert _spin(pre, until=lambda: bool(handed), steps=200, each=engine), "never forgotten"
        for _ in range(10):
            pre.progress()
        got = _pages(dec, [1, 2])
        assert all(np.array_equal(g, w) or not g.any() for g, w in zip(got, want)), \
            "the source pages were read after the room was forgotten"
        assert pre.drained
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 2: decode restart under the same name
def test_a_let_go_prefill_room_writing_to_a_decode_that_restarts_under_its_name_is_forgotten() -> None:
    """Write in flight to d0; d0 restarts (new incarnation, another address): the old room fails, its write ends,
    it is forgotten; a room with the new d0 is byte-exact."""
    pre, dec, hub, registry = _late_agents(polls=10)
    new: TransferAgent | None = None
    try:
        assert pre.prefill is not None
        sender, _receiver = _ready(pre, dec, 1, [1, 2])
        sender.send(np.array([3, 4]), last=True)
        sender.clear_when_safe()
        new = _agent(hub, Role.DECODE, "d0", registry, "late", address="d0-again")
        _connect(pre, new)
        with pre.context.lock:
            assert 1 in pre.prefill.rooms, "forgotten with its write in flight"
        assert _spin(pre, new, until=lambda: 1 not in pre.prefill.rooms), "the let-go room was never forgotten"
        assert not pre.prefill._clear_when_settled
        s2, r2 = _ready(pre, new, 2, [5, 6])
        s2.send(np.array([7, 8]), last=True)
        assert _spin(pre, new, until=lambda: r2.poll() == KVPoll.Success)
        assert all(np.array_equal(a, b) for a, b in zip(_pages(pre, [7, 8]), _pages(new, [5, 6])))
        assert _of(pre.events(), 1) == []
    finally:
        pre.close()
        dec.close()
        if new is not None:
            new.close()


# ------------------------------------------------------------------ promise 2: silence past the timeout, then back
def test_a_decode_silent_past_the_timeout_then_back_both_let_go_rooms_are_forgotten() -> None:
    """The decode stops; the prefill judges it silent and fails the room, which is let go (forgotten: nothing in
    flight). The decode, let go too, resumes: it must be told (owed acknowledgement) and forget its room."""
    with _clocked() as (pre, dec, clock):
        assert pre.prefill is not None and dec.decode is not None
        sender, receiver = _open(pre, dec, clock, 3, [1, 2])
        _run(clock, TIMEOUT_S + 0.3, pre)
        assert sender.poll() is KVPoll.Failed
        sender.clear_when_safe()
        with dec.context.lock:
            dec.decode.clear_when_safe(3)             # the decode engine lets go without a progress step
        _run(clock, 3.0, pre, dec, until=lambda: 3 not in pre.prefill.rooms and 3 not in dec.decode.rooms)
        assert 3 not in pre.prefill.rooms and 3 not in dec.decode.rooms
        assert _of(pre.events(), 3) == [] and _of(dec.events(), 3) == []
        assert not _landed(dec, [1, 2])
        again_s, again_r = _open(pre, dec, clock, 3, [1, 2])     # the number works again
        again_s.send(np.array([5, 6]), last=True)
        _run(clock, 1.0, pre, dec, until=lambda: again_r.poll() is KVPoll.Success)
        assert again_r.poll() is KVPoll.Success


def test_a_prefill_silent_past_the_timeout_then_back_inside_its_lease_both_let_go_rooms_are_forgotten() -> None:
    with _clocked() as (pre, dec, clock):
        assert pre.prefill is not None and dec.decode is not None
        sender, receiver = _open(pre, dec, clock, 4, [1, 2])
        _run(clock, TIMEOUT_S + 0.3, dec)             # the prefill stops; the decode fails the room: fencing
        assert receiver.poll() is KVPoll.Failed and not dec.decode.safe_to_reuse(4)
        receiver.clear_when_safe()
        assert 4 in dec.decode.rooms
        with pre.context.lock:
            pre.prefill.clear_when_safe(4)            # the prefill engine lets go while its rank is stalled
        _run(clock, 3.0, pre, dec, until=lambda: 4 not in pre.prefill.rooms and 4 not in dec.decode.rooms)
        assert 4 not in pre.prefill.rooms and 4 not in dec.decode.rooms
        assert _of(pre.events(), 4) == [] and _of(dec.events(), 4) == []


# ------------------------------------------------------------------ promise 2: the write lease runs out
def test_a_let_go_decode_room_of_a_writer_stopped_past_its_lease_is_forgotten_and_the_resumed_writer_forgets_too(
        ) -> None:
    with _clocked() as (pre, dec, clock):
        assert pre.prefill is not None and dec.decode is not None
        sender, receiver = _open(pre, dec, clock, 7, [3, 4])
        _run(clock, TIMEOUT_S + 0.3, dec)
        receiver.clear_when_safe()
        assert 7 in dec.decode.rooms, "forgotten while its writer may still write"
        _run(clock, LEASE_S + FLIGHT_BOUND_S, dec, until=lambda: 7 not in dec.decode.rooms)
        assert 7 not in dec.decode.rooms, "silent past its lease: safe, and let go: forgotten"
        pre.link.recv(0.0)                            # cut off: the decode's frames were lost
        with pre.context.lock:
            pre.prefill.send(7, np.array([3, 4]), True, {})   # the engine resumes inside its send
            pre.prefill.clear_when_safe(7)
            assert 7 in pre.prefill.rooms
        _run(clock, 3.0, pre, dec, until=lambda: 7 not in pre.prefill.rooms)
        assert 7 not in pre.prefill.rooms
        assert not _landed(dec, [3, 4])
        assert _of(pre.events(), 7) == [] and _of(dec.events(), 7) == []


# ------------------------------------------------------------------ promise 2: drain
def test_a_prefill_drain_waits_for_a_let_go_room_with_a_write_in_flight() -> None:
    pre, dec = _late_pair(polls=60)
    try:
        assert pre.prefill is not None
        sender, receiver = _ready(pre, dec, 1, [1, 2])
        want = _pages(pre, [3, 4])
        sender.send(np.array([3, 4]), last=True)
        sender.clear_when_safe()
        with pre.context.lock:
            handle = pre.prefill.rooms[1].inflight[0].handle
        report = pre.drain(5.0)
        assert handle[2] is not None and handle[2].state.name == "DONE", "drain closed with the write in flight"
        assert report["unsafe"] == 0, report
        assert 1 not in pre.prefill.rooms
        assert _spin(dec, until=lambda: receiver.poll() == KVPoll.Success, steps=200)
        assert all(np.array_equal(a, b) for a, b in zip(want, _pages(dec, [1, 2])))
    finally:
        pre.close()
        dec.close()


def test_a_decode_drain_reports_a_let_go_room_it_could_not_fence_and_frees_nothing() -> None:
    config = AgentConfig(staging="always", staging_bytes=1 << 20, peer_timeout_s=1.0, heartbeat_interval_s=0.2)
    pre, dec = hand_pair(config)
    try:
        assert dec.decode is not None and dec.staging is not None
        free0 = dec.staging.free_bytes
        pre.sender(2)
        receiver = dec.receiver(2, "inst")
        receiver.send_metadata({"kv": np.array([1, 2])})
        for _ in range(10):
            dec.progress()                            # the prefill is never progressed again: it never answers
        receiver.abort("cancelled")
        receiver.clear_when_safe()
        t0 = time.monotonic()
        report = dec.drain(0.2)
        assert time.monotonic() - t0 >= 0.2 + 0.5 * config.peer_timeout_s, "drain did not wait for the let-go room"
        assert report == {"success": 0, "failed": 1, "unsafe": 1}, report
        assert 2 in dec.decode.rooms and dec.staging.free_bytes < free0, "an unfenced room forgotten or freed"
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 2/3: abort racing from another thread
def test_abort_racing_clear_when_safe_from_another_thread_never_leaks_a_room_nor_reports_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Background progress threads; per room, one engine thread aborts while another lets the room go (prefill
    with a write in flight, decode too). The abort may find the room already forgotten (KVBridgeError naming it);
    otherwise nothing raises. Every room is forgotten on both sides, none reports an event after the calls, and a
    bystander room's events are untouched."""
    monkeypatch.setattr(_Async, "hold_s", 0.03)
    _Async.calls.clear()
    _Async.fail_add.clear()
    registry, hub = _registry("async", _Async), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "async")
    dec = _agent(hub, Role.DECODE, "d0", registry, "async")
    errors: list[BaseException] = []
    try:
        assert pre.prefill is not None and dec.decode is not None
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=8)
        bystander_s, bystander_r = pre.sender(1000), dec.receiver(1000, "inst")
        bystander_r.send_metadata({"kv": np.array([15])})
        wait(lambda: bystander_s.poll() == KVPoll.WaitingForInput, 8)
        late_events: list[RoomEvent] = []
        bystander_events: list[RoomEvent] = [*pre.events()]
        deadline = time.monotonic() + 8.0
        raced = 0
        for room in range(1, 11):
            if time.monotonic() > deadline:
                break
            raced += 1
            sender, receiver = pre.sender(room), dec.receiver(room, "inst")
            receiver.send_metadata({"kv": np.array([room % 8 + 1])})
            wait(lambda s=sender: s.poll() == KVPoll.WaitingForInput, 8)   # type: ignore[misc]
            bystander_events.extend(e for e in pre.events() if e.room == 1000)
            dec.events()
            sender.send(np.array([room % 8 + 1]), last=True)
            barrier = threading.Barrier(4)

            def call(fn: Callable[[], None], barrier: threading.Barrier = barrier) -> None:
                try:
                    barrier.wait(2)
                    fn()
                except KVBridgeError as exc:
                    if "was cleared" not in str(exc):
                        errors.append(exc)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=call, args=(fn,)) for fn in (
                lambda s=sender: s.abort("race"), sender.clear_when_safe,
                lambda r=receiver: r.abort("race"), receiver.clear_when_safe)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(5)
            late_events.extend(e for e in pre.events() + dec.events() if e.room == room)
            wait(lambda r=room: r not in pre.prefill.rooms and r not in dec.decode.rooms, 5)  # type: ignore[misc]
            late_events.extend(e for e in pre.events() + dec.events() if e.room == room)
        assert raced >= 4, f"only {raced} rooms raced in the time allowed"
        assert not errors, errors
        assert not late_events, late_events
        with pre.context.lock, dec.context.lock:
            assert set(pre.prefill.rooms) == {1000} and set(dec.decode.rooms) == {1000}
            assert not pre.prefill._clear_when_settled and not dec.decode._clear_when_safe
        bystander_s.send(np.array([14]), last=True)
        wait(lambda: bystander_r.poll() == KVPoll.Success, 8)
        bystander_events.extend(e for e in pre.events() if e.room == 1000)
        assert [e.kind for e in bystander_events] == [RoomEventKind.READY, RoomEventKind.FINISHED,
                                                      RoomEventKind.SAFE_TO_REUSE], bystander_events
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ promise 2: held from_start chunks
def test_a_room_let_go_while_bootstrapping_with_held_from_start_chunks_is_forgotten_after_they_landed() -> None:
    """SGLang's new path: the chunks go as from_start sends held by the core; the engine lets the room go before the
    decode's request came (no abort). The held writes go when it comes, read the source pages, and only then is the
    room forgotten; the pages overwritten at that moment never reach the decode."""
    pre, dec = _late_pair(polls=6)
    try:
        assert pre.prefill is not None
        sender = pre.sender(6)
        want = _pages(pre, [3, 4])
        sender.send(np.array([3, 4]), last=True, from_start=True)
        sender.clear_when_safe()
        assert 6 in pre.prefill.rooms
        receiver = dec.receiver(6, "inst")
        receiver.send_metadata({"kv": np.array([1, 2])})
        handed: list[bool] = []

        def engine() -> None:
            if not handed and 6 not in pre.prefill.rooms:   # type: ignore[union-attr]
                handed.append(True)
                _fill(pre, [3, 4], 0xEE)

        assert _spin(pre, dec, until=lambda: bool(handed) and receiver.poll() == KVPoll.Success, each=engine)
        assert all(np.array_equal(a, b) for a, b in zip(want, _pages(dec, [1, 2])))
        assert _of(pre.events(), 6) == []
    finally:
        pre.close()
        dec.close()

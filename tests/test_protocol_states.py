"""The protocol's four transition tables (kvbridge.protocol.states) and how the agent goes through them:
reachability, projections, an illegal event raising under test and failing the room in production, and
the fence of a receive room as a state (FENCING until every writer is fenced)."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_agent import hand_pair, spin  # the agent tests' small dense-KV pool

from kvbridge.agent import AgentConfig, RoomEventKind, TransferAgent
from kvbridge.protocol import states
from kvbridge.protocol.states import (
    PEER,
    RECV_POLL,
    RECV_ROOM,
    SEND_POLL,
    SEND_ROOM,
    WRITE,
    IllegalTransition,
    Machine,
    PeerEvent,
    PeerState,
    RecvEvent,
    RecvState,
    SendEvent,
    SendState,
    WriteEvent,
    WriteState,
)
from kvbridge.protocol.wire import Abort, KVPoll

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol-states.md"


def _reachable(machine: Machine, start: enum.Enum) -> set[enum.Enum]:
    seen, todo = {start}, deque([start])
    while todo:
        state = todo.popleft()
        for (s, _e), after in machine.table.items():
            if s is state and after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


@pytest.mark.parametrize(("machine", "start", "states_of"), [
    (SEND_ROOM, SendState.BOOTSTRAPPING, SendState),
    (RECV_ROOM, RecvState.BOOTSTRAPPING, RecvState),
    (WRITE, WriteState.QUEUED, WriteState),
    (PEER, PeerState.ALIVE, PeerState),
])
def test_every_state_is_reachable_from_the_first(machine: Machine, start: enum.Enum, states_of: type) -> None:
    assert _reachable(machine, start) == set(states_of)


def test_every_room_state_can_fail_and_a_finished_room_keeps_its_state() -> None:
    for state in SendState:
        assert SEND_ROOM.allows(state, SendEvent.FAIL), state
    assert SEND_ROOM.step(SendState.SUCCESS, SendEvent.FAIL) is SendState.SUCCESS
    for state in RecvState:
        assert RECV_ROOM.allows(state, RecvEvent.FAIL_FENCED), state
    assert RECV_ROOM.step(RecvState.SUCCESS, RecvEvent.FAIL) is RecvState.SUCCESS
    assert RECV_ROOM.step(RecvState.FAILED, RecvEvent.FAIL) is RecvState.FAILED       # never back to FENCING


def test_poll_is_a_projection_of_every_state() -> None:
    assert set(SEND_POLL) == set(SendState) and set(RECV_POLL) == set(RecvState)
    assert RECV_POLL[RecvState.FENCING] is RECV_POLL[RecvState.FAILED] is KVPoll.Failed
    assert SEND_POLL[SendState.FAILING] is SEND_POLL[SendState.FAILED] is KVPoll.Failed
    assert {SEND_POLL[s] for s in states.SAFE_SEND} == {KVPoll.Success, KVPoll.Failed}


def test_terminal_states_have_no_way_back() -> None:
    """Success and Failed never lead to a live state; a departed peer is never revived; a done write stays."""
    assert _reachable(SEND_ROOM, SendState.SUCCESS) == {SendState.SUCCESS}
    assert _reachable(SEND_ROOM, SendState.FAILING) == {SendState.FAILING, SendState.FAILED}
    assert _reachable(SEND_ROOM, SendState.FAILED) == {SendState.FAILED}
    assert _reachable(RECV_ROOM, RecvState.FENCING) == {RecvState.FENCING, RecvState.FAILED}
    assert _reachable(PEER, PeerState.DEPARTED) == {PeerState.DEPARTED, PeerState.RETIRED}
    for state in (WriteState.DONE, WriteState.FAILED, WriteState.DROPPED):
        assert _reachable(WRITE, state) == {state}


@pytest.mark.parametrize(("machine", "state", "event"), [
    (SEND_ROOM, SendState.BOOTSTRAPPING, SendEvent.SEND),
    (SEND_ROOM, SendState.SUCCESS, SendEvent.SEND),
    (SEND_ROOM, SendState.WAITING_FOR_INPUT, SendEvent.DRAINED),
    (SEND_ROOM, SendState.FAILING, SendEvent.SEND),
    (SEND_ROOM, SendState.FAILED, SendEvent.DRAINED),
    (RECV_ROOM, RecvState.FAILED, RecvEvent.NOTICE),
    (RECV_ROOM, RecvState.BOOTSTRAPPING, RecvEvent.COVERED),
    (RECV_ROOM, RecvState.SUCCESS, RecvEvent.NOTICE),
    (WRITE, WriteState.GATHERING, WriteEvent.DROP),       # its gather still touches memory
    (WRITE, WriteState.DONE, WriteEvent.COMPLETE),
    (PEER, PeerState.RETIRED, PeerEvent.FRAME),
])
def test_an_event_missing_from_the_table_is_illegal(machine: Machine, state: enum.Enum, event: enum.Enum) -> None:
    assert not machine.allows(state, event)
    with pytest.raises(IllegalTransition, match=f"{event.value!r} is illegal in state {state.value!r}"):
        machine.step(state, event, "here")


def test_the_docs_hold_the_tables() -> None:
    """docs/protocol-states.md is ``python -m kvbridge.protocol.states``: a table change updates the docs."""
    assert states.markdown() in DOC.read_text()


# ------------------------------------------------------------------ the agent goes through the tables
@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """One prefill and one decode rank over an in-process link, driven by hand (no threads)."""
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=5.0))
    yield pre, dec
    pre.close()
    dec.close()

def _spin(*agents: TransferAgent, steps: int = 50) -> None:
    spin(*agents, steps=steps)


def test_an_illegal_event_raises_under_test_and_fails_the_room_otherwise(
        pair: tuple[TransferAgent, TransferAgent], monkeypatch: pytest.MonkeyPatch) -> None:
    pre, _dec = pair
    assert pre.prefill is not None
    pre.sender(1)
    room = pre.prefill.rooms[1]
    with pytest.raises(IllegalTransition):
        pre.prefill._step(room, SendEvent.DRAINED)            # drained before any request came
    assert room.state is SendState.BOOTSTRAPPING
    monkeypatch.setenv("KVBRIDGE_STRICT_STATES", "0")
    pre.prefill._step(room, SendEvent.DRAINED)
    assert room.status is KVPoll.Failed
    assert "'drained' is illegal in state 'bootstrapping'" in room.reason
    assert states.illegal_events(clear=True)                 # both were recorded (the test hook checks none is left)


def test_a_failed_room_is_fencing_until_its_writer_acknowledges(pair: tuple[TransferAgent, TransferAgent]) -> None:
    pre, dec = pair
    assert pre.prefill is not None and dec.decode is not None
    sender = pre.sender(7)
    receiver = dec.receiver(7, "inst")
    receiver.send_metadata({"kv": np.array([1, 2, 3])})
    _spin(pre, dec)
    assert pre.prefill.rooms[7].state is SendState.WAITING_FOR_INPUT
    receiver.abort("the engine gave up")
    room = dec.decode.rooms[7]
    assert room.state is RecvState.FENCING and receiver.poll() is KVPoll.Failed and not receiver.safe_to_reuse
    _spin(pre, dec)
    assert sender.poll() is KVPoll.Failed
    assert room.state is RecvState.FAILED and receiver.safe_to_reuse
    assert room.quiesced == {"p0"}


def test_a_quiesced_abort_for_an_already_failed_room_fences_it(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """The writer's acknowledgement may reach a room that already failed for another reason: that room must
    become safe at once (FENCING -> FAILED), not at the next fence round."""
    pre, dec = pair
    assert dec.decode is not None
    pre.sender(9)
    receiver = dec.receiver(9, "inst")
    receiver.send_metadata({"kv": np.array([4, 5])})
    room = dec.decode.rooms[9]
    with dec.context.lock:
        dec.decode._fail(room, "a local reason")
        assert room.state is RecvState.FENCING
        env_abort = Abort(room=9, agent="p0", reason="ack", quiesced=True, nonce=room.nonce)
        frame = pre.context.codec.encode(env_abort, to=dec.link.address, to_incarnation=dec.incarnation)
        dec.handle_frame(frame)
    assert room.state is RecvState.FAILED and receiver.safe_to_reuse


# ------------------------------------------------------------------ events(): what the engine learns per step
def test_events_report_each_room_once_in_order_without_polling(pair: tuple[TransferAgent, TransferAgent]) -> None:
    pre, dec = pair
    ok_s, ok_r = pre.sender(1), dec.receiver(1, "inst")
    ok_r.send_metadata({"kv": np.array([1, 2])})
    pre.sender(2)
    bad_r = dec.receiver(2, "inst")
    bad_r.send_metadata({"kv": np.array([3])})
    _spin(pre, dec)
    ok_s.send(np.array([5, 6]), last=True)
    bad_r.abort("the engine gave up")
    seen: dict[str, list[tuple[int, RoomEventKind]]] = {"pre": [], "dec": []}
    for _ in range(100):
        seen["pre"] += [(e.room, e.kind) for e in pre.events()]
        seen["dec"] += [(e.room, e.kind) for e in dec.events()]
    R, F, X, S = RoomEventKind.READY, RoomEventKind.FINISHED, RoomEventKind.FAILED, RoomEventKind.SAFE_TO_REUSE
    assert sorted(seen["dec"], key=lambda x: x[0]) == [(1, F), (1, S), (2, X), (2, S)]
    assert sorted(seen["pre"], key=lambda x: x[0]) == [(1, R), (1, F), (1, S), (2, R), (2, X), (2, S)]
    assert ok_r.poll() is KVPoll.Success and bad_r.safe_to_reuse
    assert not pre.events() and not dec.events()                    # each once


def test_a_failed_rooms_safe_event_waits_for_its_fence(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """FAILED comes at once, SAFE_TO_REUSE only once the writer acknowledged (never while FENCING)."""
    pre, dec = pair
    pre.sender(3)
    receiver = dec.receiver(3, "inst")
    receiver.send_metadata({"kv": np.array([1])})
    _spin(pre, dec)
    receiver.abort("gave up")
    first = [(e.kind, e.reason) for e in dec.events()]
    assert first and first[0] == (RoomEventKind.FAILED, "gave up")
    assert all(kind is not RoomEventKind.SAFE_TO_REUSE for kind, _ in first) or receiver.safe_to_reuse
    _spin(pre, dec)
    later = [e.kind for e in dec.events()]
    assert RoomEventKind.SAFE_TO_REUSE in [k for k, _ in first] + later and receiver.safe_to_reuse


def test_a_prefill_room_is_never_safe_before_its_safe_event(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """A decode's abort handled by a frame (as a progress thread or ``link_wait`` does, no progress step after
    it) fails a prefill room with nothing in flight: it is safe to reuse at once, so SAFE_TO_REUSE must be queued
    with FAILED in that same transition. It used to come at the next progress step: an engine beside a progress
    thread saw the room safe before its event (simulator: 24 of seeds 0-199, e.g. seed 7)."""
    pre, dec = pair
    assert pre.prefill is not None
    pre.sender(11)
    receiver = dec.receiver(11, "inst")
    receiver.send_metadata({"kv": np.array([1, 2])})
    _spin(pre, dec)
    pre.events()                                            # READY: taken
    receiver.abort("the engine gave up")                    # posts the Abort; the decode's own events: not ours
    for frame in pre.link.recv(0.0):
        pre.handle_frame(frame)                             # no progress step after it
    with pre.context.lock:
        queued = [e.kind for e in pre.context.events.take()]
        room = pre.prefill.rooms[11]
        assert room.status is KVPoll.Failed and not room.busy
        assert pre.prefill.safe_to_reuse(11)
    assert queued == [RoomEventKind.FAILED, RoomEventKind.SAFE_TO_REUSE]
    assert room.state is SendState.FAILED


def test_a_failing_prefill_room_is_safe_with_its_event_once_its_last_write_ends(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    """A prefill room that fails with a write in flight is FAILING (Failed, not safe, no SAFE_TO_REUSE) until
    that write ends; then FAILED, safe and its event come in one step."""
    pre, dec = pair
    assert pre.prefill is not None
    pre.sender(12)
    receiver = dec.receiver(12, "inst")
    receiver.send_metadata({"kv": np.array([1, 2])})
    _spin(pre, dec)
    pre.events()
    room = pre.prefill.rooms[12]
    with pre.context.lock:
        pre.prefill.send(12, np.array([3, 4]), True, {})      # the side's send: no progress step after it
        assert room.busy
        pre.prefill._fail(room, "a local reason")
        assert room.state is SendState.FAILING and not pre.prefill.safe_to_reuse(12)
        assert [e.kind for e in pre.context.events.take()] == [RoomEventKind.FAILED]
    for _ in range(100):
        pre.progress()
        with pre.context.lock:
            kinds = [e.kind for e in pre.context.events.take()]
            if kinds:
                assert kinds == [RoomEventKind.SAFE_TO_REUSE] and room.state is SendState.FAILED
                assert pre.prefill.safe_to_reuse(12)
                return
            assert not pre.prefill.safe_to_reuse(12)
    pytest.fail("the failing room's write never ended")


def test_a_cleared_rooms_events_are_dropped(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """An engine that never asks for events keeps nothing once it clears its rooms."""
    pre, dec = pair
    pre.sender(4)
    receiver = dec.receiver(4, "inst")
    receiver.abort("never sent")
    assert receiver.safe_to_reuse
    receiver.clear()
    assert len(dec.context.events) == 0 and not dec.events()


def test_an_early_abort_by_one_decode_rank_tells_the_others_that_asked() -> None:
    """Prefill TP 1 serves decode ranks d0 and d1; both ask before the prefill's sender(); d0 aborts. The room
    can never succeed: d1, whose request was queued with d0's, must hear it (a quiesced abort: nothing was
    written), not wait for its waiting timeout (simulator seed 5724)."""
    from test_agent import kv_buffers, kv_layout

    from kvbridge.links import LocalHub
    from kvbridge.protocol.wire import Role

    hub = LocalHub()
    config = AgentConfig(peer_timeout_s=5.0)
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=config, name="p0")
    decs = [TransferAgent(layout=kv_layout(2, r), buffers={"kv": kv_buffers(kv_layout(2, r))}, role=Role.DECODE,
                          link=hub.link(f"d{r}"), config=config, name=f"d{r}") for r in range(2)]
    try:
        shakes = [d.connect_async("inst") for d in decs]
        for _ in range(2000):
            _spin(pre, *decs, steps=1)
            if all(s.done for s in shakes):
                break
        receivers = [d.receiver(5, "inst") for d in decs]
        for r in receivers:
            r.send_metadata({"kv": np.array([1, 2])})
        _spin(pre, *decs)                                     # both requests queued: no sender() yet
        receivers[0].abort("the engine gave up")
        _spin(pre, *decs)
        assert receivers[0].poll() is KVPoll.Failed and receivers[0].safe_to_reuse
        assert receivers[1].poll() is KVPoll.Failed, "d1 was never told the room cannot succeed"
        assert "d0" in receivers[1].failure_reason and receivers[1].safe_to_reuse
        sender = pre.sender(5)                                # comes late: fails at once with the reason
        assert sender.poll() is KVPoll.Failed and "aborted by decode d0" in sender.failure_reason
    finally:
        for agent in (pre, *decs):
            agent.close()

"""Backend calls are actions: a protocol handler decides under the agent lock and queues the call; the runtime makes
it after the lock's release and hands what the backend said back to the handler under the lock
(``kvbridge.agent.actions``). Checked here from outside the agent (the registry's call monitors, not the strict
mode's own guard), on whole transfers, and for the two answers that come back late: a refused post and a post whose
write lease ran out before the runtime could make it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import test_write_lease
from test_agent import check, fill, kv_buffers, kv_layout, spin, start_room, wait
from test_write_lease import TIMEOUT_S, ManualClock, _landed, _open, _run

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent.context import INLINE_CALLS
from kvbridge.backends.calls import BackendCall, CallKind, CallOutcome
from kvbridge.links import LocalHub
from kvbridge.protocol.states import WriteState
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry


@pytest.mark.parametrize("staging", ["always", "never"])
def test_no_rank_calls_its_backend_or_copies_memory_while_holding_its_lock(staging: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Handshake, a TP 2 -> 1 room byte-exact (staged pieces or plain descriptors), an abort, a decode restarted
    under its name (its old record removed from the backend, the new one added) and closes, threaded: every
    backend call of every rank is made outside that rank's lock, and each kind a transfer needs was made; so is
    every gather and scatter of a staged piece (host copies here; launches on the CUDA stream on a GPU)."""
    from kvbridge.agent import decode, posting

    hub, registry = LocalHub(), Registry.build()
    agents: dict[str, TransferAgent] = {}
    under: list[str] = []
    made: set[CallKind] = set()
    copies: list[str] = []

    def watched(name: str, inner: Any) -> Any:
        def copy(*args: Any, **kwargs: Any) -> Any:
            copies.append(name)
            held = [a.name for a in agents.values() if a.context.lock.held_here()]
            if held:
                under.append(f"{name} under the lock of {held}")
            return inner(*args, **kwargs)
        return copy

    monkeypatch.setattr(posting, "gather_rows", watched("gather", posting.gather_rows))
    monkeypatch.setattr(decode, "scatter_rows", watched("scatter", decode.scatter_rows))

    def before(call: BackendCall) -> None:
        agent = agents.get(call.agent)
        made.add(call.kind)
        if agent is not None and call.kind not in INLINE_CALLS and agent.context.lock.held_here():
            under.append(f"{call.agent}: {call.kind.value}")

    def after(call: BackendCall, outcome: CallOutcome) -> None:
        pass

    undo = registry.add_call_monitoring(before, after)
    config = AgentConfig(staging=staging, staging_bytes=1 << 20, staging_below_bytes=1 << 30)

    def make(role: Role, tp: int, rank: int, name: str, **kw: Any) -> TransferAgent:
        agent = TransferAgent(layout=kv_layout(tp, rank), buffers={"kv": kv_buffers(kv_layout(tp, rank))}, role=role,
                              link=hub.link(name), name=name, registry=registry, config=config, **kw)
        agents[name] = agent
        agent.start()
        return agent

    pre = [make(Role.PREFILL, 2, r, f"p{r}", instance="inst") for r in range(2)]
    dec = make(Role.DECODE, 1, 0, "d0")
    try:
        dec.connect("inst", timeout_s=10)

        class _Pair:                    # what test_agent's helpers read
            prefill, decode = pre, [dec]
            src = [list(a.buffers.views["kv"]) for a in pre]
            dst = [list(dec.buffers.views["kv"])]

        pages, positions = np.array([3, 1, 4]), np.arange(3)
        fill(_Pair, 2, 7, pages, positions)   # type: ignore[arg-type]
        senders, receivers = start_room(_Pair, 41, np.array([5, 9, 2]))   # type: ignore[arg-type]
        for s in senders:
            s.send(pages, last=True)
        wait(lambda: receivers[0].poll() == KVPoll.Success and all(s.poll() == KVPoll.Success for s in senders))
        wait(lambda: all(s.safe_to_reuse for s in senders))
        check(_Pair, 1, 7, np.array([5, 9, 2]), positions)   # type: ignore[arg-type]
        aborted = dec.receiver(42, "inst")
        aborted.send_metadata({"kv": np.array([6])})
        aborted.abort("the engine dropped the request")
        wait(lambda: aborted.poll() == KVPoll.Failed)
        dec.close()                                     # restarted under the same name: a new incarnation
        dec = make(Role.DECODE, 1, 0, "d0")
        dec.connect("inst", timeout_s=10)
        again = dec.receiver(43, "inst")
        again.send_metadata({"kv": np.array([7])})
        for s in (p.sender(43) for p in pre):
            wait(lambda s=s: s.poll() == KVPoll.WaitingForInput)      # type: ignore[misc]
            s.send(np.array([2]), last=True)
        wait(lambda: again.poll() == KVPoll.Success)
        spin(*pre, dec, steps=5)
    finally:
        for agent in [*pre, dec]:
            agent.close()
        undo()
    assert under == [], under[:5]
    if staging == "always":
        assert {"gather", "scatter"} <= set(copies), copies
    assert {CallKind.ADD_PEER, CallKind.REMOVE_PEER, CallKind.SEND_COMPONENT, CallKind.POLL, CallKind.RELEASE,
            CallKind.NOTIFY_COMPLETION} <= made, sorted(k.value for k in made)


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    yield from test_write_lease.make_pair(staging="never")      # plain writes: they land in the decode's pages


def _send_then_lapse(pre: TransferAgent, clock: ManualClock, room: int, pages: list[int]) -> Any:
    """Our write lease to the decode is about to run out (its last echo a lease ago); the engine sends, and before
    the runtime makes the post (the lock is still held around the send) the clock passes the lease. Returns the
    room's record."""
    assert pre.prefill is not None
    with pre.context.lock:
        pre.peers.peers["d0"].lease_until = clock.now + 0.01
        pre.prefill.send(room, np.array(pages), True, {})
        record = pre.prefill.rooms[room]
        assert [w.state for w in record.inflight] == [WriteState.POSTING]      # decided, not made
        clock.now += 0.02
    return record


def test_a_post_whose_lease_ran_out_before_it_was_made_is_not_made_and_waits_for_an_echo(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The lease ran out between the decision and the post: nothing is handed to the backend; the write is queued
    again and judged again; the decode's next echo renews the lease and the write lands."""
    pre, dec, clock = pair
    sender, receiver = _open(pre, dec, clock, 1, [1, 2])
    record = _send_then_lapse(pre, clock, 1, [1, 2])
    assert not record.inflight and record.nbytes == 0 and not _landed(dec, [1, 2])
    assert [p.state for p in record.pending] == [WriteState.READY]
    _run(clock, 2.0, pre, dec, until=lambda: receiver.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success and _landed(dec, [1, 2])


def test_a_post_whose_lease_ran_out_before_it_was_made_fails_the_room_when_the_decode_stays_silent(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The same, but the decode is stopped: no echo ever comes; the room fails on the lease, nothing was written."""
    pre, dec, clock = pair
    sender, _receiver = _open(pre, dec, clock, 2, [3, 4])
    record = _send_then_lapse(pre, clock, 2, [3, 4])
    _run(clock, TIMEOUT_S + 0.5, pre, until=lambda: sender.poll() is KVPoll.Failed)
    assert sender.poll() is KVPoll.Failed and "lease" in pre.prefill.reason(2)   # type: ignore[union-attr]
    assert record.nbytes == 0 and not _landed(dec, [3, 4])
    _run(clock, 0.5, pre, until=lambda: bool(pre.prefill.safe_to_reuse(2)))      # type: ignore[union-attr]


def test_a_post_the_backend_refuses_fails_the_room_and_the_engine_send_raises() -> None:
    """The refusal comes back after the lock's release, in the engine's own send(): it raises the backend's error,
    and both sides fail the room with its words."""
    from kvbridge.backends.loopback import LoopbackBackend
    from kvbridge.specs import BackendSpec, Capability
    from kvbridge.testkit.checked import SpecPlugin

    class Refuses(LoopbackBackend):
        def send_component(self, transfer: Any) -> Any:
            raise OSError("no route to the decode's memory")

    spec = BackendSpec(name="refuses", factory=Refuses, capabilities=frozenset({Capability.HOST_MEMORY}))
    registry = Registry.build(allow={"kv"}, env={}, plugins=[SpecPlugin([spec], [])])
    hub = LocalHub()
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", name="p0", registry=registry, backend="refuses")
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                        link=hub.link("d0"), name="d0", registry=registry, backend="refuses")
    try:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=10)
        sender, receiver = pre.sender(5), dec.receiver(5, "inst")
        receiver.send_metadata({"kv": np.array([1])})
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        with pytest.raises(OSError, match="no route"):
            sender.send(np.array([2]), last=True)
        wait(lambda: receiver.poll() == KVPoll.Failed and sender.safe_to_reuse)
        assert "refuses send_component raised OSError: no route" in pre.prefill.reason(5)   # type: ignore[union-attr]
        assert "no route" in dec.decode.reason(5)                                        # type: ignore[union-attr]
    finally:
        pre.close()
        dec.close()


def test_the_role_objects_take_no_lock_and_refuse_a_caller_without_it(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The role objects decide with the agent lock held by the runtime (the handles take it): called directly
    without it, a mutating method raises LockNotHeld in strict mode (a handler run without the lock would run its
    actions in the middle of its decision); with the lock held it runs, and its actions wait for the release."""
    from kvbridge.agent.context import LockNotHeld

    pre, dec, clock = pair
    assert pre.prefill is not None and dec.decode is not None
    sender, receiver = _open(pre, dec, clock, 4, [1, 2])
    for call in (lambda: pre.prefill.send(4, np.array([3, 4]), True, {}),          # type: ignore[union-attr]
                 lambda: pre.prefill.abort(4, "no lock"), lambda: dec.decode.abort(4, "no lock"),  # type: ignore[union-attr]
                 lambda: pre.prefill.open(99), lambda: dec.decode.clear(4, True)):  # type: ignore[union-attr]
        with pytest.raises(LockNotHeld, match="without the agent lock"):
            call()
    assert sender.poll() is KVPoll.WaitingForInput and receiver.poll() is KVPoll.WaitingForInput
    with pre.context.lock:
        pre.prefill.send(4, np.array([3, 4]), True, {})
        assert [w.state for w in pre.prefill.rooms[4].inflight] == [WriteState.POSTING]   # queued, not made
    assert [w.state for w in pre.prefill.rooms[4].inflight] == [WriteState.POSTED]         # made at the release
    _run(clock, 2.0, pre, dec, until=lambda: receiver.poll() is KVPoll.Success)
    assert receiver.poll() is KVPoll.Success

"""The one seam between an agent and its backend (``kvbridge.backends.calls``) and declared capabilities.

Every call an agent makes reaches the backend through ``BackendCalls``, so a call monitor sees all of them (a
real TP 2 -> 1 transfer over loopback, compared call for call with what the backend itself received); an
optional method is called only when its capability is declared, and a backend that declares one without the
method is refused, naming both; fault injection reaches call kinds that are not pluggy hooks.
"""

from __future__ import annotations

import ast
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvbridge
import kvbridge.state.kv
from kvbridge._markers import hookimpl
from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.backends.calls import BackendCall, BackendCalls, CallKind, CallMonitors, CallOutcome
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.errors import PluginError, PluginUnavailableError
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.specs import BackendSpec, Capability, PluginStatus
from kvbridge.testkit.faults import FaultInjector

HEADS, DIM, PAGE, PAGES = 4, 8, 4, 16
ALL_CAPS = frozenset({Capability.HOST_MEMORY, Capability.WRITER_GONE, Capability.NOTIFY_FAILURES})


def layout(tp: int, rank: int) -> PoolLayout:
    bufs = tuple(BufferGeometry(name=f"{t}.0", num_items=PAGES, item_shape=(PAGE, HEADS // tp, DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, HEADS)) for t in "kv")
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp, tp_rank=rank,
                      page_size=PAGE, model="m")


def buffers(lay: PoolLayout) -> dict[str, list[np.ndarray]]:
    return {"kv": [np.full((g.num_items, g.item_nbytes), 7, np.uint8) for g in lay.components[0].buffers]}


def wait(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


# ------------------------------------------------------------------ a backend that counts what reaches it
RECEIVED: Counter[str] = Counter()
_RECEIVED_LOCK = threading.Lock()
_DEPTH = threading.local()


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    """Count the outermost call of ``method`` (a backend calling its own methods is not the agent calling)."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0:
            with _RECEIVED_LOCK:
                RECEIVED[method.__name__] += 1
        _DEPTH.n = depth + 1
        try:
            return method(self, *args)
        finally:
            _DEPTH.n = depth
    return wrapper


class Counting(LoopbackBackend):
    """Loopback, counting every call of every backend method, optional ones included."""

    def drain_notify_failures(self) -> list[Any]:
        return []

    def writer_gone(self, endpoint: bytes) -> bool:     # an instance method here, to be counted like the rest
        return LoopbackBackend.writer_gone(endpoint)


for _kind in CallKind:
    setattr(Counting, _kind.value, _counted(getattr(Counting, _kind.value)))


class _Plugin:
    __name__ = "test-backend-calls"

    def __init__(self, *specs: BackendSpec) -> None:
        self.specs = list(specs)

    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return self.specs


def registry_with(*specs: BackendSpec, plugins: tuple[object, ...] = ()) -> Registry:
    return Registry.build(entry_points=False, plugins=[kvbridge.state.kv, _Plugin(*specs), *plugins])


class Seen:
    """A call monitor: the kinds it saw, before and after, and what each after got."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.before: Counter[str] = Counter()
        self.after: Counter[str] = Counter()
        self.errors: list[BaseException] = []

    def on_before(self, call: BackendCall) -> None:
        with self.lock:
            self.before[call.kind.value] += 1

    def on_after(self, call: BackendCall, outcome: CallOutcome) -> None:
        with self.lock:
            self.after[call.kind.value] += 1
            if outcome.error is not None:
                self.errors.append(outcome.error)


@pytest.fixture
def counting() -> Iterator[Registry]:
    RECEIVED.clear()
    yield registry_with(BackendSpec(name="counting", factory=Counting, capabilities=ALL_CAPS))


# no liveness connection: the backend's writer_gone proves the writers' exit; peers are reaped 1 s after death
CONFIG = AgentConfig(prove_writer_death=False, peer_timeout_s=0.3, heartbeat_interval_s=0.05)


def _tp2_to_1(registry: Registry) -> bool:
    """A real TP 2 -> 1 transfer over loopback (threads); then prefill rank 1 leaves during a second room, which
    fails and is fenced (rank 1 by the backend's proof, rank 0 by its acknowledgement); then the decode leaves
    and rank 0 forgets it. True when the first room's bytes landed."""
    hub = LocalHub()
    pre = [TransferAgent(layout=layout(2, r), buffers=buffers(layout(2, r)), role=Role.PREFILL, backend="counting",
                         link=hub.link(f"p{r}"), instance="inst", registry=registry, config=CONFIG)
           for r in range(2)]
    dl = layout(1, 0)
    dst = buffers(dl)
    for b in dst["kv"]:
        b[:] = 0
    dec = TransferAgent(layout=dl, buffers=dst, role=Role.DECODE, backend="counting", link=hub.link("d0"),
                        registry=registry, config=CONFIG)
    try:
        for agent in pre:
            agent.start()
        dec.start()
        dec.connect("inst", timeout_s=10)
        receiver = dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([2, 3])})
        senders = [a.sender(1) for a in pre]
        wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
        for s in senders:
            s.send(np.array([5, 6]), last=True)
        wait(lambda: receiver.poll() is KVPoll.Success and all(s.poll() is KVPoll.Success for s in senders))
        landed = all(bool((b[[2, 3]] == 7).all()) for b in dst["kv"])
        receiver.clear()
        for s in senders:
            s.clear()
        second = dec.receiver(2, "inst")
        second.send_metadata({"kv": np.array([4])})
        held = pre[0].sender(2)
        wait(lambda: held.poll() >= KVPoll.WaitingForInput)
        pre[1].close()                       # a writer leaves: the decode fails its room, the backend proves it
        wait(lambda: second.poll() is KVPoll.Failed)
        wait(lambda: second.safe_to_reuse)   # rank 1 proven gone (writer_gone), rank 0 acknowledged the abort
        second.clear()
        wait(lambda: held.poll() is KVPoll.Failed)
        held.clear()
        dec.close()                          # the decode leaves: rank 0 forgets it, and removes its backend peer
        wait(lambda: RECEIVED["remove_peer"] >= 1)
        return landed
    finally:
        for agent in [*pre, dec]:
            agent.close()


def test_a_monitor_sees_every_call_the_agents_make_during_a_tp_2_to_1_transfer(counting: Registry) -> None:
    seen = Seen()
    undo = counting.add_call_monitoring(seen.on_before, seen.on_after)
    assert _tp2_to_1(counting)
    undo()
    assert seen.errors == []
    # call for call: nothing reached the backend around the seam, and the seam made no call of its own
    assert seen.before == seen.after == RECEIVED, (seen.before, RECEIVED)
    # every kind the agent makes in a transfer, its teardown and a writer's exit
    assert set(seen.before) == {k.value for k in CallKind}, sorted({k.value for k in CallKind} - set(seen.before))


def test_a_detached_monitor_sees_nothing_more(counting: Registry) -> None:
    seen = Seen()
    counting.add_call_monitoring(seen.on_before, seen.on_after)()    # attached, then detached at once
    assert _tp2_to_1(counting)
    assert seen.before == Counter() and sum(RECEIVED.values()) > 0


def test_a_monitor_that_raises_after_a_call_does_not_break_the_transfer(counting: Registry,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    def broken(call: BackendCall, outcome: CallOutcome) -> None:
        raise RuntimeError("monitor bug")

    counting.add_call_monitoring(lambda call: None, broken)
    with caplog.at_level(logging.ERROR, logger="kvbridge.backends"):
        assert _tp2_to_1(counting)
    assert "a backend call monitor failed after" in caplog.text


def test_no_agent_module_calls_its_backend_around_the_seam() -> None:
    """The agent's modules name no backend method on the backend object, no operation of the registry, and
    find no optional method by ``getattr``: ``ctx.calls`` is the only way in."""
    root = Path(kvbridge.__file__).resolve().parent
    methods = {k.value for k in CallKind}
    found = []
    for path in sorted((root / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in methods:
                owner = ast.unparse(func.value)
                if owner.endswith(("backend", "_backend", "registry", "engine")):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(func)}")
            if isinstance(func, ast.Name) and func.id in {"getattr", "hasattr"} and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in methods:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


# ------------------------------------------------------------------ declared capabilities
class NoProbe(LoopbackBackend):
    """Declares WRITER_GONE below, but cannot prove anything: writer_gone is removed."""

    writer_gone = None      # type: ignore[assignment]


def test_a_class_declaring_a_capability_without_its_method_is_refused_at_load_naming_both() -> None:
    registry = registry_with(BackendSpec(name="liar", factory=NoProbe, capabilities=ALL_CAPS - {
        Capability.NOTIFY_FAILURES}))
    record = next(r for r in registry.records() if r.name == "liar")
    assert record.status is PluginStatus.ERROR
    assert "'liar'" in record.reason and "writer_gone()" in record.reason and "writer-gone" in record.reason
    with pytest.raises(PluginUnavailableError, match=r"writer_gone"):
        registry.create_backend("liar", name="x")


def test_a_lazy_factory_declaring_a_capability_without_its_method_is_refused_when_built() -> None:
    spec = BackendSpec(name="liar-lazy", factory="kvbridge.backends.loopback:LoopbackBackend",
                       capabilities=frozenset({Capability.HOST_MEMORY, Capability.NOTIFY_FAILURES}))
    registry = registry_with(spec)
    assert next(r for r in registry.records() if r.name == "liar-lazy").status is PluginStatus.AVAILABLE
    lay = layout(1, 0)
    with pytest.raises(PluginError, match=r"'liar-lazy'.*drain_notify_failures\(\)"):
        TransferAgent(layout=lay, buffers=buffers(lay), role=Role.DECODE, backend="liar-lazy",
                      link=LocalHub().link("d"), registry=registry)


def test_an_undeclared_optional_method_is_never_called(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    class Quiet(LoopbackBackend):
        def drain_notify_failures(self) -> list[Any]:
            calls.append("drain_notify_failures")
            return []

        @staticmethod
        def writer_gone(endpoint: bytes) -> bool:
            calls.append("writer_gone")
            return True

    registry = registry_with(BackendSpec(name="quiet", factory=Quiet))
    with caplog.at_level(logging.WARNING, logger="kvbridge.registry"):
        backend = registry.create_backend("quiet", name="q")
    assert "does not declare Capability.WRITER_GONE" in caplog.text
    assert "does not declare Capability.NOTIFY_FAILURES" in caplog.text
    seam = registry.backend_calls(backend, "quiet", agent="q")
    assert seam.writer_gone(b"anything") is False and seam.drain_notify_failures() == []
    assert calls == []
    seam.close()


def test_a_before_monitor_refuses_the_call_before_it_reaches_the_backend() -> None:
    reached: list[str] = []

    class Backend:
        name, endpoint = "b", b"b"

        def close(self) -> None:
            reached.append("close")

    monitors = CallMonitors()
    after: list[CallOutcome] = []

    def refuse(call: BackendCall) -> None:
        raise RuntimeError(f"no {call.kind.value}")

    monitors.add(refuse, lambda call, outcome: after.append(outcome))
    from kvbridge.backends.calls import BackendCalls

    seam = BackendCalls(Backend(), name="b", agent="a", capabilities=frozenset(), hooks=None,  # type: ignore[arg-type]
                        monitors=monitors)
    with pytest.raises(RuntimeError, match="no close"):
        seam.close()
    assert reached == [] and after == []


# ------------------------------------------------------------------ fault injection through the seam
def test_fault_injection_breaks_a_poll_and_the_room_fails_with_the_reason(counting: Registry) -> None:
    faults = FaultInjector()
    registry = registry_with(BackendSpec(name="counting", factory=Counting, capabilities=ALL_CAPS), plugins=(faults,))
    faults.arm_call(CallKind.POLL, times=1)
    hub = LocalHub()
    pl, dl = layout(1, 0), layout(1, 0)
    with TransferAgent(layout=pl, buffers=buffers(pl), role=Role.PREFILL, backend="counting", link=hub.link("p"),
                       instance="i", registry=registry) as pre, \
         TransferAgent(layout=dl, buffers=buffers(dl), role=Role.DECODE, backend="counting", link=hub.link("d"),
                       registry=registry) as dec:
        pre.start()
        dec.start()
        dec.connect("i", timeout_s=10)
        receiver = dec.receiver(3, "i")
        receiver.send_metadata({"kv": np.array([1])})
        sender = pre.sender(3)
        wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
        sender.send(np.array([2]), last=True)
        wait(lambda: sender.poll() is KVPoll.Failed)
        assert "injected by kvbridge.testkit: poll raised" in sender.failure_reason
        wait(lambda: receiver.poll() is KVPoll.Failed)
        # the poll was refused, but the handle was still released: no write is leaked behind the failure
        wait(lambda: RECEIVED["release"] == RECEIVED["send_component"])
    assert faults.calls[CallKind.POLL] >= 1 and faults.calls[CallKind.ADD_PEER] >= 1
    assert faults.calls[CallKind.CLOSE] == 2


def test_fault_injection_on_drain_notifications_never_kills_the_progress_thread(counting: Registry) -> None:
    faults = FaultInjector()
    registry = registry_with(BackendSpec(name="counting", factory=Counting, capabilities=ALL_CAPS), plugins=(faults,))
    hub = LocalHub()
    pl, dl = layout(1, 0), layout(1, 0)
    with TransferAgent(layout=pl, buffers=buffers(pl), role=Role.PREFILL, backend="counting", link=hub.link("p"),
                       instance="i", registry=registry) as pre, \
         TransferAgent(layout=dl, buffers=buffers(dl), role=Role.DECODE, backend="counting", link=hub.link("d"),
                       registry=registry) as dec:
        pre.start()
        dec.start()
        dec.connect("i", timeout_s=10)
        faults.arm_call(CallKind.DRAIN_NOTIFICATIONS, times=20, agent=dec.name)
        wait(lambda: faults.calls[CallKind.DRAIN_NOTIFICATIONS] > 40)     # 20 refused, and it went on
        receiver = dec.receiver(4, "i")
        receiver.send_metadata({"kv": np.array([1])})
        sender = pre.sender(4)
        wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
        sender.send(np.array([2]), last=True)
        wait(lambda: receiver.poll() is KVPoll.Success)


# ------------------------------------------------------------------ interceptors: around the call, in the seam
def test_interceptors_nest_in_order_change_arguments_and_the_monitors_see_what_the_agent_gets() -> None:
    """The first interceptor attached is the outermost; ``proceed`` takes changed arguments to the next one and
    then the backend; a monitor sees the agent's arguments and the result the outermost interceptor gave; an error
    an interceptor raises reaches the agent and the monitor's ``after``, and the backend was not called."""
    reached: list[tuple[str, ...]] = []

    class Backend:
        def remove_peer(self, peer_id: str) -> None:
            reached.append(("remove_peer", peer_id))

        def add_peer(self, peer: Any) -> str:
            reached.append(("add_peer", str(peer)))
            return f"id-{peer}"

    monitors = CallMonitors()
    order: list[str] = []
    outcomes: list[CallOutcome] = []
    monitors.add(lambda call: order.append(f"before {call.args}"), lambda call, out: outcomes.append(out))

    def outer(call: BackendCall, proceed: Callable[..., Any]) -> Any:
        order.append(f"outer {call.args}")
        if call.kind is CallKind.REMOVE_PEER and call.args == ("refuse",):
            raise RuntimeError("refused by the outer interceptor")
        return f"outer({proceed(*call.args)})"

    def inner(call: BackendCall, proceed: Callable[..., Any]) -> Any:
        order.append(f"inner {call.args}")
        return proceed(*(f"{a}+inner" for a in call.args))

    monitors.intercept(outer)
    undo_inner = monitors.intercept(inner)
    seam = BackendCalls(Backend(), name="b", agent="a", capabilities=frozenset(), hooks=None,  # type: ignore[arg-type]
                        monitors=monitors)
    assert seam.add_peer("p") == "outer(id-p+inner)"
    assert order == ["before ('p',)", "outer ('p',)", "inner ('p',)"] and reached == [("add_peer", "p+inner")]
    assert outcomes[-1].result == "outer(id-p+inner)"
    with pytest.raises(RuntimeError, match="refused by the outer"):
        seam.remove_peer("refuse")
    assert reached == [("add_peer", "p+inner")] and isinstance(outcomes[-1].error, RuntimeError)
    undo_inner()
    seam.remove_peer("q")
    assert reached[-1] == ("remove_peer", "q")


class _NoStandIns(Counting):
    """Counting loopback that records any handle it did not make reaching poll or release."""

    foreign: list[Any] = []

    def poll(self, handle: Any) -> Any:
        if type(handle).__name__ == "FaultHandle":
            self.foreign.append(handle)
        return super().poll(handle)

    def release(self, handle: Any) -> None:
        if type(handle).__name__ == "FaultHandle":
            self.foreign.append(handle)
        super().release(handle)


@pytest.mark.parametrize("fault", ["duplicate", "stall", "fail", "lose-notice"])
def test_handle_faults_reach_an_unwrapped_backend_through_the_seam(fault: str) -> None:
    """Fault injection is an interceptor of the seam: with a plain backend (no kit proxy) a DUPLICATE write is
    posted twice and lands once, a STALL holds the room until released, a FAIL fails it with the reason, a lost
    notice fails the decode's room at its bound; every real handle is released and the backend never sees the
    injector's stand-in handles."""
    from kvbridge.testkit.faults import Fault

    RECEIVED.clear()
    _NoStandIns.foreign = []
    faults = FaultInjector()
    registry = registry_with(BackendSpec(name="plain", factory=_NoStandIns, capabilities=ALL_CAPS), plugins=(faults,))
    hub = LocalHub()
    pl, dl = layout(1, 0), layout(1, 0)
    dst = buffers(dl)
    for b in dst["kv"]:
        b[:] = 0
    config = AgentConfig(peer_timeout_s=10.0, heartbeat_interval_s=0.05, waiting_timeout_s=1.5)
    with TransferAgent(layout=pl, buffers=buffers(pl), role=Role.PREFILL, backend="plain", link=hub.link("p"),
                       instance="i", registry=registry, config=config) as pre, \
         TransferAgent(layout=dl, buffers=dst, role=Role.DECODE, backend="plain", link=hub.link("d"),
                       registry=registry, config=config) as dec:
        pre.start()
        dec.start()
        dec.connect("i", timeout_s=10)
        faults.arm(Fault(fault), room=5, reason="broken on purpose")
        receiver = dec.receiver(5, "i")
        receiver.send_metadata({"kv": np.array([1, 2])})
        sender = pre.sender(5)
        wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
        sender.send(np.array([3, 4]), last=True)
        if fault == "stall":
            time.sleep(0.3)
            assert receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and sender.poll() is not KVPoll.Success
            faults.release()
        if fault == "fail":
            wait(lambda: sender.poll() is KVPoll.Failed)
            assert "broken on purpose" in sender.failure_reason
            wait(lambda: receiver.poll() is KVPoll.Failed)
        elif fault == "lose-notice":
            wait(lambda: receiver.poll() is KVPoll.Failed)
        else:
            wait(lambda: receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success)
            assert all(bool((b[[1, 2]] == 7).all()) for b in dst["kv"])
        assert faults.injected[Fault(fault)] >= 1
        wait(lambda: RECEIVED["release"] == RECEIVED["send_component"])
    assert _NoStandIns.foreign == []
    if fault == "duplicate":
        assert RECEIVED["send_component"] == 2 * len([s for s in faults.sends if s[1] == 5])


class _Handles:
    """A backend of bare handles: numbered sends, one send or one release made to fail on demand."""

    def __init__(self, *, fail_send: int = 0) -> None:
        self.sent: list[int] = []
        self.released: list[int] = []
        self.fail_send, self.fail_release = fail_send, -1

    def send_component(self, transfer: Any) -> int:
        if len(self.sent) + 1 == self.fail_send:
            raise RuntimeError("the engine's queue is full")
        self.sent.append(len(self.sent) + 1)
        return self.sent[-1]

    def poll(self, handle: Any) -> Any:
        from kvbridge.backends.base import Poll
        return Poll.done() if isinstance(handle, int) else Poll.failed(f"not a handle of mine: {handle!r}")

    def release(self, handle: int) -> None:
        if handle == self.fail_release:
            raise RuntimeError("release failed")
        self.released.append(handle)


class _Hooks:
    def send_component(self, backend: Any, transfer: Any) -> Any:
        return backend.send_component(transfer)


def _injected_seam(backend: _Handles) -> tuple[BackendCalls, FaultInjector]:
    monitors, faults = CallMonitors(), FaultInjector()
    monitors.intercept(faults.intercept_backend_call)
    return BackendCalls(backend, name="b", agent="a", capabilities=frozenset(), hooks=_Hooks(),  # type: ignore[arg-type]
                        monitors=monitors), faults


def _transfer() -> Any:
    import types
    return types.SimpleNamespace(room=5, component="kv", peer="d", chunk=0, notice=b"")


def test_a_duplicate_whose_second_post_fails_still_hands_the_first_write_to_the_agent() -> None:
    """Claim: the injector never leaves a real write without an owner: when DUPLICATE's second post raises, the
    agent gets a handle of the first (before the fix: the error, and the first write was never released)."""
    from kvbridge.testkit.faults import Fault

    backend = _Handles(fail_send=2)
    seam, faults = _injected_seam(backend)
    faults.arm(Fault.DUPLICATE)
    handle = seam.send_component(_transfer())
    assert backend.sent == [1] and faults.duplicates_refused == 1
    seam.poll(handle)
    seam.release(handle)
    assert backend.released == [1]


def test_a_duplicate_whose_first_release_fails_still_releases_the_second() -> None:
    from kvbridge.testkit.faults import Fault

    backend = _Handles()
    seam, faults = _injected_seam(backend)
    faults.arm(Fault.DUPLICATE)
    handle = seam.send_component(_transfer())
    backend.fail_release = 1
    with pytest.raises(RuntimeError, match="release failed"):
        seam.release(handle)
    assert backend.released == [2]


def test_an_interceptor_attached_twice_and_detached_once_stays_attached_once() -> None:
    monitors = CallMonitors()

    def identity(call: BackendCall, proceed: Callable[..., Any]) -> Any:
        return proceed(*call.args)

    undo = monitors.intercept(identity)
    monitors.intercept(identity)
    undo()
    undo()                                  # idempotent: still the other attachment
    assert monitors.interceptors == (identity,)

"""A hypothesis state machine over two backends of one process (imported only when its test runs).

Rules: register (a matching source/destination pair of buffers), send (whole items between them),
peek (poll a handle once: it must not have failed), complete (wait for a handle to end, within the bound),
abandon (release a handle without waiting: its destination items are retired), notify, drain, deregister.
The model is the expected destination bytes and the set of outstanding handles.
Invariants: destination items with no write in flight equal the model; no guard byte changes; sources
never change; each notice arrives at most once, and by teardown every notice the backend took (True from
``notify_completion``; False is allowed: the agent then sends it over the control link) and every write arrived.

Deterministic for asynchronous backends: which rules may run next never depends on how far a transfer got in
real time (hypothesis replays a failing example by its choices, and refuses a machine whose preconditions
changed between runs). So a handle leaves the outstanding set only through ``complete``, which waits for it, or
``abandon``; ``peek`` polls without changing the model.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvbridge.backends.base import ComponentTransfer, HandleState
from kvbridge.geometry import region_of
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.protocol.records import PeerInfo
from kvbridge.slicing import Segments
from kvbridge.testkit.pools import GuardedBuffer

__all__ = ["EXAMPLES_ENV", "BackendMachine", "run_backend_machine"]

EXAMPLES_ENV = "KVBRIDGE_KIT_STATEFUL_EXAMPLES"


@dataclass(eq=False, kw_only=True)
class _Pair:
    component: str
    items: int
    item: int
    src: list[GuardedBuffer]
    dst: list[GuardedBuffer]
    reg_src: Any
    reg_dst: Any
    model: list[np.ndarray]
    src_bytes: list[np.ndarray]
    busy: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    live: bool = True


@dataclass(eq=False)
class _Send:
    handle: Any
    pair: _Pair
    src_items: np.ndarray
    dst_items: np.ndarray


class BackendMachine(RuleBasedStateMachine):
    pairs = Bundle("pairs")

    def __init__(self, make_backend: Callable[[str], Any], notifications: bool, bound_s: float) -> None:
        super().__init__()
        self.a, self.b = make_backend("m-src"), make_backend("m-dst")
        self.notifications, self.bound_s = notifications, bound_s
        self.names = itertools.count()
        self.all_pairs: list[_Pair] = []
        self.outstanding: list[_Send] = []
        self.peer: str | None = None
        self.sent: set[bytes] = set()               # notices the backend took (notify_completion True)
        self.refused: set[bytes] = set()            # notices it returned False for: not owed (a copy may come)
        self.notices = itertools.count()
        self.received: Counter[bytes] = Counter()
        self.rng = np.random.default_rng(0)

    def _refresh_peer(self) -> None:
        remote = tuple(p.reg_dst.remote() for p in self.all_pairs if p.live)
        self.peer = self.a.add_peer(PeerInfo("m-dst", self.b.endpoint, remote))

    @precondition(lambda self: not self.outstanding)
    @rule(target=pairs, buffers=st.integers(1, 2), items=st.integers(2, 6), item=st.sampled_from([64, 256, 1024]))
    def register(self, buffers: int, items: int, item: int) -> _Pair:
        name = f"m{next(self.names)}"
        src = [GuardedBuffer(items * item) for _ in range(buffers)]
        dst = [GuardedBuffer(items * item) for _ in range(buffers)]
        for buf in src + dst:
            buf.write(self.rng.integers(0, 256, buf.nbytes, dtype=np.uint8))
        pair = _Pair(component=name, items=items, item=item, src=src, dst=dst,
                     reg_src=self.a.register_buffers(name, [region_of(x.data) for x in src]),
                     reg_dst=self.b.register_buffers(name, [region_of(x.data) for x in dst]),
                     model=[x.read().reshape(items, item) for x in dst],
                     src_bytes=[x.read().reshape(items, item) for x in src])
        self.all_pairs.append(pair)
        self._refresh_peer()
        note(f"registered {name}: {buffers} buffer(s) of {items} x {item} B")
        return pair

    @precondition(lambda self: not self.outstanding)
    @rule(pair=consumes(pairs))
    def deregister(self, pair: _Pair) -> None:
        if pair.retired:
            return          # an abandoned write may still land: keep it registered until close()
        self.a.deregister_buffers(pair.reg_src)
        self.b.deregister_buffers(pair.reg_dst)
        pair.live = False
        self._refresh_peer()

    @rule(pair=pairs, data=st.data())
    def send(self, pair: _Pair, data: st.DataObject) -> None:
        free = [i for i in range(pair.items) if i not in pair.busy and i not in pair.retired]
        if not free or self.peer is None:
            return
        dst_items = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True), "dst")
        src_items = data.draw(st.lists(st.integers(0, pair.items - 1), min_size=len(dst_items),
                                       max_size=len(dst_items), unique=True), "src")
        order = np.argsort(src_items, kind="stable")
        si, di = np.array(src_items, np.int64)[order], np.array(dst_items, np.int64)[order]
        whole = Segments.whole(pair.item)
        plan = plan_transfer([BufferPair(src_base=region_of(x.data).addr, src_item_nbytes=pair.item,
                                         src_num_items=pair.items, dst_base=region_of(y.data).addr,
                                         dst_item_nbytes=pair.item, dst_num_items=pair.items,
                                         segments=whole) for x, y in zip(pair.src, pair.dst)], si, di)
        transfer = ComponentTransfer(room=1, component=pair.component, peer=self.peer, chunk=0, last=True,
                                     src=pair.reg_src, dst=pair.reg_dst.remote(), plan=plan,
                                     notice=b"", src_items=si, dst_items=di, segments=tuple(whole for _ in pair.src))
        self.outstanding.append(_Send(self.a.send_component(transfer), pair, si, di))
        pair.busy.update(int(i) for i in di)

    def _finish(self, send: _Send, state: HandleState, reason: str) -> None:
        assert state is HandleState.DONE, f"a valid send of {send.pair.component} ended {state.name}: {reason}"
        for model, src in zip(send.pair.model, send.pair.src_bytes):
            model[send.dst_items] = src[send.src_items]
        send.pair.busy.difference_update(int(i) for i in send.dst_items)

    @precondition(lambda self: bool(self.outstanding))
    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        """One non-blocking poll; whatever it says, the handle stays outstanding (pending or done alike)."""
        send = data.draw(st.sampled_from(self.outstanding), "handle")
        result = self.a.poll(send.handle)
        assert result.state is not HandleState.FAILED, \
            f"a valid send of {send.pair.component} failed: {result.reason}"

    @precondition(lambda self: bool(self.outstanding))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Poll one handle until it ends (at most the bound), then release it."""
        send = data.draw(st.sampled_from(self.outstanding), "handle")
        result = self._wait(send)
        self.outstanding.remove(send)
        self.a.release(send.handle)
        self._finish(send, result.state, result.reason)

    def _wait(self, send: _Send) -> Any:
        deadline = time.monotonic() + self.bound_s
        while True:
            result = self.a.poll(send.handle)
            if result.state is not HandleState.PENDING:
                return result
            assert time.monotonic() < deadline, \
                f"a send of {send.pair.component} is still PENDING after {self.bound_s} s"
            time.sleep(0.0005)

    @precondition(lambda self: bool(self.outstanding))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """Release a handle without waiting for it (the backend-level abort): its items are retired."""
        send = data.draw(st.sampled_from(self.outstanding), "handle")
        self.outstanding.remove(send)
        self.a.release(send.handle)
        send.pair.busy.difference_update(int(i) for i in send.dst_items)
        send.pair.retired.update(int(i) for i in send.dst_items)

    @precondition(lambda self: self.notifications and self.peer is not None)
    @rule()
    def notify(self) -> None:
        message = f"kvbridge-testkit machine notice {next(self.notices)}".encode()
        taken = self.a.notify_completion(self.peer, message)
        assert isinstance(taken, bool), f"notify_completion returned {taken!r}, not a bool"
        if taken:              # False: the agent sends it over the control link (docs/plugin-api.md)
            self.sent.add(message)
        else:
            self.refused.add(message)

    @rule()
    def drain(self) -> None:
        for _, message in self.b.drain_notifications():
            assert message in self.sent | self.refused, f"drained a notice that was never sent: {message!r}"
            self.received[message] += 1
            assert self.received[message] == 1, f"the notice {message!r} arrived twice"

    @invariant()
    def memory_matches_model(self) -> None:
        for pair in self.all_pairs:
            for b, (buf, model) in enumerate(zip(pair.dst, pair.model)):
                damage = buf.guard_damage()
                assert not damage, f"{pair.component} destination buffer {b}: wrote outside registered memory: {damage}"
                if not pair.live:
                    continue
                got = buf.read().reshape(pair.items, pair.item)
                for i in range(pair.items):
                    if i not in pair.busy and i not in pair.retired and not np.array_equal(got[i], model[i]):
                        raise AssertionError(f"{pair.component} destination buffer {b} item {i} differs from the "
                                             "model (no write to it is in flight)")
            for b, (buf, src) in enumerate(zip(pair.src, pair.src_bytes)):
                assert np.array_equal(buf.read().reshape(pair.items, pair.item), src), \
                    f"{pair.component} source buffer {b} changed"

    def teardown(self) -> None:
        try:
            while self.outstanding:
                send = self.outstanding.pop(0)
                result = self._wait(send)
                self.a.release(send.handle)
                self._finish(send, result.state, result.reason)
            self.memory_matches_model()
            deadline = time.monotonic() + self.bound_s
            while set(self.received) != self.sent:
                self.drain()
                assert time.monotonic() < deadline, f"notices never arrived: {sorted(self.sent - set(self.received))}"
                time.sleep(0.001)
        finally:
            for pair in self.all_pairs:
                if pair.live:
                    self.a.deregister_buffers(pair.reg_src)
                    self.b.deregister_buffers(pair.reg_dst)
            self.a.close()
            self.b.close()
            for pair in self.all_pairs:
                for buf in pair.src + pair.dst:
                    buf.close()


def run_backend_machine(make_backend: Callable[[str], Any], notifications: bool, *, examples: int, bound_s: float,
                        steps: int = 20) -> None:
    """Run the machine; shrinking is off with ``--kvbridge-no-shrink`` or ``KVBRIDGE_KIT_NO_SHRINK=1``, and
    ``KVBRIDGE_KIT_STATEFUL_EXAMPLES=N`` runs N examples instead of the subject's ``stateful_examples`` (a long
    run: ``KVBRIDGE_KIT_STATEFUL_EXAMPLES=150 pytest plugins/nixl/tests -k stateful``)."""
    from kvbridge.testkit.plugin import kit_settings

    examples = int(os.environ.get(EXAMPLES_ENV) or examples)

    run_state_machine_as_test(
        # hypothesis only calls it (its stub asks for the class; a factory carries the arguments)
        lambda: BackendMachine(make_backend, notifications, bound_s),  # type: ignore[arg-type]
        settings=kit_settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))

"""Adversarial probes of backend calls as actions (0cc33fe): a handler decides under the agent lock and queues the
backend call; the runtime makes it after the lock's release and hands the answer back under the lock. Written by
an adversarial helper; each test names the guarantee it attacks.

Three failed at 58dcdf3 and pass since their fixes:

* test_two_threads_in_progress_never_poll_a_handle_after_its_release and
  test_engine_threads_polling_their_rooms_never_poll_a_released_handle: with progress() run by more than one
  thread (engine threads through poll(), no background thread), a handle was polled after another thread released
  it (plugin-api.md: "never polls that handle again"). Now one thread at a time polls, from its list of writes
  through the releases its results queue (``TransferAgent._poll_gate``).
* test_a_post_interrupted_by_a_base_exception_leaves_no_write_posting_forever: a BaseException (KeyboardInterrupt,
  asyncio.CancelledError) out of send_component left the write POSTING: the room never drained, on either side.
  Now the runtime hands any exception to the handler (the write fails, the engine's send() raises it) and runs
  the rest of the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_write_lease
from test_agent import kv_buffers, kv_layout, wait
from test_write_lease import ManualClock, _landed, _open, _run

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.backends.base import Poll
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.links import LocalHub
from kvbridge.protocol.states import WriteState
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.specs import BackendSpec, Capability
from kvbridge.testkit.checked import SpecPlugin

DEADLINE_S = 15.0


# ---------------------------------------------------------------------------------------------------- helpers
def _registry(name: str, factory: Callable[..., Any]) -> Registry:
    spec = BackendSpec(name=name, factory=factory, capabilities=frozenset({Capability.HOST_MEMORY}))
    return Registry.build(allow={"kv"}, env={}, plugins=[SpecPlugin([spec], [])])


def _agent(hub: LocalHub, role: Role, name: str, registry: Registry | None = None, backend: str | None = None,
           *, address: str | None = None, tp: int = 1, rank: int = 0, buffers: list[np.ndarray] | None = None,
           instance: str = "inst", **kw: Any) -> TransferAgent:
    layout = kv_layout(tp, rank)
    extra: dict[str, Any] = dict(kw)
    if registry is not None:
        extra["registry"] = registry
    if backend is not None:
        extra["backend"] = backend
    if role is Role.PREFILL:
        extra["instance"] = instance
    if buffers is None:
        buffers = kv_buffers(layout)
        if role is Role.PREFILL:
            rng = np.random.default_rng(abs(hash(name)) % 1000)
            for b in buffers:
                b[:] = rng.integers(1, 256, b.shape, dtype=np.uint8)
    return TransferAgent(layout=layout, buffers={"kv": buffers}, role=role, link=hub.link(address or name),
                         name=name, **extra)


def _pages_equal(pre: TransferAgent, dec: TransferAgent, src_pages: list[int], dst_pages: list[int]) -> bool:
    return all(np.array_equal(s[src_pages], d[dst_pages])
               for s, d in zip(pre.buffers.views["kv"], dec.buffers.views["kv"]))


def _handle_inbox(agent: TransferAgent) -> int:
    """Handle the frames waiting on ``agent``'s link (the caller may hold its lock: handled in the same hold)."""
    frames = agent.context.link.recv(0.0)
    for frame in frames:
        agent.handle_frame(frame)
    return len(frames)


def _snapshot(dec: TransferAgent, pages: list[int]) -> list[np.ndarray]:
    return [v[pages].copy() for v in dec.buffers.views["kv"]]


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, ManualClock]]:
    yield from test_write_lease.make_pair(staging="never")      # plain writes: they land in the decode's pages


# ------------------------------------------------------------------ 1. events between a post's queueing and its run
def _safe_then_unchanged(pre: TransferAgent, dec: TransferAgent, clock: ManualClock, room: int,
                         pages: list[int], seconds: float = 3.0) -> None:
    """Run both until the decode's room is safe to reuse; from then on, nothing may change in its pages; the
    prefill's room must end and become safe too."""
    assert dec.decode is not None and pre.prefill is not None
    _run(clock, seconds, pre, dec, until=lambda: dec.decode.safe_to_reuse(room))
    assert dec.decode.safe_to_reuse(room), dec.decode.reason(room)
    at_safe = _snapshot(dec, pages)
    _run(clock, 3.0, pre, dec, until=lambda: pre.prefill.safe_to_reuse(room))
    _run(clock, 0.5, pre, dec)
    assert pre.prefill.safe_to_reuse(room), pre.prefill.rooms[room].state
    assert pre.prefill.status(room) in (KVPoll.Failed, KVPoll.Success)
    after = _snapshot(dec, pages)
    assert all(np.array_equal(a, b) for a, b in zip(at_safe, after)), \
        "a write landed in the decode's pages after its room was safe to reuse"


@pytest.mark.parametrize("event", ["decode-abort", "prefill-abort", "prefill-declares-decode-gone"])
def test_a_room_failed_between_the_post_decision_and_the_post_is_fenced(
        pair: tuple[TransferAgent, TransferAgent, ManualClock], event: str) -> None:
    """The engine's send queues the post; in the same hold the room fails (the decode's Abort is handled, the prefill
    engine aborts, or the prefill engine declares the decode gone); the post is still made at the release. The
    decode's room may be safe only once that write can no longer land (quiesced acknowledgement after the write
    ended, or silence past the write lease), nothing lands in its pages after, and the prefill room ends."""
    pre, dec, clock = pair
    assert pre.prefill is not None and dec.decode is not None
    sender, receiver = _open(pre, dec, clock, 1, [1, 2])
    with pre.context.lock:
        pre.prefill.send(1, np.array([3, 4]), True, {})
        record = pre.prefill.rooms[1]
        assert [w.state for w in record.inflight] == [WriteState.POSTING]
        if event == "decode-abort":
            receiver.abort("the engine dropped it")
            dec.progress()                       # the Abort leaves the decode
            assert _handle_inbox(pre)            # ... and is handled inside the hold (re-entrant)
        elif event == "prefill-abort":
            pre.prefill.abort(1, "the prefill engine dropped it")     # the side's abort: no progress step
        else:
            pre.declare_gone("d0")
        assert pre.prefill.status(1) is KVPoll.Failed
        assert not pre.prefill.safe_to_reuse(1), "a room with a post queued is not drained"
    _safe_then_unchanged(pre, dec, clock, 1, [1, 2], 8.0)


def test_a_decode_goodbye_handled_between_the_post_decision_and_the_post_ends_the_room(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The decode closes (Goodbye) while the prefill's post is queued: the prefill room ends and is safe, nothing
    is left hanging (the post goes or is refused; the room never waits for a dead peer)."""
    pre, dec, clock = pair
    assert pre.prefill is not None
    sender, _receiver = _open(pre, dec, clock, 2, [5, 6])
    with pre.context.lock:
        pre.prefill.send(2, np.array([7, 8]), True, {})
        dec.close()
        assert _handle_inbox(pre)
    _run(clock, 5.0, pre, until=lambda: pre.prefill.safe_to_reuse(2))
    assert pre.prefill.safe_to_reuse(2) and not pre.prefill.rooms[2].busy
    assert sender.poll() in (KVPoll.Failed, KVPoll.Success)


def test_a_decode_restarted_under_its_name_between_the_post_decision_and_the_post(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The decode restarts (a new incarnation, new memory, another link address) and its Hello is handled in the
    same hold as the post's decision: the batch is post (old record), remove_peer, add_peer. The old room ends,
    the new incarnation is welcomed and a room with it is byte-exact; nothing of the old room lands in the new
    incarnation's pages."""
    pre, dec, clock = pair
    assert pre.prefill is not None
    sender, _receiver = _open(pre, dec, clock, 3, [1, 2])
    hub = pre.context.link._hub                      # type: ignore[attr-defined]
    new = _agent(hub, Role.DECODE, "d0", address="d0-again", clock=clock, config=dec.config)
    try:
        with pre.context.lock:
            pre.prefill.send(3, np.array([3, 4]), True, {})
            shake = new.connect_async("inst")
            for _ in range(5):
                new.progress()
                _handle_inbox(pre)
            assert pre.peers.peers["d0"].incarnation == new.context.incarnation
            assert pre.prefill.status(3) is KVPoll.Failed
        _run(clock, 2.0, pre, new, until=lambda: shake.done)
        assert shake.done and shake.refused is None
        _run(clock, 3.0, pre, new, until=lambda: pre.prefill.safe_to_reuse(3))
        assert pre.prefill.safe_to_reuse(3)
        assert not _landed(new, [1, 2]), "the old incarnation's room wrote into the new incarnation's memory"
        s2, r2 = _open(pre, new, clock, 4, [9, 10])
        s2.send(np.array([11, 12]), last=True)
        _run(clock, 2.0, pre, new, until=lambda: r2.poll() is KVPoll.Success)
        assert r2.poll() is KVPoll.Success and _pages_equal(pre, new, [11, 12], [9, 10])
    finally:
        new.close()


def test_a_lapsed_post_of_an_aborted_room_is_dropped_and_the_abort_acknowledged(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """Lapse and abort in one hold: the lapsed write is queued again (READY) at the head of a failed room; the pump
    must drop it (never post it) and the decode's fence must end with the acknowledgement."""
    pre, dec, clock = pair
    assert pre.prefill is not None and dec.decode is not None
    _sender, receiver = _open(pre, dec, clock, 5, [1, 2])
    with pre.context.lock:
        pre.peers.peers["d0"].lease_until = clock.now + 0.01
        pre.prefill.send(5, np.array([3, 4]), True, {})
        receiver.abort("the engine dropped it")
        dec.progress()
        assert _handle_inbox(pre)
        clock.now += 0.02                    # the lease passes before the post is made
    record = pre.prefill.rooms[5]
    assert record.nbytes == 0 and not _landed(dec, [1, 2])
    _safe_then_unchanged(pre, dec, clock, 5, [1, 2])
    assert record.nbytes == 0 and not _landed(dec, [1, 2]), "a lapsed post of an aborted room was made"


# ------------------------------------------------------------------------- 2. add_peer raises
class _AddFails(LoopbackBackend):
    fail = threading.Event()

    def add_peer(self, peer: Any) -> str:
        if _AddFails.fail.is_set():
            raise OSError("cannot reach the decode's memory agent")
        return super().add_peer(peer)


def test_add_peer_raising_refuses_the_decode_with_the_reason_and_a_later_hello_works() -> None:
    """The decode hears a refusal naming the backend's error (no hang, no Welcome); once the backend can add it,
    connecting again works and a room is byte-exact."""
    from kvbridge.errors import IncompatiblePeer

    _AddFails.fail.set()
    registry, hub = _registry("addfails", _AddFails), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "addfails")
    dec = _agent(hub, Role.DECODE, "d0", registry, "addfails")
    try:
        pre.start()
        dec.start()
        t0 = time.monotonic()
        with pytest.raises(IncompatiblePeer, match="could not add this decode: OSError: cannot reach"):
            dec.connect("inst", timeout_s=8)
        assert time.monotonic() - t0 < 5
        with pre.context.lock:
            assert "d0" not in pre.peers.peers or not pre.peers.peers["d0"].alive
        _AddFails.fail.clear()
        dec.connect("inst", timeout_s=8)
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([2, 3])})
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send(np.array([4, 5]), last=True)
        wait(lambda: receiver.poll() == KVPoll.Success)
        assert _pages_equal(pre, dec, [4, 5], [2, 3])
    finally:
        _AddFails.fail.clear()
        pre.close()
        dec.close()


# ------------------------------------------------------------------ 3. polling outside the lock, two progress threads
class _Handle:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"<handle {self.n}>"


class _TracksHandles(LoopbackBackend):
    """Loopback whose handles are objects (as NIXL's are) that must not be polled once released; the first poll of
    a handle waits for a second progress step's snapshot (``armed``), and a poll from that second step waits (up to
    2 s) for the release of the handle it polls: a thread preempted between its snapshot and its poll."""

    armed = threading.Event()
    second_snapshot = threading.Event()
    lock = threading.Lock()
    polls: dict[int, int] = {}
    released: set[int] = set()
    late_polls: list[str] = []
    released_event = threading.Event()
    n = 0

    def send_component(self, transfer: Any) -> Any:
        super().send_component(transfer)
        with _TracksHandles.lock:
            _TracksHandles.n += 1
            return _Handle(_TracksHandles.n)

    def poll(self, handle: Any) -> Poll:
        cls = _TracksHandles
        with cls.lock:
            cls.polls[handle.n] = k = cls.polls.get(handle.n, 0) + 1
        if cls.armed.is_set():
            if k == 1:
                cls.second_snapshot.wait(2.0)
            else:
                cls.released_event.wait(2.0)
        with cls.lock:
            if handle.n in cls.released:
                cls.late_polls.append(f"poll #{k} of {handle!r} after its release")
        return Poll.done()

    def release(self, handle: Any) -> None:
        with _TracksHandles.lock:
            if handle.n in _TracksHandles.released:
                _TracksHandles.late_polls.append(f"second release of {handle!r}")
            _TracksHandles.released.add(handle.n)
        _TracksHandles.released_event.set()


# FINDING (fails at 58dcdf3, passes at 0cc33fe^): a handle is polled after its release when two threads run
# progress(); cause: core/kvbridge/agent/transfer_agent.py _poll_writes (snapshot under the lock, poll outside it)
# with prefill.py poll_inflight/_finished releasing it under another thread's hold.
def test_two_threads_in_progress_never_poll_a_handle_after_its_release() -> None:
    """docs/plugin-api.md: progress() "runs on whichever thread calls it" (an engine polling its rooms from two
    threads, no background thread) and release: "The agent calls it exactly once per handle ... and never polls
    that handle again". Before 0cc33fe the poll, its result and the release happened in one hold of the agent lock.
    Now TransferAgent._poll_writes snapshots the POSTED writes under the lock and polls them after releasing it:
    a second progress() that took its snapshot before the first one applied the result polls a handle the first
    one has released meanwhile (use after free for a backend whose handles are engine objects)."""
    cls = _TracksHandles
    cls.armed.clear(), cls.second_snapshot.clear(), cls.released_event.clear()
    cls.polls.clear(), cls.released.clear(), cls.late_polls.clear()
    registry, hub = _registry("tracks", _TracksHandles), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "tracks")
    dec = _agent(hub, Role.DECODE, "d0", registry, "tracks")
    try:
        dec.start()
        shake = dec.connect_async("inst")
        deadline = time.monotonic() + 10
        while not shake.done and time.monotonic() < deadline:
            pre.progress()
            time.sleep(0.001)
        assert shake.done
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([2, 3])})
        deadline = time.monotonic() + 10
        while sender.poll() is not KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pre.prefill is not None
        with pre.context.lock:                                 # the side's send: no progress step after it
            pre.prefill.send(1, np.array([4, 5]), True, {})
        assert [w.state for w in pre.prefill.rooms[1].inflight] == [WriteState.POSTED]
        assert pre.prefill is not None
        real = pre.prefill.posted_writes
        snapshots = []

        def counted() -> Any:
            got = real()
            if got:
                snapshots.append(threading.get_ident())
                if len(snapshots) >= 2:
                    cls.second_snapshot.set()
            return got

        pre.prefill.posted_writes = counted           # type: ignore[method-assign]
        cls.armed.set()
        threads = [threading.Thread(target=pre.progress, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(6)
        assert not any(t.is_alive() for t in threads)
        cls.armed.clear()
        wait(lambda: receiver.poll() == KVPoll.Success)
        assert _pages_equal(pre, dec, [4, 5], [2, 3])
        assert cls.late_polls == [], cls.late_polls
    finally:
        cls.armed.clear()
        pre.close()
        dec.close()


# ------------------------------------------------------------------ 4. notify_completion raising / refusing
class _NotifyRaises(LoopbackBackend):
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        raise RuntimeError("notification channel down")


class _NotifyRefuses(LoopbackBackend):
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        return False


@pytest.mark.parametrize("factory", [_NotifyRaises, _NotifyRefuses], ids=["raises", "returns-false"])
def test_a_notice_the_backend_does_not_take_goes_over_the_link_and_the_decode_succeeds(factory: Any) -> None:
    registry, hub = _registry("notify", factory), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "notify")
    dec = _agent(hub, Role.DECODE, "d0", registry, "notify")
    try:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=8)
        rooms = []
        for room in range(3):
            sender, receiver = pre.sender(room), dec.receiver(room, "inst")
            receiver.send_metadata({"kv": np.array([2 * room, 2 * room + 1])})
            rooms.append((sender, receiver))
        for room, (sender, _receiver) in enumerate(rooms):
            wait(lambda s=sender: s.poll() == KVPoll.WaitingForInput)   # type: ignore[misc]
            sender.send(np.array([2 * room + 6, 2 * room + 7]), last=True)
        for room, (sender, receiver) in enumerate(rooms):
            wait(lambda r=receiver: r.poll() == KVPoll.Success)        # type: ignore[misc]
            wait(lambda s=sender: s.poll() == KVPoll.Success and s.safe_to_reuse)   # type: ignore[misc]
            assert _pages_equal(pre, dec, [2 * room + 6, 2 * room + 7], [2 * room, 2 * room + 1])
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------ 5. a post refused for one decode rank of TP 1 -> 2
class _RefusesD1(LoopbackBackend):
    def send_component(self, transfer: Any) -> Any:
        if transfer.peer == "d1":
            raise OSError("no route to d1")
        return super().send_component(transfer)


def test_a_post_refused_for_one_decode_rank_of_tp_1_to_2_fails_both_and_the_engine_send_raises() -> None:
    registry, hub = _registry("refd1", _RefusesD1), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "refd1")
    decs = [_agent(hub, Role.DECODE, f"d{r}", registry, "refd1", tp=2, rank=r) for r in range(2)]
    try:
        for a in (pre, *decs):
            a.start()
        for d in decs:
            d.connect("inst", timeout_s=8)
        sender = pre.sender(7)
        receivers = [d.receiver(7, "inst") for d in decs]
        for r in receivers:
            r.send_metadata({"kv": np.array([1, 2])})
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        with pytest.raises(OSError, match="no route to d1"):
            sender.send(np.array([3, 4]), last=True)
        wait(lambda: all(r.poll() == KVPoll.Failed for r in receivers), 8)
        wait(lambda: sender.safe_to_reuse and all(r.safe_to_reuse for r in receivers), 8)
        assert sender.poll() is KVPoll.Failed and "no route to d1" in sender.failure_reason
        assert all("no route to d1" in d.decode.reason(7) for d in decs)   # type: ignore[union-attr]
        # the pair still works for the next room after the backend recovers? (d1 still refused: only d0's room)
    finally:
        for a in (pre, *decs):
            a.close()


class _SlowPoll(LoopbackBackend):
    """A poll that takes half a millisecond (a real engine's status query); nothing forced."""

    def poll(self, handle: Any) -> Poll:
        time.sleep(0.0005)
        return super().poll(handle)


# FINDING (same cause as above; nothing forced, the kit's CheckedBackend flags it; passes at 0cc33fe^).
def test_engine_threads_polling_their_rooms_never_poll_a_released_handle() -> None:
    """The same guarantee as above with nothing forced, judged by kvbridge's own backend kit (CheckedBackend flags
    "poll of a handle that was released"): three engine threads poll (no background progress thread, so each
    poll() runs progress()) while 30 rooms go through one after another."""
    from kvbridge.testkit.checked import Tracker, kit_registry

    tracker = Tracker()
    spec = BackendSpec(name="slowpoll", factory=_SlowPoll, capabilities=frozenset({Capability.HOST_MEMORY}))
    registry, hub = kit_registry(spec, tracker=tracker), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "slowpoll")
    dec = _agent(hub, Role.DECODE, "d0", registry, "slowpoll")
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        dec.start()
        shake = dec.connect_async("inst")
        deadline = time.monotonic() + 10
        while not shake.done and time.monotonic() < deadline:
            pre.progress()
            time.sleep(0.001)
        assert shake.done
        current: list[Any] = []

        def engine_poller() -> None:
            end = time.monotonic() + DEADLINE_S
            while not stop.is_set() and time.monotonic() < end:
                if current:
                    current[-1].poll()
                else:
                    pre.progress()

        threads = [threading.Thread(target=engine_poller, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        end = time.monotonic() + DEADLINE_S
        for room in range(30):
            sender, receiver = pre.sender(room), dec.receiver(room, "inst")
            current.append(sender)
            receiver.send_metadata({"kv": np.array([room % 16])})
            while sender.poll() is not KVPoll.WaitingForInput and time.monotonic() < end:
                time.sleep(0.0005)
            sender.send(np.array([(room + 3) % 16]), last=True)
            while receiver.poll() is not KVPoll.Success and time.monotonic() < end:
                time.sleep(0.0005)
            assert receiver.poll() is KVPoll.Success
            while not sender.safe_to_reuse and time.monotonic() < end:
                time.sleep(0.0005)
            receiver.clear()
            if len(tracker.violations) > 5:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        pre.close()
        dec.close()
    late = [v for v in tracker.new_violations() if "released" in v]
    assert late == [], f"{len(late)} kit violations, e.g. {late[:2]}"


# ------------------------------------------------------------------ 6. many engine threads, progress threads running
@pytest.mark.parametrize("staging", ["never", "always"])
def test_many_threads_send_abort_poll_different_rooms_concurrently(staging: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two decode ranks (TP 1 -> 2), three waves of 16 rooms, eight engine threads per wave each driving two rooms:
    open, request, send; some rooms are aborted by the prefill engine, some by the decode engine, at once or after
    the send. No deadlock; every room ends and becomes safe on both sides; every room not aborted is byte-exact
    (checked after the next wave too: a late write of an aborted room into a page handed to the next wave shows)."""
    hub = LocalHub()
    from kvbridge.agent import posting

    gathers: list[int] = []
    real_gather = posting.gather_rows

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(posting, "gather_rows", counted_gather)
    config = AgentConfig(staging=staging, staging_bytes=1 << 16, staging_below_bytes=1 << 30)
    pre = _agent(hub, Role.PREFILL, "p0", config=config)
    decs = [_agent(hub, Role.DECODE, f"d{r}", tp=2, rank=r, config=config) for r in range(2)]
    deadline = time.monotonic() + DEADLINE_S
    errors: list[str] = []
    try:
        for a in (pre, *decs):
            a.start()
        for d in decs:
            d.connect("inst", timeout_s=8)
        tally: dict[str, int] = {"ok": 0, "failed": 0}
        for wave in range(3):
            outcomes: dict[int, str] = {}

            def drive(rooms: list[int], wave: int = wave, outcomes: dict[int, str] = outcomes) -> None:
                try:
                    for room in rooms:
                        dst = room % 16
                        src = (room * 7 + wave) % 16
                        sender = pre.sender(room)
                        receivers = [d.receiver(room, "inst") for d in decs]
                        for rc in receivers:
                            rc.send_metadata({"kv": np.array([dst])})
                        if room % 6 == 1:
                            sender.abort("prefill engine aborts early")
                        if room % 6 == 2:
                            receivers[room % 2].abort("decode engine aborts early")
                        while time.monotonic() < deadline:
                            status = sender.poll()
                            if status is not KVPoll.Bootstrapping:
                                break
                            time.sleep(0.0005)
                        if sender.poll() is KVPoll.WaitingForInput:
                            try:
                                sender.send(np.array([src]), last=True)
                            except Exception as exc:  # noqa: BLE001 - an aborted room may refuse the send
                                if room % 6 not in (1, 2, 3, 4):
                                    errors.append(f"room {room}: send raised {exc!r}")
                        if room % 6 == 3:
                            sender.abort("prefill engine aborts late")
                        if room % 6 == 4:
                            receivers[0].abort("decode engine aborts late")
                        while time.monotonic() < deadline and not (
                                sender.safe_to_reuse and all(rc.safe_to_reuse for rc in receivers)):
                            time.sleep(0.0005)
                        if not (sender.safe_to_reuse and all(rc.safe_to_reuse for rc in receivers)):
                            errors.append(f"room {room}: not safe to reuse in time ({sender.poll()}, "
                                          f"{[rc.poll() for rc in receivers]})")
                        outcomes[room] = "ok" if (sender.poll() is KVPoll.Success and all(
                            rc.poll() is KVPoll.Success for rc in receivers)) else "failed"
                        if room % 6 in (0, 5) and outcomes[room] != "ok":
                            errors.append(f"room {room} (not aborted) failed: {sender.failure_reason}")
                        for rc in receivers:
                            rc.clear()
                        sender.clear()
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"rooms {rooms}: {exc!r}")

            base = wave * 16
            threads = [threading.Thread(target=drive, args=([base + 2 * i, base + 2 * i + 1],), daemon=True)
                       for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.1, deadline - time.monotonic()))
            assert not any(t.is_alive() for t in threads), f"wave {wave}: deadlock or hang; errors {errors[:5]}"
            assert not errors, errors[:5]
            for outcome in outcomes.values():
                tally[outcome] += 1
            # byte-exact for the rooms that succeeded: each decode rank holds its heads of the source page
            for room, outcome in outcomes.items():
                if outcome != "ok":
                    continue
                src, dst = (room * 7 + wave) % 16, room % 16
                for r, d in enumerate(decs):
                    for s_view, d_view in zip(pre.buffers.views["kv"], d.buffers.views["kv"]):
                        whole = s_view[src].reshape(4, 4, 8 * 2)      # (page tokens, heads, head bytes)
                        part = whole[:, 2 * r: 2 * r + 2].reshape(-1)
                        assert np.array_equal(d_view[dst], part), f"wave {wave} room {room} decode rank {r}"
            time.sleep(0.05)                # late writes of aborted rooms, if any, land now
            for room, outcome in outcomes.items():
                if outcome != "ok":
                    continue
                src, dst = (room * 7 + wave) % 16, room % 16
                for r, d in enumerate(decs):
                    for s_view, d_view in zip(pre.buffers.views["kv"], d.buffers.views["kv"]):
                        part = s_view[src].reshape(4, 4, 16)[:, 2 * r: 2 * r + 2].reshape(-1)
                        assert np.array_equal(d_view[dst], part), f"wave {wave} room {room} rank {r}: changed late"
        assert tally["ok"] >= 16 and tally["failed"] >= 8, tally
        assert bool(gathers) == (staging == "always"), len(gathers)
    finally:
        for a in (pre, *decs):
            a.close()


# ------------------------------------------------------------------ 3. remove_peer / add_peer on a same-name restart
class _Async(LoopbackBackend):
    """Loopback whose writes report DONE only after ``hold_s`` (in flight meanwhile); a write whose peer was removed
    before that reports FAILED (plugin-api: a handle whose peer died must still end). Records the peer calls."""

    hold_s = 0.3
    calls: list[tuple[str, str]] = []
    fail_add: set[str] = set()           # endpoint names whose add_peer raises

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._removed_at: dict[str, float] = {}

    def add_peer(self, peer: Any) -> str:
        _Async.calls.append(("add_peer", peer.name))
        if peer.endpoint in _Async.fail_add:
            raise OSError("the new incarnation's memory cannot be mapped")
        self._removed_at.pop(peer.name, None)
        return super().add_peer(peer)

    def remove_peer(self, peer_id: str) -> None:
        _Async.calls.append(("remove_peer", peer_id))
        self._removed_at[peer_id] = time.monotonic()
        super().remove_peer(peer_id)

    def send_component(self, transfer: Any) -> Any:
        _Async.calls.append(("send_component", transfer.peer))
        super().send_component(transfer)
        return (transfer.peer, time.monotonic(), self._removed_at.get(transfer.peer))

    def poll(self, handle: Any) -> Poll:
        peer, at, removed_before = handle
        removed = self._removed_at.get(peer)
        if removed is not None and removed != removed_before:
            return Poll.failed(f"peer {peer} was removed while the write was in flight")
        return Poll.done() if time.monotonic() - at >= _Async.hold_s else Poll.pending()

    def release(self, handle: Any) -> None:
        return None


@pytest.mark.parametrize("new_add_fails", [False, True], ids=["new-added", "new-add-raises"])
def test_a_same_name_restart_with_writes_in_flight_removes_the_old_peer_before_adding_the_new(
        new_add_fails: bool) -> None:
    """The decode restarts under its name (new incarnation, new memory) while a write to the old one is in flight:
    the backend sees remove_peer(d0) before add_peer of the new d0 (a remove after the add would take the new
    incarnation away: both go by name); the old room fails and ends (its write fails or completes; never hangs);
    the new incarnation is welcomed (or, its add_peer raising, refused with the reason) and, once it can be added,
    a room with it is byte-exact."""
    from kvbridge.errors import IncompatiblePeer

    _Async.calls.clear()
    _Async.fail_add.clear()
    registry, hub = _registry("async", _Async), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "async")
    dec = _agent(hub, Role.DECODE, "d0", registry, "async")
    new: TransferAgent | None = None
    try:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=8)
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([1, 2])})
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send(np.array([3, 4]), last=True)
        assert pre.prefill is not None
        with pre.context.lock:
            assert [w.state for w in pre.prefill.rooms[1].inflight] == [WriteState.POSTED]
        new = _agent(hub, Role.DECODE, "d0", registry, "async", address="d0-again")
        if new_add_fails:
            _Async.fail_add.add(new.context.backend.endpoint)
        new.start()
        if new_add_fails:
            with pytest.raises(IncompatiblePeer, match="could not add this decode: OSError"):
                new.connect("inst", timeout_s=8)
        else:
            new.connect("inst", timeout_s=8)
        wait(lambda: sender.poll() == KVPoll.Failed, 8)
        wait(lambda: sender.safe_to_reuse, 8)
        peer_calls = [c for c in _Async.calls if c[0] != "send_component"]
        i_remove = peer_calls.index(("remove_peer", "d0"))
        assert peer_calls[:i_remove].count(("add_peer", "d0")) == 1, peer_calls
        assert ("add_peer", "d0") in peer_calls[i_remove:], peer_calls
        assert ("remove_peer", "d0") not in peer_calls[i_remove + 1:], f"a later remove_peer(d0): {peer_calls}"
        if new_add_fails:
            _Async.fail_add.clear()
            new.connect("inst", timeout_s=8)
        s2, r2 = pre.sender(2), new.receiver(2, "inst")
        r2.send_metadata({"kv": np.array([5, 6])})
        wait(lambda: s2.poll() == KVPoll.WaitingForInput, 8)
        s2.send(np.array([7, 8]), last=True)
        wait(lambda: r2.poll() == KVPoll.Success, 8)
        assert _pages_equal(pre, new, [7, 8], [5, 6])
    finally:
        pre.close()
        dec.close()
        if new is not None:
            new.close()


def test_a_lapsed_post_refused_when_made_again_fails_the_room_on_both_sides(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """A lapsed write is judged again by the pump (the progress loop, not the engine's send): when the backend then
    refuses it, the room fails on both sides with the backend's words and ends; nothing hangs."""
    pre, dec, clock = pair
    assert pre.prefill is not None and dec.decode is not None
    sender, receiver = _open(pre, dec, clock, 6, [1, 2])
    with pre.context.lock:
        pre.peers.peers["d0"].lease_until = clock.now + 0.01
        pre.prefill.send(6, np.array([3, 4]), True, {})
        clock.now += 0.02
    record = pre.prefill.rooms[6]
    assert [p.state for p in record.pending] == [WriteState.READY] and not record.inflight

    def refuse(transfer: Any) -> Any:
        raise OSError("the NIC went away")

    pre.context.calls.send_component = refuse      # type: ignore[method-assign]
    _run(clock, 3.0, pre, dec, until=lambda: receiver.poll() is KVPoll.Failed and sender.safe_to_reuse)
    assert sender.poll() is KVPoll.Failed and "the NIC went away" in sender.failure_reason
    assert receiver.poll() is KVPoll.Failed and "the NIC went away" in receiver.failure_reason
    _run(clock, 3.0, pre, dec, until=lambda: receiver.safe_to_reuse)
    assert sender.safe_to_reuse and receiver.safe_to_reuse and not _landed(dec, [1, 2])


# ------------------------------------------------------------------ 7. a backend call that raises a BaseException
class _Interrupted(BaseException):
    """What a Ctrl-C (KeyboardInterrupt) or an asyncio cancellation (CancelledError is a BaseException) raising
    inside the backend looks like to the agent."""


# FINDING (passes at 0cc33fe^): a BaseException out of send_component leaves the write POSTING for good; cause:
# core/kvbridge/agent/context.py _execute catches Exception only, actions.py AgentLock._run has no guard, so the
# `then` (Poster._posted) of that action and every later action of its batch are lost.
def test_a_post_interrupted_by_a_base_exception_leaves_no_write_posting_forever(
        pair: tuple[TransferAgent, TransferAgent, ManualClock]) -> None:
    """The engine's send() is interrupted inside send_component (KeyboardInterrupt, a cancellation): the engine
    sees the exception; it then aborts the room, which must end and become safe to reuse (its source pages handed
    back), as it did before 0cc33fe (the post was made inside send(), and nothing was recorded in flight unless the
    backend returned). Now the InFlight record is POSTING from the decision, AgentLock._run (actions.py) lets the
    BaseException escape from AgentContext._execute (context.py catches only Exception), so Poster._posted never
    runs: the write stays POSTING, the room busy for good, never drained, never safe, and the decode, which waits
    for the prefill's quiesced acknowledgement, never gets its pages back either."""
    pre, dec, clock = pair
    assert pre.prefill is not None
    sender, receiver = _open(pre, dec, clock, 8, [1, 2])
    real = pre.context.calls.send_component
    calls = []

    def interrupted(transfer: Any) -> Any:
        calls.append(transfer)
        if len(calls) == 1:
            raise _Interrupted("Ctrl-C inside the backend")
        return real(transfer)

    pre.context.calls.send_component = interrupted      # type: ignore[method-assign]
    with pytest.raises(_Interrupted):
        sender.send(np.array([3, 4]), last=True)
    sender.abort("the engine gives up on the request")
    _run(clock, 3.0, pre, dec, until=lambda: pre.prefill.safe_to_reuse(8) and receiver.safe_to_reuse, real_s=3.0)
    record = pre.prefill.rooms[8]
    assert pre.prefill.safe_to_reuse(8) and receiver.safe_to_reuse, (
        f"never safe to reuse: prefill room {record.state.value} with writes "
        f"{[w.state.value for w in record.inflight]}; decode room {receiver.poll().name}, safe "
        f"{receiver.safe_to_reuse} (it waits for the prefill's quiesced acknowledgement)")

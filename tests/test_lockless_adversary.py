"""Adversarial tests of the lock structure of 85aacba (role objects take no lock; the runtime's handles and
TransferAgent take the agent lock; liveness connections opened/closed by queued actions and polled outside the
lock; the heartbeat thread reads only its own target table; the metrics sampler snapshots under the lock) and of
d4e510f (``digest_buffers`` equals the numpy digests for every run shape, numpy arrays and torch tensors).

Each test names the promise it attacks. In-process agents over ``LocalHub``; real processes only for a liveness
listener that is killed -9 (127.0.0.1). Every test is bounded by a pytest-timeout mark and bounded loops.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_liveness
from test_agent import hand_pair, kv_buffers, kv_layout  # the agent tests' small dense-KV pool

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent.liveness import LivenessListener, LivenessWatch
from kvbridge.errors import KVBridgeError
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role

pytestmark = pytest.mark.timeout(90)


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert cond(), what


def _agent(hub: LocalHub, role: Role, name: str, cfg: AgentConfig, *, address: str | None = None,
           clock: Callable[[], float] | None = None) -> TransferAgent:
    kw: dict[str, Any] = {} if clock is None else {"clock": clock}
    return TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=role,
                         link=hub.link(address or name), instance="inst" if role is Role.PREFILL else "",
                         config=cfg, name=name, **kw)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that escaped any thread during the test (threading.excepthook)."""
    caught: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            caught.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield caught
    finally:
        threading.excepthook = previous


# ==================================================================================== claim 1: the lock is held
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_drain_that_times_out_aborts_its_rooms_under_the_agent_lock(role: str) -> None:
    """Claim: the runtime (TransferAgent) takes the agent lock around every role-object call; a mutating one
    without it raises LockNotHeld in strict mode. ``drain()``'s timeout path aborted the rooms left through the
    role object itself (``side.abort``) without the lock: strict mode raised, production raced the progress
    thread (the room's failure, its fence and the abort frames decided while another thread changed the room).
    Fixed: the aborts are decided in one hold of the lock."""
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=2.0, heartbeat_interval_s=0.1), threads=True)
    try:
        sender = pre.sender(5)
        receiver = dec.receiver(5, "inst")
        receiver.send_metadata({"kv": np.array([4, 5])})
        _wait("request arrived", lambda: sender.poll() == KVPoll.WaitingForInput)
        agent = pre if role == "prefill" else dec
        report = agent.drain(0.2, "node maintenance")     # nobody sends: the room is aborted at the timeout
        assert report["failed"] == 1, report
    finally:
        pre.close()
        dec.close()


# ==================================================================================== claim 2: clear in one hold
STAGED = AgentConfig(staging="always", staging_bytes=256 << 10, staging_piece_bytes=4 << 10, checksums=True,
                     peer_timeout_s=5.0, heartbeat_interval_s=0.05)


@pytest.mark.timeout(120)
def test_receiver_clear_racing_a_completing_staged_transfer(thread_errors: list[BaseException],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Claim: ``Receiver.clear`` judges safety and clears in one hold, so staging reservations are freed only when
    no write can land. Rooms stream staged pieces (rings of 4 KiB pieces, checksums on) while an engine thread
    clears the decode room at a random moment, with both progress threads running. A reservation freed under a
    write that still lands would be reused by a later room and corrupt it: every room that succeeds must be
    byte-exact and no room may fail a checksum; no clear() may raise; nothing escapes into a thread; every
    reservation freed was one no write could still reach (when the engine cleared while unsafe, the
    reservation is kept, never freed)."""
    caplog.set_level(logging.ERROR, logger="kvbridge")
    pre, dec = hand_pair(STAGED, threads=True)
    try:
        staging = dec.buffers.staging
        assert staging is not None
        total = staging.nbytes
        src, dst = pre.buffers.views["kv"], dec.buffers.views["kv"]
        freed: list[tuple[int, int, bool]] = []
        real_free = staging.free

        clearing: dict[str, int] = {}
        violations: list[str] = []

        def watched_free(offset: int, nbytes: int) -> None:
            # freed by the clear of ``clearing["room"]`` (under the decode's lock): no write of that room may
            # still be in flight or queued at its prefill (read without the prefill's lock: a snapshot)
            room_id = clearing.get("room", -1)
            sent = pre.prefill.rooms.get(room_id)           # type: ignore[union-attr]
            if sent is not None and (sent.inflight or sent.pending):
                violations.append(f"room {room_id}: staging [{offset}, +{nbytes}) freed with "
                                  f"{len(sent.inflight)} writes in flight, {len(sent.pending)} queued")
            freed.append((offset, nbytes, True))
            real_free(offset, nbytes)

        staging.free = watched_free             # type: ignore[method-assign]
        rng = random.Random(7)
        errors: list[BaseException] = []
        outcomes = {"success": 0, "cleared-early": 0}
        for room in range(1, 41):
            seed = room * 13
            for b, buf in enumerate(src):
                buf[:] = ((np.arange(buf.size, dtype=np.uint32) * (b + seed)) % 251).astype(np.uint8).reshape(buf.shape)
            pages_src = np.array(rng.sample(range(16), 6))
            pages_dst = np.array(rng.sample(range(16), 6))
            sender = pre.sender(room)
            receiver = dec.receiver(room, "inst")
            receiver.send_metadata({"kv": pages_dst})
            _wait("request arrived", lambda s=sender: s.poll() == KVPoll.WaitingForInput)
            delay = rng.choice([0.0, 0.0005, 0.001, 0.003, 0.01, None])    # None: clear after the end
            cleared = threading.Event()

            def engine_clear(delay: float | None = delay, receiver: Any = receiver, room: int = room,
                             cleared: threading.Event = cleared) -> None:
                try:
                    if delay is None:
                        _wait("done", lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 10)
                    else:
                        time.sleep(delay)
                    clearing["room"] = room
                    receiver.clear()
                except BaseException as exc:  # noqa: BLE001 - judged below
                    errors.append(exc)
                finally:
                    cleared.set()

            clearer = threading.Thread(target=engine_clear, daemon=True)
            clearer.start()
            try:
                sender.send(pages_src[:3])
                sender.send(pages_src[3:], last=True)
            except KVBridgeError:
                pass
            clearer.join(15)
            assert cleared.is_set()
            _wait("prefill room over", lambda s=sender: s.poll() in (KVPoll.Success, KVPoll.Failed), 10)
            _wait("prefill safe", lambda s=sender: s.safe_to_reuse, 10)
            sender.clear()
            if delay is None:
                outcomes["success"] += 1
                for b, buf in enumerate(dst):
                    assert np.array_equal(buf[pages_dst], src[b][pages_src]), f"room {room} buffer {b} differs"
            else:
                outcomes["cleared-early"] += 1
        assert not errors, errors
        assert not violations, violations
        assert freed, "no reservation was ever freed: the test did not exercise the release"
        assert not thread_errors, thread_errors
        bad = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage() or "progress failed" in
               r.getMessage()]
        assert not bad, bad
        # every reservation still held belongs to a room cleared while unsafe (kept, logged), never a live one
        with dec.context.lock:
            live = sum(n for rec in dec.decode.rooms.values() for _, n, _ in rec.staged.values())   # type: ignore[union-attr]
        assert live == 0 and staging.free_bytes <= total
    finally:
        pre.close()
        dec.close()


@pytest.mark.timeout(60)
def test_two_engine_threads_on_one_room_with_the_progress_thread_running(thread_errors: list[BaseException],
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Claim: the handles take the agent lock around each call, so two engine threads on the same room (one
    polling and reading the handle's properties, one aborting then clearing) while the progress threads complete
    the transfer see only the handle's documented errors (KVBridgeError once the room was cleared); nothing
    escapes into the progress thread ('progress failed')."""
    caplog.set_level(logging.ERROR, logger="kvbridge")
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=5.0, heartbeat_interval_s=0.05), threads=True)
    try:
        unexpected: list[BaseException] = []
        for room in range(1, 31):
            sender = pre.sender(room)
            receiver = dec.receiver(room, "inst")
            receiver.send_metadata({"kv": np.array([1, 2, 3])})
            _wait("request arrived", lambda s=sender: s.poll() == KVPoll.WaitingForInput)
            stop = threading.Event()

            def poller(receiver: Any = receiver, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    try:
                        receiver.poll()
                        _ = receiver.failure_reason, receiver.nbytes, receiver.safe_to_reuse
                    except KVBridgeError as exc:
                        if "cleared" not in str(exc):
                            unexpected.append(exc)
                            return
                    except BaseException as exc:  # noqa: BLE001
                        unexpected.append(exc)
                        return

            def aborter(receiver: Any = receiver, room: int = room) -> None:
                try:
                    time.sleep(random.random() * 0.002)
                    if room % 2:
                        receiver.abort("engine gave up")
                    deadline = time.monotonic() + 5
                    while not receiver.safe_to_reuse and time.monotonic() < deadline:
                        time.sleep(0.001)
                    receiver.clear()
                except KVBridgeError as exc:
                    if "cleared" not in str(exc):
                        unexpected.append(exc)
                except BaseException as exc:  # noqa: BLE001
                    unexpected.append(exc)

            threads = [threading.Thread(target=poller, daemon=True), threading.Thread(target=aborter, daemon=True)]
            for t in threads:
                t.start()
            try:
                sender.send(np.array([5, 6, 7]), last=True)
            except KVBridgeError:
                pass
            threads[1].join(10)
            stop.set()
            threads[0].join(10)
            assert not any(t.is_alive() for t in threads)
            _wait("prefill over", lambda s=sender: s.poll() in (KVPoll.Success, KVPoll.Failed), 10)
            _wait("prefill safe", lambda s=sender: s.safe_to_reuse, 10)
            sender.clear()
        assert not unexpected, unexpected
        assert not thread_errors, thread_errors
        failed = [r.getMessage() for r in caplog.records if "progress failed" in r.getMessage()
                  or "error while handling" in r.getMessage()]
        assert not failed, failed
    finally:
        pre.close()
        dec.close()


# ==================================================================================== claim 3: liveness actions
def test_a_writers_exit_read_by_a_failed_progress_step_is_not_lost() -> None:
    """Claim: liveness connections are polled outside the lock and what the poll found is handed to the peer
    table under it. ``LivenessWatch.changes()`` reports each closed connection once; the progress step reads it
    before ``_poll_writes`` and before the part under the lock. A step that failed in between (a transient link
    error in the second ``link.recv``; the progress thread logs it and goes on) dropped the exit for good: the
    writer's exit was never proven and its rooms never fenced by it (before 85aacba the closed keys were read
    under the lock, right where they were recorded). Fixed: what the poll read waits on the agent until a step
    hands it to the peer table."""
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=30.0, writer_exit_grace_s=0.1))
    try:
        pre.sender(5)
        receiver = dec.receiver(5, "inst")
        receiver.send_metadata({"kv": np.array([1, 2, 3])})
        for _ in range(20):
            pre.progress()
            dec.progress()
        assert receiver.poll() is KVPoll.WaitingForInput
        assert pre._liveness is not None and dec.peers.liveness is not None
        pre._liveness.close()                  # the kernel's part of the prefill's exit
        time.sleep(0.1)                        # the FIN is at the decode
        link = dec.context.link
        real_recv = link.recv
        calls: list[int] = []

        def flaky(timeout_s: float = 0.0) -> list[bytes]:
            calls.append(1)
            if len(calls) == 2:                # the drain under the lock, after the liveness poll
                raise ConnectionError("transient link error")
            return real_recv(timeout_s)

        link.recv = flaky                      # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            dec.progress()
        del link.recv                          # the link is fine again
        deadline = time.monotonic() + 3.0
        while not receiver.safe_to_reuse and time.monotonic() < deadline:
            dec.progress()
            time.sleep(0.005)
        assert receiver.safe_to_reuse and "exited" in receiver.failure_reason, (
            f"the writer's exit was lost: room {receiver.poll().name}, reason {receiver.failure_reason!r}")
    finally:
        pre.close()
        dec.close()


LISTENER_CHILD = test_liveness.CHILD         # a liveness listener in a process of its own


@pytest.mark.timeout(60)
def test_a_writer_killed_while_its_liveness_watch_is_still_queued() -> None:
    """Claim: decode-side liveness connections are opened by queued Work run after the lock's release (a watch
    queued after close() connects nothing). Before 85aacba the connect was made inside on_welcome, before the
    handshake was marked done, so ``connect()`` returning meant the writer's exit was provable. Now the watch is
    an action of the batch of whichever thread handled the Welcome, run in ticket order: ``connect()`` returns
    as soon as the engine sees the handshake done, possibly before that batch ran (modelled here by a watch
    action that waits 0.5 s behind the batch ahead of it). The prefill's process (its liveness listener, a real
    child) is killed -9 right after connect() returned and the prefill goes silent; the engine aborts the room.
    The watch then connected to a dead port: 'unproven', so the exit was never proven and the room stayed unsafe.
    Fixed: a handshake target is done only once its liveness connection was tried."""
    child = subprocess.Popen([sys.executable, "-c", LISTENER_CHILD], stdout=subprocess.PIPE, text=True)
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=30.0, writer_exit_grace_s=0.1, heartbeat_interval_s=0.05)
    pre = _agent(hub, Role.PREFILL, "p0", cfg)
    dec = _agent(hub, Role.DECODE, "d0", cfg)
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        assert address.startswith("127.0.0.1:")
        pre.peers.liveness_address = address          # the prefill "process" whose kernel closes this listener
        watch = dec.peers.liveness
        assert watch is not None
        real_watch = watch.watch

        def queued_behind_a_slow_batch(key: tuple[str, int], where: str) -> None:
            time.sleep(0.5)
            real_watch(key, where)

        watch.watch = queued_behind_a_slow_batch      # type: ignore[method-assign]
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=10)
        os.kill(child.pid, signal.SIGKILL)            # the writer's process dies: its kernel closes the listener
        child.wait(5)
        pre._stop.set()                               # and the prefill agent goes silent with it (no goodbye)
        if pre._thread is not None:
            pre._thread.join(5)
        receiver = dec.receiver(9, "inst")
        receiver.send_metadata({"kv": np.array([1, 2])})
        receiver.abort("engine gave up")              # FENCING: only an ack or the writer's proven exit fences it
        deadline = time.monotonic() + 3.0
        while not receiver.safe_to_reuse and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.safe_to_reuse, ("the writer was killed -9 after connect() returned, but its exit is not "
                                        "proven: its liveness watch connected only after it died")
    finally:
        child.kill()
        child.wait(5)
        pre.close()
        dec.close()


def test_liveness_watch_hammered_from_threads_then_closed() -> None:
    """Claim: LivenessWatch has its own mutex and a watch queued after close() connects nothing. Threads watch,
    forget and poll changes() of overlapping keys against a live listener while close() lands in the middle:
    nothing raises, and nothing stays connected afterwards (a socket opened after close would keep the
    prefill's listener holding a connection nobody reads)."""
    listener = LivenessListener("127.0.0.1")
    watch = LivenessWatch()
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                key = ("p", rng.randrange(4))
                op = rng.randrange(3)
                if op == 0:
                    watch.watch(key, listener.address)
                elif op == 1:
                    watch.forget(key)
                else:
                    watch.changes()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for _ in range(50):
            listener.poll()
            time.sleep(0.002)
        watch.close()
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(5)
        assert not errors, errors
        assert not watch._keys and not watch._connecting, "a watch connected after close()"
        watch.watch(("p", 9), listener.address)          # queued after close: connects nothing
        assert not watch._keys
        deadline = time.monotonic() + 2
        while listener.held and time.monotonic() < deadline:
            listener.poll()
            time.sleep(0.005)
        assert listener.held == 0, "the listener still holds a connection of a closed watch"
    finally:
        stop.set()
        listener.close()


# ==================================================================================== claim 4: heartbeats
class _GuardedPeers(dict):  # type: ignore[type-arg]
    """The peer table's dict, recording reads from the heartbeat thread."""

    offenders: list[str]

    def _note(self) -> None:
        name = threading.current_thread().name
        if name.startswith("kvbridge-beat-"):
            self.offenders.append(name)

    def __getitem__(self, key: Any) -> Any:
        self._note()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note()
        return super().get(key, default)

    def values(self) -> Any:
        self._note()
        return super().values()

    def items(self) -> Any:
        self._note()
        return super().items()

    def __iter__(self) -> Any:
        self._note()
        return super().__iter__()

    def __contains__(self, key: object) -> bool:
        self._note()
        return super().__contains__(key)


@pytest.mark.timeout(60)
def test_heartbeats_after_a_same_name_restart_echo_only_the_new_incarnation() -> None:
    """Claim: the heartbeat thread reads only ``PeerTable.beat_targets()`` (never the peer table), and echoes are
    mirrored into it in on_heartbeat only for the matching incarnation. The decode "d0" restarts under the same
    name while the old incarnation lives on and keeps beating (split brain; its clock 1000 s ahead, so its beats
    are recognizable). The prefill's target for d0 must name the new incarnation and carry only its echoes, the
    old one's must never reach the new one's target, the write lease must keep running on the new one's echoes,
    and no heartbeat thread may read a peer table."""
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=10.0, heartbeat_interval_s=0.02)
    pre = _agent(hub, Role.PREFILL, "p0", cfg)
    old = _agent(hub, Role.DECODE, "d0", cfg, address="d0-old", clock=lambda: time.monotonic() + 1000.0)
    new: TransferAgent | None = None
    offenders: list[str] = []
    try:
        for agent in (pre, old):
            guarded = _GuardedPeers(agent.peers.peers)
            guarded.offenders = offenders
            agent.peers.peers = guarded
        pre.start()
        old.start()
        old.connect("inst", timeout_s=10)

        def target(agent: str) -> Any:
            return dict(pre.peers.beat_targets()).get(agent)

        _wait("echo from the old incarnation", lambda: (t := target("d0")) is not None
              and t.last_beat[0] > time.monotonic() + 500)
        new = _agent(hub, Role.DECODE, "d0", cfg, address="d0-new")
        guarded = _GuardedPeers(new.peers.peers)
        guarded.offenders = offenders
        new.peers.peers = guarded
        new.start()
        new.connect("inst", timeout_s=10)
        _wait("the new incarnation is the beat target", lambda: (t := target("d0")) is not None
              and t.incarnation == new.incarnation)            # type: ignore[union-attr]
        _wait("an echo of the new incarnation", lambda: 0 < target("d0").last_beat[0] < time.monotonic() + 500)
        leases = []
        for _ in range(100):                                   # 1 s of beats from both incarnations
            t = target("d0")
            assert t.incarnation == new.incarnation and t.address == "d0-new", t
            assert t.last_beat[0] < time.monotonic() + 500, (
                f"the old incarnation's heartbeat was mirrored into the new one's: {t}")
            with pre.context.lock:
                peer = pre.peers.peers["d0"]
                assert peer.incarnation == new.incarnation
                leases.append(peer.lease_until)
            time.sleep(0.01)
        if leases[0] != float("inf"):
            assert leases[-1] > leases[0], "the write lease stopped running on the new incarnation's echoes"
        assert not offenders, f"the heartbeat thread read a peer table ({len(offenders)} times)"
    finally:
        for agent in (pre, old, new):
            if agent is not None:
                agent.close()


# ==================================================================================== claim 5: metrics sampler
@pytest.mark.timeout(60)
def test_metrics_sampler_while_rooms_churn(thread_errors: list[BaseException]) -> None:
    """Claim: the metrics sampler snapshots the peer and room tables under the agent lock. With metrics on and a
    1 ms sampler on both agents while rooms open, transfer, abort and clear from two engine threads, the sampler
    threads stay alive (an exception would end them silently), sample, and end once their agent closed."""
    pytest.importorskip("prometheus_client")
    from kvbridge import metrics

    metrics.enable()
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=5.0, heartbeat_interval_s=0.05), threads=True)
    samplers: list[threading.Thread] = []
    try:
        before = set(threading.enumerate())
        metrics.watch_agent(pre, interval_s=0.001)
        metrics.watch_agent(dec, interval_s=0.001)
        samplers = [t for t in threading.enumerate() if t not in before and t.name.startswith("kvbridge-metrics")]
        assert len(samplers) == 2
        errors: list[BaseException] = []

        def churn(base: int) -> None:
            try:
                for i in range(15):
                    room = base + i
                    sender = pre.sender(room)
                    receiver = dec.receiver(room, "inst")
                    receiver.send_metadata({"kv": np.array([i % 16])})
                    _wait("request", lambda s=sender: s.poll() == KVPoll.WaitingForInput)
                    if i % 3 == 0:
                        receiver.abort("churn")
                    else:
                        sender.send(np.array([(i * 7) % 16]), last=True)
                    _wait("decode over", lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed))
                    _wait("prefill over", lambda s=sender: s.poll() in (KVPoll.Success, KVPoll.Failed))
                    _wait("safe", lambda r=receiver, s=sender: r.safe_to_reuse and s.safe_to_reuse)
                    receiver.clear()
                    sender.clear()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        workers = [threading.Thread(target=churn, args=(b,), daemon=True) for b in (1000, 2000)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(40)
        assert not errors, errors
        assert all(s.is_alive() for s in samplers), "a metrics sampler thread died"
    finally:
        pre.close()
        dec.close()
    for s in samplers:
        s.join(5)
    assert not any(s.is_alive() for s in samplers), "a sampler outlived its closed agent"
    assert not thread_errors, thread_errors


# ==================================================================================== d4e510f: digest_buffers
torch = pytest.importorskip("torch")

from kvbridge.device_digests import _kernel, digest_buffers, fused  # noqa: E402
from kvbridge.digests import Runs, digest_items, run_bytes  # noqa: E402
from kvbridge.slicing import Segments  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _host(view: Any) -> np.ndarray:
    return view if isinstance(view, np.ndarray) else np.ascontiguousarray(view.cpu().numpy())


def _reference(views: list[Any], items: np.ndarray, runs: list[Runs]) -> np.ndarray:
    """The numpy digests of host copies (an independent path)."""
    return np.concatenate([digest_items(_host(v), np.asarray(items, np.int64), r) for v, r in zip(views, runs)]
                          ) if views else np.zeros(0, np.uint64)


def _rows(item: int, run: int, every: int, first: int = 0) -> Segments:
    count = (item - first) // every
    return Segments(first + np.arange(count, dtype=np.int64) * every, np.arange(count, dtype=np.int64) * run,
                    np.full(count, run, np.int64))


def _random(shape: tuple[int, ...], seed: int, device: str = "cpu") -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_digest_buffers_mixed_numpy_and_torch_views(device: str) -> None:
    """Claim: digest_buffers equals the numpy digests for numpy arrays and torch tensors. A call mixing both
    (the agent's views of one component are all one kind, but nothing refuses a mix) gives the same digests."""
    items = np.array([3, 0, 7, 7, 1])
    views = [_random((8, 1024), 1, device), _host(_random((8, 1024), 2)), _random((8, 1024), 3, device)]
    runs = [run_bytes(Segments.whole(1024), "src")] * 3
    assert np.array_equal(digest_buffers(views, items, runs), _reference(views, items, runs))


@pytest.mark.parametrize("device", DEVICES)
def test_digest_buffers_empty_runs_among_non_empty(device: str) -> None:
    """Empty runs (a buffer a partial peer does not write) among regular and irregular ones, in any position:
    zeros there, the others unchanged, buffer-major."""
    items = np.arange(6)[::-1].copy()
    empty = run_bytes(Segments.empty(), "src")
    whole = run_bytes(Segments.whole(512), "src")
    rows = run_bytes(_rows(512, 16, 64, 8), "src")
    irregular = run_bytes(Segments(np.array([0, 100, 300], np.int64), np.array([0, 8, 40], np.int64),
                                   np.array([8, 32, 3], np.int64)), "src")
    runs = [empty, whole, empty, rows, irregular, empty]
    views = [_random((6, 512), 10 + k, device) for k in range(len(runs))]
    got = digest_buffers(views, items, runs)
    assert np.array_equal(got, _reference(views, items, runs))
    assert not got[0:6].any() and not got[12:18].any() and not got[30:36].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["strided-columns", "transposed", "offset-1", "offset-4", "row-stride-odd"])
def test_digest_buffers_non_contiguous_and_unaligned_views(device: str, shape: str) -> None:
    """Views the fused kernel must not take (stride(1) != 1, data_ptr not 8-aligned, an odd row stride) and
    strided ones it may: digests exact either way, on the torch path included."""
    item, n = 1024, 10
    if shape == "strided-columns":
        view = _random((n, 2 * item), 20, device)[:, ::2]
    elif shape == "transposed":
        view = _random((item, n), 21, device).t()
    elif shape == "offset-1":
        view = _random((n * item + 8,), 22, device)[1: 1 + n * item].view(n, item)
    elif shape == "offset-4":
        view = _random((n, item + 8), 23, device)[:, 4: 4 + item]
    else:
        view = _random((n, item + 3), 24, device)[:, :item]
    assert tuple(view.shape) == (n, item)
    items = np.array([9, 0, 4, 4, 2])
    for segments in (Segments.whole(item), _rows(item, 64, 128), _rows(item, 40, 128, 8)):
        runs = [run_bytes(segments, "src")] * 2
        views = [view, _random((n, item), 25, device)]
        assert np.array_equal(digest_buffers(views, items, runs), _reference(views, items, runs)), segments


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64, "list"])
def test_digest_buffers_item_index_types(device: str, dtype: Any) -> None:
    """The items may come as any integer array (the agent's are int64 slices) or a list."""
    views = [_random((40, 256), 30 + k, device) for k in range(3)]
    raw = [39, 0, 17, 17, 5]
    items: Any = list(raw) if dtype == "list" else np.array(raw, dtype=dtype)
    runs = [run_bytes(_rows(256, 24, 32), "src")] * 3
    assert np.array_equal(digest_buffers(views, items, runs), _reference(views, np.array(raw), runs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_digest_buffers_huge_item_counts_and_multi_block_runs(device: str) -> None:
    """Many items (more than one batch of the torch path, 16 MiB) of small pages, and pages larger than one
    program's 8 KiB block (several blocks per item on the GPU, the last one partial)."""
    n = 300_000
    small = [_random((n, 64), 40 + k, device) for k in range(2)]
    items = np.random.default_rng(3).integers(0, n, 400_000)
    runs = [run_bytes(Segments.whole(64), "src")] * 2
    assert np.array_equal(digest_buffers(small, items, runs), _reference(small, items, runs))
    big_item = 3 * 8192 + 24                       # three full 8 KiB blocks and a partial one
    big = [_random((12, big_item), 50 + k, device) for k in range(3)]
    items = np.array([11, 0, 5, 5, 3, 7])
    runs = [run_bytes(Segments.whole(big_item), "src")] * 3
    assert np.array_equal(digest_buffers(big, items, runs), _reference(big, items, runs))
    runs = [run_bytes(_rows(big_item - 24, 2048, 4096, 0), "src")] * 3
    assert np.array_equal(digest_buffers(big, items, runs), _reference(big, items, runs))


@pytest.mark.parametrize("device", DEVICES)
def test_digest_buffers_groups_irregulars_and_unaligned_in_one_call(device: str) -> None:
    """One call with two groups of equal regular runs, an irregular one, an unaligned view sharing a group's runs
    (it must leave the group: torch path) and an empty one: buffer-major, each its own runs."""
    item, n = 2048, 9
    whole, rows = run_bytes(Segments.whole(item), "src"), run_bytes(_rows(item, 128, 256, 64), "src")
    irregular = run_bytes(Segments(np.array([5, 999], np.int64), np.array([0, 13], np.int64),
                                   np.array([13, 700], np.int64)), "src")
    unaligned = _random((n * item + 8,), 60, device)[3: 3 + n * item].view(n, item)
    views = [_random((n, item), 61, device), unaligned, _random((n, item), 62, device),
             _random((n, item), 63, device), _random((n, item), 64, device), _random((n, item), 65, device)]
    runs = [whole, whole, rows, irregular, rows, run_bytes(Segments.empty(), "src")]
    items = np.array([8, 1, 1, 0, 4])
    assert np.array_equal(digest_buffers(views, items, runs), _reference(views, items, runs))
    if device == "cuda" and _kernel() is not None:
        assert fused(views[0], whole) and not fused(unaligned, whole) and not fused(views[3], irregular)


@pytest.mark.timeout(60)
def test_a_decode_hears_the_welcome_before_any_heartbeat() -> None:
    """Claim: the heartbeat thread (which sends outside the agent's ordered batches) beats to a decode only once its
    Welcome left. The prefill's backend takes 0.3 s to add the decode (the Welcome waits for it) while the thread
    beats every 10 ms: before the fix a beat reached the decode first, from an agent it did not know yet, and was
    dropped and counted (seen against the previous release's decode in the version-skew test under CI load)."""
    from kvbridge.backends.calls import BackendCall, CallKind
    from kvbridge.registry import Registry

    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=10.0, heartbeat_interval_s=0.01)
    adding = threading.Event()
    registry = Registry.build()

    def slow_add(call: BackendCall) -> None:
        if call.kind is CallKind.ADD_PEER:
            adding.set()
            time.sleep(0.3)

    registry.add_call_monitoring(slow_add, lambda call, outcome: None)
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=cfg, name="p0", registry=registry)
    dec = _agent(hub, Role.DECODE, "d0", cfg)
    try:
        pre.start()
        dec.start()
        connecting = threading.Thread(target=dec.connect, args=("inst",), kwargs={"timeout_s": 10})
        connecting.start()
        _wait("the prefill's backend was asked to add the decode", adding.is_set)
        time.sleep(0.1)                      # ten beat intervals while the backend is adding it
        assert "d0" not in dict(pre.peers.beat_targets()), "a beat target before the Welcome left"
        connecting.join(10)
        _wait("the prefill beats to the decode once welcomed", lambda: "d0" in dict(pre.peers.beat_targets()))
        seen = dec.peers.peers["p0"].last_beat
        _wait("the decode hears the prefill's heartbeats", lambda: dec.peers.peers["p0"].last_beat != seen)
        assert dec.rejected_frames == 0 and pre.rejected_frames == 0
    finally:
        dec.close()
        pre.close()


@pytest.mark.timeout(60)
def test_a_beat_that_overtakes_its_welcome_from_an_earlier_release_is_not_rejected(
        caplog: pytest.LogCaptureFixture) -> None:
    """Claim: a decode that awaits a prefill's Welcome takes a heartbeat from that prefill's address as early, not
    foreign: no warning, not counted as rejected, and the Welcome behind it admits the peer. Earlier releases made a
    decode their beat target on its Hello, before the Welcome left (fixed on our side, but the previous release's
    prefill still does it): the version-skew test under CI load saw the new decode count one rejected frame. The
    prefill here beats once by hand while its backend is still adding the decode, as those releases did; a beat
    from an address no handshake waits for is still dropped and counted."""
    from kvbridge.agent.peers import heartbeat
    from kvbridge.backends.calls import BackendCall, CallKind
    from kvbridge.protocol.wire import Codec
    from kvbridge.registry import Registry

    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=10.0, heartbeat_interval_s=0.05)
    registry = Registry.build()
    dec = _agent(hub, Role.DECODE, "d0", cfg)
    stray = hub.link("stray")
    beat_sent = threading.Event()

    def beat_before_welcome(call: BackendCall) -> None:
        if call.kind is CallKind.ADD_PEER and not beat_sent.is_set():
            ctx = pre.context
            message = heartbeat(agent="p0", address=ctx.link.address, seq=1, now=ctx.clock(), last_beat=(0.0, 0.0))
            ctx.link.send(dec.context.link.address,
                          ctx.codec.encode(message, to=dec.context.link.address,
                                           to_incarnation=dec.context.incarnation))
            beat_sent.set()
            time.sleep(0.3)                  # the decode reads the beat while the Welcome still waits

    registry.add_call_monitoring(beat_before_welcome, lambda call, outcome: None)
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=cfg, name="p0", registry=registry)
    try:
        pre.start()
        dec.start()
        with caplog.at_level(logging.WARNING, logger="kvbridge"):
            dec.connect("inst", timeout_s=10)
        assert beat_sent.is_set()
        assert "p0" in dec.peers.peers, "the Welcome behind the early beat admitted the prefill"
        assert dec.rejected_frames == 0, "an early beat of a prefill we shake hands with was counted as rejected"
        assert not [r for r in caplog.records if "not a peer" in r.getMessage()], caplog.text
        # a beat from an agent no handshake waits for is still refused
        codec = Codec(sender="stray", address="stray", incarnation=7)
        forged = heartbeat(agent="stray", address="stray", seq=1, now=time.monotonic(), last_beat=(0.0, 0.0))
        with caplog.at_level(logging.WARNING, logger="kvbridge"):
            stray.send(dec.context.link.address,
                       codec.encode(forged, to=dec.context.link.address, to_incarnation=dec.context.incarnation))
            _wait("the stray beat was counted", lambda: dec.rejected_frames == 1)
        assert [r for r in caplog.records if "'stray', which is not a peer" in r.getMessage()], caplog.text
    finally:
        dec.close()
        pre.close()

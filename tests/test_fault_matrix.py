"""The fault matrix (issue 12): real prefill and decode processes, faults injected from outside.

For every backend that runs here (loopback, nixl, mooncake), each probe runs a prefill process and one
or two decode processes (``tests/_faultrig.py``) over a BootstrapServer and ZmqLinks on 127.0.0.1. The
decode pools are /dev/shm segments this test process created and reads on its own; every byte is
judged against :mod:`kvbridge.pattern` (through ``kvbridge.testkit.reference``), never through the agent.

Probes (each bounded; every process is killed in a finally; no segment of this run outlives a test):

1. kill -9 the prefill mid-transfer: the decode room fails within the peer timeout, never succeeds;
   ``safe_to_reuse`` becomes True only where the backend can prove the writer gone (``writer_gone``:
   loopback), and stays False otherwise (nixl, mooncake: nothing acknowledges, nothing proves).
2. kill -9 the decode mid-transfer: the prefill room fails within the bound, the prefill lives on and
   serves a new decode process byte-exactly.
3. SIGSTOP the prefill past the peer timeout: the decode room fails, ``safe_to_reuse`` stays False while
   the prefill is stopped; after SIGCONT the prefill acknowledges the abort, ``safe_to_reuse`` becomes
   True, and not one byte of the decode pool (pages, guards, staging) changes after that moment.
4. Same-name restart: the decode is killed and a new process takes its name within a second; the old
   room fails on the prefill, the new process's canary stays intact except the pages it asked for.
5. Bootstrap server killed and restarted at the same address: live pairs keep working, and a new decode
   finds the prefill again (needs the link to re-publish).
6. Short send: a prefill that sends 4 of 8 pages with last=True fails on both sides ("4 of 8"); a
   lying prefill (it believes the decode asked for 4) is caught by the decode's coverage check.

Numbers (time to Failed, bytes after safe_to_reuse, fds) are collected into a matrix printed at the end
of the module (and written as JSON to ``$KVBRIDGE_FAULT_MATRIX`` when set).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _faultrig import Child, landed, pool_bytes, segment_spec, spawn_bootstrap

from kvbridge.testkit.kvmodel import KVPool
from kvbridge.testkit.pools import SHM_PREFIX, GuardedBuffer
from kvbridge.zmq_link import BootstrapServer, ZmqLink

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

HEARTBEAT_S = 0.1
PEER_TIMEOUT_S = 1.0
FAIL_BOUND_S = PEER_TIMEOUT_S + 1.5        # detection: timeout + a progress tick + a loaded 2-core host
SETTLE_S = 8.0                             # bound for things that need a round trip after a resume
SPAWN_S = 60.0                             # a child imports kvbridge (and nixl: ~3 s) on a shared host
NUM_PAGES = 40
SEED = 7
PREFILL_BG, DECODE_BG, DECODE2_BG = 11, 21, 22
STAGING_BYTES = 1 << 20
REPUBLISH_S = 0.5

# rooms: source pages on the prefill, request positions, destination pages on a decode (disjoint sets)
ROOMS: dict[int, dict[str, np.ndarray]] = {
    101: {"src": np.arange(0, 8), "pos": np.arange(0, 8), "dst": np.array([31, 3, 17, 9, 25, 12, 5, 20])},
    102: {"src": np.arange(8, 16), "pos": np.arange(100, 108), "dst": np.array([0, 33, 7, 14, 28, 22, 1, 38])},
    103: {"src": np.arange(16, 24), "pos": np.arange(200, 208), "dst": np.array([2, 4, 6, 8, 10, 11, 13, 15])},
    104: {"src": np.arange(24, 32), "pos": np.arange(300, 308), "dst": np.array([16, 18, 19, 21, 23, 24, 26, 27])},
}
A, B, C, D = 101, 102, 103, 104

MATRIX: dict[str, dict[str, Any]] = {}


def _engine_present(backend: str) -> bool:
    if backend == "loopback":
        return True
    module = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}[backend]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _engine_present(b), reason=f"{b} engine not importable"))
            for b in ("loopback", "nixl", "mooncake")]


def _record(probe: str, backend: str, **numbers: Any) -> None:
    MATRIX.setdefault(f"{probe} | {backend}", {}).update(numbers)


@pytest.fixture(scope="module", autouse=True)
def _print_matrix(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    out = os.environ.get("KVBRIDGE_FAULT_MATRIX")
    if out:
        Path(out).write_text(json.dumps(MATRIX, indent=1, sort_keys=True, default=str))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not MATRIX:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line("fault matrix (probe | backend: numbers)")
        for key in sorted(MATRIX):
            reporter.write_line(f"  {key}: {json.dumps(MATRIX[key], sort_keys=True, default=str)}")


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    yield
    ours = f"{SHM_PREFIX}{os.getpid()}-"
    leaked = sorted(n for n in os.listdir("/dev/shm") if n.startswith(ours))
    assert not leaked, f"this test left /dev/shm segments behind: {leaked}"


class Scenario:
    """One probe's processes, pools and bootstrap server; ``close()`` tears everything down."""

    def __init__(self, backend: str, tmp: Path, probe: str, *, external_bootstrap: bool = False) -> None:
        self.backend, self.tmp, self.probe = backend, tmp, probe
        self.uid = uuid.uuid4().hex[:6]
        self.instance = f"fault-{self.uid}"
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}
        self.children: list[Child] = []
        self.buffers: list[Any] = []
        self.server: BootstrapServer | None = None
        self.bootstrap = ""
        if not external_bootstrap:
            self.server = BootstrapServer().start()
            self.bootstrap = self.server.address

    def mark(self, phase: str) -> None:
        """Seconds since the scenario began (where a slow probe spends its time)."""
        self.phases[phase] = round(time.monotonic() - self.t0, 2)

    def spawn(self, label: str, argv: list[str] | None = None) -> Child:
        child = Child(label, argv)
        self.children.append(child)
        return child

    def spawn_bootstrap(self, address: str = "tcp://127.0.0.1:0") -> Child:
        child, self.bootstrap = spawn_bootstrap(address)
        self.children.append(child)
        return child

    def decode_pool(self, background: int) -> tuple[KVPool, GuardedBuffer]:
        pool = KVPool(1, 0, memory="shm", num_pages=NUM_PAGES, role="decode")
        self.buffers.append(pool)
        staging = GuardedBuffer(STAGING_BYTES, memory="shm")
        self.buffers.append(staging)
        pool.fill(SEED, background)                   # the canary: background everywhere
        staging.write(np.full(STAGING_BYTES, 0x5A, np.uint8))
        return pool, staging

    def _job(self, role: str, name: str, **extra: Any) -> dict[str, Any]:
        return {"role": role, "name": name, "backend": self.backend, "bootstrap": self.bootstrap,
                "instance": self.instance, "num_pages": NUM_PAGES, "republish_s": REPUBLISH_S,
                "config": {"heartbeat_s": HEARTBEAT_S, "peer_timeout_s": PEER_TIMEOUT_S, "bootstrap_timeout_s": 20.0,
                           "waiting_timeout_s": 60.0, "staging_bytes": STAGING_BYTES}, **extra}

    def start_prefill(self, child: Child, lie_short: dict[int, int] | None = None) -> None:
        """Hand the prefill its job (it reads it once imported); ``ready()`` waits for it."""
        src = np.concatenate([r["src"] for r in ROOMS.values()])
        pos = np.concatenate([r["pos"] for r in ROOMS.values()])
        child.send(**self._job("prefill", f"fault-prefill-{self.uid}", seed=SEED, background=PREFILL_BG,
                               src=src.tolist(), positions=pos.tolist(),
                               lie_short={str(k): v for k, v in (lie_short or {}).items()}))

    def start_decode(self, child: Child, name: str, pool: KVPool, staging: GuardedBuffer, *,
                     connect_timeout_s: float = SPAWN_S, defer_connect: bool = False) -> None:
        """Hand a decode its job: build its agent over the test's segments and connect (or, deferred,
        connect on ``child.send(cmd="connect")``)."""
        child.send(**self._job("decode", name, segments=segment_spec(pool, staging),
                               connect_timeout_s=connect_timeout_s, defer_connect=defer_connect))

    def ready(self, child: Child, event: str = "ready") -> dict[str, Any]:
        """Wait for a child's ``ready`` (prefill), ``started`` or ``connected`` (decode)."""
        got = child.events.wait(event, SPAWN_S, child.stderr)
        self.mark(f"{child.label} {event}")
        return got

    def close(self) -> None:
        self.mark("test body done")
        for child in self.children:
            child.kill()
        for buf in self.buffers:
            buf.close()
        if self.server is not None:
            self.server.close()
        self.mark("torn down")
        _record(self.probe, self.backend, phases_s=self.phases)


@pytest.fixture
def scenario_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Scenario] = []

    def make(backend: str, probe: str, **kw: Any) -> Scenario:
        sc = Scenario(backend, tmp_path, probe, **kw)
        made.append(sc)
        return sc

    yield make
    for sc in made:
        sc.close()


def _serve(child: Child, room: int, *, chunks: list[Any] | None = None, pace_s: float = 0.0) -> None:
    src = ROOMS[room]["src"]
    parts = chunks if chunks is not None else [src[:4], src[4:]]
    child.send(cmd="serve", room=room, chunks=[np.asarray(c).tolist() for c in parts], pace_s=pace_s)


def _recv(child: Child, room: int, snap_dir: Path | None = None) -> None:
    child.send(cmd="recv", room=room, dst=ROOMS[room]["dst"].tolist(), snap_dir=str(snap_dir or ""))


def _absent(child: Child, event: str, window_s: float, **match: Any) -> None:
    """Poll for ``window_s``: ``event`` must not appear (an assertion of something staying false)."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        found = child.events.find(event, **match)
        assert not found, f"{child.label}: unexpected {event} {match}: {found}"
        time.sleep(0.01)


def _never_success(child: Child, room: int) -> None:
    found = child.events.find("status", room=room, status="Success")
    assert not found, f"{child.label} reported Success for room {room}: {found}"


def _success(child: Child, room: int, timeout_s: float) -> dict[str, Any]:
    def failed() -> str:
        return str(child.events.find("status", room=room, status="Failed")) + child.stderr()[-800:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.events.find("status", room=room, status="Failed"):
            raise AssertionError(f"{child.label}: room {room} failed: {failed()}")
        done = child.events.find("status", room=room, status="Success")
        if done:
            return done[0]
        time.sleep(0.005)
    raise AssertionError(f"{child.label}: room {room} did not succeed in {timeout_s} s: {failed()}")


def _exact(pool: KVPool, background: int, *rooms: int) -> None:
    pages = np.concatenate([ROOMS[r]["dst"] for r in rooms])
    positions = np.concatenate([ROOMS[r]["pos"] for r in rooms])
    problems = pool.check(SEED, background, pages, positions)
    assert not problems, "decode pool differs from the reference:\n  " + "\n  ".join(problems)


def _ping(child: Child, timeout_s: float = 5.0) -> dict[str, Any]:
    nonce = uuid.uuid4().hex
    child.send(cmd="ping", nonce=nonce)
    return child.events.wait("pong", timeout_s, child.stderr, nonce=nonce)


# ============================================================================ probe 1
@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_prefill_mid_transfer(backend: str, scenario_factory: Any, tmp_path: Path) -> None:
    sc = scenario_factory(backend, "1 kill -9 prefill")
    pre, dec = sc.spawn("prefill"), sc.spawn("decode")
    pool, staging = sc.decode_pool(DECODE_BG)
    sc.start_prefill(pre)
    sc.start_decode(dec, f"fault-decode-{sc.uid}", pool, staging)
    sc.ready(pre)
    connected = sc.ready(dec, "connected")
    proves_death = connected["writer_gone"]
    _recv(dec, A, tmp_path)
    _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.4)
    pre.events.wait("sent", 20, pre.stderr, room=A, chunk=1)
    dec.events.wait("status", 10, dec.stderr, room=A, status="Transferring")
    killed = pre.kill9()

    failed = dec.events.wait("status", FAIL_BOUND_S + 2, dec.stderr, room=A, status="Failed")
    took = failed["t"] - killed
    _record("1 kill -9 prefill", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
    assert took <= FAIL_BOUND_S, f"decode took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
    if proves_death:
        # the backend proves the writer gone (loopback: its abstract socket name is free): safe at once
        safe = dec.events.wait("safe", FAIL_BOUND_S, dec.stderr, room=A)
        _record("1 kill -9 prefill", backend, safe_to_reuse=True, safe_after_kill_s=round(safe["t"] - killed, 3))
        # nothing can land any more: the pool stays as it was when safe_to_reuse became True
        snap = np.load(tmp_path / f"room{A}-safe.npy")
        after = int(np.count_nonzero(pool_bytes(pool, staging) != snap))
        _record("1 kill -9 prefill", backend, bytes_after_safe=after)
        assert after == 0
    else:
        # documented (agent/decode.py, peers.writer_gone): without an acknowledgement or a backend proof,
        # silence never makes safe_to_reuse True
        _absent(dec, "safe", 1.0, room=A)
        _record("1 kill -9 prefill", backend, safe_to_reuse="stays False (no writer_gone proof; documented)")
    _never_success(dec, A)
    good, problems = landed(pool, SEED, DECODE_BG, ROOMS[A]["dst"], ROOMS[A]["pos"])
    _record("1 kill -9 prefill", backend, reference_bytes_landed=good)
    assert not problems, problems
    assert dec.alive()


# ============================================================================ probe 2
@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_decode_mid_transfer(backend: str, scenario_factory: Any) -> None:
    sc = scenario_factory(backend, "2 kill -9 decode")
    pre, d1, d2 = sc.spawn("prefill"), sc.spawn("decode-1"), sc.spawn("decode-2")
    pool1, staging1 = sc.decode_pool(DECODE_BG)
    pool2, staging2 = sc.decode_pool(DECODE2_BG)
    sc.start_prefill(pre)
    sc.start_decode(d1, f"fault-decode1-{sc.uid}", pool1, staging1)
    sc.start_decode(d2, f"fault-decode2-{sc.uid}", pool2, staging2, defer_connect=True)
    ready = sc.ready(pre)
    sc.ready(d1, "connected")
    fds_connected = _ping(pre)["fds"]
    _recv(d1, A)
    _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.4)
    pre.events.wait("sent", 20, pre.stderr, room=A, chunk=1)
    killed = d1.kill9()

    failed = pre.events.wait("status", FAIL_BOUND_S + 2, pre.stderr, room=A, status="Failed")
    took = failed["t"] - killed
    _record("2 kill -9 decode", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
    assert took <= FAIL_BOUND_S, f"prefill took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
    _never_success(pre, A)
    pre.events.wait("safe", SETTLE_S, pre.stderr, room=A)     # no write of the room left in flight
    assert pre.alive(), f"the prefill died: {pre.stderr()}"
    _ping(pre)

    # the prefill still serves a new decode process, byte-exactly
    sc.ready(d2, "started")
    d2.send(cmd="connect")
    sc.ready(d2, "connected")
    _recv(d2, B)
    _serve(pre, B)
    _success(d2, B, 20)
    _success(pre, B, 10)
    _exact(pool2, DECODE2_BG, B)
    good, problems = landed(pool1, SEED, DECODE_BG, ROOMS[A]["dst"], ROOMS[A]["pos"])
    assert not problems, problems
    fds_served = _ping(pre)["fds"]
    # the dead decode's peer record (sockets, mappings, caches) is released once no room refers to it
    deadline = time.monotonic() + 2 * PEER_TIMEOUT_S + SETTLE_S
    while (pong := _ping(pre))["peers"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    _record("2 kill -9 decode", backend, second_decode="Success, byte-exact",
            prefill_fds={"ready": ready["fds"], "decode1 connected": fds_connected, "decode2 served": fds_served,
                         "decode1 released": pong["fds"]})
    assert pong["peers"] == 1, f"the dead decode's peer record was never released: {pong}"
    assert pre.alive()


# ============================================================================ probe 3
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigstop_prefill_past_timeout_then_sigcont(backend: str, scenario_factory: Any, tmp_path: Path) -> None:
    sc = scenario_factory(backend, "3 SIGSTOP prefill")
    pre, dec = sc.spawn("prefill"), sc.spawn("decode")
    pool, staging = sc.decode_pool(DECODE_BG)
    sc.start_prefill(pre)
    sc.start_decode(dec, f"fault-decode-{sc.uid}", pool, staging)
    sc.ready(pre)
    sc.ready(dec, "connected")
    _recv(dec, A, tmp_path)
    _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.3)
    pre.events.wait("sent", 20, pre.stderr, room=A, chunk=0)
    dec.events.wait("status", 10, dec.stderr, room=A, status="Transferring")
    stopped = pre.signal(signal.SIGSTOP)
    try:
        failed = dec.events.wait("status", FAIL_BOUND_S + 2, dec.stderr, room=A, status="Failed")
        took = failed["t"] - stopped
        _record("3 SIGSTOP prefill", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
        assert took <= FAIL_BOUND_S, f"decode took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
        # the prefill is stopped, not gone: nothing acknowledged, nothing proven -> not safe
        _absent(dec, "safe", 1.0, room=A)
    finally:
        resumed = pre.signal(signal.SIGCONT)
    stopped_for = resumed - stopped
    safe = dec.events.wait("safe", SETTLE_S, dec.stderr, room=A)
    assert safe["t"] > resumed, "safe_to_reuse became True while the prefill was stopped"
    # the resumed prefill learns the abort: its room fails, its engine stops, nothing is left in flight
    pre.events.wait("status", SETTLE_S, pre.stderr, room=A, status="Failed")
    pre.events.wait("engine-done", SETTLE_S, pre.stderr, room=A)
    pre.events.wait("safe", SETTLE_S, pre.stderr, room=A)
    _ping(pre)
    _ping(dec)
    snap_safe = np.load(tmp_path / f"room{A}-safe.npy")
    snap_failed = np.load(tmp_path / f"room{A}-failed.npy")
    now = pool_bytes(pool, staging)
    after_safe = int(np.count_nonzero(now != snap_safe))
    failed_to_safe = int(np.count_nonzero(snap_safe != snap_failed))
    refused = pre.events.find("refused", room=A)
    sent = pre.events.find("sent", room=A)
    _record("3 SIGSTOP prefill", backend, stopped_for_s=round(stopped_for, 2),
            safe_after_sigcont_s=round(safe["t"] - resumed, 3), bytes_after_safe=after_safe,
            bytes_between_failed_and_safe=failed_to_safe, chunks_sent=len(sent),
            prefill_refused=refused[0]["reason"][:80] if refused else "")
    assert after_safe == 0, f"{after_safe} bytes of the decode pool changed after safe_to_reuse became True"
    _never_success(dec, A)
    _never_success(pre, A)
    good, problems = landed(pool, SEED, DECODE_BG, ROOMS[A]["dst"], ROOMS[A]["pos"])
    _record("3 SIGSTOP prefill", backend, reference_bytes_landed=good)
    assert not problems, problems


# ============================================================================ probe 4
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_name_restart_gets_nothing_of_the_old_room(backend: str, scenario_factory: Any) -> None:
    sc = scenario_factory(backend, "4 same-name restart")
    pre, d1, d2 = sc.spawn("prefill"), sc.spawn("decode-1"), sc.spawn("decode-2")
    pool1, staging1 = sc.decode_pool(DECODE_BG)
    pool2, staging2 = sc.decode_pool(DECODE2_BG)
    name = f"fault-decode-{sc.uid}"
    sc.start_prefill(pre)
    sc.start_decode(d1, name, pool1, staging1)
    # the successor is up (engine initialised, same name, fresh pages, a new incarnation) but silent: it
    # speaks to the prefill only once its predecessor is dead, as a restarted process would. (Starting its
    # engine only after the kill takes seconds with NIXL, longer than the peer timeout.)
    sc.start_decode(d2, name, pool2, staging2, defer_connect=True)
    sc.ready(pre)
    sc.ready(d1, "connected")
    sc.ready(d2, "started")
    _recv(d1, A)
    _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.3)
    pre.events.wait("sent", 20, pre.stderr, room=A, chunk=1)
    killed = d1.kill9()
    d2.send(cmd="connect")
    connected = sc.ready(d2, "connected")
    restart_gap = connected["t"] - killed

    failed = pre.events.wait("status", FAIL_BOUND_S + 2, pre.stderr, room=A, status="Failed")
    _record("4 same-name restart", backend, restart_connected_after_kill_s=round(restart_gap, 3),
            time_to_failed_s=round(failed["t"] - killed, 3), reason=failed["reason"][:90])
    assert failed["t"] - killed <= FAIL_BOUND_S
    assert restart_gap < PEER_TIMEOUT_S + 1.0, f"the restart took {restart_gap:.2f} s; the probe wants it quick"
    pre.events.wait("engine-done", SETTLE_S, pre.stderr, room=A)
    pre.events.wait("safe", SETTLE_S, pre.stderr, room=A)
    sc.mark("old room settled")
    _never_success(pre, A)
    # the new process asked for nothing yet: every byte of it is still the canary
    stray = pool2.check(SEED, DECODE2_BG)
    _record("4 same-name restart", backend, new_process_bytes_changed_before_asking=len(stray))
    assert not stray, "the prefill wrote into the restarted process before it asked:\n  " + "\n  ".join(stray)

    _recv(d2, B)
    _serve(pre, B)
    _success(d2, B, 20)
    _success(pre, B, 10)
    sc.mark("new room done")
    _exact(pool2, DECODE2_BG, B)            # room B exact, canary intact everywhere else (no room A data)
    good, problems = landed(pool1, SEED, DECODE_BG, ROOMS[A]["dst"], ROOMS[A]["pos"])
    assert not problems, problems
    _record("4 same-name restart", backend, new_room="Success, byte-exact, canary intact elsewhere")


# ============================================================================ probe 5
def _link_republishes() -> bool:
    return "republish_s" in inspect.signature(ZmqLink).parameters


@pytest.mark.parametrize("backend", BACKENDS)
def test_bootstrap_restart(backend: str, scenario_factory: Any) -> None:
    sc = scenario_factory(backend, "5 bootstrap restart", external_bootstrap=True)
    boot = sc.spawn_bootstrap()
    address = sc.bootstrap
    pre, d1, d2 = sc.spawn("prefill"), sc.spawn("decode-1"), sc.spawn("decode-2")
    pool1, staging1 = sc.decode_pool(DECODE_BG)
    pool2, staging2 = sc.decode_pool(DECODE2_BG)
    bound = 3 * REPUBLISH_S + 4.0
    sc.start_prefill(pre)
    sc.start_decode(d1, f"fault-decode1-{sc.uid}", pool1, staging1)
    sc.start_decode(d2, f"fault-decode2-{sc.uid}", pool2, staging2, defer_connect=True, connect_timeout_s=bound)
    sc.ready(pre)
    sc.ready(d1, "connected")
    sc.ready(d2, "started")
    boot.kill9()
    restarted_child = sc.spawn_bootstrap(address)
    restarted = time.monotonic()
    assert sc.bootstrap == address
    assert restarted_child.alive()

    # a pair that shook hands before keeps working: the control plane is peer to peer
    _recv(d1, A)
    _serve(pre, A)
    _success(d1, A, 20)
    _success(pre, A, 10)
    _exact(pool1, DECODE_BG, A)

    # a new decode must find the prefill at the restarted server: the prefill has to publish again
    d2.send(cmd="connect")
    try:
        connected = d2.events.wait("connected", bound + 5, d2.stderr)
    except AssertionError as exc:
        if not _link_republishes():
            pytest.xfail("ZmqLink does not re-publish a prefill's ranks to a restarted BootstrapServer (no "
                         f"republish_s / re-publish loop in kvbridge.zmq_link): {str(exc)[:200]}")
        raise
    assert _link_republishes(), ("a new decode found the prefill after the bootstrap restart although ZmqLink has "
                                 "no re-publish option: update this test (drop its xfail branch)")
    _record("5 bootstrap restart", backend, found_after_restart_s=round(connected["t"] - restarted, 3),
            live_pair="Success, byte-exact", republish_s=REPUBLISH_S)
    _recv(d2, B)
    _serve(pre, B)
    _success(d2, B, 20)
    _success(pre, B, 10)
    _exact(pool2, DECODE2_BG, B)


# ============================================================================ probe 6
@pytest.mark.parametrize("backend", BACKENDS)
def test_short_send_fails_both_sides(backend: str, scenario_factory: Any) -> None:
    sc = scenario_factory(backend, "6 short send")
    pre, dec = sc.spawn("prefill"), sc.spawn("decode")
    pool, staging = sc.decode_pool(DECODE_BG)
    sc.start_prefill(pre, lie_short={D: 4})           # room D: the prefill believes 4 pages were asked
    sc.start_decode(dec, f"fault-decode-{sc.uid}", pool, staging)
    sc.ready(pre)
    sc.ready(dec, "connected")

    # an honest prefill sends 4 of 8 pages with last=True: its own check refuses the chunk before posting
    _recv(dec, C)
    _serve(pre, C, chunks=[ROOMS[C]["src"][:4]])
    requested = pre.events.wait("requested", 20, pre.stderr, room=C)
    refused = pre.events.wait("refused", 10, pre.stderr, room=C)
    assert "4 of 8" in refused["reason"], refused
    p_failed = pre.events.wait("status", 10, pre.stderr, room=C, status="Failed")
    d_failed = dec.events.wait("status", FAIL_BOUND_S, dec.stderr, room=C, status="Failed")
    assert "4 of 8" in d_failed["reason"], d_failed
    dec.events.wait("safe", SETTLE_S, dec.stderr, room=C)
    good_c, problems = landed(pool, SEED, DECODE_BG, ROOMS[C]["dst"], ROOMS[C]["pos"])
    assert not problems, problems
    assert good_c == 0, f"{good_c} bytes of a refused chunk landed (a chunk is all or nothing)"
    _record("6 short send (honest)", backend, decode_failed_after_request_s=round(d_failed["t"] - requested["t"], 3),
            decode_reason=d_failed["reason"][:110], prefill_reason=p_failed["reason"][:80], bytes_landed=good_c)

    # a lying prefill sends 4 of 8 with last=True and believes it is done: the decode's coverage catches it
    _recv(dec, D)
    _serve(pre, D, chunks=[ROOMS[D]["src"][:4]])
    pre.events.wait("sent", 20, pre.stderr, room=D, chunk=0)
    d_failed = dec.events.wait("status", FAIL_BOUND_S, dec.stderr, room=D, status="Failed")
    assert "4 of 8" in d_failed["reason"], d_failed
    safe = dec.events.wait("safe", SETTLE_S, dec.stderr, room=D)
    p_final = [e["status"] for e in pre.events.find("status", room=D)]
    good_d, problems = landed(pool, SEED, DECODE_BG, ROOMS[D]["dst"], ROOMS[D]["pos"])
    assert not problems, problems
    half = pool.expected_nbytes(4)
    _record("6 short send (lying prefill)", backend, decode_reason=d_failed["reason"][:110],
            prefill_statuses=p_final, decode_safe_after_failed_s=round(safe["t"] - d_failed["t"], 3),
            reference_bytes_landed=good_d, four_pages_bytes=half)
    for room in (C, D):
        _never_success(dec, room)
    _never_success(pre, C)

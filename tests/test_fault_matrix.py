"""The fault matrix (issue 12): real prefill and decode processes, faults injected from outside.

For every backend that runs here (loopback, nixl, mooncake), prefill and decode ranks run in their own
processes (``tests/_faultrig.py``) over a BootstrapServer and ZmqLinks on 127.0.0.1. The decode pools
are /dev/shm segments this test process created and reads on its own; every byte is judged against
:mod:`kvbridge.pattern` (via ``kvbridge.testkit.reference``), never through the agent: rooms that
succeeded byte-exact, rooms that did not reference-or-canary, the canary (background) everywhere else,
guard zones intact.

Starting a process costs seconds (NIXL imports torch), so the probes share processes in three scenarios
per backend, each probe its own test, run in order (a probe whose predecessor failed is skipped):

* pair (one prefill, one decode):
  6. short send: 4 of 8 pages with last=True fails on both sides, never Success, the reason says
     "4 of 8"; a lying prefill (it believes the decode asked for 4) is caught by the decode's coverage.
  3. SIGSTOP the prefill past the peer timeout: the decode room fails within the bound and
     ``safe_to_reuse`` stays False while the prefill is stopped inside its write lease; once it stayed silent
     past the lease + the fabric's flight bound (set here), ``safe_to_reuse`` becomes True while it is still
     stopped, then SIGCONT: the resumed prefill posts nothing (its lease ran out on its own clock), and not one
     byte of the decode pool (pages, guards, staging) changes after that moment (the decode snapshots its pool
     the instant it sees it True).
  1. kill -9 the prefill mid-transfer: Failed within the bound, never Success; ``safe_to_reuse`` becomes
     True on every backend without ``declare_gone`` (the prefill's kernel closes the decode's liveness
     connection, kvbridge.agent.liveness), within the bound, and not one byte changes after it.
* decode deaths (one prefill, three decodes):
  4. same-name restart: the decode is killed and a new process with the same name speaks within a
     second: the old room fails on the prefill, the new process's canary is intact but for its own room.
  2. kill -9 a decode mid-transfer (no successor): the prefill room fails within the bound, the prefill
     lives on, serves a new decode byte-exactly, and releases the dead peers' records.
* bootstrap restart: 5. the server is killed and restarted at its address: live pairs keep working and
  a new decode finds the prefill (the link re-publishes).

Every wait is bounded; every process is killed in a finally; no /dev/shm segment of this run outlives a
scenario. Numbers (time to Failed, bytes after safe_to_reuse, fds) are collected into a matrix printed at
the end of the module and written as JSON to ``$KVBRIDGE_FAULT_MATRIX`` when set.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _faultrig import Child, check_pool, pool_bytes, segment_spec, spawn_bootstrap

from kvbridge.testkit.kvmodel import KVPool
from kvbridge.testkit.pools import SHM_PREFIX, GuardedBuffer
from kvbridge.zmq_link import BootstrapServer, ZmqLink

pytestmark = [pytest.mark.kvbridge_multiprocess, pytest.mark.timeout(120)]

HEARTBEAT_S = 0.1
PEER_TIMEOUT_S = 1.0
FAIL_BOUND_S = PEER_TIMEOUT_S + 2.0        # detection: timeout + a progress tick + a loaded, shared 2-core host
SETTLE_S = 8.0                             # bound for things that need a round trip after a resume
LEASE_S = 2 * PEER_TIMEOUT_S               # a prefill's write lease (kvbridge.agent.peers.writer_lease_s)
FLIGHT_BOUND_S = 0.5                       # AgentConfig.write_flight_bound_s: loopback TCP and one host's NIXL
#                                            and Mooncake land a posted write in milliseconds
SPAWN_S = 60.0                             # a child imports kvbridge (and nixl: ~3 s) on a shared host
NUM_PAGES = 40
SEED = 7
PREFILL_BG, DECODE_BG, DECODE2_BG, DECODE3_BG = 11, 21, 22, 23
STAGING_BYTES = 1 << 20
REPUBLISH_S = 0.5

# rooms: source pages on the prefill, request positions, destination pages on a decode; the destination
# sets are disjoint, so several rooms can share one decode pool and each byte has one expected value
_DST = np.random.default_rng(1234).permutation(NUM_PAGES)
ROOMS: dict[int, dict[str, np.ndarray]] = {
    room: {"src": np.arange(8 * k, 8 * k + 8), "pos": np.arange(100 * k, 100 * k + 8), "dst": _DST[8 * k: 8 * k + 8]}
    for k, room in enumerate((101, 102, 103, 104))
}
A, B, C, D = ROOMS

MATRIX: dict[str, dict[str, Any]] = {}


def _engine_present(backend: str) -> bool:
    if backend == "loopback":
        return True
    module = {"nixl": "nixl", "mooncake": "mooncake.engine"}[backend]     # nixl._api would import it (and torch)
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


def _leaked_segments() -> list[str]:
    ours = f"{SHM_PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(ours))


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    yield
    assert not _leaked_segments(), f"the fault matrix left /dev/shm segments behind: {_leaked_segments()}"


class Scenario:
    """One probe's processes, pools and bootstrap server; ``close()`` tears everything down."""

    def __init__(self, backend: str, tmp: Path, probe: str, *, external_bootstrap: bool = False) -> None:
        self.backend, self.tmp, self.probe = backend, tmp, probe
        self.uid = uuid.uuid4().hex[:6]
        self.instance = f"fault-{self.uid}"
        self.t0 = time.monotonic()
        self.done: set[str] = set()             # probes of this scenario that passed
        self.room_dir = tmp                     # the decode's snapshots of its pool
        self.pools: dict[str, tuple[KVPool, GuardedBuffer]] = {}
        self.proves_death = False               # the decode's backend has writer_gone
        self.fds: dict[str, int] = {}
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
                           "waiting_timeout_s": 60.0, "staging_bytes": STAGING_BYTES,
                           "write_flight_bound_s": FLIGHT_BOUND_S}, **extra}

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


@contextmanager
def _scenario(backend: str, tmp: Path, label: str, **kw: Any) -> Iterator[Scenario]:
    sc = Scenario(backend, tmp, label, **kw)
    try:
        yield sc
    finally:
        sc.close()
        leaked = _leaked_segments()
        assert not leaked, f"{label} ({backend}) left /dev/shm segments behind: {leaked}"


def _needs(sc: Scenario, *steps: str) -> None:
    """Probes of one scenario run in order on the same processes; a later one needs the earlier ones."""
    missing = [step for step in steps if step not in sc.done]
    if missing:
        pytest.skip(f"an earlier probe of this scenario did not pass: {missing}")


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


def _judge(pool: KVPool, background: int, *, exact: tuple[int, ...] = (), partial: tuple[int, ...] = ()) -> int:
    """Check a decode pool against the reference: rooms in ``exact`` byte-exact, rooms in ``partial``
    reference-or-canary, the canary everywhere else; returns the partial rooms' reference bytes."""
    good, problems = check_pool(pool, SEED, background, exact=[(ROOMS[r]["dst"], ROOMS[r]["pos"]) for r in exact],
                                partial=[(ROOMS[r]["dst"], ROOMS[r]["pos"]) for r in partial])
    assert not problems, "decode pool differs from the reference:\n  " + "\n  ".join(problems)
    return good


def _ping(child: Child, timeout_s: float = 5.0) -> dict[str, Any]:
    nonce = uuid.uuid4().hex
    child.send(cmd="ping", nonce=nonce)
    return child.events.wait("pong", timeout_s, child.stderr, nonce=nonce)


@pytest.fixture(scope="class")
def pair(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    with _scenario(backend, tmp_path_factory.mktemp(f"pair-{backend}"), "pair") as sc:
        pre, dec = sc.spawn("prefill"), sc.spawn("decode")
        pool, staging = sc.decode_pool(DECODE_BG)
        sc.start_prefill(pre, lie_short={D: 4})        # room D: this prefill believes 4 pages were asked
        sc.start_decode(dec, f"fault-decode-{sc.uid}", pool, staging)
        sc.ready(pre)
        sc.proves_death = sc.ready(dec, "connected")["writer_gone"]
        sc.pools = {"decode": (pool, staging)}
        yield sc


@pytest.fixture(scope="class")
def world(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    with _scenario(backend, tmp_path_factory.mktemp(f"deaths-{backend}"), "decode deaths") as sc:
        pre = sc.spawn("prefill")
        d1, d2, d3 = sc.spawn("decode-1"), sc.spawn("decode-2"), sc.spawn("decode-3")
        sc.pools = {"1": sc.decode_pool(DECODE_BG), "2": sc.decode_pool(DECODE2_BG),
                    "3": sc.decode_pool(DECODE3_BG)}
        same = f"fault-decode-{sc.uid}"
        sc.start_prefill(pre)
        sc.start_decode(d1, same, *sc.pools["1"])
        # the successor is up (engine initialised, same name, fresh canary pages, a new incarnation) but
        # silent: it speaks to the prefill only once its predecessor is dead, as a restarted process would
        # (starting a NIXL engine after the kill takes seconds, longer than the peer timeout)
        sc.start_decode(d2, same, *sc.pools["2"], defer_connect=True)
        sc.start_decode(d3, f"fault-decode3-{sc.uid}", *sc.pools["3"], defer_connect=True)
        sc.fds = {"prefill ready": sc.ready(pre)["fds"]}
        sc.ready(d1, "connected")
        sc.fds["decode-1 connected"] = _ping(pre)["fds"]
        sc.ready(d2, "started")
        sc.ready(d3, "started")
        yield sc


# ============================================================================ scenario X: one pair
# probes 6 (short send), 3 (SIGSTOP/SIGCONT), 1 (kill -9 prefill), in that order, on one prefill process and
# one decode process; rooms C and D (short sends), A (stop), B (kill) share the decode pool (disjoint pages)
@pytest.mark.parametrize("backend", BACKENDS, scope="class")
class TestPair:
    def test_short_send_fails_both_sides(self, backend: str, pair: Scenario) -> None:
        """Probe 6: 4 of 8 pages with last=True is never Success; the reason says '4 of 8'."""
        sc, (pre, dec) = pair, pair.children
        pool, _ = sc.pools["decode"]
        # an honest prefill: its own check refuses the chunk before anything is posted (all or nothing)
        _recv(dec, C)
        _serve(pre, C, chunks=[ROOMS[C]["src"][:4]])
        requested = pre.events.wait("requested", 20, pre.stderr, room=C)
        refused = pre.events.wait("refused", 10, pre.stderr, room=C)
        assert "4 of 8" in refused["reason"], refused
        p_failed = pre.events.wait("status", 10, pre.stderr, room=C, status="Failed")
        d_failed = dec.events.wait("status", FAIL_BOUND_S, dec.stderr, room=C, status="Failed")
        assert "4 of 8" in d_failed["reason"], d_failed
        dec.events.wait("safe", SETTLE_S, dec.stderr, room=C)
        landed_c = _judge(pool, DECODE_BG, partial=(C,))
        assert landed_c == 0, f"{landed_c} bytes of a refused chunk landed (a chunk is all or nothing)"
        _record("6 short send, honest prefill", backend, bytes_landed=landed_c,
                decode_failed_after_request_s=round(d_failed["t"] - requested["t"], 3),
                decode_reason=d_failed["reason"][:120], prefill_reason=p_failed["reason"][:80])

        # a lying prefill sends 4 of 8 with last=True and believes it is done: the decode's coverage catches it
        _recv(dec, D)
        _serve(pre, D, chunks=[ROOMS[D]["src"][:4]])
        pre.events.wait("sent", 20, pre.stderr, room=D, chunk=0)
        d_failed = dec.events.wait("status", FAIL_BOUND_S, dec.stderr, room=D, status="Failed")
        assert "4 of 8" in d_failed["reason"], d_failed
        safe = dec.events.wait("safe", SETTLE_S, dec.stderr, room=D)
        landed_d = _judge(pool, DECODE_BG, partial=(C, D))
        assert landed_d <= pool.expected_nbytes(4)
        _record("6 short send, lying prefill", backend, decode_reason=d_failed["reason"][:120],
                prefill_statuses=[e["status"] for e in pre.events.find("status", room=D)],
                decode_safe_after_failed_s=round(safe["t"] - d_failed["t"], 3), reference_bytes_landed=landed_d,
                bytes_of_4_pages=pool.expected_nbytes(4))
        for room in (C, D):
            _never_success(dec, room)
        _never_success(pre, C)
        sc.done.add("short send")

    def test_sigstop_prefill_past_timeout_then_sigcont(self, backend: str, pair: Scenario) -> None:
        """Probe 3: no byte lands after safe_to_reuse. A writer stopped past the peer timeout is not proven gone
        (safe stays False), but once it stays silent past its write lease + the flight bound it can post nothing
        more: safe comes while it is still stopped, and after SIGCONT not one byte changes."""
        sc, (pre, dec) = pair, pair.children
        _needs(sc, "short send")
        pool, staging = sc.pools["decode"]
        _recv(dec, A, sc.room_dir)
        _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.3)
        pre.events.wait("sent", 20, pre.stderr, room=A, chunk=0)
        dec.events.wait("status", 10, dec.stderr, room=A, status="Transferring")
        stopped = pre.signal(signal.SIGSTOP)
        try:
            failed = dec.events.wait("status", FAIL_BOUND_S + 2, dec.stderr, room=A, status="Failed")
            took = failed["t"] - stopped
            _record("3 SIGSTOP prefill", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
            assert took <= FAIL_BOUND_S, f"decode took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
            # stopped, not gone, and still inside its lease: nothing acknowledged, nothing proven -> not safe
            if failed["t"] - stopped < LEASE_S - 0.6:
                _absent(dec, "safe", 0.4, room=A)
            safe = dec.events.wait("safe", LEASE_S + FLIGHT_BOUND_S + FAIL_BOUND_S, dec.stderr, room=A)
            assert safe["t"] - stopped >= LEASE_S, "safe before the writer's lease could have run out"
            time.sleep(0.3)                # stopped a little longer: the resume finds its lease well over
        finally:
            resumed = pre.signal(signal.SIGCONT)
        assert safe["t"] < resumed, "safe_to_reuse came only after SIGCONT: the lease did not end the fence"
        # give the resumed prefill every chance to write: its engine ends (refused, or all chunks sent) and
        # its room settles (nothing in flight); only then compare the pool with the snapshot
        pre.events.wait("engine-done", SETTLE_S, pre.stderr, room=A)
        pre.events.wait("safe", SETTLE_S, pre.stderr, room=A)
        _ping(pre)
        _ping(dec)
        snap_safe = np.load(sc.room_dir / f"room{A}-safe.npy")
        snap_failed = np.load(sc.room_dir / f"room{A}-failed.npy")
        after_safe = int(np.count_nonzero(pool_bytes(pool, staging) != snap_safe))
        refused = pre.events.find("refused", room=A)
        _record("3 SIGSTOP prefill", backend, stopped_for_s=round(resumed - stopped, 2),
                safe_after_stop_s=round(safe["t"] - stopped, 3), bytes_after_safe=after_safe,
                bytes_landed_between_failed_and_safe=int(np.count_nonzero(snap_safe != snap_failed)),
                chunks_sent=len(pre.events.find("sent", room=A)),
                prefill_refused=refused[0]["reason"][:80] if refused else "")
        assert after_safe == 0, f"{after_safe} bytes of the decode pool changed after safe_to_reuse became True"
        # the resumed prefill did not write on: its room failed (its lease ran out, or the abort reached it)
        assert pre.events.find("status", room=A, status="Failed"), pre.events.find("status", room=A)
        _never_success(dec, A)
        _never_success(pre, A)
        _record("3 SIGSTOP prefill", backend, reference_bytes_landed=_judge(pool, DECODE_BG, partial=(C, D, A)))
        sc.done.add("sigstop")

    def test_kill_prefill_mid_transfer(self, backend: str, pair: Scenario) -> None:
        """Probe 1: Failed within the bound, never Success; safe_to_reuse only with a proof of death."""
        sc, (pre, dec) = pair, pair.children
        _needs(sc, "short send", "sigstop")
        pool, staging = sc.pools["decode"]
        _recv(dec, B, sc.room_dir)
        _serve(pre, B, chunks=[[p] for p in ROOMS[B]["src"]], pace_s=0.4)
        pre.events.wait("sent", 20, pre.stderr, room=B, chunk=1)
        dec.events.wait("status", 10, dec.stderr, room=B, status="Transferring")
        killed = pre.kill9()
        failed = dec.events.wait("status", FAIL_BOUND_S + 2, dec.stderr, room=B, status="Failed")
        took = failed["t"] - killed
        _record("1 kill -9 prefill", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
        assert took <= FAIL_BOUND_S, f"decode took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
        # every backend: the prefill's kernel closed the decode's liveness connection (loopback's backend can
        # also prove it by its abstract socket name); the room is safe within the bound, without declare_gone
        safe = dec.events.wait("safe", FAIL_BOUND_S, dec.stderr, room=B)
        time.sleep(0.5)                 # anything still in flight would land now
        after = int(np.count_nonzero(pool_bytes(pool, staging) != np.load(sc.room_dir / f"room{B}-safe.npy")))
        _record("1 kill -9 prefill", backend, safe_to_reuse=f"True {safe['t'] - killed:.3f} s after the kill "
                f"({'backend writer_gone' if sc.proves_death else 'liveness connection'})", bytes_after_safe=after)
        assert safe["t"] - killed <= FAIL_BOUND_S
        assert after == 0, f"{after} bytes of the decode pool changed after safe_to_reuse became True"
        _never_success(dec, B)
        _record("1 kill -9 prefill", backend, reference_bytes_landed=_judge(pool, DECODE_BG, partial=(C, D, A, B)))
        assert dec.alive()
        sc.done.add("kill prefill")


# ============================================================================ scenario Y: decode deaths
# probes 4 (same-name restart) then 2 (kill -9 decode, timeout path), on one prefill and three decodes
@pytest.mark.parametrize("backend", BACKENDS, scope="class")
class TestDecodeDeaths:
    def test_same_name_restart_gets_nothing_of_the_old_room(self, backend: str, world: Scenario) -> None:
        """Probe 4: the old room fails on the prefill; the new process's canary is intact but for its own room."""
        sc, (pre, d1, d2, _d3) = world, world.children
        pool1, pool2 = sc.pools["1"][0], sc.pools["2"][0]
        _recv(d1, A)
        _serve(pre, A, chunks=[[p] for p in ROOMS[A]["src"]], pace_s=0.5)
        pre.events.wait("sent", 20, pre.stderr, room=A, chunk=1)
        killed = d1.kill9()
        d2.send(cmd="connect")
        connected = sc.ready(d2, "connected")
        assert connected["t"] - killed < PEER_TIMEOUT_S, "the successor spoke after the peer timeout: not the probe"
        # give the prefill every chance to write room A into the successor: its engine ends (refused, or all
        # chunks sent) and the room settles; then the successor, which asked for nothing yet, must hold
        # nothing but its canary
        pre.events.wait("engine-done", SETTLE_S, pre.stderr, room=A)
        pre.events.wait("safe", SETTLE_S, pre.stderr, room=A)
        _judge(pool2, DECODE2_BG)
        ended = [e for e in pre.events.find("status", room=A) if e["status"] in ("Failed", "Success")]
        assert ended and ended[0]["status"] == "Failed", f"the old room did not fail on the prefill: {ended}"
        took = ended[0]["t"] - killed
        _record("4 same-name restart", backend, restart_connected_after_kill_s=round(connected["t"] - killed, 3),
                time_to_failed_s=round(took, 3), reason=ended[0]["reason"][:100])
        assert took <= FAIL_BOUND_S, f"the prefill took {took:.2f} s to fail the old room"
        _never_success(pre, A)
        _recv(d2, B)
        _serve(pre, B)
        _success(d2, B, 20)
        _success(pre, B, 10)
        _judge(pool2, DECODE2_BG, exact=(B,))        # room B exact, the canary everywhere else (no room A data)
        _record("4 same-name restart", backend, old_room_bytes_in_new_process=0,
                new_room="Success, byte-exact; canary intact elsewhere",
                old_process_reference_bytes=_judge(pool1, DECODE_BG, partial=(A,)))
        sc.done.add("same-name restart")

    def test_kill_decode_mid_transfer(self, backend: str, world: Scenario) -> None:
        """Probe 2: the prefill room fails within the bound (peer timeout), the prefill lives on and serves
        a new decode process byte-exactly, and the dead peer's resources are released."""
        sc, (pre, _d1, d2, d3) = world, world.children
        _needs(sc, "same-name restart")
        pool2, pool3 = sc.pools["2"][0], sc.pools["3"][0]
        _recv(d2, C)
        _serve(pre, C, chunks=[[p] for p in ROOMS[C]["src"]], pace_s=1.0)
        pre.events.wait("sent", 20, pre.stderr, room=C, chunk=1)
        killed = d2.kill9()
        failed = pre.events.wait("status", FAIL_BOUND_S + 2, pre.stderr, room=C, status="Failed")
        took = failed["t"] - killed
        _record("2 kill -9 decode", backend, time_to_failed_s=round(took, 3), reason=failed["reason"][:90])
        assert took <= FAIL_BOUND_S, f"prefill took {took:.2f} s to fail the room (bound {FAIL_BOUND_S} s)"
        _never_success(pre, C)
        # no write of the room left in flight: the backend must have called the writes to the dead decode
        # done or failed (Mooncake retries its TCP connection with backoff first: 8 s was passed once at load ~10)
        safe = pre.events.wait("safe", 2 * SETTLE_S, pre.stderr, room=C)
        _record("2 kill -9 decode", backend, time_to_safe_s=round(safe["t"] - killed, 3))
        assert pre.alive(), f"the prefill died: {pre.stderr()}"
        d3.send(cmd="connect")
        sc.ready(d3, "connected")
        _recv(d3, D)
        _serve(pre, D)
        _success(d3, D, 20)
        _success(pre, D, 10)
        _judge(pool3, DECODE3_BG, exact=(D,))
        _judge(pool2, DECODE2_BG, exact=(B,), partial=(C,))
        sc.fds["decode-3 served"] = _ping(pre)["fds"]
        # dead decodes' peer records (sockets, mappings, caches) are released once no room refers to them
        deadline = time.monotonic() + 2 * PEER_TIMEOUT_S + SETTLE_S
        while (pong := _ping(pre))["peers"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        sc.fds["dead decodes released"] = pong["fds"]
        _record("2 kill -9 decode", backend, second_decode="Success, byte-exact", prefill_fds=dict(sc.fds),
                prefill_peers_left=pong["peers"])
        assert pong["peers"] == 1, f"the dead decodes' peer records were never released: {pong}"
        assert pre.alive()
        sc.done.add("kill decode")


# ============================================================================ scenario Z: bootstrap restart
def _link_republishes() -> bool:
    return "republish_s" in inspect.signature(ZmqLink).parameters


@pytest.mark.parametrize("backend", BACKENDS)
def test_bootstrap_restart(backend: str, tmp_path: Path) -> None:
    """Probe 5: the bootstrap server is killed -9 and started again at its address: a pair that shook hands
    keeps working, and a new decode finds the prefill (the link re-publishes)."""
    with _scenario(backend, tmp_path, "bootstrap restart", external_bootstrap=True) as sc:
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
        sc.spawn_bootstrap(address)
        restarted = time.monotonic()
        assert sc.bootstrap == address

        # a pair that shook hands before keeps working: the control plane is peer to peer
        _recv(d1, A)
        _serve(pre, A)
        _success(d1, A, 20)
        _success(pre, A, 10)
        _judge(pool1, DECODE_BG, exact=(A,))

        # a new decode must find the prefill at the restarted server: the prefill has to publish again
        d2.send(cmd="connect")
        try:
            connected = d2.events.wait("connected", bound + 5, d2.stderr)
        except AssertionError as exc:
            if not _link_republishes():
                pytest.xfail("ZmqLink does not re-publish a prefill's ranks to a restarted BootstrapServer (no "
                             f"republish_s / re-publish loop in kvbridge.zmq_link): {str(exc)[:200]}")
            raise
        assert _link_republishes(), ("a new decode found the prefill after the bootstrap restart although ZmqLink "
                                     "has no re-publish option: update this test (drop its xfail branch)")
        found = round(connected["t"] - restarted, 3)
        _record("5 bootstrap restart", backend, new_decode_connected_after_restart_s=found,
                live_pair="Success, byte-exact", republish_s=REPUBLISH_S)
        _recv(d2, B)
        _serve(pre, B)
        _success(d2, B, 20)
        _success(pre, B, 10)
        _judge(pool2, DECODE2_BG, exact=(B,))

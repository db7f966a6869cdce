"""Churn: one prefill process, many decode processes in turn (issue 12, "Resources").

Each decode process connects, runs one room to Success (every byte checked against the reference pattern
of :mod:`kvbridge.pattern`, independently of the agent), then leaves: even restarts close cleanly (Goodbye),
odd ones are killed with SIGKILL. After every restart the prefill process reports its descriptors, RSS,
/dev/shm mappings, peers and link queues; the test counts this run's /dev/shm segments. After a warm-up,
and again after the last restart, the test waits until departed peers are released (peer timeout, then
2 x peer timeout of linger) and compares: descriptors within +8, RSS within +32 MB, /dev/shm mappings and
segments back to the warm-up baseline, at most 2 peers.

The default run (CI) does 16 restarts per backend (11 after the warm-up: a descriptor leaked per restart
exceeds the +8 slack); ``KVBRIDGE_LONG_TESTS=1`` (set by ``.ci/long``) does 100.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
from _churnrig import Child, shm_segments

from kvbridge.registry import Registry
from kvbridge.testkit.pools import SHM_PREFIX
from kvbridge.zmq_link import BootstrapServer

pytestmark = pytest.mark.kvbridge_multiprocess

LONG = os.environ.get("KVBRIDGE_LONG_TESTS") == "1"
RESTARTS = int(os.environ.get("KVBRIDGE_CHURN_RESTARTS", "100" if LONG else "16"))
WARMUP = 5
PEER_TIMEOUT_S = 1.0
BOUND_S = 30.0
NUM_PAGES, REQUEST_PAGES = 12, 5          # kvbridge.testkit.kvmodel.NUM_PAGES; pages per room
FD_SLACK, RSS_SLACK = 8, 32 << 20
#: decode processes started ahead of their restart: a NIXL decode imports torch and NIXL (~4 CPU-s, 7-11 s on a
#: loaded 2-core host), more than a restart takes (~3 s), so one ahead left every other restart waiting for it
PREFETCH = 2
_AVAILABLE = Registry.build().backend_names()


def _quiesce(prefill: Child, started: float) -> tuple[dict[str, Any], float]:
    """Wait (bounded) until the prefill holds no peer; its stats and the wait. The bound: a departed peer is
    judged dead after the peer timeout (or a 1 s goodbye grace), released 2 x peer timeout later."""
    bound = PEER_TIMEOUT_S * 3 + 5.0
    while True:
        stats = prefill.ask("stats", 10)
        waited = time.monotonic() - started
        if stats["peers"] == 0 or waited > bound:
            return stats, waited
        time.sleep(0.1)


def _row(i: int, s: dict[str, Any]) -> str:
    return (f"{i:>4} fds {s['fds']:>4} {s['fd_kinds']} rss {s['rss'] / 2**20:7.1f} MB threads {s['threads']:>3} "
            f"shm-maps "
            f"{s['shm_maps']:>3} ({s['shm_mapped'] / 2**20:6.2f} MB) segs {s['segments']:>2} peers {s['peers']} "
            f"(alive {s['alive_peers']}) backend-peers {s['backend_peers']} link-queues {s['link_queues']} "
            f"plans {s['plan_slices']} windows {s['replay_windows']} rooms {s['rooms']}")


@pytest.mark.timeout(1500 if LONG else 600)
@pytest.mark.parametrize("backend", [
    "loopback", "nixl",
    # Mooncake's engine keeps 4 TCP sockets per departed peer (measured: +4 fds per restart) and its Python API
    # (mooncake.engine.TransferEngine) has no call that closes a connection or a segment; kvbridge releases its
    # own records of the peer (plugin peer entry, plan caches, link queue and socket). Fewer restarts suffice to
    # show it; strict, so the day the engine stops leaking this turns red and the mark goes.
    pytest.param("mooncake", marks=pytest.mark.xfail(strict=True, reason="mooncake.engine keeps 4 TCP sockets per "
                                                                          "departed peer and cannot close them")),
])
def test_decode_restarts_leave_the_prefill_flat(backend: str) -> None:
    if backend not in _AVAILABLE:
        pytest.skip(f"{backend}: the engine cannot be imported here")
    restarts = min(RESTARTS, 15) if backend == "mooncake" else RESTARTS
    server = BootstrapServer().start()
    children: list[Child] = []
    pids: set[int] = set()
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def spawn(label: str) -> Child:
        child = Child(label, backend=backend)      # imports the engine before "spawned": overlapped with a restart
        children.append(child)
        pids.add(child.pid)
        return child

    def stats() -> dict[str, Any]:
        s = prefill.ask("stats", 10)
        s["segments"] = shm_segments(SHM_PREFIX, pids)[0]
        return s

    try:
        prefill = spawn("prefill")
        prefill.wait("spawned", 60)
        common = {"backend": backend, "bootstrap": server.address, "peer_timeout_s": PEER_TIMEOUT_S,
                  "bound_s": BOUND_S}
        prefill.send(role="prefill", **common)
        prefill.wait("ready", 60)
        start = stats()
        print(f"\n[{backend}] churn: {restarts} decode restarts against one prefill process")
        print(_row(-1, start))
        baseline: dict[str, Any] | None = None
        upcoming = deque(spawn(f"decode-{i}") for i in range(min(PREFETCH, restarts)))
        for i in range(restarts):
            decode = upcoming.popleft()
            if i + PREFETCH < restarts:                 # they import while this one runs
                upcoming.append(spawn(f"decode-{i + PREFETCH}"))
            rng = np.random.default_rng([i, 0xC4])
            src = rng.permutation(NUM_PAGES)[:REQUEST_PAGES]
            dst = rng.permutation(NUM_PAGES)[:REQUEST_PAGES]
            positions = np.arange(REQUEST_PAGES)
            room, seed = 7000 + i, 1000 + i
            t_start = time.monotonic()
            decode.wait("spawned", 60)
            t_spawned = time.monotonic()
            decode.send(role="decode", room=room, seed=seed, dst=dst.tolist(), positions=positions.tolist(), **common)
            # the prefill opens the room once the decode's request is on its way (held as an early request): the
            # room's bootstrap clock must not run while a loaded host imports the decode's engine (it did, 30 s)
            decode.wait("ready", BOUND_S * 4)
            t_ready = time.monotonic()
            prefill.send(cmd="room", room=room, seed=seed, src=src.tolist(), positions=positions.tolist())
            result = decode.wait("result", BOUND_S + 10)
            assert not result["problems"], f"restart {i}: wrong bytes:\n  " + "\n  ".join(result["problems"])
            sent = prefill.wait("room", BOUND_S * 2 + 10)
            assert sent["status"] == "Success" and sent["safe"], f"restart {i}: prefill room {sent}"
            assert decode.wait("done", BOUND_S + 10)["safe"], f"restart {i}: decode room never safe to reuse"
            t_done = time.monotonic()
            if i % 2 == 0:
                decode.send(cmd="close")
                assert decode.close(15) == 0, f"restart {i}: decode did not exit cleanly:\n{decode.stderr()}"
            else:
                decode.kill9()
            decode.kill()                                         # reaps a killed process's segments
            sample = stats()
            samples.append(sample)
            t_left = time.monotonic()
            print(_row(i, sample) + f" | s: start {t_spawned - t_start:.1f} agent+connect {t_ready - t_spawned:.1f} "
                  f"room {t_done - t_ready:.1f} leave {t_left - t_done:.1f}", flush=True)
            if i + 1 == WARMUP:
                baseline, waited = _quiesce(prefill, time.monotonic())
                baseline["segments"] = shm_segments(SHM_PREFIX, pids)[0]
                print(f"baseline after {WARMUP} restarts (peers released in {waited:.1f} s):\n" + _row(i, baseline))
        assert baseline is not None
        final, waited = _quiesce(prefill, time.monotonic())
        final["segments"] = shm_segments(SHM_PREFIX, pids)[0]
        took = time.monotonic() - t0
        print(f"final after {restarts} restarts (peers released in {waited:.1f} s), {took:.1f} s in all:\n"
              + _row(restarts - 1, final))
        after = samples[WARMUP:]
        if len(after) > 2:
            x = np.arange(len(after))
            fd_slope = np.polyfit(x, [s["fds"] for s in after], 1)[0]
            rss_slope = np.polyfit(x, [s["rss"] for s in after], 1)[0] / 2**10
            print(f"slope after warm-up: {fd_slope:+.3f} fds/restart, {rss_slope:+.1f} KiB RSS/restart")
        problems = []
        if final["fds"] > baseline["fds"] + FD_SLACK:
            problems.append(f"fds {baseline['fds']} -> {final['fds']} ({final['fd_kinds']} was "
                            f"{baseline['fd_kinds']})")
        if final["rss"] > baseline["rss"] + RSS_SLACK:
            problems.append(f"RSS {baseline['rss'] / 2**20:.1f} -> {final['rss'] / 2**20:.1f} MB")
        if final["shm_mapped"] > baseline["shm_mapped"] or final["shm_maps"] > baseline["shm_maps"]:
            problems.append(f"/dev/shm mappings {baseline['shm_maps']} ({baseline['shm_mapped']} B) -> "
                            f"{final['shm_maps']} ({final['shm_mapped']} B)")
        if final["segments"] > baseline["segments"]:
            problems.append(f"/dev/shm segments of this run {baseline['segments']} -> {final['segments']}")
        if final["peers"] > 2:
            problems.append(f"{final['peers']} peers still held {waited:.1f} s after the last decode left")
        for key in ("link_queues", "backend_peers", "plan_slices", "rooms", "early"):
            if final[key] > max(2, baseline[key]):
                problems.append(f"{key} {baseline[key]} -> {final[key]}")
        assert not problems, f"[{backend}] after {restarts} restarts: " + "; ".join(problems)
        prefill.send(cmd="exit")
        assert prefill.close(15) == 0, f"the prefill process did not exit cleanly:\n{prefill.stderr()}"
    finally:
        for child in children:
            child.kill()
        server.close()
    assert shm_segments(SHM_PREFIX, pids)[0] == 0

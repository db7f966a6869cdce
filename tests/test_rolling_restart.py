"""A rolling restart under steady load loses no request (issue 26, item 3), over each real backend.

Two prefill instances (``pA``, ``pB``: one rank each, child processes of ``tests/_rollingrig.py``) and a
decode rank (this process, its pool in /dev/shm) behind one bootstrap server; requests run back to back,
alternating between the instances, every byte checked against :mod:`kvbridge.pattern`'s reference. Each
instance in turn is stopped the way an orchestrator stops an engine, with SIGTERM:

1. a request is routed to it and the SIGTERM lands while that room is in flight (the prefill holds its send
   for 0.6 s): the draining process must finish it (Success, byte-exact);
2. the next request is routed to it after it began draining: it must be refused with a reason naming the
   drain, on both sides (``Draining`` for its engine, a failed decode room naming it for ours), so the router
   sends it to the other instance (a re-route, not a failure);
3. the process exits 0 on its own, its peers told (Goodbye); a replacement starts under the same instance and
   agent name (a new incarnation), the decode connects to it again, and requests go to it again.

Asserted: every request Success and byte-exact, 0 failed, every decode room safe to reuse; each drain's
report has nothing failed or unsafe. Printed: the drain time, the restart-to-first-Success time per backend.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _churnrig import Child

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.testkit.kvmodel import NUM_PAGES, KVPool
from kvbridge.testkit.pools import GuardedBuffer
from kvbridge.zmq_link import BootstrapServer, ZmqLink

pytestmark = pytest.mark.kvbridge_multiprocess

RIG = Path(__file__).resolve().parent / "_rollingrig.py"
PEER_TIMEOUT_S = 3.0
BOUND_S = 30.0
REQUEST_PAGES = 5
STEADY = 3                      # requests between two restarts
_AVAILABLE = Registry.build().backend_names()


class Prefill:
    """One prefill instance's process (restartable under the same instance and agent name)."""

    def __init__(self, instance: str, job: dict[str, Any]) -> None:
        self.instance, self.job = instance, job
        self.generation = 0
        self.child = self._spawn()

    def _spawn(self) -> Child:
        child = Child(f"{self.instance}-{self.generation}", RIG)
        child.wait("spawned", 60)
        child.send(instance=self.instance, **self.job)
        child.wait("ready", 60)
        return child

    def restart(self) -> float:
        self.child.kill()
        self.generation += 1
        started = time.monotonic()
        self.child = self._spawn()
        return time.monotonic() - started


class Decode:
    """The decode rank (this process) and the router in front of it."""

    def __init__(self, backend: str, bootstrap: str) -> None:
        self.pool = KVPool(1, 0, memory="shm", role="decode")
        self.staging = GuardedBuffer(1 << 20, memory="shm")
        config = AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=PEER_TIMEOUT_S, bootstrap_timeout_s=BOUND_S,
                             waiting_timeout_s=BOUND_S, staging_bytes=1 << 20)
        self.agent = TransferAgent(layout=self.pool.layout, buffers=self.pool.arrays(), role=Role.DECODE,
                                   link=ZmqLink(bootstrap=bootstrap), backend=backend, name="rolling-decode",
                                   config=config, staging=self.staging.data)
        self.agent.start()
        self.next_room = 100
        self.log: list[tuple[int, str, str, str]] = []         # (room, instance, outcome, reason)

    def start(self, prefill: Prefill, *, delay_s: float = 0.0) -> dict[str, Any]:
        """Route one request to ``prefill``: the prefill's room command, then the decode's request."""
        room, self.next_room = self.next_room, self.next_room + 1
        rng = np.random.default_rng([room, 0x5E])
        src, dst = rng.permutation(NUM_PAGES)[:REQUEST_PAGES], rng.permutation(NUM_PAGES)[:REQUEST_PAGES]
        positions, seed = np.arange(REQUEST_PAGES), 5000 + room
        self.pool.fill(seed, 200)
        prefill.child.send(cmd="room", room=room, seed=seed, src=src.tolist(), positions=positions.tolist(),
                           delay_s=delay_s)
        receiver = self.agent.receiver(room, prefill.instance)
        receiver.send_metadata({k.name: dst for k in self.pool.kinds})
        return {"room": room, "seed": seed, "dst": dst, "positions": positions, "receiver": receiver,
                "prefill": prefill}

    def finish(self, request: dict[str, Any]) -> str:
        """Wait for the request: ``"ok"`` (byte-exact), or ``"draining"`` (refused by a draining prefill: the
        router may send it elsewhere); anything else fails the test."""
        receiver, prefill, room = request["receiver"], request["prefill"], request["room"]
        deadline = time.monotonic() + BOUND_S
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.002)
        status, reason, nbytes = receiver.poll(), receiver.failure_reason or "", receiver.nbytes
        sent = prefill.child.wait("room", BOUND_S * 2, room=room)
        while not receiver.safe_to_reuse and time.monotonic() < deadline + BOUND_S:
            time.sleep(0.002)
        assert receiver.safe_to_reuse, f"room {room}: never safe to reuse ({status.name}: {reason})"
        receiver.clear()
        if status is KVPoll.Failed and "draining" in reason and sent["status"] == "Refused":
            assert "draining" in sent["reason"], sent
            self.log.append((room, prefill.instance, "re-routed", reason))
            return "draining"
        assert status is KVPoll.Success, f"room {room} on {prefill.instance}: {status.name} ({reason}); prefill {sent}"
        assert sent["status"] == "Success" and sent["safe"], f"room {room}: prefill side {sent}"
        problems = self.pool.check(request["seed"], 200, request["dst"], request["positions"])
        assert nbytes == self.pool.expected_nbytes(REQUEST_PAGES), f"room {room}: counted {nbytes} bytes"
        assert not problems, f"room {room} on {prefill.instance}: wrong bytes:\n  " + "\n  ".join(problems[:10])
        self.log.append((room, prefill.instance, "ok", ""))
        return "ok"

    def run(self, prefill: Prefill, fallback: Prefill) -> None:
        """One request to ``prefill``; re-routed to ``fallback`` if ``prefill`` refuses it for draining."""
        if self.finish(self.start(prefill)) == "draining":
            assert self.finish(self.start(fallback)) == "ok"

    def close(self) -> None:
        self.agent.close()
        self.staging.close()
        self.pool.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["loopback", "nixl", "mooncake"])
def test_a_rolling_restart_of_every_prefill_under_load_fails_no_request(backend: str) -> None:
    if backend not in _AVAILABLE:
        pytest.skip(f"{backend}: the engine cannot be imported here")
    server = BootstrapServer().start()
    job = {"backend": backend, "bootstrap": server.address, "peer_timeout_s": PEER_TIMEOUT_S, "bound_s": BOUND_S,
           "drain_timeout_s": 20.0}
    prefills: list[Prefill] = []
    decode: Decode | None = None
    measured: list[str] = []
    try:
        prefills = [Prefill("pA", job), Prefill("pB", job)]
        decode = Decode(backend, server.address)
        for p in prefills:
            decode.agent.connect(p.instance, timeout_s=BOUND_S)
        for stopping, other in [(prefills[0], prefills[1]), (prefills[1], prefills[0])]:
            for k in range(STEADY):                                           # steady load on both
                decode.run(prefills[k % 2], prefills[(k + 1) % 2])
            in_flight = decode.start(stopping, delay_s=0.6)                 # 1. SIGTERM while a room is in flight
            time.sleep(0.2)
            stopped = time.monotonic()
            os.kill(stopping.child.pid, signal.SIGTERM)
            stopping.child.wait("draining", BOUND_S)
            refused = decode.start(stopping)                                  # 2. routed to it while it drains
            assert decode.finish(in_flight) == "ok", "the room in flight when SIGTERM came did not finish"
            assert decode.finish(refused) == "draining", "a draining prefill took a new room"
            decode.run(other, other)                                          # ... its re-route
            drained = stopping.child.wait("drained", BOUND_S)
            assert drained["report"]["failed"] == 0 and drained["report"]["unsafe"] == 0, drained
            rc = stopping.child.close(BOUND_S)
            assert rc == 0, f"{stopping.instance} did not exit 0 ({rc}):\n{stopping.child.stderr()}"
            exited = time.monotonic() - stopped
            decode.run(other, other)                                          # load goes on meanwhile
            started = stopping.restart()                                      # 3. same names, new incarnation
            back = time.monotonic()
            decode.agent.connect(stopping.instance, timeout_s=BOUND_S)
            decode.run(stopping, other)
            assert decode.log[-1][1] == stopping.instance, f"the restarted {stopping.instance} took no request"
            first = time.monotonic() - back
            measured.append(f"{stopping.instance}: drained in {drained['took']:.2f} s, exited {exited:.2f} s after "
                            f"SIGTERM, replacement up in {started:.2f} s, first Success {first:.2f} s after it was up")
        for k in range(STEADY):
            decode.run(prefills[k % 2], prefills[(k + 1) % 2])
        outcomes = [outcome for _, _, outcome, _ in decode.log]
        print(f"\n[{backend}] rolling restart: {outcomes.count('ok')} requests byte-exact, "
              f"{outcomes.count('re-routed')} re-routed from a draining prefill, 0 failed")
        for line in measured:
            print(f"  {line}")
        assert outcomes.count("re-routed") == 2 and outcomes.count("ok") == 2 * (STEADY + 4) + STEADY
    finally:
        if decode is not None:
            decode.close()
        for p in prefills:
            p.child.kill()
        server.close()

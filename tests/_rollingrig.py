"""The rolling-restart rig: a prefill instance of one rank in a child process that drains on SIGTERM.

``python tests/_rollingrig.py`` imports kvbridge, says ``spawned`` and reads its job (one JSON line on stdin):
``{"instance", "backend", "bootstrap", "peer_timeout_s", "bound_s", "drain_timeout_s"}``. It starts a 1-rank
prefill agent of that instance (host-memory :class:`kvbridge.testkit.kvmodel.KVPool`) and says ``ready``.
Every later stdin line is a command, each run in its own thread:

- ``room`` (``room``, ``seed``, ``src``, ``positions``, ``delay_s``): ``sender()`` first (a draining agent
  raises :class:`kvbridge.Draining`: answered ``room`` with status ``Refused`` and the reason), then fill the
  request's pages with the reference pattern, wait for the decode's request, wait ``delay_s`` (so a test can
  stop the process mid-room), send two chunks, wait for Success and ``safe_to_reuse``, clear; answers ``room``.

On SIGTERM the process does what an engine's shutdown does: ``begin_drain`` (says ``draining``; new rooms are
refused from then on), lets the rooms it accepted finish, then ``drain()`` with what is left of
``drain_timeout_s`` (fails anything still open, closes the agent: its peers hear a Goodbye), says ``drained``
with the report and how long it took, and exits 0.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _churnrig import _say, _wait, run_job


def _room(agent: Any, pool: Any, cmd: dict[str, Any], bound_s: float, fill_lock: threading.Lock) -> None:
    import numpy as np

    from kvbridge.errors import Draining
    from kvbridge.protocol.wire import KVPoll

    started = time.monotonic()
    try:
        sender = agent.sender(cmd["room"])
    except Draining as exc:
        _say("room", room=cmd["room"], status="Refused", reason=str(exc), safe=True, took=0.0)
        return
    src, positions = np.array(cmd["src"], np.int64), np.array(cmd["positions"], np.int64)
    with fill_lock:                      # the test keeps at most one accepted room in flight per instance
        pool.fill(cmd["seed"], 100, src, positions)
    reason = ""
    if not _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, bound_s):
        reason = f"no request: {sender.poll().name} {sender.failure_reason}"
    elif sender.poll() is not KVPoll.Failed:
        time.sleep(float(cmd.get("delay_s", 0.0)))
        half = max(1, len(src) // 2)
        sender.send(src[:half])
        sender.send(src[half:], last=True)
        _wait(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), bound_s)
    status, reason = sender.poll().name, reason or sender.failure_reason
    safe = _wait(lambda: sender.safe_to_reuse, bound_s)
    if safe:
        sender.clear()
    _say("room", room=cmd["room"], status=status, reason=reason, safe=safe, took=time.monotonic() - started)


def _prefill(job: dict[str, Any]) -> None:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.zmq_link import ZmqLink

    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    pool = KVPool(1, 0, role="prefill")
    config = AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=job["peer_timeout_s"],
                         bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["bound_s"], staging_bytes=1 << 20)
    agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL,
                          link=ZmqLink(bootstrap=job["bootstrap"]), backend=job["backend"], instance=job["instance"],
                          name=f"rolling-{job['instance']}", config=config)   # the same name after a restart
    agent.start()
    fill_lock = threading.Lock()
    rooms: list[threading.Thread] = []

    def commands() -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "room":
                thread = threading.Thread(target=_room, args=(agent, pool, cmd, job["bound_s"], fill_lock), daemon=True)
                rooms.append(thread)
                thread.start()
        term.set()                                   # stdin closed: the test is gone, shut down the same way

    threading.Thread(target=commands, daemon=True).start()
    _say("ready")
    try:
        term.wait()
        started = time.monotonic()
        agent.begin_drain("SIGTERM")
        _say("draining")
        deadline = started + job["drain_timeout_s"]
        for thread in list(rooms):                   # the engine finishes (sends, polls, clears) what it has
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        report = agent.drain(max(0.0, deadline - time.monotonic()), "SIGTERM")   # fails what is left; closes
        _say("drained", report=report, took=time.monotonic() - started)
    finally:
        agent.close()       # closes its link too: the decode hears a Goodbye
        pool.close()


def _main() -> int:
    return run_job(_prefill)


if __name__ == "__main__":
    sys.exit(_main())

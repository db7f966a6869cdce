"""The goodbye rig: a child process that starts a fresh one-rank prefill agent per room, serves that one room
and closes the agent the moment the room is Success (its last write done locally), as a prefill whose engine
stops right after its last request does (issue 26: its Goodbye overtook the backend's notice).

``python tests/_goodbyerig.py`` says ``spawned`` and reads its job (one JSON line on stdin):
``{"backend", "bootstrap", "peer_timeout_s", "bound_s", "resend"}`` (``resend: false`` turns the fix off, to
measure the race it closes; never in a test). Every later line is a ``room`` command (``instance``, ``room``,
``seed``, ``src``, ``positions``): start a prefill agent of that instance (says ``up``), fill its pages with the
reference pattern, wait for the decode's request, send every page in one chunk, wait for Success, close at
once, and answer ``room`` with the status, how long the close took and how many notices it sent again.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _churnrig import _say, _wait, run_job


def _one_room(agent: Any, pool: Any, cmd: dict[str, Any], bound_s: float) -> tuple[str, str]:
    """Serve one room to its Success (or failure); (status, reason)."""
    import numpy as np

    from kvbridge.protocol.wire import KVPoll

    sender = agent.sender(cmd["room"])
    src, positions = np.array(cmd["src"], np.int64), np.array(cmd["positions"], np.int64)
    pool.fill(cmd["seed"], 100, src, positions)
    _say("up", room=cmd["room"])
    if not _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, bound_s):
        return sender.poll().name, f"no request: {sender.poll().name} {sender.failure_reason}"
    sender.send(src, last=True)
    _wait(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), bound_s)
    return sender.poll().name, sender.failure_reason


def _serve(job: dict[str, Any]) -> None:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.agent.prefill import PrefillSide
    from kvbridge.protocol.wire import Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.zmq_link import ZmqLink

    if not job.get("resend", True):
        PrefillSide.resend_unconfirmed = lambda self: 0      # type: ignore[method-assign]  # the race, measured
    pool = KVPool(1, 0, role="prefill")
    config = AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=job["peer_timeout_s"],
                         bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["bound_s"], staging_bytes=0)
    from kvbridge.registry import Registry

    Registry.build().create_backend(job["backend"], name="warm-up", options={}).close()   # its imports (NIXL: torch)
    _say("ready")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            faulthandler.dump_traceback_later(job["bound_s"] * 0.9)     # a stuck room shows where, on stderr
            agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL,
                                  link=ZmqLink(bootstrap=job["bootstrap"]), backend=job["backend"],
                                  instance=cmd["instance"], config=config)
            try:
                agent.start()
                status, reason = _one_room(agent, pool, cmd, job["bound_s"])
                kept = agent.prefill.unconfirmed if agent.prefill is not None else 0
            finally:
                started = time.monotonic()
                agent.close()                           # at once: no wait for the decode
                took = time.monotonic() - started
            faulthandler.cancel_dump_traceback_later()
            _say("room", room=cmd["room"], status=status, reason=reason, close_s=took, again=kept)
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(run_job(_serve))

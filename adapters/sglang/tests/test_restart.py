"""Adversarial: a prefill server SIGKILLed mid-transfer and started again at the same bootstrap host:port (same or
another TP size), and a decode SIGKILLed and started again while the prefill runs. SGLang's classes drive the
adapter in real rank processes (``adversary_driver.py``); every byte a decode receives is checked.

What must hold: the requests in flight fail (SGLang's loop sees Failed with a reason, never a hang); the running
decode finds the new prefill server within the topology recheck interval without being restarted or told,
including requests it opened while the prefill was dead or before it noticed the restart; every later request
succeeds byte for byte; nothing lands outside the pages the requests own.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import _rig
import pytest
from _rig import Run, need_sglang
from test_adversary_faults import _victim

from kvbridge.settings import Settings
from kvbridge_sglang import bootstrap

DRV = Path(__file__).with_name("adversary_driver.py")
ENV = {"KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "40", "KVBRIDGE_WAITING_TIMEOUT_S": "30", "KVBRIDGE_TOPOLOGY_RECHECK_S": "1"}
RECHECK_S = 1.0
PEER_TIMEOUT_S = 3.0            # _rig.BASE_ENV
DEC, PRE = ("decode", 0, 0, 0), ("prefill", 0, 0, 0)


def scenario(**kw: Any) -> dict[str, Any]:
    base = {"seed": 5, "page": 4, "layers": 2, "heads": 4, "head_bytes": 8, "pool_pages": 128, "requests": 7,
            "max_len": 33, "min_len": 17, "prefix_prob": 0.0, "aux_slots": 16, "aux_bytes": [64, 64],
            "timeout": 240, "prefill": {"tp": 1}, "decode": {"tp": 1}, "prefill_hold_s": 3.0, "phase_timeout": 60,
            "safe_wait_s": 20}
    base.update(kw)
    return base


def _wait(run: Run, key: Any, pred: Any, timeout_s: float) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        res = run.result(key)
        if pred(res) or run.procs[key].poll() is not None:
            return run.result(key)
        time.sleep(0.1)
    return run.result(key)


def _topology_complete(addr: str, ranks: int, timeout_s: float, secret: bytes | None) -> float:
    """Wait until the prefill server at ``addr`` answers with all its ``ranks``; the time it did."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if len(bootstrap.fetch(addr, secret=secret, timeout_s=1.0).get("ranks") or []) == ranks:
                return time.time()
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the restarted prefill at {addr} never registered its {ranks} ranks")


@pytest.mark.parametrize(("opened", "secret", "new"), [
    ("while_dead", "sglang-restart-secret-0123456789ab", {"tp": 2}),
    ("after_restart", "", {"tp": 1, "pp": 2}),
], ids=["while_dead-secret-tp2", "after_restart-pp2"])
def test_prefill_restarted_at_same_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: str,
                                           secret: str, new: dict[str, int]) -> None:
    """Prefill TP 1 is SIGKILLed about to send chunk 1 of a request; a new prefill server with another topology
    (TP 2, or PP 2: two agents per decode rank instead of one) starts at the same bootstrap host:port. The
    running decode (TP 1, never restarted, no call but SGLang's) fails the requests of the dead server with a
    reason, then serves the next requests from the new server byte for byte: opened while the prefill was dead
    (with a secret: the rechecks are sealed), or right after it came back (before the decode could have
    noticed). The old server's agents are closed once idle."""
    need_sglang()
    monkeypatch.setattr(_rig, "DRIVER", DRV)
    base = scenario()
    victim = _victim(base, range(1, 4))
    sc = scenario(adv={"phase2": 3, "watch_s": 2.0,
                       "die": {"pp": 0, "tp": 0, "k": victim, "chunk": 1, "how": "kill", "gen": 1}})
    env = dict(ENV, KVBRIDGE_SECRET=secret) if secret else ENV
    run = Run(sc, tmp_path, env=env)
    addr = f"127.0.0.1:{run.sc['port']}"
    go = Path(str(run.results[DEC]) + ".go")
    try:
        dec = _wait(run, DEC, lambda res: res.get("phase1_done"), 150)
        assert dec.get("phase1_done"), f"phase 1 never ended\n{run.log(DEC)}\n{run.log(PRE)}"
        died = run.result(PRE).get("died")
        assert died, f"the prefill did not die where planned\n{run.log(PRE)}"
        assert run.procs[PRE].wait(30) == -signal.SIGKILL or run.procs[PRE].poll() is not None
        if opened == "while_dead":
            go.touch()
            time.sleep(1.0)           # the decode opens the phase-2 rooms while nothing serves the address
        sc2 = dict(run.sc, gen=2, prefill=new)
        restarted = [run.add("prefill2", "prefill", 0, pp, tp, sc2, env=env)
                     for pp in range(new.get("pp", 1)) for tp in range(new["tp"])]
        # without a configured secret the ranks seal with this host's local secret file (kvbridge.local_secret)
        sealing = secret or Settings().with_local_secret(addr, env={**os.environ, **env}).secret
        ready_at = _topology_complete(addr, len(restarted), 150, sealing.encode() or None)
        if opened == "after_restart":
            go.touch()
        results = run.wait(240)
    finally:
        run.kill()
    dec = results[DEC]
    assert dec.get("done"), f"{dec.get('exception')}\n{run.log(DEC)}"
    assert not dec["raised"], dec["raised"]
    assert not dec["errors"], dec["errors"][:10]
    assert not dec["late"], f"writes landed after is_abort_release_safe: {dec['late']}"
    status = dec["status"]
    # phase 1: the victim fails with a reason within the peer timeout; nothing hangs
    k = str(victim)
    assert status.get(k, "").startswith("failed") and dec["failed"][k], (status, dec["failed"])
    assert dec["failed_at"][k] - died["at"] < PEER_TIMEOUT_S + 3.0, (dec["failed_at"][k] - died["at"])
    for j in range(4):
        assert status.get(str(j), "") == "success" or status.get(str(j), "").startswith("failed"), (j, status)
    assert victim in dec["safe"], f"the dead writer's room never turned release-safe: {dec['unsafe']}"
    # phase 2: every request served by the new server, byte for byte (the driver verified them)
    assert sorted(dec["verified"])[-3:] == [4, 5, 6] and all(status[str(j)] == "success" for j in (4, 5, 6)), (
        status, dec["failed"], run.log(DEC))
    first = min(dec["success_at"][str(j)] for j in (4, 5, 6))
    found_s = first - max(ready_at, go.stat().st_mtime)
    print(json.dumps({"opened": opened, "new": new, "found_after_s": round(found_s, 2),
                      "victim_failed_after_s": round(dec["failed_at"][k] - died["at"], 2)}))
    assert found_s < RECHECK_S + 4.0, f"the new prefill server was found {found_s:.1f} s after it was up"
    assert dec["restarts"] == 1 and dec["retired_open"] == 0, (dec["restarts"], dec["retired_open"])
    for key in restarted:
        res = results[key]
        assert res.get("done") and not res.get("raised"), f"{key}: {res.get('exception')} {res.get('raised')}"
        assert sorted(res["sent"]) == [4, 5, 6], (key, res)


def test_decode_restarted_while_prefill_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode SIGKILLs itself 0.5 s after asking for request 2, while the prefill's forward pass for it runs
    past the peer timeout; a new decode process starts (new agents, same pool layout) and asks for requests
    3..5 from the same, never restarted, prefill. The prefill fails request 2 with a reason (not a hang), keeps
    serving, and the new decode gets every byte of 3..5."""
    need_sglang()
    monkeypatch.setattr(_rig, "DRIVER", DRV)
    sc = scenario(requests=6, adv={"phase2": 3, "serve_all": True, "dec_die": {"k": 2, "gen": 1, "after_s": 0.5},
                                   "pre_delay": {"2": PEER_TIMEOUT_S + 2.0}}, prefill_hold_s=2.0)
    run = Run(sc, tmp_path, env=ENV)
    try:
        dec1 = _wait(run, DEC, lambda res: res.get("died"), 150)
        assert dec1.get("died"), f"the decode did not die where planned\n{run.log(DEC)}"
        run.procs[DEC].wait(30)
        dec2_key = run.add("decode2", "decode", 0, 0, 0, dict(run.sc, gen=2), env=ENV)
        results = run.wait(240)
    finally:
        run.kill()
    pre, dec2 = results[PRE], results[dec2_key]
    assert pre.get("done") and not pre.get("raised"), f"{pre.get('exception')} {pre.get('raised')}\n{run.log(PRE)}"
    assert not pre.get("unfinished"), pre
    for k in (0, 1):          # finished before the decode died, or failed with it (the prefill waited on request 2)
        assert k in pre["sent"] or pre["failed"].get(str(k)), (k, pre["sent"], pre["failed"])
    assert "2" in pre["failed"] and "gone" in pre["failed"]["2"], (pre["sent"], pre["failed"])
    assert {3, 4, 5} <= set(pre["sent"]), (pre["sent"], pre["failed"])
    assert dec2.get("done"), f"{dec2.get('exception')}\n{run.log(dec2_key)}"
    assert not dec2["raised"] and not dec2["errors"], (dec2["raised"], dec2["errors"][:10])
    assert sorted(dec2["verified"]) == [3, 4, 5], (dec2["status"], dec2["failed"])
    print(json.dumps({"prefill_failed_2": pre["failed"]["2"][:160]}))

"""Adversarial: a prefill rank SIGKILLed / SIGSTOPped mid-transfer, one PP stage killed (a prefill server restarted
at the same bootstrap address: test_restart.py)."""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path
from typing import Any

import _rig
import pytest
from _rig import Run, need_sglang

DRV = Path(__file__).with_name("adversary_driver.py")
ENV = {"KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "40", "KVBRIDGE_WAITING_TIMEOUT_S": "30"}


def scenario(**kw: Any) -> dict[str, Any]:
    base = {"seed": 5, "page": 4, "layers": 2, "heads": 4, "head_bytes": 8, "pool_pages": 128, "requests": 4,
            "max_len": 33, "min_len": 17, "prefix_prob": 0.0, "aux_slots": 16, "aux_bytes": [64, 64],
            "timeout": 200, "prefill": {"tp": 1}, "decode": {"tp": 1}, "prefill_hold_s": 2.0, "phase_timeout": 70,
            "safe_wait_s": 60}
    base.update(kw)
    return base


def _requests(sc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("_d", Path(__file__).with_name("sglang_driver.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out: list[dict[str, Any]] = mod.requests(dict(sc, port=0))
    return out


def _victim(sc: dict[str, Any], among: range) -> int:
    """A request of ``among`` with at least two chunks (so dying at chunk 1 is mid-transfer)."""
    for r in _requests(sc):
        if r["k"] in among and len(r["cuts"]) >= 1:
            return int(r["k"])
    raise AssertionError("no multi-chunk request; change the seed")


def _wait(run: Run, key: Any, pred: Any, timeout_s: float) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        res = run.result(key)
        if pred(res):
            return res
        if run.procs[key].poll() is not None:
            break
        time.sleep(0.25)
    return run.result(key)


DEC, PRE = ("decode", 0, 0, 0), ("prefill", 0, 0, 0)


def _stopping_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> tuple[Run, int]:
    """Four requests; the prefill stops itself (SIGSTOP) at chunk 1 of a multi-chunk one, the victim."""
    need_sglang()
    monkeypatch.setattr(_rig, "DRIVER", DRV)
    victim = _victim(scenario(requests=4), range(0, 4))
    sc = scenario(requests=4, adv={"watch_s": 6.0, "die": {"pp": 0, "tp": 0, "k": victim, "chunk": 1, "how": "stop"}})
    return Run(sc, tmp_path, env={**ENV, **env}), victim


def test_prefill_sigstop_past_timeout_then_sigcont(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill stops mid-request past the peer timeout, then continues: decode has failed the room with a
    reason, is_abort_release_safe is False while the writer is stopped, turns True once it quiesced, and from
    then on the room's destination pages stay unchanged."""
    # SGLang's heartbeat must not judge the stopped server gone here (the next test): only the writer's
    # acknowledgement after SIGCONT can fence the room
    run, victim = _stopping_run(tmp_path, monkeypatch, {"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000"})
    k = str(victim)
    try:
        dec = _wait(run, DEC, lambda res: k in res.get("failed", {}), 150)
        assert k in dec.get("failed", {}), f"decode never failed the stopped room\n{run.log(DEC)}\n{run.log(PRE)}"
        assert dec["safe_at_fail"][k] is False, dec
        time.sleep(2.0)
        assert victim not in run.result(DEC).get("safe", []), "safe while the writer is stopped"
        run.signal(PRE, signal.SIGCONT)
        results = run.wait(200)
    finally:
        run.kill()
    dec, pre = results[DEC], results[PRE]
    assert pre.get("resumed_at"), run.log(PRE)
    assert dec.get("done"), dec.get("exception")
    assert victim in dec["safe"], f"never release-safe after the writer resumed: {dec}"
    assert dec["safe_at"][k] > pre["resumed_at"] - 0.5 or dec["safe_at"][k] > dec["failed_at"][k] + 2.0
    assert not dec["late"], f"writes landed after is_abort_release_safe: {dec['late']}"
    assert not dec["errors"], dec["errors"][:10]
    others = [r for r in range(4) if r != victim and dec["status"].get(str(r)) == "success"]
    assert not dec["raised"], dec["raised"]
    assert dec["status"].get(k, "").startswith("failed")
    _ = others


def test_a_prefill_stopped_past_its_lease_with_its_server_unreachable_is_declared_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's heartbeat judgement: the prefill process (its bootstrap server with it) stops mid-request; after
    two failed topology fetches and once the rank was silent past its write lease (twice the 3 s peer timeout),
    the adapter declares it gone and the room is release-safe while it is still stopped, never before the
    lease ran out. After SIGCONT the writer's own lease has run out: not one byte changes in the room's pages."""
    run, victim = _stopping_run(tmp_path, monkeypatch, {"KVBRIDGE_TOPOLOGY_RECHECK_S": "0.5"})
    k = str(victim)
    try:
        dec = _wait(run, DEC, lambda res: victim in res.get("safe", []), 60)
        assert victim in dec.get("safe", []), f"never release-safe while stopped\n{run.log(DEC)}\n{run.log(PRE)}"
        assert dec["safe_at"][k] - dec["failed_at"][k] >= 6.0 - 3.0 - 0.5, "safe before the writer's lease ran out"
        assert "declared gone" in run.log(DEC), run.log(DEC)
        time.sleep(0.5)
        run.signal(PRE, signal.SIGCONT)
        results = run.wait(200)
    finally:
        run.kill()
    dec, pre = results[DEC], results[PRE]
    assert pre.get("resumed_at"), run.log(PRE)
    assert dec.get("done"), dec.get("exception")
    assert not dec["late"], f"writes landed after is_abort_release_safe: {dec['late']}"
    assert dec["status"].get(k, "").startswith("failed")
    assert not dec["raised"], dec["raised"]


@pytest.mark.parametrize("stage", [0, 1])
def test_pp_stage_killed_fails_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """Prefill PP 2 (TP 1) -> decode PP 1: one stage is SIGKILLed before it sends any chunk of request k while
    the other stage sends all of it: the decode request fails (never Success with one stage's layers missing)."""
    need_sglang()
    monkeypatch.setattr(_rig, "DRIVER", DRV)
    sc = scenario(requests=3, layers=4, prefill={"tp": 1, "pp": 2},
                  adv={"watch_s": 2.0, "die": {"pp": stage, "tp": 0, "k": 1, "chunk": 0, "how": "kill"}})
    run = Run(sc, tmp_path, env=ENV)
    try:
        results = run.wait(250)
    finally:
        run.kill()
    dec = results[DEC]
    assert dec.get("done"), f"{dec.get('exception')}\n{run.log(DEC)}"
    assert results[("prefill", 0, stage, 0)].get("died"), run.log(("prefill", 0, stage, 0))
    assert dec["status"].get("1", "").startswith("failed"), (dec["status"], dec["failed"], dec["errors"][:5])
    assert dec["failed"]["1"]
    assert not dec["late"], dec["late"]

"""Adversarial: bad input from SGLang's scheduler / a client fails only that request, with the reason.

Each request k of the scenario gets one bad argument on one side; controls next to them must verify byte for
byte; no adapter call may raise out into the scheduler (except failure_exception); no byte lands outside the
pages / slots the requests own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _rig
import pytest
from _rig import Run, need_sglang

DRV = Path(__file__).with_name("adversary_driver.py")
AUX = [64, 64]
MAMBA = {"type": "mamba", "groups": [8, 8, 16], "kernel": 4, "ssm_heads": 4, "ssm_bytes": 16, "slots": 32,
         "layers": [0, 1]}
ENV = {"KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "40", "KVBRIDGE_WAITING_TIMEOUT_S": "15"}


def scenario(**kw: Any) -> dict[str, Any]:
    base = {"seed": 11, "page": 4, "layers": 2, "heads": 4, "head_bytes": 8, "pool_pages": 128, "requests": 6,
            "max_len": 21, "min_len": 9, "prefix_prob": 0.0, "aux_slots": 40, "aux_bytes": AUX, "timeout": 150,
            "prefill": {"tp": 1}, "decode": {"tp": 1}, "state": [MAMBA], "prefill_hold_s": 2.0}
    base.update(kw)
    return base


def go(sc: dict[str, Any], tmp: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None
       ) -> tuple[Run, dict[Any, dict[str, Any]]]:
    need_sglang()
    monkeypatch.setattr(_rig, "DRIVER", DRV)
    r = Run(sc, tmp, env={**ENV, **(env or {})})
    try:
        return r, r.wait(300)
    finally:
        r.kill()


def _dec(results: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    return results[("decode", 0, 0, 0)]


def _pre(results: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    return results[("prefill", 0, 0, 0)]


BAD_INDICES = {
    "dec": {"1": {"kv": "oob"}, "2": {"kv": "neg"}, "3": {"kv": "float"}, "4": {"aux": 40}, "5": {"slot": 32},
            "6": {"dp": 3}, "12": {"kv": "2d"}, "13": {"kv": "huge"}},
    "pre": {"7": {"kv": "oob"}, "8": {"aux": 40}, "9": {"slot": 32}, "11": {"kv": "float"}, "14": {"kv": "2d"}},
}
CONTROLS = [0, 10, 15]


def test_bad_indices_fail_only_their_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = scenario(requests=16, adv=BAD_INDICES)
    r, results = go(sc, tmp_path, monkeypatch)
    dec = _dec(results)
    for key, res in results.items():
        assert res.get("done"), f"{key} crashed: {res.get('exception')}\n{r.log(key)}"
        assert not res.get("raised"), f"{key}: adapter calls raised into the scheduler: {res['raised']}"
    assert not dec["errors"], dec["errors"][:10]
    assert sorted(dec["verified"]) == CONTROLS, (dec["status"], dec["failed"])
    for k in sorted(set(BAD_INDICES["dec"]) | set(BAD_INDICES["pre"]), key=int):
        assert dec["status"].get(k, "").startswith("failed"), f"request {k} {BAD_INDICES} -> {dec['status'].get(k)}"
        assert dec["failed"][k].strip(), k


def test_rooms_zero_negative_huge_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room 0 is a valid room; -5 and 2**64+7 must fail that request with a reason (not hang, not crash the
    agent); two concurrent requests with one room: at most one verifies, the other fails, and the manager's
    is_abort_release_safe(room) (what SGLang's deferred release asks) never says True for a receiver of that
    room that itself says False."""
    req = scenario(requests=8)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_d", Path(__file__).with_name("sglang_driver.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rooms = [x["room"] for x in mod.requests(dict(req, port=0))]
    adv = {"rooms": {"1": 0, "2": -5, "3": 2**64 + 7, "5": rooms[4]}}
    sc = scenario(requests=8, adv=adv, phase_timeout=60)
    r, results = go(sc, tmp_path, monkeypatch)
    dec, pre = _dec(results), _pre(results)
    for key, res in results.items():
        assert res.get("done"), f"{key} crashed: {res.get('exception')}\n{r.log(key)}"
    assert not dec["errors"], dec["errors"][:10]
    assert {0, 6, 7} <= set(dec["verified"]), (dec["status"], dec["failed"], dec["raised"])
    assert not dec["raised"], f"decode: adapter calls raised into the scheduler: {dec['raised']}"
    assert not pre["raised"], f"prefill: adapter calls raised into the scheduler: {pre['raised']}"
    assert dec["status"].get("1") == "success", (dec["status"], dec["failed"])
    for k in ("2", "3"):
        assert dec["status"].get(k, "").startswith("failed") and dec["failed"][k], (k, dec["status"], dec["failed"])
    assert [dec["status"].get("4"), dec["status"].get("5")].count("success") <= 1
    assert not dec["mgr_safe_vs_rx"], dec["mgr_safe_vs_rx"]

"""Adversarial: abort on either side at each stage of the call order; release-safety and no late writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_adversary_input import go, scenario

ABORTS = {"dec": {"1": {"abort": "before_init"}, "2": {"abort": "after_init"}, "3": {"abort": "after_meta"}},
          "pre": {"4": {"abort": "before_init"}, "5": {"abort": "after_init"}}}


def test_abort_each_stage_each_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every aborted request fails with a reason on decode, becomes is_abort_release_safe within the wait, its
    destination stays unchanged for 3 s after that; the controls verify; nothing raises into the scheduler."""
    sc = scenario(requests=7, adv=dict(ABORTS, watch_s=3.0), safe_wait_s=30, state=[])
    r, results = go(sc, tmp_path, monkeypatch, env={"KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "20"})
    dec = results[("decode", 0, 0, 0)]
    for key, res in results.items():
        assert res.get("done"), f"{key} crashed: {res.get('exception')}\n{r.log(key)}"
        assert not res.get("raised"), f"{key}: {res['raised']}"
    assert sorted(dec["verified"]) == [0, 6], (dec["status"], dec["failed"])
    for k in ("1", "2", "3", "4", "5"):
        assert dec["status"].get(k, "").startswith("failed") and dec["failed"][k], (k, dec["status"])
    assert sorted(dec["safe"]) == [1, 2, 3, 4, 5], f"never release-safe: {dec['unsafe']}"
    assert not dec["late"], f"writes landed after is_abort_release_safe: {dec['late']}"
    assert not dec["errors"], dec["errors"][:10]
    assert not dec["mgr_safe_vs_rx"], dec["mgr_safe_vs_rx"]
    for key, res in results.items():     # what the scheduler let go (clear(), abort()) kvbridge cleared once over
        if key[0] == "prefill":
            assert res["let_go"] and not res["let_go_kept"], (key, res["let_go_kept"])
            ours = {t for t in res["threads"] if t.startswith("kvbridge-sglang")}
            assert ours <= {"kvbridge-sglang-bootstrap"}, (key, res["threads"])    # the HTTP bootstrap server only

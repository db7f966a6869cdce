"""Adversarial tests of ``KVBridgeConnector`` (the class vLLM loads) driven directly, without an engine.

The connector imports vLLM, which lives in ``.venv-vllm`` (no pytest there): one child process under that
python builds producer/consumer connectors on a fake ``VllmConfig`` (only the fields the connector reads),
gives them ``WorkerSide``s on one LocalHub, plays the scheduler's and the workers' calls, and prints one
JSON result per scenario. Each test checks one scenario's result.

A raise from ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``build_connector_meta``
happens inside vLLM's ``Scheduler.schedule()``, and one from ``save_kv_layer`` / ``wait_for_save`` /
``start_load_kv`` inside the model's forward pass: vLLM 0.32 catches neither (the engine core dies).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _vllmrig import ROOT, VLLM_PYTHON

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)")

SCRIPT = r'''
import itertools, json, sys, time, traceback
from types import SimpleNamespace
import torch
from kvbridge.links import LocalHub
from kvbridge_vllm.connector import KVBridgeConnector
from kvbridge_vllm.layout import pool_layout
from kvbridge_vllm.worker import WorkerSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 2, 4, 4, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
HUB = LocalHub()
COUNT = itertools.count()
RESULTS = {}

def caches(fill):
    whole = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    if fill is not None:
        for l in range(LAYERS):
            for b in range(BLOCKS):
                whole[l, b] = fill + 100 * l + b
    return {n: whole[i] for i, n in enumerate(NAMES)}

def connector(role, extra, engine_id, fill=None, worker=True):
    kvt = SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", engine_id=engine_id)
    cfg = SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=BLOCK))
    c = KVBridgeConnector(cfg, KVConnectorRole.SCHEDULER, None)
    if worker:
        kv = caches(fill)
        pool = pool_layout(kv, kind="cpu", total_kv_heads=HEADS, tp_size=1, tp_rank=0, block_size=BLOCK)
        c.worker = WorkerSide(settings=c.settings, pool=pool, produce=c.produce, consume=c.consume,
                              instance=c.instance, link_factory=lambda: HUB.link(f"a{next(COUNT)}"))
        c._layer_index = {n: i for i, n in enumerate(pool.layers)}
        c.kv = kv
    return c

def req(rid, prompt, params):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), kv_transfer_params=params)

def sched_out(new=(), scheduled=None):
    return SimpleNamespace(
        num_scheduled_tokens=scheduled or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(list(ids),), num_computed_tokens=0)
                            for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                              num_computed_tokens=[]))

def prefill_step(p, reqs):
    """One prefill step that computes every prompt of reqs [(request, block ids)]: schedule, forward, finish."""
    for r, _ in reqs:
        p.get_num_new_matched_tokens(r, 0)
    meta = p.build_connector_meta(sched_out(reqs, {r.request_id: len(r.prompt_token_ids) for r, _ in reqs}))
    p.bind_connector_metadata(meta)
    try:
        for name in NAMES:
            p.save_kv_layer(name, p.kv[name], None)
        p.wait_for_save()
    finally:
        p.clear_connector_metadata()
    return [p.request_finished(r, list(ids)) for r, ids in reqs]

def decode_load(d, r, ids, timeout_s=20):
    """Schedule r on decode with blocks ids; run start_load_kv; poll get_finished until r's load ended."""
    n, is_async = d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (list(ids),)), n or 0)
    meta = d.build_connector_meta(sched_out())
    d.bind_connector_metadata(meta)
    d.start_load_kv(None)
    d.clear_connector_metadata()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recv = d.get_finished(set())
        if recv and r.request_id in recv:
            return sorted(d.get_block_ids_with_load_errors())
        time.sleep(0.01)
    return "timeout"

def scenario(name):
    def wrap(fn):
        try:
            RESULTS[name] = {"ok": True, **(fn() or {})}
        except BaseException as exc:
            RESULTS[name] = {"ok": False, "raised": f"{type(exc).__name__}: {exc}",
                             "where": traceback.format_exc(limit=-3)}
        return fn
    return wrap

P = connector("kv_producer", {"backend": "loopback", "instance": "P", "bootstrap_timeout_s": 2.0,
                              "heartbeat_interval_s": 0.1}, "p", fill=1000.0)
D = connector("kv_consumer", {"backend": "loopback", "connect_timeout_s": 1.0, "waiting_timeout_s": 3.0,
                              "heartbeat_interval_s": 0.1}, "d")
PROMPT_A = list(range(10, 18))         # 8 tokens, 2 blocks
PROMPT_B = list(range(50, 58))         # another prompt of the same length

# -- promise 1, prefill scheduler side: a client-chosen room that is not a 63-bit positive int
for i, room in enumerate([-1, 0, 2**63, "abc", [1], 1.5]):
    @scenario(f"prefill-room-{room!r}")
    def _(room=room, i=i):
        out = P.get_num_new_matched_tokens(req(f"pr{i}", PROMPT_A, {"do_remote_decode": True, "room": room}), 0)
        return {"returned": repr(out), "tracked_room": repr(getattr(P._producing.get(f"pr{i}"), "room", None))}
    P.request_finished(req(f"pr{i}", PROMPT_A, {}), [])

# -- promise 1, decode scheduler side: malformed params from a client / router
BAD_DECODE = {"no-instance": {"do_remote_prefill": True, "room": 5},
              "room-str": {"do_remote_prefill": True, "room": "abc", "instance": "P"},
              "room-list": {"do_remote_prefill": True, "room": [5], "instance": "P"},
              "room-dict": {"do_remote_prefill": True, "room": {"r": 5}, "instance": "P"},
              "room-negative": {"do_remote_prefill": True, "room": -5, "instance": "P"},
              "room-huge": {"do_remote_prefill": True, "room": 2**64, "instance": "P"},
              "instance-unknown": {"do_remote_prefill": True, "room": 6, "instance": "nobody"}}
for i, (label, params) in enumerate(BAD_DECODE.items()):
    @scenario(f"decode-{label}")
    def _(params=params, i=i):
        errors = decode_load(D, req(f"db{i}", PROMPT_A, dict(params)), (3 + i % 4, 8 + i % 4))
        return {"load_errors": errors}

# -- the decode keeps serving correctly after all that
@scenario("decode-good-after-bad")
def _():
    (keep, params), = prefill_step(P, [(req("ga", PROMPT_A, {"do_remote_decode": True}), (0, 1))])
    errors = decode_load(D, req("ga", PROMPT_A, params), (12, 13))
    same = all(bool(torch.equal(D.kv[n][d], P.kv[n][s])) for n in NAMES for s, d in ((0, 12), (1, 13)))
    return {"keep": keep, "load_errors": errors, "bytes_equal": same}

# -- promise 1: a router reuses one request's params for another prompt (same room, same length)
@scenario("decode-other-prompt-same-params")
def _():
    (_, params), = prefill_step(P, [(req("sa", PROMPT_A, {"do_remote_decode": True}), (2, 3))])
    errors = decode_load(D, req("sb", PROMPT_B, params), (14, 15))
    got_a = all(bool(torch.equal(D.kv[n][d], P.kv[n][s])) for n in NAMES for s, d in ((2, 14), (3, 15)))
    return {"load_errors": errors, "b_holds_a_kv": got_a}

# -- promise 1: two concurrent prefill requests with the same client-chosen room
@scenario("prefill-same-room-concurrent")
def _():
    out = prefill_step(P, [(req("d1", PROMPT_A, {"do_remote_decode": True, "room": 77}), (4, 5)),
                           (req("d2", PROMPT_B, {"do_remote_decode": True, "room": 77}), (6, 7))])
    return {"finished": repr(out)}

print("KVB-RESULTS " + json.dumps(RESULTS), flush=True)
for c in (P, D):
    try:
        c.worker.close()
    except Exception:
        pass
import os
os._exit(0)
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    script = tmp_path_factory.mktemp("adv") / "connector_scenarios.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([str(VLLM_PYTHON), str(script)], capture_output=True, text=True, timeout=400,
                          cwd=str(ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith("KVB-RESULTS "):
            got: dict[str, Any] = json.loads(line[len("KVB-RESULTS "):])
            (Path(script).parent / "results.json").write_text(json.dumps(got, indent=1))
            (Path(script).parent / "stderr.txt").write_text(proc.stderr)
            return got
    raise AssertionError(f"scenario script failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")


def _no_raise(results: dict[str, Any], name: str) -> dict[str, Any]:
    got = results[name]
    assert got["ok"], f"{name}: raised from a scheduler/worker hook (kills vLLM's engine core): {got['raised']}\n" \
                      f"{got['where']}"
    return got


@pytest.mark.timeout(420)
@pytest.mark.parametrize("room", [-1, 0, 2**63, "abc", [1], 1.5], ids=repr)
def test_prefill_bad_room_does_not_crash_scheduler(results: dict[str, Any], room: object) -> None:
    """Promise 1: a bad "room" in a prefill request's kv_transfer_params fails that request (or is served
    without remote KV) with a reason; it must not raise out of get_num_new_matched_tokens (the scheduler)."""
    got = _no_raise(results, f"prefill-room-{room!r}")
    if room == 1.5:      # silently truncated to room 1: a client that sends 1.5 and 1 collides
        assert got["tracked_room"] != "1", f"room 1.5 silently became room 1: {got}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("label", ["no-instance", "room-str", "room-list", "room-dict", "room-negative",
                                   "room-huge", "instance-unknown"])
def test_decode_bad_params_fail_the_request_only(results: dict[str, Any], label: str) -> None:
    """Promise 1: malformed params on decode: no raise from the scheduler hooks; the request's load fails
    (its blocks reported as load errors) within the connect timeout."""
    got = _no_raise(results, f"decode-{label}")
    assert got["load_errors"] != "timeout" and got["load_errors"], got


@pytest.mark.timeout(420)
def test_decode_serves_correctly_after_bad_requests(results: dict[str, Any]) -> None:
    got = _no_raise(results, "decode-good-after-bad")
    assert got["keep"] and got["load_errors"] == [] and got["bytes_equal"], got


@pytest.mark.timeout(420)
def test_params_of_another_prompt_are_not_loaded_silently(results: dict[str, Any]) -> None:
    """Promise 1 (never a wrong token silently): a decode request whose kv_transfer_params came from another
    prompt's prefill (router bug / replay; same length) must fail its load, not get that prompt's KV as its
    own. The params carry nothing (length, hash) the decode could check the prompt against."""
    got = _no_raise(results, "decode-other-prompt-same-params")
    assert got["load_errors"], f"prompt B loaded prompt A's KV without any error: {got}"


@pytest.mark.timeout(420)
def test_same_room_concurrent_prefill_does_not_crash_forward(results: dict[str, Any]) -> None:
    """Promise 1: two concurrent prefill requests with the same client-chosen room: no raise out of
    save_kv_layer / wait_for_save (the forward pass)."""
    _no_raise(results, "prefill-same-room-concurrent")

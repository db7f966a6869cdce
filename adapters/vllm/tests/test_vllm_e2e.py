"""End to end with real vLLM 0.32 engines on CPU (tiny random Llama made at test time, 2 KV heads x 64, bf16).

Instances live side by side, each its own process: a single-instance reference, a loopback prefill/decode
pair and a NIXL pair (TP 1 -> 1); with KVBRIDGE_VLLM_HETERO=1 (not yet passing) also a TP 2 instance that both
produces and consumes KV over loopback (with the loopback pair: prefill TP 2 -> decode TP 1 and TP 1 -> TP 2).
At equal TP every comparison is of greedy token ids: decode's 16 generated tokens after the transfer must
equal the reference's for every prompt.
Also: a prompt whose first two blocks decode already holds in its prefix cache (only the rest travels,
checked in the dumped blocks), a fault hook that negates one layer of the arrived KV (tokens must then differ:
the comparison can fail), and a prefill killed while decode waits for its KV (decode reports the blocks as
load errors, vLLM fails that request, and serves the next).
Hetero TP compares bytes, not tokens (TP 2 and TP 1 greedy outputs differ slightly in bf16): every block decode
received equals the prefill's blocks of those tokens resharded by heads (both sides dumped per rank).

Needs ``.venv-vllm`` (made by scripts/setup.sh); slow on a 2-core host (each engine takes ~1-2 min to start).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _vllmrig import VLLM_PYTHON, Instance, make_model, reap_dead_segments

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)"),
              pytest.mark.timeout(900)]

BLOCK, TOKENS = 32, 16
LENGTHS = [5, 31, 32, 33, 64, 77, 96, 100, 130]      # block-aligned and not
START_S = 600


def prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


PROMPTS = [prompt(i, n) for i, n in enumerate(LENGTHS)]
PREFIX_PROMPT = PROMPTS[4] + prompt(99, 45)            # PROMPTS[4]'s 64 tokens (2 blocks) are cached on decode
# NOT YET PASSING, so off unless KVBRIDGE_VLLM_HETERO=1: on this 2-core host the TP 2 instance's two mp workers
# spin at ~60-70 % CPU each even while idle, the five TP 1 engines starve, and decode TP 1's handshake with the
# TP 2 prefill did not complete in 30 s (its ranks saw the Hello; the decode's heartbeats reached them > 10 s
# late). Not yet told apart: starvation only, or also a connector/agent fault on the TP 2 -> 1 path.
HETERO_ON = os.environ.get("KVBRIDGE_VLLM_HETERO") == "1"
HETERO_LENGTHS = [5, 32, 33, 77, 130]
HETERO = [prompt(200 + i, n) for i, n in enumerate(HETERO_LENGTHS)]   # new to every instance: whole prompts travel


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "tiny-llama"
    make_model(model)
    dumps = tmp / "dumps"
    dumps.mkdir()
    base = {"model": str(model)}
    lo = {"backend": "loopback", "bootstrap": "tcp://127.0.0.1:17631", "test_hooks": True, "dump_dir": str(dumps),
          "peer_timeout_s": 2.0}
    nx = {"backend": "nixl", "bootstrap": "tcp://127.0.0.1:17632"}
    instances: dict[str, Instance] = {}
    try:
        instances["ref"] = Instance("ref", base, tmp)
        instances["p"] = Instance("p", base | {"role": "kv_producer", "extra": lo}, tmp)
        instances["d"] = Instance("d", base | {"role": "kv_consumer", "extra": lo}, tmp)
        instances["pn"] = Instance("pn", base | {"role": "kv_producer", "extra": nx}, tmp)
        instances["dn"] = Instance("dn", base | {"role": "kv_consumer", "extra": nx}, tmp)
        if HETERO_ON:   # TP 2, both roles, on p's bootstrap server (p serves it; this one waits for it)
            instances["tp2"] = Instance("tp2", base | {"role": "kv_both", "extra": lo | {
                "serve_bootstrap": False, "bootstrap_timeout_s": START_S, "peer_timeout_s": 10.0}}, tmp, tp=2)
        started = time.monotonic()
        for inst in instances.values():
            assert inst.answer(START_S - (time.monotonic() - started))["ready"]
        print(f"{len(instances)} vLLM instances ready in {time.monotonic() - started:.0f} s")
        ref = instances["ref"].generate([{"prompt": p, "max_tokens": TOKENS} for p in PROMPTS])
        # after PROMPTS, as on decode: the 64-token prefix then comes from the prefix cache (computed in a
        # 64-token forward), so bf16 numerics match the disaggregated path
        ref += instances["ref"].generate([{"prompt": PREFIX_PROMPT, "max_tokens": TOKENS}])
        yield {"tmp": tmp, "dumps": dumps, **instances, "want": [o["tokens"] for o in ref]}
    finally:
        for inst in instances.values():
            inst.kill()
        reap_dead_segments()


def disagg(prefill: Instance, decode: Instance, prompts: list[list[int]], extra: dict[str, Any] | None = None,
           prefill_extra: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What the proxy does: prefill with max_tokens=1, then decode with the returned kv_transfer_params."""
    pre = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True} | (prefill_extra or {})}
                            for p in prompts])
    for o in pre:
        assert o["params"] and o["params"]["do_remote_prefill"], o
    dec = decode.generate([{"prompt": p, "max_tokens": TOKENS, "params": o["params"] | (extra or {})}
                           for p, o in zip(prompts, pre)])
    return pre, dec


@pytest.mark.parametrize("pair", ["loopback", "nixl"])
def test_tp1_to_tp1_tokens_equal_single_instance(cluster: dict[str, Any], pair: str) -> None:
    p, d = (cluster["p"], cluster["d"]) if pair == "loopback" else (cluster["pn"], cluster["dn"])
    pre, dec = disagg(p, d, PROMPTS)
    for i, (o, want) in enumerate(zip(dec, cluster["want"])):
        assert o["finish"] == "length", (i, o)
        assert o["tokens"] == want, f"prompt {i} ({LENGTHS[i]} tokens): decode {o['tokens']} != reference {want}"
        assert pre[i]["tokens"] == want[:1]


def test_prefix_already_cached_on_decode(cluster: dict[str, Any]) -> None:
    """Decode served PROMPTS[4] (64 tokens) before: only the blocks after those two travel."""
    pre, dec = disagg(cluster["p"], cluster["d"], [PREFIX_PROMPT])
    assert dec[0]["tokens"] == cluster["want"][-1]
    room = pre[0]["params"]["room"]
    got = np.load(cluster["dumps"] / f"decode-room{room}-rank0.npy")
    sent = np.load(cluster["dumps"] / f"prefill-room{room}-rank0.npy")
    blocks = -(-len(PREFIX_PROMPT) // BLOCK)
    assert sent.shape[1] == blocks and got.shape[1] == blocks - 2, (sent.shape, got.shape)
    assert np.array_equal(got, sent[:, 2:]), "decode's blocks differ from the prefill's"


def test_corrupted_layer_changes_tokens(cluster: dict[str, Any]) -> None:
    """The check can fail: negating layer 1 of the arrived KV makes decode's tokens differ."""
    prompts = PROMPTS[5:8]
    _, dec = disagg(cluster["p"], cluster["d"], prompts, extra={"kvbridge_flip_layer": 1})
    differ = [o["tokens"] != want for o, want in zip(dec, cluster["want"][5:8])]
    assert all(differ), f"corrupted KV went unnoticed: {differ}"


def _dump(cluster: dict[str, Any], side: str, room: int, tp: int) -> np.ndarray:
    """One side's blocks of ``room`` as ``[layers, blocks, bytes of every head]``: the ranks' dumps joined by
    heads (a CPU block is (heads, 2*block, head_size), heads outermost, so each rank's bytes are a slice)."""
    ranks = [np.load(cluster["dumps"] / f"{side}-room{room}-rank{r}.npy") for r in range(tp)]
    return np.concatenate(ranks, axis=2)


@pytest.mark.skipif(not HETERO_ON, reason="hetero TP with real vLLM does not pass yet on 2 cores; "
                    "KVBRIDGE_VLLM_HETERO=1 runs it")
@pytest.mark.parametrize(("src", "dst"), [("tp2", "d"), ("p", "tp2")], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_hetero_tp_bytes_equal_resharded(cluster: dict[str, Any], src: str, dst: str) -> None:
    """Prefill TP 2 -> decode TP 1 and TP 1 -> TP 2 (loopback): decode's blocks, joined over its ranks, equal
    the prefill's joined over its ranks, byte for byte, for every prompt; decode then generates every token."""
    tp = {"p": 1, "d": 1, "tp2": 2}
    pre, dec = disagg(cluster[src], cluster[dst], HETERO)
    compared = 0
    for i, (p, o) in enumerate(zip(pre, dec)):
        assert o["finish"] == "length" and len(o["tokens"]) == TOKENS, (i, o)
        room = p["params"]["room"]
        sent, got = _dump(cluster, "prefill", room, tp[src]), _dump(cluster, "decode", room, tp[dst])
        blocks = -(-HETERO_LENGTHS[i] // BLOCK)
        assert sent.shape == got.shape and sent.shape[1] == blocks, (i, sent.shape, got.shape)
        assert got.any(), f"prompt {i}: decode's blocks are all zero"
        assert np.array_equal(got, sent), f"prompt {i} ({HETERO_LENGTHS[i]} tokens): decode's KV differs"
        compared += got.size
    print(f"{src} -> {dst}: {len(HETERO)} prompts, {compared} KV bytes equal")


def test_prefill_killed_mid_transfer(cluster: dict[str, Any]) -> None:
    """Prefill holds its send (test hook) and is killed while decode waits: decode's load fails (vLLM finishes
    the request with an error, policy 'fail'), and decode then serves a new request correctly."""
    p, d = cluster["p"], cluster["d"]
    pre = p.generate([{"prompt": PROMPTS[6], "max_tokens": 1,
                       "params": {"do_remote_decode": True, "kvbridge_delay_send_s": 120}}])
    d.submit([{"prompt": PROMPTS[6], "max_tokens": TOKENS, "params": pre[0]["params"]}])
    time.sleep(3)
    p.kill()
    started = time.monotonic()
    out = d.answer(120)["outputs"][0]
    assert out["finish"] != "length" and len(out["tokens"]) < TOKENS, out
    print(f"decode gave up {time.monotonic() - started:.1f} s after the kill: {out}")
    again = d.generate([{"prompt": PROMPTS[7], "max_tokens": TOKENS}])
    assert again[0]["tokens"] == cluster["want"][7]

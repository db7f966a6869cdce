"""End to end with real vLLM 0.32 engines on CPU (tiny random Llama made at test time, 2 KV heads x 64, bf16).

Instances live side by side, each its own process: a single-instance reference, a loopback prefill/decode
pair and a NIXL pair (TP 1 -> 1); hetero TP is test_vllm_hetero's. Every comparison is of greedy token ids:
decode's 16 generated tokens after the transfer must equal the reference's for every prompt.
Also: a prompt whose first two blocks decode already holds in its prefix cache (only the rest travels,
checked in the dumped blocks), a fault hook that negates one layer of the arrived KV (tokens must then differ:
the comparison can fail), and a prefill killed while decode waits for its KV (decode reports the blocks as
load errors, vLLM fails that request, and serves the next).

Needs ``.venv-vllm`` (made by scripts/setup.sh); slow on a 2-core host (each engine takes ~1-2 min to start).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _vllmrig import VLLM_PYTHON, Instance, make_model, reap_dead_segments

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)"),
              pytest.mark.timeout(900)]

BLOCK, TOKENS = 32, 16
LENGTHS = [5, 31, 32, 33, 64, 77, 96, 100, 130]      # block-aligned and not
START_S = 600


def prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


PROMPTS = [prompt(i, n) for i, n in enumerate(LENGTHS)]
P_INSTANCE = "prefill-lo"                               # the loopback prefill's kvbridge instance name
PREFIX_PROMPT = PROMPTS[4] + prompt(99, 45)            # PROMPTS[4]'s 64 tokens (2 blocks) are cached on decode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "tiny-llama"
    make_model(model)
    dumps = tmp / "dumps"
    dumps.mkdir()
    base = {"model": str(model)}
    # 10 s, not less: five engines share this host's cores, and a decode whose threads stalled past a 2 s timeout
    # was judged gone by the prefill, which then stopped its heartbeats, so the decode failed its rooms in turn
    # (both verdicts are by design: a silent peer's rooms fail); the killed-prefill test waits that long. The NIXL
    # pair too: with the default 3 s, its decode judged its prefill gone ("no message for 3.0 s") while that
    # prefill was still warming up beside the four other engines (clean-clone run 62), and failed every request
    lo = {"backend": "loopback", "bootstrap": "tcp://127.0.0.1:17631", "test_hooks": True, "dump_dir": str(dumps),
          "peer_timeout_s": 10.0}
    nx = {"backend": "nixl", "bootstrap": "tcp://127.0.0.1:17632", "peer_timeout_s": 10.0}
    instances: dict[str, Instance] = {}
    try:
        instances["ref"] = Instance("ref", base, tmp)
        instances["p"] = Instance("p", base | {"role": "kv_producer", "extra": lo | {"instance": P_INSTANCE}}, tmp)
        instances["d"] = Instance("d", base | {"role": "kv_consumer", "extra": lo}, tmp)
        instances["pn"] = Instance("pn", base | {"role": "kv_producer", "extra": nx}, tmp)
        instances["dn"] = Instance("dn", base | {"role": "kv_consumer", "extra": nx}, tmp)
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


def test_decode_asks_first_layer_wise(cluster: dict[str, Any]) -> None:
    """A router that sends both requests at once (room chosen by the router): the decode's request reaches the
    prefill before its forward pass, so each layer is posted from save_kv_layer as soon as it is written
    (the prefill's dump records the layer groups); decode's tokens equal the single instance's."""
    prompts = [prompt(700 + i, n) for i, n in enumerate([33, 77, 130])]      # new to every instance
    want = [o["tokens"] for o in cluster["ref"].generate([{"prompt": p, "max_tokens": TOKENS} for p in prompts])]
    rooms = [int(r) for r in np.random.default_rng(7).integers(1, 2**62, size=len(prompts))]
    cluster["d"].submit([{"prompt": p, "max_tokens": TOKENS, "params": {
        "do_remote_prefill": True, "room": room, "instance": P_INSTANCE, "bootstrap": "tcp://127.0.0.1:17631"}}
        for p, room in zip(prompts, rooms)])
    time.sleep(3)           # decode allocates blocks and sends its requests; the prefill has not started
    cluster["p"].generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True, "room": room}}
                           for p, room in zip(prompts, rooms)])
    dec = cluster["d"].answer(240)["outputs"]
    for i, (o, w) in enumerate(zip(dec, want)):
        assert o["tokens"] == w, f"prompt {i}: decode {o['tokens']} != reference {w}"
    for room in rooms:
        path = cluster["dumps"] / f"prefill-room{room}-rank0.json"
        assert path.exists(), f"room {room} was not sent layer-wise"
        groups = json.loads(path.read_text())["layer_groups"]
        assert groups[0][0] == 0 and groups[-1][1] == 2 and all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
        print(f"room {room}: layer groups {groups}")


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

"""End to end with real vLLM 0.32 engines on CPU (tiny random Llama made at test time, 2 KV heads x 64, bf16).

One set of instances serves the whole module (each engine startup costs tens of CPU-seconds on the 2-core
host; they are forked from one process that imported vLLM): a single-instance reference, a loopback
prefill/decode pair (TP 1 -> 1), a NIXL pair (TP 1 -> 1) and a TP 2 instance that is both producer and
consumer (``kv_both``, its two workers pinned one per core), on the loopback pair's bootstrap.

Tokens: every comparison is of greedy token ids where the TP sizes match: decode's 16 generated tokens after
the transfer must equal the reference's for every prompt. Also: a prompt whose first two blocks decode already
holds in its prefix cache (only the rest travels, checked in the dumped blocks), a fault hook that negates one
layer of the arrived KV (tokens must then differ: the comparison can fail), and a prefill killed while decode
waits for its KV (decode reports the blocks as load errors, vLLM fails that request, and serves the next;
last, as it kills the loopback prefill).

Adversarial (loopback pair): a router hands prompt B's decode request the kv_transfer_params of prompt A's
prefill (same length): decode must not answer B from A's KV silently (tokens equal to B's own greedy tokens,
or an error); a client sends the prefill ``"room": -1``: that request fails, the engine keeps serving.

Hetero TP (loopback): prefill TP 2 -> decode TP 1 and TP 1 -> TP 2. TP 2 and TP 1 greedy outputs differ
slightly in bf16 (reduction order), so the check is on bytes: every block decode received, joined over its
ranks by heads, equals the prefill's blocks of those tokens joined over its ranks (both sides dump per rank),
and decode then generates every token.

Needs ``.venv-vllm`` (made by scripts/setup.sh); slow on a 2-core host (each engine takes ~1-2 min to start).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _vllmrig import VLLM_PYTHON, Instance, Zygote, reap_dead_segments, shared_model

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)"),
              pytest.mark.timeout(1200)]

BLOCK, TOKENS = 32, 16
LENGTHS = [5, 31, 32, 33, 64, 77, 96, 100, 130]      # block-aligned and not
START_S = 900
BOOTSTRAP = "tcp://127.0.0.1:17631"                    # the loopback prefill's; the TP 2 instance uses it too


def prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


PROMPTS = [prompt(i, n) for i, n in enumerate(LENGTHS)]
P_INSTANCE = "prefill-lo"                               # the loopback prefill's kvbridge instance name
PREFIX_PROMPT = PROMPTS[4] + prompt(99, 45)            # PROMPTS[4]'s 64 tokens (2 blocks) are cached on decode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = shared_model(tmp_path_factory.getbasetemp())
    dumps = tmp / "dumps"
    dumps.mkdir()
    base = {"model": str(model)}
    # 10 s, not less: six engines share this host's cores, and a decode whose threads stalled past a 2 s timeout
    # was judged gone by the prefill, which then stopped its heartbeats, so the decode failed its rooms in turn
    # (both verdicts are by design: a silent peer's rooms fail); the killed-prefill test waits that long
    lo = {"backend": "loopback", "bootstrap": BOOTSTRAP, "test_hooks": True, "dump_dir": str(dumps),
          "peer_timeout_s": 10.0}
    # the prefill holds finished blocks 120 s for a TP 2 decode's request (a TP 2 instance is slow to answer on
    # a busy 2-core host); the TP 2 instance waits as long for its handshakes. The TP 1 decode keeps its 30 s
    # connect timeout: the killed-prefill test waits 120 s for its verdict.
    slow = {"connect_timeout_s": 120.0, "bootstrap_timeout_s": 120.0}
    nx = {"backend": "nixl", "bootstrap": "tcp://127.0.0.1:17632"}
    instances: dict[str, Instance] = {}
    zygote = Zygote(tmp, START_S)
    try:
        instances["ref"] = Instance("ref", base, tmp, zygote=zygote)
        instances["p"] = Instance("p", base | {"role": "kv_producer", "extra": lo | {
            "instance": P_INSTANCE, "bootstrap_timeout_s": 120.0}}, tmp, zygote=zygote)
        instances["d"] = Instance("d", base | {"role": "kv_consumer", "extra": lo}, tmp, zygote=zygote)
        instances["pn"] = Instance("pn", base | {"role": "kv_producer", "extra": nx}, tmp, zygote=zygote)
        instances["dn"] = Instance("dn", base | {"role": "kv_consumer", "extra": nx}, tmp, zygote=zygote)
        instances["two"] = Instance("two", base | {"role": "kv_both", "extra": lo | slow | {"serve_bootstrap": False}},
                                    tmp, tp=2, zygote=zygote)
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
        zygote.close()
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
        "do_remote_prefill": True, "room": room, "instance": P_INSTANCE, "bootstrap": BOOTSTRAP}}
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


# -- adversarial (was test_vllm_e2e_adversary): the loopback pair, new prompts

PROMPT_A = [int(t) for t in np.random.default_rng(901).integers(3, 1000, size=70)]
PROMPT_B = [int(t) for t in np.random.default_rng(902).integers(3, 1000, size=70)]
PROMPT_C = [int(t) for t in np.random.default_rng(903).integers(3, 1000, size=45)]


def test_params_of_another_prompt_do_not_give_wrong_tokens_silently(cluster: dict[str, Any]) -> None:
    p, d = cluster["p"], cluster["d"]
    want_b = p.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS}])[0]["tokens"]      # B on its own
    pre = p.generate([{"prompt": PROMPT_A, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    out = d.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS, "params": pre[0]["params"]}])[0]
    again = d.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS}])[0]       # no params: decode's own cache
    print(f"B alone {want_b}\nB with A's params {out}\nB again on decode {again}")
    assert out["finish"] != "length" or out["tokens"] == want_b, \
        f"decode answered prompt B from prompt A's KV, silently: {out['tokens']} != {want_b}"
    assert again["tokens"] == want_b, "decode's prefix cache now serves A's KV for prompt B"


def test_prefill_bad_room_fails_only_that_request(cluster: dict[str, Any]) -> None:
    p = cluster["p"]
    try:
        bad = p.generate([{"prompt": PROMPT_C, "max_tokens": 1, "params": {"do_remote_decode": True, "room": -1}}],
                         timeout_s=120)
        print(f"bad room answered: {bad}")
    except RuntimeError as exc:
        pytest.fail(f"the prefill engine died on a request with room -1:\n{str(exc)[-1500:]}")
    good = p.generate([{"prompt": PROMPT_C, "max_tokens": 4}], timeout_s=120)
    assert good[0]["finish"] == "length"


# -- hetero TP (was test_vllm_hetero): the TP 2 instance with the loopback pair, prompts new to all

HETERO_LENGTHS = [5, 32, 33, 77, 130]            # block-aligned and not; up to 5 blocks
TP = {"p": 1, "d": 1, "two": 2}


def hetero_disagg(prefill: Instance, decode: Instance, prompts: list[list[int]]) -> tuple[list[dict[str, Any]],
                                                                                         list[dict[str, Any]]]:
    """``disagg`` with the TP 2 instance's patience (600 s an answer)."""
    pre = prefill.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts],
                           timeout_s=600)
    for o in pre:
        assert o["params"] and o["params"]["do_remote_prefill"], o
    dec = decode.generate([{"prompt": p, "max_tokens": TOKENS, "params": o["params"]} for p, o in zip(prompts, pre)],
                          timeout_s=600)
    return pre, dec


def joined(dumps: Any, side: str, room: int, tp: int) -> np.ndarray:
    """One side's blocks of ``room`` as ``[layers, blocks, bytes of every head]``: the ranks' dumps joined by
    heads (a CPU block is (heads, 2*block, head_size), heads outermost, so each rank's bytes are a slice)."""
    return np.concatenate([np.load(dumps / f"{side}-room{room}-rank{r}.npy") for r in range(tp)], axis=2)


@pytest.mark.parametrize(("src", "dst", "seed"), [("two", "d", 200), ("p", "two", 300)],
                         ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_hetero_tp_bytes_equal_resharded(cluster: dict[str, Any], src: str, dst: str, seed: int) -> None:
    """Decode's blocks, joined over its ranks, equal the prefill's joined over its ranks, byte for byte, for
    every prompt (new to both instances: whole prompts travel); decode then generates every token."""
    prompts = [prompt(seed + i, n) for i, n in enumerate(HETERO_LENGTHS)]
    pre, dec = hetero_disagg(cluster[src], cluster[dst], prompts)
    compared = 0
    for i, (p, o) in enumerate(zip(pre, dec)):
        assert o["finish"] == "length" and len(o["tokens"]) == TOKENS, (i, o)
        room = p["params"]["room"]
        sent = joined(cluster["dumps"], "prefill", room, TP[src])
        got = joined(cluster["dumps"], "decode", room, TP[dst])
        blocks = -(-HETERO_LENGTHS[i] // BLOCK)
        assert sent.shape == got.shape and sent.shape[1] == blocks, (i, sent.shape, got.shape)
        assert got.any(), f"prompt {i}: decode's blocks are all zero"
        assert np.array_equal(got, sent), \
            f"prompt {i} ({HETERO_LENGTHS[i]} tokens): decode's KV differs from prefill's"
        compared += got.size
    print(f"{src} -> {dst}: {len(prompts)} prompts, {compared} KV bytes equal, {TOKENS} tokens each generated")


# -- last: kills the loopback prefill (the bootstrap server of the loopback pair and the TP 2 instance)


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

"""Adversarial real-engine scenarios (vLLM 0.32 CPU, tiny random Llama, loopback, TP 1 -> 1).

1. A router hands prompt B's decode request the kv_transfer_params of prompt A's prefill (same length):
   decode must not answer B from A's KV silently (tokens equal to B's own greedy tokens, or an error).
2. A client sends the prefill ``"room": -1``: that request fails, the engine keeps serving the next one.

Slow: two engines (~1-2 min each to start on a 2-core host).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _vllmrig import VLLM_PYTHON, Instance, make_model, reap_dead_segments

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)"),
              pytest.mark.timeout(900)]

TOKENS, START_S = 16, 600
PROMPT_A = [int(t) for t in np.random.default_rng(901).integers(3, 1000, size=70)]
PROMPT_B = [int(t) for t in np.random.default_rng(902).integers(3, 1000, size=70)]
PROMPT_C = [int(t) for t in np.random.default_rng(903).integers(3, 1000, size=45)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("advvllm")
    model = tmp / "tiny-llama"
    make_model(model)
    extra = {"backend": "loopback", "bootstrap": "tcp://127.0.0.1:17651", "instance": "adv-p",
             "connect_timeout_s": 10.0, "waiting_timeout_s": 20.0}
    base = {"model": str(model)}
    instances: dict[str, Instance] = {}
    try:
        instances["p"] = Instance("advp", base | {"role": "kv_producer", "extra": extra}, tmp)
        instances["d"] = Instance("advd", base | {"role": "kv_consumer", "extra": extra}, tmp)
        started = time.monotonic()
        for inst in instances.values():
            assert inst.answer(START_S - (time.monotonic() - started))["ready"]
        yield instances
    finally:
        for inst in instances.values():
            inst.kill()
        reap_dead_segments()


def test_params_of_another_prompt_do_not_give_wrong_tokens_silently(pair: dict[str, Any]) -> None:
    p, d = pair["p"], pair["d"]
    want_b = p.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS}])[0]["tokens"]      # B on its own
    pre = p.generate([{"prompt": PROMPT_A, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    out = d.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS, "params": pre[0]["params"]}])[0]
    again = d.generate([{"prompt": PROMPT_B, "max_tokens": TOKENS}])[0]       # no params: decode's own cache
    print(f"B alone {want_b}\nB with A's params {out}\nB again on decode {again}")
    assert out["finish"] != "length" or out["tokens"] == want_b, \
        f"decode answered prompt B from prompt A's KV, silently: {out['tokens']} != {want_b}"
    assert again["tokens"] == want_b, "decode's prefix cache now serves A's KV for prompt B"


def test_prefill_bad_room_fails_only_that_request(pair: dict[str, Any]) -> None:
    p = pair["p"]
    try:
        bad = p.generate([{"prompt": PROMPT_C, "max_tokens": 1, "params": {"do_remote_decode": True, "room": -1}}],
                         timeout_s=120)
        print(f"bad room answered: {bad}")
    except RuntimeError as exc:
        pytest.fail(f"the prefill engine died on a request with room -1:\n{str(exc)[-1500:]}")
    good = p.generate([{"prompt": PROMPT_C, "max_tokens": 4}], timeout_s=120)
    assert good[0]["finish"] == "length"

"""examples/vllm-disagg/proxy.py in front of two real vLLM OpenAI servers (CPU, tiny random Llama, TP 1,
loopback): prefill (kv_producer) and decode (kv_consumer) as the example's README starts them, the proxy in
this process. Each prompt's 16 greedy tokens through the proxy must equal the prefill instance's own answer
for the same prompt asked directly (a single-instance run of the same engine, from the same KV).

Needs ``.venv-vllm`` (made by scripts/setup.sh); each server takes ~1-2 min to start on a 2-core host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _vllmrig import VLLM_PYTHON, make_model, reap_dead_segments
from test_proxy import load_proxy

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run scripts/setup.sh)"),
              pytest.mark.timeout(900)]

START_S, TOKENS = 420, 16
PROMPTS = [[int(t) for t in np.random.default_rng(300 + i).integers(3, 1000, size=n)] for i, n in
           enumerate([40, 96])]


def serve(model: Path, port: int, role: str, log: Path) -> subprocess.Popen[bytes]:
    config = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge_vllm.connector",
              "kv_role": role, "kv_connector_extra_config": {"backend": "loopback",
                                                             "bootstrap": "tcp://127.0.0.1:17634",
                                                             "peer_timeout_s": 10.0}}
    # peer_timeout_s 10 (the default is 3), as in test_vllm_e2e: on a 2-core host shared with other work (load
    # 25-30), the prefill's heartbeats stalled past 3 s and the decode rightly judged it gone, failing the load
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", PYTHONUNBUFFERED="1",
               OMP_WAIT_POLICY="PASSIVE")                # OpenMP threads sleep, not spin, between regions
    # vllm-cpu's ``vllm`` script dies asking for the metadata of a distribution named "vllm" (it is
    # "vllm-cpu"); the server module it would run takes the same arguments, the model as --model
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1",
           "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "256", "--block-size", "32",
           "--max-num-seqs", "8", "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20),
           "--kv-transfer-config", json.dumps(config)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: vllm serve exited (rc {proc.returncode}); log {log}:\n"
                               + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: not healthy in {START_S} s; log {log}")
        time.sleep(1)


def complete(url: str, model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True} | extra
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: {exc.code} {exc.read()[:500]!r}") from None
    return answer


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    model = tmp / "tiny-llama"
    make_model(model)
    procs: list[subprocess.Popen[bytes]] = []
    server = None
    try:
        started = time.monotonic()
        urls = {}
        for name, port, role in (("prefill", 18100, "kv_producer"), ("decode", 18200, "kv_consumer")):
            procs.append(serve(model, port, role, tmp / f"{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        for (name, url), proc in zip(urls.items(), procs):
            wait_healthy(url, proc, tmp / f"{name}.log", started + START_S)
        print(f"2 vllm serve instances healthy in {time.monotonic() - started:.0f} s")
        mod = load_proxy()
        server = mod.make_server(mod.Proxy([urls["prefill"]], [urls["decode"]], timeout_s=240), port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield {"proxy": f"http://127.0.0.1:{server.server_address[1]}", "model": str(model), **urls}
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        reap_dead_segments()


def test_proxy_tokens_equal_single_instance(served: dict[str, Any]) -> None:
    for i, prompt in enumerate(PROMPTS):
        got = complete(served["proxy"], served["model"], prompt)
        assert got.get("kv_transfer_params") is None or not got["kv_transfer_params"].get("do_remote_prefill")
        tokens = got["choices"][0]["token_ids"]
        assert len(tokens) == TOKENS and got["choices"][0]["finish_reason"] == "length", got
        want = complete(served["prefill"], served["model"], prompt)["choices"][0]["token_ids"]
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens): via proxy {tokens} != prefill alone {want}"

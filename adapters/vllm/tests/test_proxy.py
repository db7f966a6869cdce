"""examples/vllm-disagg/proxy.py against STUB HTTP servers (no vLLM here): the request each instance gets, the
kv_transfer_params hand-over, streamed and whole answers, and errors. The proxy with real ``vllm serve``
instances is in test_vllm_e2e.py."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PROXY_PY = Path(__file__).resolve().parents[3] / "examples" / "vllm-disagg" / "proxy.py"


def load_proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvbridge_vllm_disagg_proxy", PROXY_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Stub:
    """An instance that records each request body and answers with ``reply(path, body) -> (status, bytes)``."""

    def __init__(self, reply: Any) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        stub = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.seen.append((self.path, body))
                status, data, ctype = reply(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.end_headers()
                for part in data if isinstance(data, list) else [data]:
                    self.wfile.write(part)
                    self.wfile.flush()

            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"data": []}')

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "room": 77, "instance": "vllm-p",
          "bootstrap": "tcp://127.0.0.1:17600"}


def prefill_ok(path: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    return 200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode(), "application/json"


def decode_ok(path: str, body: dict[str, Any]) -> tuple[int, Any, str]:
    if body.get("stream"):
        return 200, [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"], "text/event-stream"
    return 200, json.dumps({"choices": [{"text": "abc"}], "got": body["kv_transfer_params"]}).encode(), \
        "application/json"


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    proxy_mod = load_proxy()
    stubs = {"p": Stub(prefill_ok), "d": Stub(decode_ok)}
    server = proxy_mod.make_server(proxy_mod.Proxy([stubs["p"].url], [stubs["d"].url], timeout_s=10), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "mod": proxy_mod, **stubs}
    finally:
        server.shutdown()
        server.server_close()
        for s in stubs.values():
            s.close()


def post(url: str, body: Any) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_prefill_gets_one_token_and_decode_gets_its_params(rig: dict[str, Any]) -> None:
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "max_completion_tokens": 16, "temperature": 0,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    status, data = post(rig["url"] + "/v1/completions", body)
    assert status == 200 and json.loads(data)["got"] == PARAMS
    [(path, pre)] = rig["p"].seen
    assert path == "/v1/completions"
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert "stream_options" not in pre and pre["prompt"] == [5, 6, 7]
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    [(path, dec)] = rig["d"].seen
    assert dec == body | {"kv_transfer_params": PARAMS}       # the client's request, unchanged but for the params


def test_streamed_answer_passes_through(rig: dict[str, Any]) -> None:
    status, data = post(rig["url"] + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert status == 200
    assert data == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert rig["p"].seen[0][1]["stream"] is False and rig["d"].seen[0][1]["stream"] is True


def test_errors(rig: dict[str, Any]) -> None:
    # no kv_transfer_params from the prefill (not a kvbridge producer): 502, decode never asked
    rig["p"].close()
    bare = Stub(lambda path, body: (200, b'{"choices": []}', "application/json"))
    failing = Stub(lambda path, body: (400, b'{"error": "too long"}', "application/json"))
    try:
        mod = rig["mod"]
        for prefill, want, text in ((bare.url, 502, b"no kv_transfer_params"), (failing.url, 400, b"too long"),
                                    (rig["p"].url, 502, b"error")):
            server = mod.make_server(mod.Proxy([prefill], [rig["d"].url], timeout_s=5), port=0)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                status, data = post(f"http://127.0.0.1:{server.server_address[1]}/v1/completions",
                                    {"prompt": [1], "max_tokens": 2})
            finally:
                server.shutdown()
                server.server_close()
            assert (status, text in data) == (want, True), (prefill, status, data)
        assert rig["d"].seen == []
        assert post(rig["url"] + "/v1/embeddings", {})[0] == 404
        assert post(rig["url"] + "/v1/completions", [1, 2])[0] == 400
    finally:
        bare.close()
        failing.close()


def test_round_robin() -> None:
    mod = load_proxy()
    proxy = mod.Proxy(["http://a/", "http://b"], ["http://c"])
    assert [proxy.pick() for _ in range(3)] == [("http://a", "http://c"), ("http://b", "http://c"),
                                                ("http://a", "http://c")]
    with pytest.raises(ValueError):
        mod.Proxy([], ["http://c"])

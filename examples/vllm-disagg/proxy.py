"""A disaggregated prefill/decode proxy for vLLM instances that use kvbridge's connector (stdlib only).

    python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to a prefill instance with ``max_tokens=1`` (and ``max_completion_tokens=1``), no
   streaming, and ``kv_transfer_params={"do_remote_decode": true}``: the prefill computes the prompt's KV, keeps
   its blocks, and answers with ``kv_transfer_params`` (kvbridge's ``room``, ``instance``, ``bootstrap``);
2. the client's request, unchanged except for those ``kv_transfer_params``, goes to a decode instance, which
   pulls the KV through kvbridge and generates; its answer (streamed or not) goes back to the client as is.

Instances are picked round-robin. ``GET /v1/models`` is answered by a decode instance; ``GET /health`` checks
every instance. Errors of an instance come back with its status code; an unreachable one gives 502.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kvbridge.vllm-proxy")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """An instance answered with an error (``status`` and its body) or could not be reached (502)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body[:200]!r}")
        self.status, self.body = status, body


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's version of a client request: one token, no streaming, keep the KV for decode."""
    pre = dict(body)
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre["kv_transfer_params"] = dict(body.get("kv_transfer_params") or {}) | {"do_remote_decode": True,
                                                                             "do_remote_prefill": False}
    return pre


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's request for the decode instance: as sent, with the prefill's ``kv_transfer_params``."""
    return dict(body) | {"kv_transfer_params": kv_transfer_params}


class Proxy:
    """Round-robin over prefill and decode instances (base URLs like ``http://host:port``)."""

    def __init__(self, prefill: list[str], decode: list[str], *, timeout_s: float = 300.0) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode instance")
        self.prefill, self.decode, self.timeout_s = list(prefill), list(decode), timeout_s
        self._next_prefill, self._next_decode = itertools.cycle(self.prefill), itertools.cycle(self.decode)
        self._lock = threading.Lock()

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._next_prefill).rstrip("/"), next(self._next_decode).rstrip("/")

    def open(self, url: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise UpstreamError(exc.code, exc.read()) from None
        except (OSError, urllib.error.URLError) as exc:
            raise UpstreamError(502, json.dumps({"error": f"{url}: {exc}"}).encode()) from None

    def prefill_params(self, prefill: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run the prefill and return its ``kv_transfer_params`` (what the decode instance needs)."""
        with self.open(prefill + path, prefill_request(body)) as resp:
            answer = json.loads(resp.read())
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise UpstreamError(502, json.dumps({"error": f"prefill {prefill} returned no kv_transfer_params "
                                                          "(is it a kvbridge kv_producer?)"}).encode())
        return params

    def generate(self, path: str, body: dict[str, Any]) -> tuple[int, str, Iterator[bytes]]:
        """Prefill, then decode: (status, content type, body chunks of the decode instance's answer)."""
        prefill, decode = self.pick()
        params = self.prefill_params(prefill, path, body)
        log.info("%s: prefill %s -> decode %s, room %s", path, prefill, decode, params.get("room"))
        resp = self.open(decode + path, decode_request(body, params))

        def chunks() -> Iterator[bytes]:
            with resp:
                while chunk := resp.read1(65536):
                    yield chunk
        return resp.status, resp.headers.get("Content-Type", "application/json"), chunks()


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.0: an answer ends when the connection closes (streamed answers need no chunked encoding)."""

    proxy: Proxy

    def _send(self, status: int, content_type: str, chunks: Iterator[bytes] | bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if isinstance(chunks, bytes):
            self.send_header("Content-Length", str(len(chunks)))
            self.end_headers()
            self.wfile.write(chunks)
            return
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
            self.wfile.flush()

    def _error(self, exc: UpstreamError) -> None:
        self._send(exc.status, "application/json", exc.body)

    def do_POST(self) -> None:
        if self.path not in GENERATE_PATHS:
            self._send(404, "application/json", json.dumps({"error": f"no route {self.path}"}).encode())
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
        except ValueError as exc:
            self._send(400, "application/json", json.dumps({"error": f"bad request: {exc}"}).encode())
            return
        try:
            status, content_type, chunks = self.proxy.generate(self.path, body)
        except UpstreamError as exc:
            self._error(exc)
            return
        self._send(status, content_type, chunks)

    def do_GET(self) -> None:
        try:
            if self.path == "/health":
                for url in self.proxy.prefill + self.proxy.decode:
                    self.proxy.open(url.rstrip("/") + "/health", timeout_s=10).close()
                self._send(200, "application/json", b'{"status": "ok"}')
            elif self.path == "/v1/models":
                with self.proxy.open(self.proxy.pick()[1] + "/v1/models", timeout_s=10) as resp:
                    self._send(resp.status, "application/json", resp.read())
            else:
                self._send(404, "application/json", json.dumps({"error": f"no route {self.path}"}).encode())
        except UpstreamError as exc:
            self._error(exc)

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s " + format, self.address_string(), *args)


def make_server(proxy: Proxy, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A threaded HTTP server for ``proxy`` (port 0: any free port, see ``server.server_address``)."""
    handler = type("BoundHandler", (Handler,), {"proxy": proxy})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per upstream request")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    server = make_server(Proxy(args.prefill, args.decode, timeout_s=args.timeout_s), args.host, args.port)
    log.info("proxy on http://%s:%d: prefill %s, decode %s", *server.server_address[:2], args.prefill,
             args.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

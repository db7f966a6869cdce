"""The bootstrap server of a prefill instance, at SGLang's ``--disaggregation-bootstrap-port``.

One HTTP listener (stdlib, a daemon thread) answers what SGLang's decode loop and our ranks ask at the
bootstrap address:

* ``GET /kvbridge`` -> ``{"bootstrap": <kvbridge ZMQ bootstrap address>, "ranks": [rows]}``: the prefill
  ranks' topology (DP rank, PP stage and its layer range, TP size and rank, page size, KV dtype);
* ``PUT /kvbridge/rank`` with one row: a prefill rank registers itself;
* ``POST /register_dp_rank`` / ``POST /query_dp_ranks``: SGLang's own DP routing protocol (same JSON as
  its bootstrap server), so its decode scheduler's ``query_prefill_dp_ranks`` works unchanged;
* ``GET /health`` -> ``OK``.

Next to it runs kvbridge's ZMQ ``BootstrapServer`` (an ephemeral port on the same host) where the rank
agents publish their control addresses, one kvbridge instance per (DP rank, PP stage).

With a secret (kvbridge's one sealing scheme, :mod:`kvbridge.sealing`), every route that reads the topology or
changes anything — ``GET /kvbridge``, ``PUT /kvbridge/rank``, ``POST /register_dp_rank`` — takes only a request
carrying ``X-KVBridge-Nonce`` and ``X-KVBridge-Time`` and an ``X-KVBridge-MAC`` over the method, the path, both
and the body; a request is accepted once and only inside the clock window (``KVBRIDGE_CLOCK_WINDOW_S``), and every
JSON answer is tagged over the request's nonce and the body, so an answer cannot be replayed to another request.
The two writes also name the server's per-life epoch (``X-KVBridge-Server``, from ``GET /kvbridge``): a captured
write is refused by another server with the same secret and by this one after a restart.
Two routes stay open because SGLang's own code calls them without a tag: ``POST /query_dp_ranks`` (SGLang's
decode scheduler; it reads which DP rank serves a room and changes nothing) and ``GET /health``. Without a
secret, anybody who reaches the port can register a rank (the kvbridge handshake still refuses a peer whose
layout differs).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvbridge.addresses import format_tcp
from kvbridge.clockskew import Clock, clock_window_from_env
from kvbridge.logs import LineBudget
from kvbridge.sealing import NONCE_BYTES, Busy, FreshnessGuard, Replayed, Stale, matches, new_nonce, tag
from kvbridge.zmq_link import BootstrapServer, check_exposure

log = logging.getLogger("kvbridge.sglang")

_ROOMS = 1 << 16          # DP routing entries kept (oldest dropped)
_ROOM_TTL_S = 600.0


def instance_name(dp_rank: int, pp_rank: int) -> str:
    """The kvbridge instance of one (DP rank, PP stage) of a prefill server."""
    return f"sglang-dp{dp_rank}-pp{pp_rank}"


_REQUEST_PURPOSE = b"kvbridge-sglang-request"
_ANSWER_PURPOSE = b"kvbridge-sglang-answer"
_SEALED_ROUTES = frozenset({("GET", "/kvbridge"), ("PUT", "/kvbridge/rank"), ("POST", "/register_dp_rank")})
#: routes that change the server's tables: a sealed request names the server (its per-life epoch, from
#: ``GET /kvbridge``), so it cannot be replayed to another server with the same secret, or to this one restarted
_WRITES = frozenset({("PUT", "/kvbridge/rank"), ("POST", "/register_dp_rank")})
_CONNECTIONS = 64          # HTTP connections served at once; more wait in the listen queue
_SOCKET_TIMEOUT_S = 10.0   # a client that stops sending mid-request is dropped after this long


def _request_tag(secret: bytes, method: str, path: str, nonce: bytes, sent_at: str, server: str,
                 body: bytes) -> bytes:
    return tag(secret, _REQUEST_PURPOSE, method.encode(), path.encode(), nonce, sent_at.encode(), server.encode(),
               body)


def _answer_tag(secret: bytes, nonce: bytes, body: bytes) -> bytes:
    return tag(secret, _ANSWER_PURPOSE, nonce, body)


STALE_SERVER = "stale server epoch"


class _BoundedHTTPServer(ThreadingHTTPServer):
    """At most ``slots`` connections served at once (a thread each); the rest wait in the listen queue."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 slots: threading.BoundedSemaphore) -> None:
        self._slots = slots
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that vanished or stalled past the socket timeout: a debug line, not a traceback on stderr."""
        log.debug("bootstrap http: request from %s ended early", client_address, exc_info=True)


class TopologyServer:
    """The HTTP listener and the kvbridge ZMQ bootstrap server of one prefill instance."""

    def __init__(self, host: str, port: int, *, secret: bytes | None = None, clock: Clock = time.time,
                 allow_insecure: bool = False) -> None:
        self.secret = secret
        self.clock = clock            # the wall clock requests' times are judged by (injectable for tests)
        self.fresh = FreshnessGuard(window_s=clock_window_from_env())
        self.refused = 0              # requests refused for their tag, nonce, time or server
        self.epoch = secrets.token_hex(16)     # this server's life: sealed writes name it
        self.refusal_log = LineBudget(per_interval=5, interval_s=60.0)
        self.slots = threading.BoundedSemaphore(_CONNECTIONS)
        zhost = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        check_exposure("SGLang HTTP bootstrap", format_tcp(host or "0.0.0.0", port), secret=secret,
                       allow_insecure=allow_insecure)
        self.zmq = BootstrapServer(f"tcp://{zhost}:0", secret=secret, allow_insecure=allow_insecure).start()
        self.ranks: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.lock = threading.Lock()
        self.http = _BoundedHTTPServer((host, port), _handler(self), slots=self.slots)
        self.http.daemon_threads = True
        bound_host, bound_port = self.http.server_address[:2]
        self.address = f"{bound_host!s}:{int(bound_port)}"
        self._thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvbridge-sglang-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.zmq.close()


def _handler(server: TopologyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("bootstrap http: " + format, *args)

        nonce = b""
        timeout = _SOCKET_TIMEOUT_S

        def _send(self, code: int, body: bytes, content: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content)
            self.send_header("Content-Length", str(len(body)))
            if content == "application/json" and server.secret is not None and self.nonce:
                self.send_header("X-KVBridge-MAC", _answer_tag(server.secret, self.nonce, body).hex())
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            return self.rfile.read(max(0, min(length, 1 << 20)))

        def _admitted(self, method: str, body: bytes) -> bool:
            """With a secret, whether a request to a sealed route is authentic and fresh (else answered 403)."""
            self.nonce = b""
            if server.secret is None or (method, self.path) not in _SEALED_ROUTES:
                return True
            why = ""
            try:
                nonce = bytes.fromhex(self.headers.get("X-KVBridge-Nonce", ""))
                sent_at = self.headers.get("X-KVBridge-Time", "")
                named = self.headers.get("X-KVBridge-Server", "")
                got = bytes.fromhex(self.headers.get("X-KVBridge-MAC", ""))
            except ValueError:
                nonce, sent_at, named, got = b"", "", "", b""
            if len(nonce) != NONCE_BYTES or not matches(server.secret, _REQUEST_PURPOSE, got, method.encode(),
                                                        self.path.encode(), nonce, sent_at.encode(), named.encode(),
                                                        body):
                why = "bad or missing X-KVBridge-MAC/-Nonce/-Time (is the secret the same?)"
            elif (method, self.path) in _WRITES and named != server.epoch:
                why = ("sealed for another bootstrap server, or for this one before it restarted "
                       f"({STALE_SERVER}: fetch /kvbridge again)")
            else:
                try:
                    with server.lock:
                        server.fresh.admit(nonce, sent_at=float(sent_at), now=server.clock())
                except (Stale, Replayed, Busy) as exc:
                    why = str(exc)
                except ValueError:
                    why = f"X-KVBridge-Time {sent_at[:40]!r} is not a number"
            if why:
                with server.lock:
                    server.refused += 1
                peer = str(self.client_address[0])
                if server.refusal_log.take(peer):       # a flood of forged requests must not flood the log
                    log.warning("bootstrap http: refused %s %s from %s: %s%s", method, self.path[:80], peer, why,
                                server.refusal_log.suppressed_note(peer))
                self._send(403, json.dumps({"error": why}).encode())
                return False
            self.nonce = nonce
            return True

        def do_GET(self) -> None:
            if not self._admitted("GET", b""):
                return
            if self.path == "/health":
                self._send(200, b"OK", "text/plain")
            elif self.path == "/kvbridge":
                with server.lock:
                    body = json.dumps({"bootstrap": server.zmq.address, "ranks": list(server.ranks.values()),
                                       "time": time.time(), "epoch": server.epoch}).encode()
                self._send(200, body)
            else:
                self._send(404, b'{"error": "unknown route"}')

        def do_PUT(self) -> None:
            if self.path != "/kvbridge/rank":
                self._send(404, b'{"error": "unknown route"}')
                return
            body = self._body()
            if not self._admitted("PUT", body):
                return
            try:
                row = json.loads(body)
                key = (int(row["dp_rank"]), int(row["pp_rank"]), int(row["tp_rank"]))
                for field in ("dp_size", "pp_size", "tp_size", "start_layer", "end_layer", "page_size"):
                    int(row[field])
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, json.dumps({"error": f"bad rank row: {exc}"}).encode())
                return
            with server.lock:
                server.ranks[key] = row
            self._send(200, b"{}")

        def do_POST(self) -> None:
            body = self._body()
            if not self._admitted("POST", body):
                return
            try:
                payload = json.loads(body or b"{}")
            except ValueError:
                self._send(400, b'{"error": "bad json"}')
                return
            now = time.monotonic()
            if self.path == "/register_dp_rank":
                try:
                    room, dp = int(payload["bootstrap_room"]), int(payload["dp_rank"])
                except (KeyError, TypeError, ValueError):
                    self._send(400, b'{"error": "need bootstrap_room and dp_rank"}')
                    return
                with server.lock:
                    server.rooms[room] = (dp, now)
                    server.rooms.move_to_end(room)
                    while len(server.rooms) > _ROOMS or (
                            server.rooms and now - next(iter(server.rooms.values()))[1] > _ROOM_TTL_S):
                        server.rooms.popitem(last=False)
                self._send(200, b"{}")
            elif self.path == "/query_dp_ranks":          # open (SGLang's own decode calls it): checked input only
                rooms = payload.get("bootstrap_rooms") if isinstance(payload, dict) else None
                if (not isinstance(rooms, list) or len(rooms) > _ROOMS
                        or not all(isinstance(r, int) and not isinstance(r, bool) for r in rooms)):
                    self._send(400, b'{"error": "need bootstrap_rooms: a list of integers"}')
                    return
                with server.lock:
                    found = {str(r): server.rooms[r][0] for r in rooms if r in server.rooms}
                self._send(200, json.dumps(found).encode())
            else:
                self._send(404, b'{"error": "unknown route"}')

    return Handler


# ---------------------------------------------------------------------------------------------- client


def _request(url: str, *, method: str = "GET", body: bytes | None = None, secret: bytes | None = None,
             timeout_s: float = 5.0, server: str = "") -> bytes:
    """One request; with a secret, sealed (nonce, time, the server's epoch, tag) and its answer checked against
    that nonce."""
    headers = {"Content-Type": "application/json"}
    nonce = new_nonce()
    if secret is not None:
        sent_at = repr(time.time())
        path = urllib.parse.urlsplit(url).path
        headers |= {"X-KVBridge-Nonce": nonce.hex(), "X-KVBridge-Time": sent_at, "X-KVBridge-Server": server,
                    "X-KVBridge-MAC": _request_tag(secret, method, path, nonce, sent_at, server, body or b"").hex()}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data: bytes = resp.read()
        if secret is not None:
            try:
                got = bytes.fromhex(resp.headers.get("X-KVBridge-MAC", ""))
            except ValueError:
                got = b""
            if not matches(secret, _ANSWER_PURPOSE, got, nonce, data):
                raise PermissionError(f"{url}: answer without a valid X-KVBridge-MAC for this request (is the "
                                      "secret the same?)")
        return data


def fetch(addr: str, *, secret: bytes | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The topology at bootstrap address ``host:port``."""
    answer: dict[str, Any] = json.loads(_request(f"http://{addr}/kvbridge", secret=secret, timeout_s=timeout_s))
    return answer


_EPOCHS: dict[str, str] = {}          # bootstrap address -> the server's epoch last fetched (sealed writes name it)


def _write(addr: str, path: str, method: str, body: bytes, *, secret: bytes | None, timeout_s: float) -> None:
    """A table-changing request; with a secret it names the server's epoch (fetched once, and again when the
    server says it restarted)."""
    if secret is None:
        _request(f"http://{addr}{path}", method=method, body=body, timeout_s=timeout_s)
        return
    for attempt in range(2):
        epoch = _EPOCHS.get(addr)
        if epoch is None:
            epoch = _EPOCHS[addr] = str(fetch(addr, secret=secret, timeout_s=timeout_s).get("epoch", ""))
        try:
            _request(f"http://{addr}{path}", method=method, body=body, secret=secret, timeout_s=timeout_s,
                     server=epoch)
            return
        except urllib.error.HTTPError as exc:
            if attempt or exc.code != 403 or STALE_SERVER not in exc.read().decode(errors="replace"):
                raise
            _EPOCHS.pop(addr, None)          # the server restarted (or the address moved): learn its epoch again


def register(addr: str, row: dict[str, Any], *, secret: bytes | None = None, timeout_s: float = 5.0) -> None:
    _write(addr, "/kvbridge/rank", "PUT", json.dumps(row).encode(), secret=secret, timeout_s=timeout_s)


def register_dp_rank(addr: str, room: int, dp_rank: int, *, secret: bytes | None = None,
                     timeout_s: float = 5.0) -> None:
    body = json.dumps({"bootstrap_room": int(room), "dp_rank": int(dp_rank)}).encode()
    _write(addr, "/register_dp_rank", "POST", body, secret=secret, timeout_s=timeout_s)


def wait_for(addr: str, *, secret: bytes | None, timeout_s: float) -> dict[str, Any]:
    """The topology, retried until the server answers (a prefill rank may start before it)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            return fetch(addr, secret=secret)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvbridge-sglang bootstrap server at {addr} did not answer in {timeout_s} s") \
                    from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


@dataclass(frozen=True, slots=True)
class Stage:
    """One PP stage of one DP rank of a prefill server: its kvbridge instance and layers."""

    dp_rank: int
    pp_rank: int
    layers: range
    instance: str
    last: bool


@dataclass(frozen=True, slots=True)
class Topology:
    """A complete prefill server as its ranks registered it."""

    bootstrap: str
    tp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_cache_dtype: str
    follow_bootstrap_room: bool
    stages: tuple[Stage, ...]

    @classmethod
    def parse(cls, answer: dict[str, Any]) -> Topology | None:
        """None while some rank has not registered yet."""
        rows = answer.get("ranks") or []
        if not rows:
            return None
        first = rows[0]
        tp, dp, pp = int(first["tp_size"]), int(first["dp_size"]), int(first["pp_size"])
        have = {(int(r["dp_rank"]), int(r["pp_rank"]), int(r["tp_rank"])) for r in rows}
        if len(have) < tp * dp * pp or any((d, p, t) not in have for d in range(dp) for p in range(pp)
                                           for t in range(tp)):
            return None
        ranges: dict[tuple[int, int], range] = {}
        for r in rows:
            ranges.setdefault((int(r["dp_rank"]), int(r["pp_rank"])), range(int(r["start_layer"]), int(r["end_layer"])))
        stages = tuple(Stage(d, p, ranges[(d, p)], instance_name(d, p), p == pp - 1)
                       for d in range(dp) for p in range(pp))
        return cls(bootstrap=str(answer["bootstrap"]), tp_size=tp, dp_size=dp, pp_size=pp,
                   page_size=int(first["page_size"]), kv_cache_dtype=str(first.get("kv_cache_dtype", "")),
                   follow_bootstrap_room=bool(first.get("follow_bootstrap_room", True)), stages=stages)

    def stages_of(self, dp_rank: int) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.dp_rank == dp_rank)

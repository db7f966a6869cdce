"""The SGLang HTTP bootstrap with a secret, attacked: every route that reads the topology or changes anything
refuses unsigned, forged, replayed, stale and re-targeted requests; answers are bound to their request; the two
routes SGLang's own code calls untagged stay open and change nothing. Runs in the main venv (the bootstrap module
imports no SGLang)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvbridge_sglang import bootstrap
from kvbridge_sglang.bootstrap import TopologyServer

SECRET = b"sglang-http-bootstrap-secret-012"
ROW = {"dp_rank": 0, "pp_rank": 0, "tp_rank": 0, "dp_size": 1, "pp_size": 1, "tp_size": 1, "start_layer": 0,
       "end_layer": 2, "page_size": 16, "kv_cache_dtype": "bfloat16", "instance": "sglang-dp0-pp0",
       "backend": "loopback"}


@pytest.fixture
def server() -> Iterator[TopologyServer]:
    srv = TopologyServer("127.0.0.1", 0, secret=SECRET)
    try:
        yield srv
    finally:
        srv.close()


class Captured:
    """The last request a client sent, recorded at the urllib seam (an attacker on the path sees as much)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.request: urllib.request.Request | None = None
        real = urllib.request.urlopen

        def spy(req: urllib.request.Request, *args: object, **kwargs: object) -> object:
            self.request = req
            return real(req, *args, **kwargs)             # type: ignore[arg-type]

        monkeypatch.setattr(bootstrap.urllib.request, "urlopen", spy)

    def resend(self, *, url: str | None = None, method: str | None = None, data: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        assert self.request is not None
        req = urllib.request.Request(url or self.request.full_url,
                                     data=self.request.data if data is None else data,
                                     method=method or self.request.get_method(),
                                     headers=dict(self.request.header_items()) | (headers or {}))
        return raw(req)


def raw(req: urllib.request.Request) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def plain(server: TopologyServer, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    return raw(urllib.request.Request(f"http://{server.address}{path}", data=body, method=method,
                                      headers={"Content-Type": "application/json"}))


def test_signed_clients_work_and_unsigned_writes_are_refused(server: TopologyServer) -> None:
    bootstrap.register(server.address, ROW, secret=SECRET)
    bootstrap.register_dp_rank(server.address, 7, 0, secret=SECRET)
    assert bootstrap.fetch(server.address, secret=SECRET)["ranks"] == [ROW]
    before = server.refused
    forged = dict(ROW, tp_rank=5, tp_size=8)
    assert plain(server, "PUT", "/kvbridge/rank", json.dumps(forged).encode())[0] == 403
    assert plain(server, "POST", "/register_dp_rank", b'{"bootstrap_room": 7, "dp_rank": 3}')[0] == 403
    assert plain(server, "GET", "/kvbridge")[0] == 403
    with pytest.raises(urllib.error.HTTPError) as caught:
        bootstrap.register(server.address, forged, secret=b"another-secret-0123456789abcdefg")
    assert caught.value.code == 403
    assert server.refused == before + 4
    assert list(server.ranks.values()) == [ROW]
    assert server.rooms[7][0] == 0                         # the forged DP rank did not land


def test_a_captured_request_cannot_be_replayed_retargeted_or_altered(server: TopologyServer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Captured(monkeypatch)
    bootstrap.register_dp_rank(server.address, 9, 0, secret=SECRET)
    assert spy.resend()[0] == 403                                               # replayed as is
    base = f"http://{server.address}"
    assert spy.resend(url=f"{base}/kvbridge/rank", method="PUT")[0] == 403     # to another route
    assert spy.resend(data=b'{"bootstrap_room": 9, "dp_rank": 1}',
                      headers={"X-KVBridge-Nonce": "ab" * 16})[0] == 403        # new body, fresh nonce
    assert server.rooms[9][0] == 0
    bootstrap.register(server.address, ROW, secret=SECRET)
    assert spy.resend()[0] == 403


def test_a_stale_or_future_request_is_refused_with_the_offset(server: TopologyServer) -> None:
    for skew in (-3600.0, 3600.0):
        server.clock = lambda skew=skew: time.time() + skew             # the server's clock is an hour off
        with pytest.raises(urllib.error.HTTPError) as caught:
            bootstrap.register(server.address, ROW, secret=SECRET)
        assert caught.value.code == 403
        assert "window" in json.loads(caught.value.read())["error"]
    assert server.ranks == {}
    server.clock = time.time
    bootstrap.register(server.address, ROW, secret=SECRET)


def test_an_answer_is_bound_to_its_request(server: TopologyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A man in the middle replays yesterday's (authentic) topology answer to today's request: refused."""
    bootstrap.register(server.address, ROW, secret=SECRET)
    spy = Captured(monkeypatch)
    bootstrap.fetch(server.address, secret=SECRET)
    assert spy.request is not None
    old_nonce = spy.request.get_header("X-kvbridge-nonce")
    assert old_nonce
    answer_body = json.dumps({"bootstrap": "tcp://198.18.0.1:1", "ranks": [ROW], "time": time.time()}).encode()
    old_tag = bootstrap._answer_tag(SECRET, bytes.fromhex(old_nonce), answer_body).hex()

    class Replay:
        status = 200
        headers = {"X-KVBridge-MAC": old_tag}

        def read(self) -> bytes:
            return answer_body

        def __enter__(self) -> Replay:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(bootstrap.urllib.request, "urlopen", lambda *a, **k: Replay())
    with pytest.raises(PermissionError, match="X-KVBridge-MAC"):
        bootstrap.fetch(server.address, secret=SECRET)


def test_sglang_routes_stay_open_and_change_nothing(server: TopologyServer) -> None:
    bootstrap.register_dp_rank(server.address, 11, 0, secret=SECRET)
    code, body = plain(server, "POST", "/query_dp_ranks", b'{"bootstrap_rooms": [11, 12]}')
    assert code == 200 and json.loads(body) == {"11": 0}
    assert plain(server, "GET", "/health") == (200, b"OK")


def test_garbage_headers_are_refused_and_the_server_keeps_serving(server: TopologyServer) -> None:
    garbage = [{"X-KVBridge-Nonce": "zz", "X-KVBridge-Time": "1", "X-KVBridge-MAC": "00"},
               {"X-KVBridge-Nonce": "ab" * 16, "X-KVBridge-Time": "nan", "X-KVBridge-MAC": "00" * 32},
               {"X-KVBridge-Nonce": "ab" * 16, "X-KVBridge-Time": "x" * 10_000, "X-KVBridge-MAC": "g" * 64},
               {"Content-Length": "-5"}]
    for headers in garbage:
        req = urllib.request.Request(f"http://{server.address}/kvbridge/rank", data=b"{}", method="PUT",
                                     headers=headers)
        assert raw(req)[0] in (400, 403)
    bootstrap.register(server.address, ROW, secret=SECRET)
    assert bootstrap.fetch(server.address, secret=SECRET)["ranks"] == [ROW]


def test_a_flood_of_forged_requests_leaves_signed_clients_served(server: TopologyServer) -> None:
    stop = time.monotonic() + 3.0
    sent = [0]

    def flood() -> None:
        while time.monotonic() < stop and sent[0] < 2_000:
            plain(server, "POST", "/register_dp_rank", b'{"bootstrap_room": 1, "dp_rank": 1}')
            sent[0] += 1

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for room in range(20):
            bootstrap.register_dp_rank(server.address, 100 + room, 0, secret=SECRET)
    finally:
        for t in threads:
            t.join()
    assert all(server.rooms[100 + r][0] == 0 for r in range(20))
    assert 1 not in server.rooms
    assert server.refused >= sent[0] > 0


def test_without_a_secret_everything_is_open_as_before() -> None:
    srv = TopologyServer("127.0.0.1", 0)
    try:
        bootstrap.register(srv.address, ROW)
        bootstrap.register_dp_rank(srv.address, 3, 0)
        assert bootstrap.fetch(srv.address)["ranks"] == [ROW]
        assert srv.rooms[3][0] == 0
    finally:
        srv.close()


def test_every_interface_without_a_secret_needs_the_opt_in() -> None:
    from kvbridge.errors import InsecureSetup
    from kvbridge_sglang.settings import Settings

    with pytest.raises(InsecureSetup, match="SGLang HTTP bootstrap bound at tcp://0.0.0.0"):
        TopologyServer("0.0.0.0", 0)
    TopologyServer("0.0.0.0", 0, secret=SECRET).close()
    TopologyServer("0.0.0.0", 0, allow_insecure=True).close()
    assert Settings.from_env(env={"KVBRIDGE_ALLOW_INSECURE": "1"}).allow_insecure
    assert not Settings.from_env(env={}).allow_insecure


def test_a_sealed_write_cannot_be_replayed_to_another_server_or_a_restarted_one(
        server: TopologyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers of one cluster share the secret (and SGLang's instance names): a write names its server's epoch."""
    other = TopologyServer("127.0.0.1", 0, secret=SECRET)
    try:
        spy = Captured(monkeypatch)
        bootstrap.register(server.address, ROW, secret=SECRET)
        bootstrap.register_dp_rank(server.address, 5, 0, secret=SECRET)
        assert spy.resend(url=f"http://{other.address}/register_dp_rank")[0] == 403
        assert other.rooms == {} and other.ranks == {}
        port = int(server.address.rsplit(":", 1)[1])
        server.close()
        reborn = TopologyServer("127.0.0.1", port, secret=SECRET)     # same address, new life
        try:
            assert spy.resend()[0] == 403                             # inside the clock window, fresh nonce cache
            assert reborn.rooms == {}
            bootstrap.register_dp_rank(reborn.address, 6, 1, secret=SECRET)   # the client learns the new epoch
            assert reborn.rooms[6][0] == 1
        finally:
            reborn.close()
    finally:
        other.close()


def test_malformed_queries_on_the_open_route_get_400_and_the_server_goes_on(server: TopologyServer) -> None:
    for body in (b'{"bootstrap_rooms": ["x"]}', b'{"bootstrap_rooms": 5}', b"[1]", b"[1e999]",
                 b'{"bootstrap_rooms": [true]}', b'{"bootstrap_rooms": [1.5]}'):
        assert plain(server, "POST", "/query_dp_ranks", body)[0] == 400, body
    bootstrap.register_dp_rank(server.address, 8, 0, secret=SECRET)
    assert plain(server, "POST", "/query_dp_ranks", b'{"bootstrap_rooms": [8]}') == (200, b'{"8": 0}')


def test_stalled_connections_cannot_starve_the_server(server: TopologyServer) -> None:
    """80 clients that stop mid-request hold at most the server's connection slots, each for its socket timeout;
    a signed client is served once slots free up, and the thread count stays bounded."""
    import socket

    host, port = server.address.rsplit(":", 1)
    before = threading.active_count()
    stalled = []
    try:
        for _ in range(80):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"PUT /kvbridge/rank HTTP/1.0\r\nContent-Length: 1000\r\n\r\n{")
            stalled.append(sock)
        time.sleep(0.5)
        assert threading.active_count() <= before + 64 + 2
        started = time.monotonic()
        assert bootstrap.fetch(server.address, secret=SECRET, timeout_s=30.0)["ranks"] == []
        assert time.monotonic() - started < 25
    finally:
        for sock in stalled:
            sock.close()


def test_a_flood_of_refusals_logs_a_few_lines(server: TopologyServer, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="kvbridge.sglang"):
        for _ in range(50):
            assert plain(server, "GET", "/kvbridge")[0] == 403
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refused) <= 5
    assert server.refused >= 50

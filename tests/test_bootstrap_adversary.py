"""Adversarial tests of the embedded ZMQ bootstrap server (discovery): rogue frames must not kill its thread
or block other clients, an unauthenticated publish must not register anything, a replayed registration must
not override a newer one."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvbridge.discovery import DiscoveryError
from kvbridge.links import InstanceInfo
from kvbridge.sealing import seal
from kvbridge.zmq_link import (
    BootstrapServer,
    ZmqBootstrap,
    _Answer,
    _Lookup,
    _Publish,
    _Watch,
)

SECRET = b"adv-ops-bootstrap-secret-0123456"


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer().start()
    yield srv
    srv.close()


@pytest.fixture
def secured() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(secret=SECRET).start()
    yield srv
    srv.close()


def _raw_ask(url: str, frame: bytes, timeout_ms: int = 1500) -> bytes | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(url)
    try:
        sock.send(frame)
        return sock.recv()
    except zmq.Again:
        return None
    finally:
        sock.close(0)


def _alive(server: BootstrapServer, secret: bytes | None = None) -> bool:
    """A fresh, well-behaved client can still publish and look up within a bounded time."""
    client = ZmqBootstrap(server.address, secret=secret, timeout_s=2.0, republish_s=0)
    try:
        client.publish("probe", 1, 0, "tcp://127.0.0.1:4242")
        info = client.lookup("probe")
        return info is not None and info.addresses == {0: "tcp://127.0.0.1:4242"}
    except DiscoveryError:
        return False
    finally:
        client.withdraw("probe", 0)
        client.close()


def test_malformed_frames_do_not_kill_the_server(server: BootstrapServer) -> None:
    ctx = zmq.Context.instance()
    garbage = [b"", b"\x00", b"\xff" * 100, msgspec.msgpack.encode({"type": "nope"}),
               msgspec.msgpack.encode({"type": "publish"}), msgspec.msgpack.encode([1, 2, 3]),
               msgspec.msgpack.encode({"type": "publish", "instance": "x", "tp_size": -1, "rank": 0,
                                       "address": "tcp://127.0.0.1:1"}),
               msgspec.msgpack.encode({"type": "publish", "instance": "x", "tp_size": 1, "rank": 0,
                                       "address": "tcp://0.0.0.0:1"})]
    for frame in garbage:
        _raw_ask(server.address, frame)
    # frames without the REQ delimiter, extra frames, and a frame over the size limit
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.address)
    try:
        dealer.send(b"no-delimiter")
        dealer.send_multipart([b"", b"a", b"b", b"c"])
        dealer.send_multipart([b"", b"x" * (2 << 20)])
    finally:
        dealer.close(0)
    time.sleep(0.3)
    assert server._thread is not None and server._thread.is_alive()
    assert _alive(server)


def test_a_watch_with_a_nan_wait_does_not_kill_the_server(server: BootstrapServer) -> None:
    """A long poll carries the time the client wants to wait; a NaN (or inf) there must not take down the
    serving thread for everyone."""
    first = _raw_ask(server.address, msgspec.msgpack.encode(_Watch(instance="")))
    assert first is not None
    answer = msgspec.msgpack.Decoder(_Answer).decode(first)
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(server.address)
    try:
        for wait in (math.nan, math.inf):
            rogue.send_multipart([b"", msgspec.msgpack.encode(
                _Watch(instance="", since=answer.revision, epoch=answer.epoch, wait_s=wait))])
        time.sleep(0.5)
        assert server._thread is not None and server._thread.is_alive(), "the bootstrap thread died"
        assert _alive(server), "the bootstrap server stopped answering after a rogue watch"
    finally:
        rogue.close(0)


def test_a_lookup_flood_does_not_starve_another_client(server: BootstrapServer) -> None:
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.SNDHWM, 100000)
    rogue.connect(server.address)
    frame = msgspec.msgpack.encode(_Lookup(instance="x" * 10000))
    try:
        for _ in range(5000):
            try:
                rogue.send_multipart([b"", frame], zmq.NOBLOCK)
            except zmq.Again:
                break
        started = time.monotonic()
        assert _alive(server)
        assert time.monotonic() - started < 4.0
    finally:
        rogue.close(0)


def test_many_parked_watches_do_not_block_other_clients(server: BootstrapServer) -> None:
    first = msgspec.msgpack.Decoder(_Answer).decode(
        _raw_ask(server.address, msgspec.msgpack.encode(_Watch(instance=""))) or b"")
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.SNDHWM, 100000)
    rogue.connect(server.address)
    frame = msgspec.msgpack.encode(_Watch(instance="", since=first.revision, epoch=first.epoch, wait_s=5.0))
    try:
        for _ in range(3000):
            try:
                rogue.send_multipart([b"", frame], zmq.NOBLOCK)
            except zmq.Again:
                break
        time.sleep(0.3)
        started = time.monotonic()
        assert _alive(server)
        assert time.monotonic() - started < 4.0, f"took {time.monotonic() - started:.1f} s"
    finally:
        rogue.close(0)


def test_with_a_secret_an_unauthenticated_publish_registers_nothing(secured: BootstrapServer) -> None:
    plain = _Publish(instance="victim", tp_size=1, rank=0, address="tcp://127.0.0.1:6666", lease_s=0)
    reply = _raw_ask(secured.address, msgspec.msgpack.encode(plain))
    # forged tag, and the right body under a tag of another secret
    _raw_ask(secured.address, b"\x00" * 32 + msgspec.msgpack.encode(plain))
    stamped = msgspec.structs.replace(plain, nonce=os.urandom(16), time=time.time())
    _raw_ask(secured.address, seal(b"another-secret-xxxxxxxxxxxxxxxxx", b"bootstrap-request",
                                    msgspec.msgpack.encode(stamped)))
    del reply
    reader = ZmqBootstrap(secured.address, secret=SECRET, republish_s=0)
    try:
        assert reader.lookup("victim") is None
    finally:
        reader.close()
    assert secured.rejected >= 3


def test_a_replayed_registration_does_not_override_a_newer_one(secured: BootstrapServer) -> None:
    """Capture rank 0's (authenticated) publication of the old life of an instance, let a new life publish
    rank 0 elsewhere, replay the capture: the new address must stay."""
    old = msgspec.structs.replace(
        _Publish(instance="inst", tp_size=1, rank=0, address="tcp://127.0.0.1:7001", lease_s=0),
        nonce=os.urandom(16), time=time.time())
    captured = seal(SECRET, b"bootstrap-request", msgspec.msgpack.encode(old))
    assert _raw_ask(secured.address, captured) is not None
    new = ZmqBootstrap(secured.address, secret=SECRET, republish_s=0)
    try:
        new.publish("inst", 1, 0, "tcp://127.0.0.1:7002")
        _raw_ask(secured.address, captured)                    # the replay
        info = new.lookup("inst")
        assert info is not None and info.addresses == {0: "tcp://127.0.0.1:7002"}
    finally:
        new.close()


def test_an_authenticated_client_with_a_stale_clock_is_refused_not_hung(secured: BootstrapServer) -> None:
    stale = msgspec.structs.replace(
        _Publish(instance="stale", tp_size=1, rank=0, address="tcp://127.0.0.1:7003"),
        nonce=os.urandom(16), time=time.time() - 3600)
    started = time.monotonic()
    reply = _raw_ask(secured.address, seal(SECRET, b"bootstrap-request", msgspec.msgpack.encode(stale)))
    assert reply is not None and time.monotonic() - started < 2
    reader = ZmqBootstrap(secured.address, secret=SECRET, republish_s=0)
    try:
        assert reader.lookup("stale") is None
    finally:
        reader.close()


def test_a_lookup_of_an_unreachable_server_is_bounded() -> None:
    client = ZmqBootstrap("tcp://127.0.0.1:9", timeout_s=0.5, republish_s=0)
    try:
        started = time.monotonic()
        assert client.lookup("anything") is None
        assert time.monotonic() - started < 2.0
        with pytest.raises(DiscoveryError, match="did not answer"):
            client.publish("x", 1, 0, "tcp://127.0.0.1:7004")
    finally:
        client.close()


def test_a_restart_under_the_same_name_is_never_mixed_with_the_dead_life(server: BootstrapServer) -> None:
    """Old life TP 2 (ranks 0, 1, leases still running after a SIGKILL); the new life has published rank 0 so
    far: a lookup must not give a complete instance of the new rank 0 and the dead rank 1."""
    old = ZmqBootstrap(server.address, republish_s=2.0, lease_s=10.0)
    new = ZmqBootstrap(server.address, republish_s=0)
    try:
        old.publish("mixed", 2, 0, "tcp://127.0.0.10:20000")
        old.publish("mixed", 2, 1, "tcp://127.0.0.11:20001")
        old._stop.set()                       # "SIGKILL": no more republication, no withdrawal
        old._published.clear()
        new.publish("mixed", 2, 0, "tcp://127.0.0.99:30000")
        info = new.lookup("mixed")
        assert info is not None
        assert not (info.complete and info.addresses.get(1) == "tcp://127.0.0.11:20001"), \
            f"a complete instance mixing the new rank 0 with the dead rank 1: {info}"
    finally:
        new.close()
        old.close()


def test_an_unencodable_instance_name_is_a_discovery_error(server: BootstrapServer) -> None:
    client = ZmqBootstrap(server.address, republish_s=0)
    try:
        with pytest.raises(DiscoveryError):
            client.publish("bad\udc80name", 1, 0, "tcp://127.0.0.1:22001")
        assert client.lookup("bad\udc80name") is None
    finally:
        client.close()


ODD_NAMES = ["a/b", "..", "../escape", "%2F", "名前-α", "new\nline", "*", "L" * 256]


def test_odd_instance_names_round_trip_and_stay_apart(server: BootstrapServer) -> None:
    client = ZmqBootstrap(server.address, republish_s=0)
    try:
        for i, name in enumerate(ODD_NAMES):
            client.publish(name, 1, 0, f"tcp://127.0.0.1:{21000 + i}")
        for i, name in enumerate(ODD_NAMES):
            assert client.lookup(name) == InstanceInfo(1, {0: f"tcp://127.0.0.1:{21000 + i}"}), name
        for other in ("a", "b", "escape", "/", "L" * 255):
            assert client.lookup(other) is None
        with pytest.raises(DiscoveryError):
            client.publish("L" * 257, 1, 0, "tcp://127.0.0.1:22000")
        assert client.lookup("x" * 2_000_000) is None          # over the request size: refused, not hung
    finally:
        client.close()


def test_a_decode_that_finds_a_dead_prefills_registration_fails_clearly_not_hangs(server: BootstrapServer) -> None:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.zmq_link import ZmqLink

    ghost = ZmqBootstrap(server.address, republish_s=0)
    ghost.publish("ghost", 1, 0, "tcp://127.0.0.1:9")           # nobody listens there (the dead prefill)
    pool = KVPool(1, 0, role="decode")
    dec = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.DECODE, backend="loopback",
                        link=ZmqLink(bootstrap=server.address),
                        config=AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=1.0, bootstrap_timeout_s=2.0))
    try:
        dec.start()
        started = time.monotonic()
        with pytest.raises((TimeoutError, ConnectionError)) as err:
            dec.connect("ghost", timeout_s=2.0)
        assert time.monotonic() - started < 4.0
        assert "ghost" in str(err.value)
    finally:
        dec.close()
        pool.close()
        ghost.close()


def test_a_restarted_bootstrap_server_learns_the_ranks_back_and_a_dead_rank_expires() -> None:
    srv = BootstrapServer("tcp://127.0.0.1:0").start()
    address = srv.address
    alive = ZmqBootstrap(address, republish_s=1.0, lease_s=4.0, timeout_s=1.0)
    dead = ZmqBootstrap(address, republish_s=1.0, lease_s=4.0, timeout_s=1.0)
    reader = ZmqBootstrap(address, republish_s=0, timeout_s=1.0)
    try:
        alive.publish("alive", 1, 0, "tcp://127.0.0.1:7100")
        dead.publish("dead", 1, 0, "tcp://127.0.0.1:7101")
        dead._stop.set()                                    # "SIGKILL": it stops re-publishing, withdraws nothing
        dead._published.clear()
        srv.close()
        t0 = time.monotonic()
        assert reader.lookup("alive") is None               # the server is down: an answer, bounded
        assert time.monotonic() - t0 < 2.0
        srv = BootstrapServer(address).start()
        deadline = time.monotonic() + 4.0
        while reader.lookup("alive") is None:
            assert time.monotonic() < deadline, "the live rank was not re-published to the restarted server"
            time.sleep(0.1)
        assert reader.lookup("dead") is None
    finally:
        reader.close()
        alive.close()
        dead.close()
        srv.close()


def test_a_sigkilled_ranks_lease_runs_out_on_the_server(server: BootstrapServer) -> None:
    dead = ZmqBootstrap(server.address, republish_s=1.0, lease_s=2.0, timeout_s=1.0)
    reader = ZmqBootstrap(server.address, republish_s=0, timeout_s=1.0)
    try:
        dead.publish("dead", 1, 0, "tcp://127.0.0.1:7101")
        dead._stop.set()
        dead._published.clear()
        t0 = time.monotonic()
        while reader.lookup("dead") is not None:
            assert time.monotonic() - t0 < 2.0 + 1.5 + 1.0, "the rank outlived its lease"
            time.sleep(0.1)
    finally:
        reader.close()
        dead.close()

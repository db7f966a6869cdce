"""Adversarial tests of cc2bcb0's restart eviction in the ZMQ bootstrap server (a rank re-published at another
address makes the server forget the instance's other leased ranks)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from kvbridge.discovery import DiscoveryError
from kvbridge.links import InstanceInfo
from kvbridge.sealing import seal
from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap, _Publish

SECRET = b"adv-fix-bootstrap-secret-0123456"


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer().start()
    yield srv
    srv.close()


def _until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def test_a_contradicting_tp_on_an_existing_rank_is_refused_not_an_eviction(server: BootstrapServer) -> None:
    """The kit's contract: publish raises DiscoveryError (never publishes) for a TP size that contradicts the
    instance's live ranks. Live TP 2 instance (ranks 0 and 1, republishing); a second process publishes rank 0
    at another address with TP 4 (a misdeployment, or a new life with another TP while the old still runs)."""
    r0 = ZmqBootstrap(server.address, republish_s=0.3, lease_s=2.0, timeout_s=10.0)
    r1 = ZmqBootstrap(server.address, republish_s=0.3, lease_s=2.0, timeout_s=10.0)
    other = ZmqBootstrap(server.address, republish_s=0, timeout_s=10.0)
    try:
        r0.publish("tp", 2, 0, "tcp://127.0.0.10:20000")
        r1.publish("tp", 2, 1, "tcp://127.0.0.11:20001")
        assert r0.lookup("tp") == InstanceInfo(2, {0: "tcp://127.0.0.10:20000", 1: "tcp://127.0.0.11:20001"})
        refused = False
        try:
            other.publish("tp", 4, 0, "tcp://127.0.0.99:30000")
        except DiscoveryError:
            refused = True
        info = other.lookup("tp")
        assert refused, f"a TP 4 rank 0 was accepted over a live TP 2 instance; lookup now: {info}"
    finally:
        for c in (other, r1, r0):
            c.close()


def test_a_live_rank_evicted_by_a_restart_is_back_within_its_republish_interval(server: BootstrapServer) -> None:
    """Old life rank 0 dies (lease still running); live rank 1 keeps republishing every 0.3 s; a new rank 0
    publishes at another address: the instance is complete again (new 0 + live 1) within ~republish_s."""
    dead = ZmqBootstrap(server.address, republish_s=0.3, lease_s=5.0, timeout_s=10.0)
    live1 = ZmqBootstrap(server.address, republish_s=0.3, lease_s=5.0, timeout_s=10.0)
    new0 = ZmqBootstrap(server.address, republish_s=0.3, lease_s=5.0, timeout_s=10.0)
    try:
        dead.publish("life", 2, 0, "tcp://127.0.0.10:20000")
        live1.publish("life", 2, 1, "tcp://127.0.0.11:20001")
        dead._stop.set()
        dead._published.clear()
        t0 = time.monotonic()
        new0.publish("life", 2, 0, "tcp://127.0.0.99:30000")
        info = _until(lambda: (i := new0.lookup("life")) is not None and i.complete and i, 3.0, "complete again")
        took = time.monotonic() - t0
        assert info.addresses == {0: "tcp://127.0.0.99:30000", 1: "tcp://127.0.0.11:20001"}
        assert took < 1.5, took
    finally:
        for c in (new0, live1, dead):
            c.close()


def test_a_replayed_old_life_publication_to_a_restarted_server_does_not_evict() -> None:
    """With a secret: a publication of the dead life's rank 0 (captured on the wire) is replayed to the
    bootstrap server restarted on the same address (its nonce memory is gone), within the 60 s window,
    after the new life published both ranks. It must not evict the live rank 1 nor bring the dead address
    back."""
    first = BootstrapServer(secret=SECRET).start()
    address = first.bound
    old = _Publish(instance="rep", tp_size=2, rank=0, address="tcp://127.0.0.10:20000", lease_s=5.0,
                   nonce=b"n" * 16, time=time.time())
    frame = seal(SECRET, b"bootstrap-request", msgspec.msgpack.encode(old))
    import zmq

    def send(frame: bytes) -> None:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 1500)
        sock.connect(address)
        try:
            sock.send(frame)
            sock.recv()
        finally:
            sock.close(0)

    send(frame)                                           # the old life's publication, as it was on the wire
    first.close()
    time.sleep(0.2)
    second = BootstrapServer(address, secret=SECRET).start()
    n0 = ZmqBootstrap(address, secret=SECRET, republish_s=2.0, lease_s=5.0)
    n1 = ZmqBootstrap(address, secret=SECRET, republish_s=2.0, lease_s=5.0)
    try:
        n0.publish("rep", 2, 0, "tcp://127.0.0.99:30000")
        n1.publish("rep", 2, 1, "tcp://127.0.0.98:30001")
        want = InstanceInfo(2, {0: "tcp://127.0.0.99:30000", 1: "tcp://127.0.0.98:30001"})
        assert n0.lookup("rep") == want
        send(frame)                                       # replay
        info = n0.lookup("rep")
        assert info == want, f"a replayed publication of the dead life changed the instance: {info}"
    finally:
        n1.close()
        n0.close()
        second.close()


def test_a_restart_that_keeps_rank_0s_address_is_not_mixed_with_the_dead_rank_1(server: BootstrapServer) -> None:
    """Rank 0 restarts at the same address (a fixed port), rank 1 of the new life has not published yet and
    had a random port in the dead life: the eviction keys on an address change, so nothing is forgotten."""
    old = ZmqBootstrap(server.address, republish_s=2.0, lease_s=10.0, timeout_s=10.0)
    new = ZmqBootstrap(server.address, republish_s=0, timeout_s=10.0)
    try:
        old.publish("fixed", 2, 0, "tcp://127.0.0.10:20000")
        old.publish("fixed", 2, 1, "tcp://127.0.0.11:41234")
        old._stop.set()
        old._published.clear()
        new.publish("fixed", 2, 0, "tcp://127.0.0.10:20000")
        info = new.lookup("fixed")
        assert info is not None
        assert not (info.complete and info.addresses.get(1) == "tcp://127.0.0.11:41234"), \
            f"a complete instance mixing the new rank 0 with the dead rank 1: {info}"
    finally:
        new.close()
        old.close()

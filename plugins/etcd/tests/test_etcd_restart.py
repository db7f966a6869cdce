"""Adversarial tests of cc2bcb0's restart eviction in kvbridge-etcd (``_forget_other_life``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvbridge.plugin import DiscoveryError, InstanceInfo
from kvbridge_etcd.client import EtcdDiscovery
from kvbridge_etcd.testing import EtcdServer, etcd_unavailable

_WHY_NOT = etcd_unavailable()
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)

SECRET = b"adv-fix-etcd-secret-0123456789ab"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def test_a_contradicting_tp_on_an_existing_rank_is_refused_not_an_eviction(etcd: EtcdServer) -> None:
    """Kit contract: publish raises DiscoveryError (never publishes) for a TP size contradicting the live
    ranks. Live TP 2 (ranks 0 and 1, leases renewed); another client publishes rank 0 elsewhere with TP 4."""
    r0 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    r1 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    other = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    try:
        r0.publish("tp", 2, 0, "tcp://127.0.0.10:20000")
        r1.publish("tp", 2, 1, "tcp://127.0.0.11:20001")
        refused = False
        try:
            other.publish("tp", 4, 0, "tcp://127.0.0.99:30000")
        except DiscoveryError:
            refused = True
        info = r0.lookup("tp")
        assert refused, f"a TP 4 rank 0 was accepted over a live TP 2 instance; lookup now: {info}"
    finally:
        for c in (other, r1, r0):
            c.close()


def test_a_live_rank_deleted_by_a_restart_is_back_within_a_third_of_its_ttl(etcd: EtcdServer) -> None:
    """Old life rank 0 dies (its lease still runs); live rank 1 (lease 6 s: keep-alive every 2 s); a new rank
    0 publishes elsewhere: how long is the instance incomplete?"""
    dead = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    live1 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    new0 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0)
    try:
        dead.publish("life", 2, 0, "tcp://127.0.0.10:20000")
        live1.publish("life", 2, 1, "tcp://127.0.0.11:20001")
        dead._stop.set()                  # "SIGKILL": no keep-alive from now on, the lease runs 30 s
        t0 = time.monotonic()
        new0.publish("life", 2, 0, "tcp://127.0.0.99:30000")
        while True:
            info = reader.lookup("life")
            if info is not None and info.complete:
                break
            assert time.monotonic() - t0 < 8, f"incomplete for 8 s: {info}"
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"incomplete for {took:.2f} s")
        assert info == InstanceInfo(2, {0: "tcp://127.0.0.99:30000", 1: "tcp://127.0.0.11:20001"})
        assert took < 6 / 3 + 1.5, took
    finally:
        for c in (reader, new0, live1):
            c.close()
        dead._closed = True


def test_a_replayed_dead_record_does_not_make_the_next_publish_evict(etcd: EtcdServer) -> None:
    """With a secret, a reader of etcd puts back the dead life's sealed rank-0 value under its (still running)
    lease after the new life published rank 0: the record passes open_record. A live rank 1 re-publishing
    (e.g. after its own restart at the same address) must not lose anything it should not."""
    from kvbridge_etcd.client import _b64

    dead = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    new0 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    new1 = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=6)
    try:
        dead.publish("rp", 2, 0, "tcp://127.0.0.10:20000")
        key = dead._key("rp", 0)
        reply = dead._client.post(dead._client.get_url("/kv/range"), json={"key": _b64(key)})
        old_value, old_lease = reply["kvs"][0]["value"], int(reply["kvs"][0]["lease"])
        dead._stop.set()
        new0.publish("rp", 2, 0, "tcp://127.0.0.99:30000")
        new1.publish("rp", 2, 1, "tcp://127.0.0.98:30001")
        want = InstanceInfo(2, {0: "tcp://127.0.0.99:30000", 1: "tcp://127.0.0.98:30001"})
        assert new0.lookup("rp") == want
        # the replay: the old sealed value under the old (live) lease
        dead._client.post(dead._client.get_url("/kv/put"), json={"key": _b64(key), "value": old_value,
                                                                  "lease": old_lease})
        seen = new0.lookup("rp")
        print("after the replay:", seen)
        # new0's keep-alive puts its key back within ttl/3
        deadline = time.monotonic() + 6
        while new0.lookup("rp") != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert new0.lookup("rp") == want, new0.lookup("rp")
    finally:
        for c in (new1, new0):
            c.close()
        dead._closed = True

"""kvbridge-etcd against a real etcd server (started here on free ports, data in a temporary directory,
stopped after): the conformance kit's discovery tier, then what is particular to etcd - records forged,
moved or replayed by someone who can write to etcd, a lease lost or a key removed behind the client's back,
a watch across an etcd restart - and a transfer between two agents that find each other through etcd."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.plugin import Change, DiscoveryError, InstanceInfo, RankRecord, seal_record
from kvbridge.testkit import DiscoveryTests
from kvbridge_etcd.client import EtcdDiscovery
from kvbridge_etcd.testing import EtcdServer, etcd_unavailable

_WHY_NOT = etcd_unavailable()
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)

SECRET = b"kvbridge-kit-discovery-secret-32"


class TestEtcdDiscovery(DiscoveryTests):
    discovery = "etcd"
    lease_s = 2.0
    leak_allowed_threads: ClassVar[tuple[str, ...]] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def service_url(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        with EtcdServer(tmp_path_factory.mktemp("etcd-kit")) as server:
            yield server.url


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


def _until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def _raw(server: EtcdServer) -> Any:
    """A plain etcd client, as anyone with write access to etcd has (no kvbridge, no secret)."""
    from etcd3gw.client import Etcd3Client

    return Etcd3Client(host=server.host, port=server.client_port, timeout=5)


def _held(raw: Any, key: str) -> tuple[bytes, str]:
    (value, meta), = raw.get(key, metadata=True)
    return value, str(meta.get("lease", ""))


KEY0 = "/kvbridge/instances/victim/0"
KEY1 = "/kvbridge/instances/victim/1"


# ------------------------------------------------------------------------------------------ integrity
def test_forged_moved_and_replayed_records_are_refused(etcd: EtcdServer) -> None:
    """Someone who can write to etcd but lacks the secret cannot redirect a rank: a record without the
    secret's HMAC is forged, one copied to another key does not match that key, one put back after its lease
    ended names a lease the key is not held under. Each is refused (and counted); the genuine one is found."""
    victim = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=30)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=30)
    raw = _raw(etcd)
    try:
        victim.publish("victim", 2, 0, "tcp://198.18.0.2:17610")
        genuine, lease = _held(raw, KEY0)
        assert reader.lookup("victim") == InstanceInfo(2, {0: "tcp://198.18.0.2:17610"})

        # forged: a well-formed record for rank 1, without the secret
        evil = RankRecord(instance="victim", tp_size=2, rank=1, address="tcp://203.0.113.9:6666", lease="")
        raw.put(KEY1, seal_record(b"not-the-secret-not-the-secret-!!", KEY1, evil))
        raw.put(KEY1 + "0", seal_record(None, KEY1 + "0", evil))             # and one with no tag at all
        # moved: rank 0's genuine bytes under another key of the instance, attached to the victim's own live
        # lease (lease ids are visible to every reader), and under another instance's key
        from etcd3gw.lease import Lease

        raw.put("/kvbridge/instances/victim/3", genuine, lease=Lease(int(lease), raw))
        raw.put("/kvbridge/instances/other/0", genuine, lease=raw.lease(30))
        before = reader.rejected
        assert reader.lookup("victim") == InstanceInfo(2, {0: "tcp://198.18.0.2:17610"})
        assert reader.lookup("other") is None
        assert reader.rejected - before >= 4

        # replayed: the victim goes away (its lease is revoked), the attacker puts its old record back
        victim.close()
        _until(lambda: reader.lookup("victim") is None or 0 not in reader.lookup("victim").addresses, 10,
               "victim's rank gone")
        raw.put(KEY0, genuine)                                               # without a lease
        assert reader.lookup("victim") is None or 0 not in reader.lookup("victim").addresses
        raw.put(KEY0, genuine, lease=raw.lease(30))                          # under the attacker's lease
        assert reader.lookup("victim") is None or 0 not in reader.lookup("victim").addresses
        assert lease not in ("", "0")
    finally:
        victim.close()
        reader.close()
        raw.session.close()


def test_without_a_secret_records_are_plain_and_trusted(etcd: EtcdServer) -> None:
    """Documented weakness (docs/integrity.md): without a secret, whoever can write to etcd decides where a
    rank is. This pins the behaviour so it cannot change silently."""
    reader = EtcdDiscovery(etcd.url, lease_s=30)
    raw = _raw(etcd)
    try:
        rogue = RankRecord(instance="open", tp_size=1, rank=0, address="tcp://203.0.113.9:6666")
        raw.put("/kvbridge/instances/open/0", seal_record(None, "/kvbridge/instances/open/0", rogue))
        assert reader.lookup("open") == InstanceInfo(1, {0: "tcp://203.0.113.9:6666"})
        raw.put("/kvbridge/instances/open/1", b"\x00garbage")            # not a record at all: refused anyway
        assert reader.lookup("open") == InstanceInfo(1, {0: "tcp://203.0.113.9:6666"})
    finally:
        reader.close()
        raw.session.close()


# ------------------------------------------------------------------------------------------ upkeep
def test_a_lost_lease_and_a_removed_key_are_put_back(etcd: EtcdServer) -> None:
    """The client's lease is revoked behind its back (as when it expired during a partition): the keep-alive
    notices, takes a new lease and publishes again. Then its key is deleted by someone: put back too."""
    client = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=3)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=3)
    raw = _raw(etcd)
    try:
        client.publish("upkeep", 1, 0, "tcp://198.18.0.2:17610")
        _, lease = _held(raw, "/kvbridge/instances/upkeep/0")
        raw.post(raw.get_url("/kv/lease/revoke"), json={"ID": int(lease)})
        assert reader.lookup("upkeep") is None
        _until(lambda: reader.lookup("upkeep") == InstanceInfo(1, {0: "tcp://198.18.0.2:17610"}), 10,
               "published again under a new lease")
        assert _held(raw, "/kvbridge/instances/upkeep/0")[1] != lease
        raw.delete("/kvbridge/instances/upkeep/0")
        _until(lambda: reader.lookup("upkeep") is not None, 10, "the removed key put back")
    finally:
        client.close()
        reader.close()
        raw.session.close()


def test_a_watch_goes_on_across_an_etcd_restart(etcd: EtcdServer) -> None:
    """etcd is killed and started again on the same data: the watch lists again, reports what changed while
    it was away and follows new changes; a publisher's lease survived (etcd keeps leases on disk)."""
    publisher = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=5, options={"watch_idle_s": "2"})
    reader = EtcdDiscovery(etcd.url, secret=SECRET, lease_s=5, options={"watch_idle_s": "2"})
    watch = reader.watch(None)
    try:
        publisher.publish("before", 1, 0, "tcp://198.18.0.2:17610")
        _until(lambda: [c for c in watch.changes(0.5) if c.instance == "before"], 10, "first change")
        etcd.kill()
        time.sleep(0.5)
        etcd.start()
        publisher.publish("after", 1, 0, "tcp://198.18.0.2:17611")
        seen: list[Change] = []
        _until(lambda: seen.extend(watch.changes(0.5)) or any(c.instance == "after" and c.info for c in seen), 20,
               "a change after the restart")
        assert reader.lookup("before") == InstanceInfo(1, {0: "tcp://198.18.0.2:17610"})
    finally:
        watch.close()
        publisher.close()
        reader.close()


def test_an_unreachable_etcd_is_an_error_not_a_hang(tmp_path: Path) -> None:
    from kvbridge_etcd.testing import free_port

    url = f"etcd://127.0.0.1:{free_port()}/kvbridge"
    client = EtcdDiscovery(url, secret=SECRET, timeout_s=1.0, options={"api_path": "/v3/"})
    try:
        started = time.monotonic()
        with pytest.raises(DiscoveryError, match="could not publish"):
            client.publish("nowhere", 1, 0, "tcp://198.18.0.2:17610")
        assert client.lookup("nowhere") is None
        assert time.monotonic() - started < 10
    finally:
        client.close()
    with pytest.raises(ValueError, match="unknown etcd discovery option"):
        EtcdDiscovery(url, options={"ttl": "3"})
    with pytest.raises(ValueError, match="not an etcd URL"):
        EtcdDiscovery("http://127.0.0.1:2379")


# ------------------------------------------------------------------------------------------ end to end
def test_agents_find_each_other_through_etcd(etcd: EtcdServer) -> None:
    """A prefill and a decode agent whose links publish and look up through etcd (``bootstrap="etcd://..."``),
    loopback backend, authenticated: one request, byte-exact; the prefill's rank vanishes when it closes."""
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import KVPoll, Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.zmq_link import ZmqLink

    config = AgentConfig(secret=SECRET, heartbeat_interval_s=0.1, peer_timeout_s=3.0, bootstrap_timeout_s=20)
    pre_pool, dec_pool = KVPool(1, 0, role="prefill"), KVPool(1, 0, memory="shm", role="decode")
    pre = TransferAgent(layout=pre_pool.layout, buffers=pre_pool.arrays(), role=Role.PREFILL, instance="etcd-e2e",
                        link=ZmqLink(bootstrap=etcd.url, host="0.0.0.0", secret=SECRET, lease_s=5),
                        backend="loopback", config=config)
    dec = TransferAgent(layout=dec_pool.layout, buffers=dec_pool.arrays(), role=Role.DECODE, backend="loopback",
                        link=ZmqLink(bootstrap=etcd.url, secret=SECRET, lease_s=5), config=config)
    reader = EtcdDiscovery(etcd.url, secret=SECRET)
    try:
        info = reader.lookup("etcd-e2e")
        assert info is not None and info.addresses == {0: pre.link.address}
        assert pre.link.address.startswith("tcp://127.0.0.1:")      # bound everywhere, advertised towards etcd
        pre.start()
        dec.start()
        dec.connect("etcd-e2e", timeout_s=20)
        src, dst, positions = np.array([1, 4, 7]), np.array([2, 3, 9]), np.arange(3)
        pre_pool.fill(7, 50, src, positions)
        dec_pool.fill(0, 60)
        receiver = dec.receiver(11, "etcd-e2e")
        receiver.send_metadata({k.name: dst for k in dec_pool.kinds})
        sender = pre.sender(11)
        _until(lambda: sender.poll() >= KVPoll.WaitingForInput, 20, "prefill saw the request")
        sender.send(src, last=True)
        _until(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 20, "decode room settled")
        assert receiver.poll() is KVPoll.Success, receiver.failure_reason
        assert dec_pool.check(7, 60, dst, positions) == []
        pre.close()
        _until(lambda: reader.lookup("etcd-e2e") is None, 10, "the closed prefill's rank gone")
    finally:
        reader.close()
        dec.close()
        pre.close()
        pre_pool.close()
        dec_pool.close()

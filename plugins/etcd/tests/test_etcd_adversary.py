"""Adversarial tests of kvbridge-etcd against a real etcd: a SIGKILLed publisher expires within its lease and
lookups meanwhile are bounded; etcd hung, stopped or wiped mid-run; a restart under the same instance name;
instance names with odd characters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.plugin import DiscoveryError, InstanceInfo
from kvbridge_etcd.client import EtcdDiscovery
from kvbridge_etcd.testing import EtcdServer, etcd_unavailable

_WHY_NOT = etcd_unavailable()
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)

SECRET = b"adv-ops-etcd-secret-0123456789ab"


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


_CHILD = """
import sys, time
from kvbridge_etcd.client import EtcdDiscovery
url, instance, tp, ranks, lease = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
client = EtcdDiscovery(url, secret=%r, lease_s=lease)
for r in ranks.split(","):
    client.publish(instance, tp, int(r), "tcp://127.0.0.%%d:%%d" %% (10 + int(r), 20000 + int(r)))
print("ready", flush=True)
time.sleep(120)
""" % SECRET  # noqa: UP031 - the child script keeps its own %-format


def _publisher(url: str, instance: str, tp: int, ranks: str, lease_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, url, instance, str(tp), ranks, str(lease_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line
    return proc


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=15)


def test_a_sigkilled_publisher_expires_within_its_lease_and_lookups_stay_bounded(etcd: EtcdServer) -> None:
    proc = _publisher(etcd.url, "killed", 1, "0", 3.0)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0)
    try:
        assert reader.lookup("killed") == InstanceInfo(1, {0: "tcp://127.0.0.10:20000"})
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        slowest = 0.0
        while True:
            t0 = time.monotonic()
            info = reader.lookup("killed")
            slowest = max(slowest, time.monotonic() - t0)
            if info is None:
                break
            assert time.monotonic() - killed_at < 3.0 + 2.0, "the dead rank outlived its 3 s lease by 2 s"
            time.sleep(0.1)
        assert slowest < 1.0, f"a lookup took {slowest:.2f} s"
    finally:
        _reap(proc)
        reader.close()


def test_a_hung_etcd_makes_lookups_and_publishes_fail_within_the_timeout(etcd: EtcdServer) -> None:
    client = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    assert etcd.proc is not None
    try:
        client.publish("hung", 1, 0, "tcp://127.0.0.10:20000")
        assert reader.lookup("hung") is not None
        etcd.pause()                                          # returns once every etcd thread is stopped
        try:
            t0 = time.monotonic()
            assert reader.lookup("hung") is None
            lookup_s = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(DiscoveryError):
                client.publish("hung", 1, 0, "tcp://127.0.0.10:20001")
            publish_s = time.monotonic() - t0
        finally:
            etcd.resume()
        assert lookup_s < 3.0, f"lookup took {lookup_s:.1f} s with timeout_s=1"
        assert publish_s < 3.0, f"publish took {publish_s:.1f} s with timeout_s=1"
        _until(lambda: reader.lookup("hung") is not None, 10, "etcd answers again")
    finally:
        client.close()
        reader.close()


def test_etcd_stopped_and_restarted_keeps_the_registration(etcd: EtcdServer) -> None:
    client = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=3)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=3)
    try:
        client.publish("bounce", 1, 0, "tcp://127.0.0.10:20000")
        etcd.stop()
        t0 = time.monotonic()
        assert reader.lookup("bounce") is None
        assert time.monotonic() - t0 < 3.0
        time.sleep(4.0)                                       # longer than the TTL while etcd is down
        etcd.start()
        _until(lambda: reader.lookup("bounce") == InstanceInfo(1, {0: "tcp://127.0.0.10:20000"}), 10,
               "the rank found again after etcd came back")
        time.sleep(4.0)                                       # and still there a TTL later: the lease is renewed
        assert reader.lookup("bounce") == InstanceInfo(1, {0: "tcp://127.0.0.10:20000"})
    finally:
        client.close()
        reader.close()


def test_etcd_restarted_empty_gets_the_registration_back(etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    client = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=3)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=3)
    try:
        client.publish("wiped", 1, 0, "tcp://127.0.0.10:20000")
        etcd.kill()
        shutil.rmtree(etcd.data_dir / "data")
        etcd.start()
        # the record may be back before any lookup (the publisher's keepalive is quick), so the wipe is proven by
        # the publisher noticing its lease gone, not by a lookup that races it
        _until(lambda: reader.lookup("wiped") == InstanceInfo(1, {0: "tcp://127.0.0.10:20000"})
               and "is gone; publishing 1 rank(s) again" in caplog.text, 10, "re-published into the empty etcd")
    finally:
        client.close()
        reader.close()


def test_a_restart_under_the_same_name_is_reached_and_the_old_lease_does_not_remove_it(etcd: EtcdServer) -> None:
    old = _publisher(etcd.url, "same", 1, "0", 3.0)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0)
    new = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    try:
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=10)
        new.publish("same", 1, 0, "tcp://127.0.0.99:30000")
        assert reader.lookup("same") == InstanceInfo(1, {0: "tcp://127.0.0.99:30000"})
        time.sleep(4.5)                                      # the old lease runs out
        assert reader.lookup("same") == InstanceInfo(1, {0: "tcp://127.0.0.99:30000"})
    finally:
        _reap(old)
        new.close()
        reader.close()


def test_a_restart_under_the_same_name_is_never_mixed_with_the_dead_life(etcd: EtcdServer) -> None:
    """The old life (TP 2, ranks 0 and 1) is killed; the new life (same name, TP 2) has published rank 0 so
    far. A lookup meanwhile must not hand out a complete instance made of the new rank 0 and the dead rank 1."""
    old = _publisher(etcd.url, "mixed", 2, "0,1", 10.0)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0)
    new = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=1.0, lease_s=30)
    try:
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=10)
        new.publish("mixed", 2, 0, "tcp://127.0.0.99:30000")
        info = reader.lookup("mixed")
        assert info is not None
        assert not (info.complete and info.addresses[1] == "tcp://127.0.0.11:20001"), \
            f"a complete instance mixing the new rank 0 with the dead rank 1: {info}"
    finally:
        _reap(old)
        new.close()
        reader.close()


ODD_NAMES = ["a/b", "..", "../escape", "x/../y", "%2F", "a%2Fb", "名前-α", "sp ace", "tab\tname", "new\nline",
             "q?x=1#f", "*", "L" * 256]


def test_odd_instance_names_stay_under_the_prefix_and_round_trip(etcd: EtcdServer) -> None:
    from etcd3gw.client import Etcd3Client

    client = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=2.0, lease_s=30)
    reader = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=2.0, lease_s=30)
    raw = Etcd3Client(host=etcd.host, port=etcd.client_port, timeout=5)
    watch = reader.watch(None)
    try:
        for i, name in enumerate(ODD_NAMES):
            client.publish(name, 1, 0, f"tcp://127.0.0.1:{21000 + i}")
        for i, name in enumerate(ODD_NAMES):
            assert reader.lookup(name) == InstanceInfo(1, {0: f"tcp://127.0.0.1:{21000 + i}"}), name
        for other in ("a", "b", "y", "escape", "/", "x", "L" * 255):
            assert reader.lookup(other) is None, other
        keys = [meta["key"].decode() if isinstance(meta["key"], bytes) else meta["key"]
                for _, meta in raw.get_all()]
        assert keys and all(k.startswith("/kvbridge/instances/") for k in keys), keys
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while set(seen) != set(ODD_NAMES) and time.monotonic() < deadline:
            for change in watch.changes(0.5):
                seen[change.instance] = change.info
        assert set(seen) == set(ODD_NAMES)
        with pytest.raises(DiscoveryError):
            client.publish("L" * 257, 1, 0, "tcp://127.0.0.1:22000")
        with pytest.raises(DiscoveryError):
            client.publish("", 1, 0, "tcp://127.0.0.1:22000")
    finally:
        watch.close()
        client.close()
        reader.close()
        raw.session.close()


def test_an_unencodable_instance_name_is_a_discovery_error(etcd: EtcdServer) -> None:
    client = EtcdDiscovery(etcd.url, secret=SECRET, timeout_s=2.0, lease_s=30)
    try:
        with pytest.raises(DiscoveryError):
            client.publish("bad\udc80name", 1, 0, "tcp://127.0.0.1:22001")
        assert client.lookup("bad\udc80name") is None
    finally:
        client.close()

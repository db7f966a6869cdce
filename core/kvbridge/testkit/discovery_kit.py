"""The discovery tier of the conformance kit: what every discovery service (``kvbridge.discovery.Discovery``)
must do, run against a real service. A plugin subclasses :class:`DiscoveryTests` in its tests::

    class TestEtcdDiscovery(DiscoveryTests):
        discovery = "etcd"                  # the installed DiscoverySpec's name (or spec = DiscoverySpec(...))
        lease_s = 3.0                       # short leases, so expiry is seen quickly

        @pytest.fixture(scope="class")
        @classmethod
        def service_url(cls, tmp_path_factory):
            with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:   # started by the test, stopped after
                yield server.url

The service is shared by the class's tests (each test uses instance names of its own); clients are opened
with :meth:`DiscoveryTests.open` and must be closed by the test (the kit's leak checks look for threads,
descriptors and child processes left behind). Every wait is bounded. What is checked: publish and look up
(one rank, every rank of TP 8, several instances), unknown instances, a rank re-published at a new address,
refusals (TP size contradicting the live ranks, rank outside the TP size, unspecified address), withdraw and
close, watches of one instance and of all of them, a publisher killed with SIGKILL vanishing once its lease
expires, records and requests made with another secret refused both ways, and ``route_target``.

The expiry test publishes from a child process through ``kvbridge.discovery.open_discovery(url)``, so the
service must be reachable by its URL scheme (an installed plugin, or the built-in ZMQ bootstrap).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from kvbridge.discovery import Change, Discovery, DiscoveryError
from kvbridge.links import InstanceInfo
from kvbridge.specs import DiscoverySpec, PluginKind, resolve
from kvbridge.testkit.checked import installed_registry
from kvbridge.testkit.kitbase import KitTests

__all__ = ["DiscoveryTests"]

_CHILD = """
import json, sys, time
from kvbridge.discovery import open_discovery
job = json.loads(sys.argv[1])
client = open_discovery(job["url"], secret=bytes.fromhex(job["secret"]), lease_s=job["lease_s"],
                        options=job["options"])
client.publish(job["instance"], 1, 0, job["address"])
print("published", flush=True)
time.sleep(120)
"""


def _until(predicate: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.1f} s")
        time.sleep(step_s)


class DiscoveryTests(KitTests):
    """Conformance tests of one discovery service (see the module docstring)."""

    _kvbridge_kit_class: ClassVar[bool] = True
    #: an installed discovery service's name (entry points) ...
    discovery: ClassVar[str] = ""
    #: ... or its spec
    spec: ClassVar[DiscoverySpec | None] = None
    #: the lease the tests publish under (short: the expiry test waits for it)
    lease_s: ClassVar[float] = 3.0
    #: the plugin's own options, given to its factory
    options: ClassVar[dict[str, str]] = {}
    #: how long a change may take to be seen (lookups and watches) once the service has it
    settle_s: ClassVar[float] = 5.0
    #: the shared secret of the tests' clients
    secret: ClassVar[bytes] = b"kvbridge-kit-discovery-secret-32"
    #: the service is a class fixture: its threads and descriptors outlive each test
    shared_fixtures: ClassVar[tuple[str, ...]] = ("service_url",)

    _kvbridge_name_attr: ClassVar[str] = "discovery"

    # ---------------------------------------------------------------- what the plugin author provides
    @pytest.fixture(scope="class")
    @classmethod
    def service_url(cls) -> Iterator[str]:
        """A running service's URL for the class (start it here, stop it after the yield)."""
        raise NotImplementedError(f"{cls.__name__} must define a class-scoped fixture service_url")

    def open(self, url: str, *, secret: bytes | None = None, lease_s: float | None = None) -> Discovery:
        """A client of the service under test (the spec's factory)."""
        spec: DiscoverySpec = self._kvbridge_spec_or_skip()
        client = resolve(spec.factory)(url, secret=self.secret if secret is None else secret, timeout_s=2.0,
                                       lease_s=self.lease_s if lease_s is None else lease_s,
                                       options=dict(self.options))
        assert isinstance(client, Discovery), f"{spec.name}'s factory returned {type(client).__name__}"
        return client

    # ---------------------------------------------------------------- subject
    @classmethod
    def _kvbridge_lookup(cls, name: str) -> DiscoverySpec | str:
        records = [r for r in installed_registry().records() if r.kind is PluginKind.DISCOVERY and r.name == name]
        if not records or not isinstance(records[0].spec, DiscoverySpec):
            return f"'{name}' is not an installed discovery service"
        if records[0].reason:
            return f"'{name}' is unavailable here: {records[0].reason}"
        return records[0].spec

    @classmethod
    def _kvbridge_unavailable(cls, config: pytest.Config) -> str:
        spec = cls._kvbridge_resolve()
        return spec if isinstance(spec, str) else ""

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def instance(tag: str = "") -> str:
        return f"kit-{tag}-{uuid.uuid4().hex[:10]}"

    def _lookup_until(self, client: Discovery, instance: str, want: Callable[[InstanceInfo | None], bool],
                      what: str) -> InstanceInfo | None:
        box: list[InstanceInfo | None] = []

        def check() -> bool:
            box[:] = [client.lookup(instance)]
            return want(box[0])

        _until(check, self.settle_s + self.lease_s, what)
        return box[0]

    def _changes_until(self, watch: Any, want: Callable[[Change], bool], what: str) -> list[Change]:
        seen: list[Change] = []
        deadline = time.monotonic() + self.settle_s + self.lease_s
        while time.monotonic() < deadline:
            seen += watch.changes(timeout_s=0.5)
            if any(want(c) for c in seen):
                return seen
        raise AssertionError(f"{what}: the watch reported only {seen}")

    # ---------------------------------------------------------------- publish and look up
    def test_published_ranks_are_found_by_another_client(self, service_url: str) -> None:
        """Troubleshooting: ``lookup`` must return every live rank of the instance (``InstanceInfo(tp_size,
        {rank: address})``), from any client, shortly after ``publish`` returned."""
        a, b, reader = self.open(service_url), self.open(service_url), self.open(service_url)
        try:
            name = self.instance("pub")
            assert reader.lookup(name) is None
            a.publish(name, 2, 0, "tcp://198.18.0.2:17610")
            half = self._lookup_until(reader, name, lambda i: i is not None, "rank 0 published")
            assert half == InstanceInfo(2, {0: "tcp://198.18.0.2:17610"}) and not half.complete
            b.publish(name, 2, 1, "tcp://198.18.0.3:17611")
            info = self._lookup_until(reader, name, lambda i: i is not None and i.complete, "both ranks published")
            assert info == InstanceInfo(2, {0: "tcp://198.18.0.2:17610", 1: "tcp://198.18.0.3:17611"})
        finally:
            for client in (a, b, reader):
                client.close()

    def test_every_rank_of_a_large_instance_and_instances_apart(self, service_url: str) -> None:
        """Troubleshooting: ranks are kept per (instance, rank); instances never mix."""
        client, reader = self.open(service_url), self.open(service_url)
        try:
            big, other = self.instance("tp8"), self.instance("other")
            for rank in range(8):
                client.publish(big, 8, rank, f"tcp://198.18.1.{rank + 1}:{17600 + rank}")
            client.publish(other, 1, 0, "tcp://[fd00::5]:17600")
            info = self._lookup_until(reader, big, lambda i: i is not None and i.complete, "8 ranks")
            assert info == InstanceInfo(8, {r: f"tcp://198.18.1.{r + 1}:{17600 + r}" for r in range(8)})
            assert reader.lookup(other) == InstanceInfo(1, {0: "tcp://[fd00::5]:17600"})
        finally:
            client.close()
            reader.close()

    def test_a_rank_published_again_moves_to_its_new_address(self, service_url: str) -> None:
        """Troubleshooting: a restarted rank publishes the same (instance, rank) with a new address; the new
        address replaces the old one."""
        old, new, reader = self.open(service_url), self.open(service_url), self.open(service_url)
        try:
            name = self.instance("move")
            old.publish(name, 1, 0, "tcp://198.18.0.2:17610")
            self._lookup_until(reader, name, lambda i: i is not None, "first address")
            new.publish(name, 1, 0, "tcp://198.18.0.2:17612")
            self._lookup_until(reader, name, lambda i: i is not None and i.addresses == {0: "tcp://198.18.0.2:17612"},
                               "the new address")
        finally:
            for client in (new, old, reader):
                client.close()

    def test_contradictions_and_bad_records_are_refused(self, service_url: str) -> None:
        """Troubleshooting: ``publish`` raises ``DiscoveryError`` (never publishes) for a TP size that
        contradicts the instance's live ranks, a rank outside its TP size, and an address peers cannot reach."""
        a, b = self.open(service_url), self.open(service_url)
        try:
            name = self.instance("refuse")
            a.publish(name, 2, 0, "tcp://198.18.0.2:17610")
            with pytest.raises(DiscoveryError, match="TP"):
                b.publish(name, 4, 1, "tcp://198.18.0.2:17611")
            with pytest.raises(DiscoveryError, match="rank 2 outside TP 2"):
                b.publish(name, 2, 2, "tcp://198.18.0.2:17611")
            with pytest.raises(DiscoveryError, match="unspecified|not a control address"):
                b.publish(name, 2, 1, "tcp://0.0.0.0:17611")
            with pytest.raises(DiscoveryError, match="not a control address"):
                b.publish(name, 2, 1, "http://198.18.0.2:80/../etc")
            assert a.lookup(name) == InstanceInfo(2, {0: "tcp://198.18.0.2:17610"})
        finally:
            a.close()
            b.close()

    # ---------------------------------------------------------------- withdraw, close, expiry
    def test_withdraw_and_close_take_ranks_back(self, service_url: str) -> None:
        """Troubleshooting: ``withdraw`` removes one rank; ``close`` removes every rank the client published
        (an orderly shutdown must not wait for the lease)."""
        a, reader = self.open(service_url), self.open(service_url)
        try:
            name = self.instance("withdraw")
            a.publish(name, 2, 0, "tcp://198.18.0.2:17610")
            a.publish(name, 2, 1, "tcp://198.18.0.2:17611")
            self._lookup_until(reader, name, lambda i: i is not None and i.complete, "both ranks")
            a.withdraw(name, 1)
            self._lookup_until(reader, name, lambda i: i == InstanceInfo(2, {0: "tcp://198.18.0.2:17610"}),
                               "rank 1 withdrawn")
            a.withdraw(name, 1)                       # again: nothing
            a.close()
            _until(lambda: reader.lookup(name) is None, self.settle_s, "the closed client's ranks gone")
        finally:
            a.close()
            reader.close()

    def test_a_killed_publisher_vanishes_when_its_lease_expires(self, service_url: str) -> None:
        """Troubleshooting: a process that dies without closing (SIGKILL) must not stay published: its ranks
        go when the lease it published under runs out (``lease_s`` after its last renewal), and watchers are
        told."""
        reader = self.open(service_url)
        watch = None
        name = self.instance("kill")
        job = {"url": service_url, "secret": self.secret.hex(), "lease_s": self.lease_s, "options": self.options,
               "instance": name, "address": "tcp://198.18.0.9:17610"}
        child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(job)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            if line != "published":
                child.wait(timeout=10)
                err = child.stderr.read() if child.stderr else ""
                raise AssertionError(f"the publisher did not start: {line!r} {err}")
            self._lookup_until(reader, name, lambda i: i is not None, "the child's rank")
            watch = reader.watch(name)
            time.sleep(min(1.0, self.lease_s / 2))     # a renewal or two happen: the lease is live, not new
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            _until(lambda: reader.lookup(name) is None, 2 * self.lease_s + self.settle_s,
                   "the killed publisher's rank gone")
            self._changes_until(watch, lambda c: c.instance == name and c.info is None, "watch: instance gone")
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=10)
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
            if watch is not None:
                watch.close()
            reader.close()

    # ---------------------------------------------------------------- watches
    def test_a_watch_reports_publications_and_withdrawals(self, service_url: str) -> None:
        """Troubleshooting: ``watch(instance).changes(timeout_s)`` returns ``Change(instance, info)`` records in
        order, ``info`` being the instance's ranks after the change and None once no rank is left; nothing
        from before the watch began is reported as a change."""
        a, reader = self.open(service_url), self.open(service_url)
        watch = None
        try:
            name = self.instance("watch")
            a.publish(name, 2, 0, "tcp://198.18.0.2:17610")
            self._lookup_until(reader, name, lambda i: i is not None, "rank 0")
            watch = reader.watch(name)
            assert watch.changes(timeout_s=0.3) == [], "a change from before the watch began was reported"
            a.publish(name, 2, 1, "tcp://198.18.0.2:17611")
            self._changes_until(watch, lambda c: c.info is not None and c.info.complete, "watch: rank 1")
            a.withdraw(name, 0)
            a.withdraw(name, 1)
            seen = self._changes_until(watch, lambda c: c.info is None, "watch: both withdrawn")
            assert all(c.instance == name for c in seen), seen
        finally:
            if watch is not None:
                watch.close()
            a.close()
            reader.close()

    def test_a_watch_of_every_instance(self, service_url: str) -> None:
        """Troubleshooting: ``watch(None)`` reports changes of every instance."""
        a, reader = self.open(service_url), self.open(service_url)
        watch = reader.watch(None)
        try:
            first, second = self.instance("all1"), self.instance("all2")
            a.publish(first, 1, 0, "tcp://198.18.0.2:17610")
            a.publish(second, 1, 0, "tcp://198.18.0.2:17611")
            seen: list[Change] = []
            deadline = time.monotonic() + self.settle_s + self.lease_s
            while time.monotonic() < deadline and not {first, second} <= {c.instance for c in seen if c.info}:
                seen += watch.changes(timeout_s=0.5)
            assert {first, second} <= {c.instance for c in seen if c.info}, f"watch(None) reported only {seen}"
        finally:
            watch.close()
            a.close()
            reader.close()

    # ---------------------------------------------------------------- authentication
    def test_another_secret_is_refused_both_ways(self, service_url: str) -> None:
        """Troubleshooting: with a shared secret, nothing published with another secret (or none) may be
        returned by ``lookup``, and a client with another secret must not read our ranks: either the service
        refuses the request (``DiscoveryError`` / None) or the reader drops the record (bad HMAC)."""
        ours, theirs, reader = (self.open(service_url), self.open(service_url, secret=b"x" * 32),
                                self.open(service_url))
        try:
            name, forged = self.instance("auth"), self.instance("forged")
            ours.publish(name, 1, 0, "tcp://198.18.0.2:17610")
            try:
                theirs.publish(forged, 1, 0, "tcp://203.0.113.66:17610")
            except DiscoveryError:
                pass                                  # refused by the service: fine
            self._lookup_until(reader, name, lambda i: i is not None, "our rank")
            time.sleep(0.5)
            assert reader.lookup(forged) is None, "a record made with another secret was accepted"
            assert theirs.lookup(name) is None, "a client with another secret read our ranks"
        finally:
            for client in (ours, theirs, reader):
                client.close()

    def test_route_target_names_the_service(self, service_url: str) -> None:
        """Troubleshooting: ``route_target()`` is the service's (host, port) when it has a TCP host, so a link
        bound to every interface can advertise the one that reaches it."""
        client = self.open(service_url)
        try:
            target = client.route_target()
            assert target is None or (isinstance(target[0], str) and 0 < int(target[1]) < 65536), target
            if target is not None:
                assert target[0] in service_url and str(target[1]) in service_url
        finally:
            client.close()

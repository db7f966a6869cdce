"""Discovery: where the TP ranks of a prefill instance listen. A plugin axis, like backends and state types.

A :class:`Discovery` client publishes this process's ranks (``publish``: instance, TP size, rank, control
address), keeps them alive while the process lives (re-publication, or a lease the service expires), takes
them back (``withdraw``, and ``close`` for every rank it published), answers ``lookup(instance)`` with an
:class:`~kvbridge.links.InstanceInfo`, and reports changes (``watch(instance)`` -> :class:`Watch`, whose
``changes(timeout_s)`` returns :class:`Change` records: the instance's ranks as they are now, or None once
none is left). ``route_target()`` names the service's (host, port): a link bound to every interface
advertises the address of the interface that routes there (:mod:`kvbridge.addresses`).

Two implementations:

* the embedded ZMQ bootstrap server (``tcp://host:port``, :class:`kvbridge.zmq_link.ZmqBootstrap`), the
  default: one host or a small cluster, no extra process beyond the prefill instance's rank 0;
* plugins, found by the URL scheme they declare in a :class:`~kvbridge.specs.DiscoverySpec` returned from
  the ``kvbridge_discovery_services`` hook (``etcd://host:port/prefix`` is ``kvbridge-etcd``).

    discovery = open_discovery("etcd://198.18.0.1:2379/kvbridge", secret=key)
    link = ZmqLink(discovery=discovery, host="0.0.0.0", secret=key)   # advertises the interface towards etcd

**Authenticated records.** A service that stores records for others to read (etcd) keeps them as
:func:`seal_record` bytes: with the shared secret, an HMAC-SHA256 tag over the record's key in the store and
the whole record, which names its instance, rank, TP size, address and the store's freshness id (the etcd
lease it is attached to). :func:`open_record` refuses a record without a valid tag (forged), one moved to
another key, and one whose lease is not the lease the store holds it under (replayed from an earlier life of
the rank). Without a secret, records are plain and anyone who can write to the store can redirect a rank
(as with the bootstrap server; see docs/integrity.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import urlsplit

import msgspec

from kvbridge._markers import hookimpl
from kvbridge.addresses import is_ipv6_literal, is_unspecified
from kvbridge.errors import KVBridgeError
from kvbridge.links import InstanceInfo
from kvbridge.sealing import BadTag, seal, unseal
from kvbridge.specs import DiscoverySpec, resolve

if TYPE_CHECKING:
    from kvbridge.registry import Registry

__all__ = ["Change", "Discovery", "DiscoveryError", "RankRecord", "Watch", "check_address", "instances_from",
           "open_discovery", "open_record", "seal_record"]

_RECORD_PURPOSE = b"kvbridge-discovery-record"
_ADDRESS = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}|ipc://[A-Za-z0-9_./-]{1,200}|"
                      r"inproc://[A-Za-z0-9_.-]{1,200})$")
_MAX_INSTANCE = 256
_MAX_TP = 1 << 16


class DiscoveryError(KVBridgeError, ConnectionError):
    """The discovery service refused a request, could not be reached, or returned a record that failed its
    checks (the message says which)."""


class Change(msgspec.Struct, frozen=True):
    """An instance's ranks as they are now (``info``), or None once no rank of it is published."""

    instance: str
    info: InstanceInfo | None


class RankRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One published rank, as a discovery service stores it. ``lease``: the store's freshness id the record
    is bound to (etcd: the lease id, in decimal; empty where the store has none); ``written``: wall-clock time
    of the write (the newest record wins when ranks of one instance disagree on the TP size)."""

    instance: str
    tp_size: int
    rank: int
    address: str
    lease: str = ""
    written: float = 0.0


class Watch(Protocol):
    """Changes of one instance (or of every instance) since the watch began."""

    def changes(self, timeout_s: float = 0.0) -> list[Change]:
        """Changes since the last call, in order; waits up to ``timeout_s`` for the first one."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Discovery(Protocol):
    """Publish, withdraw and look up the ranks of prefill instances; watch them change (module docstring)."""

    url: str

    def publish(self, instance: str, tp_size: int, rank: int, address: str) -> None:
        """Publish rank ``rank`` of ``instance`` (TP ``tp_size``) at control ``address`` and keep it published
        until ``withdraw``/``close`` or this process dies. Raises :class:`DiscoveryError` when refused (a TP
        size that contradicts the instance's live ranks, a rank outside the TP size) or unreachable."""
        ...

    def withdraw(self, instance: str, rank: int) -> None:
        """Take back a rank this client published (no-op for one it did not)."""
        ...

    def lookup(self, instance: str) -> InstanceInfo | None:
        """The live ranks of ``instance``; None when it has none or the service is unreachable (logged)."""
        ...

    def watch(self, instance: str | None = None) -> Watch:
        """Changes of ``instance`` (every instance when None) from now on."""
        ...

    def route_target(self) -> tuple[str, int] | None:
        """(host, port) of the service, for address detection; None when it has no TCP host."""
        ...

    def close(self) -> None:
        """Withdraw every rank this client published and release its connections."""
        ...


def check_address(address: str) -> str:
    """A control address from a peer or a store, checked against a strict grammar (returned unchanged)."""
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise DiscoveryError(f"not a control address: {address!r:.80}")
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not 0 < int(port) < 65536:
            raise DiscoveryError(f"not a control address (port): {address!r}")
        if is_unspecified(host.strip("[]")):
            raise DiscoveryError(f"an unspecified address cannot be reached by peers: {address!r}")
        if host.startswith("[") and not is_ipv6_literal(host[1:-1]):
            raise DiscoveryError(f"not a control address (brackets hold an IPv6 literal only): {address!r}")
    return address


def check_rank(instance: str, tp_size: int, rank: int) -> None:
    """The (instance, TP size, rank) triple of a publication is well formed."""
    if not isinstance(instance, str) or not 0 < len(instance) <= _MAX_INSTANCE:
        raise DiscoveryError(f"instance name {instance!r:.80} must be 1-{_MAX_INSTANCE} characters")
    if not 0 < tp_size <= _MAX_TP:
        raise DiscoveryError(f"instance {instance!r}: TP size {tp_size} outside 1..{_MAX_TP}")
    if not 0 <= rank < tp_size:
        raise DiscoveryError(f"instance {instance!r}: rank {rank} outside TP {tp_size}")


def seal_record(secret: bytes | None, key: str | bytes, record: RankRecord) -> bytes:
    """The bytes a store keeps for ``record`` at ``key``: msgpack, after a tag bound to the key when a
    secret is set."""
    body = msgspec.msgpack.encode(record)
    if secret is None:
        return body
    key_bytes = key.encode() if isinstance(key, str) else key
    return seal(secret, _RECORD_PURPOSE, body, key_bytes)


_RECORD = msgspec.msgpack.Decoder(RankRecord)


def open_record(secret: bytes | None, key: str | bytes, blob: bytes, *, lease: str = "",
                instance: str | None = None, rank: int | None = None) -> RankRecord:
    """The record a store holds at ``key``, checked: its tag (with a secret), that it names ``instance`` and
    ``rank`` (what the key says), that it is bound to ``lease`` (the lease the store holds it under; with a
    secret only, since without one a writer can put anything), and its address grammar. Raises
    :class:`DiscoveryError` naming what failed."""
    key_bytes = key.encode() if isinstance(key, str) else key
    if secret is not None:
        try:
            body = unseal(secret, _RECORD_PURPOSE, blob, key_bytes)
        except BadTag:
            raise DiscoveryError(f"record at {key_bytes!r:.120}: bad or missing HMAC (forged, moved from "
                                 "another key, or written with another secret)") from None
    else:
        body = blob
    try:
        record = _RECORD.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DiscoveryError(f"record at {key_bytes!r:.120} is not a rank record: {exc}") from None
    if instance is not None and record.instance != instance:
        raise DiscoveryError(f"record at {key_bytes!r:.120} names instance {record.instance!r:.80}, "
                             f"the key {instance!r:.80}")
    if rank is not None and record.rank != rank:
        raise DiscoveryError(f"record at {key_bytes!r:.120} names rank {record.rank}, the key {rank}")
    if secret is not None and record.lease != lease:
        raise DiscoveryError(f"record at {key_bytes!r:.120} is bound to lease {record.lease or '-'}, the store "
                             f"holds it under {lease or 'no lease'} (replayed from an earlier publication)")
    check_rank(record.instance, record.tp_size, record.rank)
    check_address(record.address)
    return record


def instances_from(records: Iterable[RankRecord]) -> dict[str, InstanceInfo]:
    """Group rank records by instance. Where live ranks of one instance disagree on its TP size (a restart
    with another TP while the old leases run out), the TP size of the newest record wins and the others are
    left out."""
    by_instance: dict[str, list[RankRecord]] = {}
    for record in records:
        by_instance.setdefault(record.instance, []).append(record)
    out: dict[str, InstanceInfo] = {}
    for instance, recs in by_instance.items():
        tp = max(recs, key=lambda r: r.written).tp_size
        out[instance] = InstanceInfo(tp, {r.rank: r.address for r in sorted(recs, key=lambda r: r.written)
                                          if r.tp_size == tp})
    return out


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme.lower()


ZMQ_SCHEMES = ("tcp", "ipc", "inproc")


_ZMQ_FACTORY = "kvbridge.zmq_link:ZmqBootstrap"


@hookimpl
def kvbridge_discovery_services() -> list[DiscoverySpec]:
    """The built-in discovery service: the embedded ZMQ bootstrap server."""
    return [DiscoverySpec(name="zmq", schemes=ZMQ_SCHEMES, factory=_ZMQ_FACTORY,
                          description="embedded ZMQ bootstrap server (the default; no extra process)")]


def open_discovery(url: str, *, secret: bytes | None = None, timeout_s: float = 2.0, lease_s: float = 10.0,
                   options: Mapping[str, str] | None = None, registry: Registry | None = None) -> Discovery:
    """A discovery client for ``url``: the embedded ZMQ bootstrap for ``tcp://``/``ipc://``/``inproc://``,
    else the plugin whose :class:`~kvbridge.specs.DiscoverySpec` declares the URL's scheme. ``lease_s``: how
    long a published rank outlives this process's last sign of life; ``options``: the plugin's own."""
    scheme = scheme_of(url)
    if scheme in ZMQ_SCHEMES:
        factory = resolve(_ZMQ_FACTORY)
    else:
        if registry is None:
            from kvbridge.registry import Registry

            registry = Registry.build()
        factory = registry.discovery_factory(scheme)
    client = factory(url, secret=secret, timeout_s=timeout_s, lease_s=lease_s, options=dict(options or {}))
    if not isinstance(client, Discovery):
        raise DiscoveryError(f"the discovery plugin for {scheme}:// returned {type(client).__name__}, which does "
                             "not implement kvbridge.discovery.Discovery")
    return client

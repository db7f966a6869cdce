"""``EtcdDiscovery``: kvbridge's discovery (``kvbridge.plugin.Discovery``) on an etcd v3 cluster.

URL: ``etcd://host:port/prefix`` (port 2379 and prefix ``/kvbridge`` by default). Rank ``r`` of instance ``I``
lives at ``<prefix>/instances/<I, percent-encoded>/<r>``; its value is a sealed
:class:`~kvbridge.plugin.RankRecord` (with a secret: HMAC-SHA256 over the key and the record, which names the
lease it is attached to; see ``kvbridge.discovery``).

* **Leases.** Every rank a client publishes is attached to the client's one lease (TTL ``lease_s``, at least
  2 s), kept alive by a thread every third of the TTL. A process that dies stops renewing it: etcd deletes
  its keys when the TTL runs out, and watchers see the deletion. ``close()`` revokes the lease (the keys go
  at once). A lease that was lost anyway (etcd restarted from an old snapshot, a partition longer than the
  TTL) is replaced and every rank put again under the new one; a rank whose key was overwritten or deleted
  by someone else is put again too.
* **Lookups** read the instance's keys and keep only records that pass ``open_record``: right HMAC for
  that key, the lease the key is held under (a record replayed from an earlier lease or moved from
  another key is refused and logged), a well-formed address.
* **Watches** list the watched keys, then follow etcd's watch stream from the listed revision; when the
  stream ends (etcd restarted, compaction, an idle connection closed after ``watch_idle_s``) they list
  again and report what differs, so nothing is missed.

It talks to etcd's gRPC gateway (JSON over HTTP) through ``etcd3gw``: no gRPC runtime in the engine's
process; ``docs/deployment.md`` says why this client was chosen. Options (``options=``, all strings):
``api_path`` (default: asked from the server's ``/version``), ``watch_idle_s`` (default 10).
"""

from __future__ import annotations

import base64
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from kvbridge.plugin import (
    Change,
    DiscoveryError,
    InstanceInfo,
    RankRecord,
    check_address,
    check_rank,
    instances_from,
    open_record,
    seal_record,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/kvbridge"
MIN_TTL_S = 2
_KNOWN_OPTIONS = ("api_path", "watch_idle_s")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def _errors() -> tuple[type[BaseException], ...]:
    """What a failed request to etcd raises: the library's errors, and OSError (requests' errors are
    OSErrors)."""
    from etcd3gw.exceptions import Etcd3Exception

    return (Etcd3Exception, OSError, ValueError, KeyError)


class EtcdDiscovery:
    """A discovery client on one etcd endpoint (see the module docstring)."""

    def __init__(self, url: str, *, secret: bytes | None = None, timeout_s: float = 2.0, lease_s: float = 10.0,
                 options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(_KNOWN_OPTIONS))
        if unknown:
            raise ValueError(f"unknown etcd discovery option(s) {unknown}; known: {list(_KNOWN_OPTIONS)}")
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.hostname:
            raise ValueError(f"{url!r} is not an etcd URL (etcd://host:port/prefix)")
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or DEFAULT_PORT
        prefix = (parts.path or DEFAULT_PREFIX).rstrip("/") or DEFAULT_PREFIX
        if not all(c.isalnum() or c in "/_.-" for c in prefix):
            raise ValueError(f"etcd key prefix {prefix!r}: use letters, digits and / _ . -")
        self._root = f"{prefix}/instances/"
        self._secret = secret
        self._timeout_s = timeout_s
        self._api_path = opts.get("api_path")
        self._watch_idle_s = float(opts.get("watch_idle_s", "10"))
        self._ttl = max(MIN_TTL_S, math.ceil(lease_s))
        self._lock = threading.RLock()                  # the main client, the lease and what we published
        self._client = self._new_client()
        self._lease_id: int | None = None
        self._published: dict[tuple[str, int], tuple[bytes, RankRecord]] = {}   # -> (key, record)
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._closed = False
        self.rejected = 0                               # records refused by open_record

    # ---------------------------------------------------------------- plumbing
    def _new_client(self) -> Any:
        from etcd3gw.client import Etcd3Client

        return Etcd3Client(host=self._host, port=self._port, timeout=self._timeout_s, api_path=self._api_path)

    def route_target(self) -> tuple[str, int] | None:
        return self._host, self._port

    def _key(self, instance: str, rank: int) -> bytes:
        return self._instance_prefix(instance) + str(rank).encode()

    def _instance_prefix(self, instance: str) -> bytes:
        try:
            return f"{self._root}{quote(instance, safe='')}/".encode()
        except UnicodeEncodeError as exc:
            raise DiscoveryError(f"instance name {instance!r:.80} cannot be encoded as UTF-8 ({exc.reason})") from None

    def _parse_key(self, key: bytes) -> tuple[str, int] | None:
        text = key.decode(errors="replace")
        if not text.startswith(self._root):
            return None
        name, _, rank = text[len(self._root):].partition("/")
        if not rank.isdigit() or not name:
            return None
        return unquote(name), int(rank)

    def _open(self, key: bytes, value: bytes, lease: str) -> RankRecord | None:
        """The checked record at ``key`` (None, logged and counted, when it fails a check)."""
        where = self._parse_key(key)
        if where is None:
            return None
        try:
            return open_record(self._secret, key, value, lease=lease, instance=where[0], rank=where[1])
        except DiscoveryError as exc:
            self.rejected += 1
            log.warning("etcd discovery: refused a record: %s", exc)
            return None

    def _range(self, client: Any, prefix: bytes) -> tuple[int, list[tuple[bytes, bytes, str]]]:
        """(revision, [(key, value, lease)]) of every key under ``prefix``."""
        reply = client.post(client.get_url("/kv/range"),
                            json={"key": _b64(prefix), "range_end": _b64(_range_end(prefix))})
        revision = int(reply.get("header", {}).get("revision", 0))
        kvs = [(_unb64(kv["key"]), _unb64(kv.get("value", "")), str(kv.get("lease", "") or ""))
               for kv in reply.get("kvs", [])]
        return revision, kvs

    def _records(self, client: Any, prefix: bytes) -> tuple[int, dict[bytes, RankRecord]]:
        revision, kvs = self._range(client, prefix)
        out = {}
        for key, value, lease in kvs:
            record = self._open(key, value, lease)
            if record is not None:
                out[key] = record
        return revision, out

    def _grant(self) -> int:
        reply = self._client.post(self._client.get_url("/lease/grant"), json={"TTL": self._ttl})
        return int(reply["ID"])

    def _put(self, client: Any, key: bytes, record: RankRecord, lease_id: int) -> None:
        value = seal_record(self._secret, key, record)
        client.post(client.get_url("/kv/put"), json={"key": _b64(key), "value": _b64(value), "lease": lease_id})

    # ---------------------------------------------------------------- the protocol
    def publish(self, instance: str, tp_size: int, rank: int, address: str) -> None:
        check_rank(instance, tp_size, rank)
        check_address(address)
        if self._closed:
            raise DiscoveryError("the etcd discovery client is closed")
        key = self._key(instance, rank)
        try:
            with self._lock:
                _, live = self._records(self._client, self._instance_prefix(instance))
                others = {r.tp_size for r in live.values() if r.rank != rank}
                if others and tp_size not in others:
                    raise DiscoveryError(f"instance {instance!r} already has TP {sorted(others)[0]} (live ranks "
                                         f"{sorted(r.rank for r in live.values())}), rank {rank} says {tp_size}")
                if any(r.rank == rank and (r.address != address or r.lease != str(self._lease_id))
                       for r in live.values()):     # our rank's key is another client's: a new life
                    live = self._forget_other_life(instance, rank, address, live)
                if self._lease_id is None:
                    self._lease_id = self._grant()
                record = RankRecord(instance=instance, tp_size=tp_size, rank=rank, address=address,
                                    lease=str(self._lease_id), written=time.time())
                self._put(self._client, key, record, self._lease_id)
                self._published[(instance, rank)] = (key, record)
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep_alive, name="kvbridge-etcd-keepalive",
                                                    daemon=True)
                    self._keeper.start()
        except DiscoveryError:
            raise
        except _errors() as exc:
            raise DiscoveryError(f"could not publish rank {rank} of {instance!r} at {self.url}: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _forget_other_life(self, instance: str, rank: int, address: str,
                           live: dict[bytes, RankRecord]) -> dict[bytes, RankRecord]:
        """Rank ``rank`` of ``instance`` starts a new life (its key holds another client's record): the instance's other
        keys may be the dead life's, still leased, and a lookup would mix the two. Delete them; the live ranks'
        keep-alive puts theirs back within a third of the TTL (it puts again a key that no longer holds its
        record), the dead ones stay gone."""
        kept: dict[bytes, RankRecord] = {}
        for key, record in live.items():
            if record.rank == rank:
                kept[key] = record
                continue
            value = seal_record(self._secret, key, record)
            txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}],
                   "success": [{"request_delete_range": {"key": _b64(key)}}], "failure": []}
            self._client.post(self._client.get_url("/kv/txn"), json=txn)    # only if it still holds that record
        log.info("etcd discovery: rank %d of %r restarted at %s; its other ranks wait until they are put again",
                 rank, instance, address)
        return kept

    def withdraw(self, instance: str, rank: int) -> None:
        with self._lock:
            entry = self._published.pop((instance, rank), None)
            if entry is None:
                return
            key, record = entry
            value = seal_record(self._secret, key, record)
            txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}],
                   "success": [{"request_delete_range": {"key": _b64(key)}}], "failure": []}
            try:
                self._client.post(self._client.get_url("/kv/txn"), json=txn)    # only if it is still ours
            except _errors() as exc:
                log.warning("etcd discovery: withdrawing rank %d of %r failed (its lease ends it): %s", rank,
                            instance, exc)

    def lookup(self, instance: str) -> InstanceInfo | None:
        try:
            with self._lock:
                _, records = self._records(self._client, self._instance_prefix(instance))
        except _errors() as exc:
            log.warning("etcd discovery: lookup of %r at %s failed: %s", instance, self.url, exc)
            return None
        return instances_from(records.values()).get(instance)

    def watch(self, instance: str | None = None) -> EtcdWatch:
        prefix = self._instance_prefix(instance) if instance else self._root.encode()
        return EtcdWatch(self, prefix)

    def close(self) -> None:
        """Stop renewing, revoke the lease (every published rank goes at once), release the connections."""
        self._closed = True
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=self._timeout_s + 2)
        with self._lock:
            lease, self._lease_id = self._lease_id, None
            self._published.clear()
            if lease is not None:
                try:
                    self._client.post(self._client.get_url("/kv/lease/revoke"), json={"ID": lease})
                except _errors() as exc:
                    log.info("etcd discovery: revoking lease %d failed (it expires by itself): %s", lease, exc)
            self._client.session.close()

    # ---------------------------------------------------------------- lease upkeep
    def _keep_alive(self) -> None:
        """Renew the lease every third of its TTL; replace a lost lease and put every rank again; put again a
        rank whose key no longer holds our record."""
        client = self._new_client()
        try:
            while not self._stop.wait(self._ttl / 3):
                with self._lock:
                    lease = self._lease_id
                    published = list(self._published.items())
                if lease is None or not published:
                    continue
                try:
                    reply = client.post(client.get_url("/lease/keepalive"), json={"ID": lease})
                    ttl = int(reply.get("result", {}).get("TTL", -1))
                    if ttl <= 0:
                        self._replace_lease(lease)
                        continue
                    for (instance, rank), (key, record) in published:
                        _, kvs = self._range(client, key)
                        held = [(value, owner) for k, value, owner in kvs if k == key]
                        if not held or held[0] != (seal_record(self._secret, key, record), str(lease)):
                            log.warning("etcd discovery: rank %d of %r was changed or removed by someone else; "
                                        "putting it again", rank, instance)
                            with self._lock:
                                if self._published.get((instance, rank)) == (key, record):
                                    self._put(client, key, record, lease)
                except _errors() as exc:
                    log.debug("etcd discovery: keep-alive of lease %d failed: %s", lease, exc)
        finally:
            client.session.close()

    def _replace_lease(self, lost: int) -> None:
        with self._lock:
            if self._lease_id != lost or self._stop.is_set():
                return
            log.warning("etcd discovery: lease %d is gone; publishing %d rank(s) again under a new one", lost,
                        len(self._published))
            self._lease_id = self._grant()
            for where, (key, record) in list(self._published.items()):
                fresh = RankRecord(instance=record.instance, tp_size=record.tp_size, rank=record.rank,
                                   address=record.address, lease=str(self._lease_id), written=time.time())
                self._put(self._client, key, fresh, self._lease_id)
                self._published[where] = (key, fresh)


class EtcdWatch:
    """Changes under one key prefix (one instance, or every instance): list, then follow the watch stream;
    list again whenever the stream ends. ``changes()`` drains what the thread queued."""

    def __init__(self, owner: EtcdDiscovery, prefix: bytes) -> None:
        self._owner = owner
        self._prefix = prefix
        self._queue: queue.Queue[Change] = queue.Queue()
        self._cache: dict[bytes, RankRecord] | None = None
        self._stop = threading.Event()
        self._response: Any = None
        self._client = owner._new_client()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-etcd-watch", daemon=True)
        self._thread.start()
        self._ready.wait(owner._timeout_s + 1)          # the first listing: later changes are changes

    def changes(self, timeout_s: float = 0.0) -> list[Change]:
        out: list[Change] = []
        try:
            out.append(self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _infos(self, cache: Mapping[bytes, RankRecord]) -> dict[str, InstanceInfo]:
        return instances_from(cache.values())

    def _relist(self) -> int:
        revision, fresh = self._owner._records(self._client, self._prefix)
        if self._cache is not None:
            before, after = self._infos(self._cache), self._infos(fresh)
            for name in sorted(set(before) | set(after)):
                if before.get(name) != after.get(name):
                    self._queue.put(Change(name, after.get(name)))
        self._cache = fresh
        return revision

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision = self._relist()
                self._ready.set()
                self._follow(revision + 1)
            except Exception as exc:  # noqa: BLE001 - any failure: list again after a pause
                if not self._stop.is_set():
                    log.debug("etcd watch of %r: %s: %s", self._prefix, type(exc).__name__, exc)
                    self._stop.wait(0.5)

    def _follow(self, start: int) -> None:
        client = self._client
        request = {"create_request": {"key": _b64(self._prefix), "range_end": _b64(_range_end(self._prefix)),
                                      "start_revision": start}}
        response = client.session.post(client.get_url("/watch"), json=request, stream=True,
                                       timeout=(self._owner._timeout_s, self._owner._watch_idle_s))
        self._response = response
        try:
            if self._stop.is_set():
                return
            if response.status_code != 200:
                raise DiscoveryError(f"watch refused: HTTP {response.status_code} {response.text[:200]}")
            import json

            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if not line:
                    continue
                message = json.loads(line)
                if "error" in message:
                    raise DiscoveryError(f"watch error: {message['error']}")
                result = message.get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return                                   # compacted or cancelled: list again
                self._apply(result.get("events", []))
        finally:
            self._response = None
            response.close()

    def _apply(self, events: list[dict[str, Any]]) -> None:
        assert self._cache is not None
        touched: dict[str, None] = {}
        before = self._infos(self._cache)
        for event in events:
            kv = event.get("kv", {})
            key = _unb64(kv.get("key", ""))
            where = self._owner._parse_key(key)
            if where is None:
                continue
            if event.get("type") == "DELETE":
                self._cache.pop(key, None)
            else:
                record = self._owner._open(key, _unb64(kv.get("value", "")), str(kv.get("lease", "") or ""))
                if record is None:
                    self._cache.pop(key, None)
                else:
                    self._cache[key] = record
            touched[where[0]] = None
        after = self._infos(self._cache)
        for name in touched:
            if before.get(name) != after.get(name):
                self._queue.put(Change(name, after.get(name)))

    def close(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:                                         # wake the reader blocked on the stream
                fd = os.dup(response.raw.fileno())
                with socket.socket(fileno=fd) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, ValueError, AttributeError):
                pass
        self._thread.join(timeout=self._owner._timeout_s + self._owner._watch_idle_s + 2)
        self._client.session.close()

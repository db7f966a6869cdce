"""Control links: how agents exchange control frames and find a prefill instance's ranks.

A link is a mailbox with an address. ``LocalHub`` connects agents of one process (tests, the
single-process demo); ``kvbridge.zmq_link`` connects processes over ZMQ. Both carry opaque frames
produced by :class:`kvbridge.protocol.wire.Codec`, so the same validation runs either way.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol, runtime_checkable

import msgspec


class InstanceInfo(msgspec.Struct, frozen=True):
    """Where the ranks of a prefill instance listen, by TP rank."""

    tp_size: int
    addresses: dict[int, str]

    @property
    def complete(self) -> bool:
        return len(self.addresses) == self.tp_size


class Link(Protocol):
    address: str

    def send(self, address: str, frame: bytes) -> None: ...
    def recv(self, timeout_s: float = 0.0) -> list[bytes]: ...
    def publish(self, instance: str, tp_size: int, rank: int) -> None: ...
    def lookup(self, instance: str) -> InstanceInfo | None: ...
    def close(self) -> None: ...


@runtime_checkable
class PeerQueues(Protocol):
    """A link that queues frames per address (``kvbridge.zmq_link.ZmqLink``): the agent tells it when the peer
    at an address dies (its queued frames are dropped, later ones bounded), comes back, or is forgotten."""

    def peer_down(self, address: str) -> int: ...
    def peer_up(self, address: str) -> None: ...
    def forget(self, address: str) -> None: ...
    def queued_to(self, address: str) -> int: ...


@runtime_checkable
class SharedSecretLink(Protocol):
    """A link that carries frames between processes and holds the shared secret for its own traffic (bootstrap,
    exposure checks): ``kvbridge.zmq_link.ZmqLink``. An agent refuses one whose secret is not its own."""

    def secret_mismatch(self, secret: bytes | None) -> str: ...


class LocalHub:
    """Connects in-process links by address. ``hub.link("prefill-0")`` makes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, LocalLink] = {}
        self._instances: dict[str, InstanceInfo] = {}

    def link(self, address: str) -> LocalLink:
        with self._lock:
            if address in self._links:
                raise ValueError(f"address {address!r} is already taken on this hub")
            link = self._links[address] = LocalLink(self, address)
            return link

    def _deliver(self, address: str, frame: bytes) -> None:
        with self._lock:
            link = self._links.get(address)
        if link is not None:  # like a network: frames to a gone address are lost
            link._push(frame)

    def _publish(self, instance: str, tp_size: int, rank: int, address: str) -> None:
        with self._lock:
            info = self._instances.get(instance)
            addresses = dict(info.addresses) if info else {}
            addresses[rank] = address
            self._instances[instance] = InstanceInfo(tp_size, addresses)

    def _lookup(self, instance: str) -> InstanceInfo | None:
        with self._lock:
            return self._instances.get(instance)

    def _drop(self, address: str) -> None:
        with self._lock:
            self._links.pop(address, None)


class LocalLink:
    def __init__(self, hub: LocalHub, address: str) -> None:
        self._hub = hub
        self.address = address
        self._inbox: deque[bytes] = deque()
        self._ready = threading.Condition()

    def _push(self, frame: bytes) -> None:
        with self._ready:
            self._inbox.append(frame)
            self._ready.notify()

    def send(self, address: str, frame: bytes) -> None:
        self._hub._deliver(address, frame)

    def recv(self, timeout_s: float = 0.0) -> list[bytes]:
        with self._ready:
            if not self._inbox and timeout_s > 0:
                self._ready.wait(timeout_s)
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def publish(self, instance: str, tp_size: int, rank: int) -> None:
        self._hub._publish(instance, tp_size, rank, self.address)

    def lookup(self, instance: str) -> InstanceInfo | None:
        return self._hub._lookup(instance)

    def close(self) -> None:
        self._hub._drop(self.address)

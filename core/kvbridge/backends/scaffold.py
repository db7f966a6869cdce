"""Bookkeeping shared by engine backends: the registration and peer tables, the send preconditions, the
first steps of ``poll``, and loading an injectable engine module.

A backend keeps one :class:`EngineTables` and lets it answer the questions every ``send_component`` asks
first (closed? known peer? source buffers registered here and still live?)::

    self._tables: EngineTables[_Peer] = EngineTables("mybackend")
    ...
    def send_component(self, transfer):
        peer, local = self._tables.for_send(transfer)     # raises RegionError
"""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvbridge.backends.base import ComponentTransfer, Poll, RegisteredBuffers
from kvbridge.errors import PluginUnavailableError, RegionError
from kvbridge.geometry import MemoryRegion

__all__ = ["EngineTables", "NoNotifications", "PendingHandle", "Registration", "default_host", "import_engine",
           "load_api", "settled"]

P = TypeVar("P")


@dataclass(slots=True, eq=False)
class Registration:
    """``RegisteredBuffers.handle`` of a scaffolded backend: the engine's object for each region (a memory
    descriptor, an address...); ``live`` until deregistered."""

    per_region: tuple[Any, ...]
    live: bool = True


class PendingHandle(Protocol):
    """What ``send_component`` of a scaffolded backend returns: a sticky result, a released flag."""

    result: Poll | None
    released: bool


class EngineTables(Generic[P]):
    """A backend's live registrations (by the identity of their engine handle) and its peers (by name),
    under one re-entrant ``lock`` the backend may also hold for its own compound updates."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self.registrations: dict[int, RegisteredBuffers] = {}
        self.peers: dict[str, P] = {}
        self.closed = False

    # -- registrations
    def register(self, component: str, regions: Sequence[MemoryRegion], per_region: Sequence[Any],
                 descriptor: bytes = b"") -> RegisteredBuffers:
        """Record the engine's objects for ``regions`` as one live registration."""
        registered = RegisteredBuffers(component, tuple(regions), descriptor, handle=Registration(tuple(per_region)))
        with self.lock:
            self.registrations[id(registered.handle)] = registered
        return registered

    def deregister(self, registered: RegisteredBuffers) -> tuple[Any, ...]:
        """Forget ``registered`` and mark it dead; the engine objects to release (none when it was not
        registered here)."""
        with self.lock:
            if self.registrations.pop(id(registered.handle), None) is None:
                return ()
        registration: Registration = registered.handle
        registration.live = False
        return registration.per_region

    # -- peers
    def add_peer(self, name: str, peer: P) -> str:
        with self.lock:
            self.peers[name] = peer
        return name

    def peer(self, name: str) -> P:
        with self.lock:
            peer = self.peers.get(name)
        if peer is None:
            raise RegionError(f"unknown peer {name!r}; add_peer first")
        return peer

    def pop_peer(self, name: str) -> P | None:
        with self.lock:
            return self.peers.pop(name, None)

    # -- the life cycle
    def for_send(self, transfer: ComponentTransfer) -> tuple[P, RegisteredBuffers]:
        """The peer and the local registration ``transfer`` uses; RegionError when the backend is closed,
        the peer unknown, or the source buffers not (or no longer) registered here."""
        if self.closed:
            raise RegionError(f"{self.backend} backend is closed")
        with self.lock:
            peer = self.peers.get(transfer.peer)
            local = self.registrations.get(id(transfer.src.handle))
        if peer is None:
            raise RegionError(f"unknown peer {transfer.peer!r}; add_peer first")
        if local is None or local.handle is not transfer.src.handle or not local.handle.live:
            raise RegionError(f"source buffers of {transfer.component!r} are not registered with this "
                              f"{self.backend} backend")
        return peer, local

    def close(self) -> tuple[list[RegisteredBuffers], list[P]] | None:
        """Mark the backend closed, empty both tables and mark every registration dead; what they held
        (registrations whose engine objects are still to be released, peers), or None when closed already."""
        if self.closed:
            return None
        self.closed = True
        with self.lock:
            registrations, self.registrations = list(self.registrations.values()), {}
            peers, self.peers = list(self.peers.values()), {}
        for registered in registrations:
            registered.handle.live = False
        return registrations, peers


def settled(handle: Any, kind: type[Any], backend: str) -> Poll | None:
    """The first steps of ``poll``: a failure for a foreign handle, the sticky result, a failure for a
    released handle; None when the engine has to be asked."""
    if not isinstance(handle, kind):
        article = "an" if backend[:1] in "aeiou" else "a"
        return Poll.failed(f"not {article} {backend} handle: {handle!r}")
    result: Poll | None = handle.result
    if result is not None:
        return result
    if handle.released:
        return Poll.failed("handle was released")
    return None


class NoNotifications:
    """For engines without a notice payload: the core's control plane carries every completion notice."""

    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        return False

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return []


def load_api(spec: str) -> Any:
    """Import the engine module named by ``spec`` (``"pkg.mod"`` or ``"pkg.mod:attr"``)."""
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def import_engine(spec: str, plugin: str, hint: str) -> Any:
    """:func:`load_api`, with a missing engine (or its native runtime) as PluginUnavailableError."""
    try:
        return load_api(spec)
    except (ImportError, OSError) as exc:   # OSError: the module imports, its shared library does not
        raise PluginUnavailableError(plugin, f"cannot import {spec}: {type(exc).__name__}: {exc}", hint) from exc


def default_host() -> str:
    """This host's address as peers see it (loopback when the host name does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

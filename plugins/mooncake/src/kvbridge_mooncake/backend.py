"""``mooncake``: kvbridge's TransferBackend over the Mooncake transfer engine (P2P handshake, no etcd).

Each backend owns one ``TransferEngine``; its endpoint is the engine's session id ``host:rpc_port``
(msgpack). ``send_component`` bounds-checks the plan against the registered regions on both sides,
then hands it to a transfer thread (``worker.py``) and returns a handle; ``poll`` reads the handle.
No failure is remembered per peer: every send is attempted afresh (unlike SGLang's sticky
``failed_sessions``, bug #13054). Notices ride Mooncake's notify channel after a 1-byte write between
two scratch bytes each backend registers; they are queued behind the data already posted to that peer.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    ComponentTransfer,
    DeviceKind,
    IncompatiblePeer,
    MemoryRegion,
    PeerInfo,
    Poll,
    ProtocolError,
    RegionError,
    RegisteredBuffers,
    check_within,
)
from kvbridge_mooncake.engine import MooncakeOptions, MooncakeOptionsSchema, create_engine
from kvbridge_mooncake.worker import MooncakeHandle, NotifyFailure, NotifyJob, SendJob, Worker

log = logging.getLogger("kvbridge.mooncake")
_CLOSE_WAIT_S = 60.0
_SCRATCH_NBYTES = 64


class MooncakeEndpoint(msgspec.Struct, frozen=True, array_like=True):
    """What a peer needs to reach this backend (the ``endpoint`` bytes, msgpack)."""

    session: str      # "host:rpc_port", the engine's P2P handshake address
    name: str         # the backend's endpoint name, shown as the sender of its notices
    protocol: str
    scratch: int      # address of a registered scratch byte that notices write to


@dataclass(frozen=True, slots=True)
class _Peer:
    info: PeerInfo
    endpoint: MooncakeEndpoint
    worker: int


class MooncakeBackend:
    """Mooncake transfer backend. ``name`` must be unique per endpoint; ``options`` see MooncakeOptions."""

    options_schema = MooncakeOptionsSchema     # what kvbridge.settings checks backend_options against

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        self.name = "mooncake"
        self.endpoint_name = name
        self.options = MooncakeOptions.parse(options)
        self._engine, self.session = create_engine(self.options)
        self._lock = threading.Lock()
        self._registered: dict[str, list[RegisteredBuffers]] = {}
        self._refs: Counter[tuple[int, int]] = Counter()   # (addr, nbytes) -> registrations holding it
        self._peers: dict[str, _Peer] = {}
        self._closing = threading.Event()
        self._closed = False
        self._notify_failures: deque[NotifyFailure] = deque()
        self._scratch = np.zeros(_SCRATCH_NBYTES, dtype=np.uint8)
        self._engine_register([(self._scratch.ctypes.data, _SCRATCH_NBYTES)], "notify scratch")
        self.endpoint = msgspec.msgpack.encode(
            MooncakeEndpoint(self.session, name, self.options.protocol, self._scratch.ctypes.data))
        self._workers = [Worker(self._engine, f"kvbridge-mooncake-{name}-{i}", self._closing)
                         for i in range(self.options.workers)]

    # -- memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        self._check_open()
        for region in regions:
            if region.device is not DeviceKind.CPU:
                raise RegionError(f"mooncake (this build) moves host memory only; {component} has a "
                                  f"{region.device.value} region at {region.addr:#x}")
        keys = [(r.addr, r.nbytes) for r in regions]
        with self._lock:
            fresh = list(dict.fromkeys(k for k in keys if self._refs[k] == 0))
            self._engine_register(fresh, component)
            self._refs.update(keys)
            registered = RegisteredBuffers(component, tuple(regions))
            self._registered.setdefault(component, []).append(registered)
        return registered

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        with self._lock:
            entries = self._registered.get(registered.component, [])
            if registered not in entries:
                return
            entries.remove(registered)
            if not entries:
                del self._registered[registered.component]
            keys = [(r.addr, r.nbytes) for r in registered.regions]
            self._refs.subtract(keys)
            gone = list(dict.fromkeys(k for k in keys if self._refs[k] <= 0))
            for key in gone:
                del self._refs[key]
        engine = self._engine
        if gone and engine is not None and not self._closed:
            rc = engine.batch_unregister_memory([addr for addr, _ in gone])
            if rc != 0:
                log.warning("mooncake batch_unregister_memory of %d regions of %s returned %d",
                            len(gone), registered.component, rc)

    def _engine_register(self, keys: list[tuple[int, int]], what: str) -> None:
        if not keys:
            return
        rc = self._engine.batch_register_memory([a for a, _ in keys], [n for _, n in keys])
        if rc != 0:
            raise RegionError(f"mooncake batch_register_memory of {len(keys)} regions of {what} returned "
                              f"{rc} (does a region overlap one registered before?)")

    @property
    def registered_regions(self) -> list[MemoryRegion]:
        with self._lock:
            return [r for regs in self._registered.values() for reg in regs for r in reg.regions]

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        self._check_open()
        try:
            endpoint = msgspec.msgpack.decode(peer.endpoint, type=MooncakeEndpoint)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"peer {peer.name!r} sent an endpoint that is not a mooncake endpoint: "
                                f"{exc}") from None
        if endpoint.protocol != self.options.protocol:
            raise IncompatiblePeer(f"peer {peer.name!r} speaks mooncake {endpoint.protocol}, this backend "
                                   f"{self.options.protocol}")
        worker = zlib.crc32(endpoint.session.encode()) % len(self._workers)
        with self._lock:
            self._peers[peer.name] = _Peer(peer, endpoint, worker)
        return peer.name

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> MooncakeHandle:
        self._check_open()
        plan = transfer.plan
        with self._lock:
            peer = self._peers.get(transfer.peer)
            local = [r for reg in self._registered.get(transfer.component, []) for r in reg.regions]
        if peer is None:
            raise RegionError(f"unknown peer {transfer.peer!r}; add_peer first")
        check_within(plan.src_addr, plan.nbytes, local, f"source ({transfer.component})")
        check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, f"destination ({transfer.component})")
        handle = MooncakeHandle(transfer.peer, len(plan), plan.total_nbytes if len(plan) else 0)
        if len(plan) == 0:
            handle.finish(Poll.done())
            return handle
        self._submit(peer, SendJob(handle=handle, session=peer.endpoint.session, src=plan.src_addr,
                                   dst=plan.dst_addr, nbytes=plan.nbytes,
                                   chunk=self.options.chunk, window=self.options.window))
        return handle

    def _submit(self, peer: _Peer, job: SendJob | NotifyJob) -> None:
        workers = self._workers
        if not workers:
            raise RegionError("mooncake backend is closed")
        workers[peer.worker].submit(job)

    def poll(self, handle: Any) -> Poll:
        if not isinstance(handle, MooncakeHandle):
            return Poll.failed(f"not a mooncake handle: {handle!r}")
        return handle.poll

    def release(self, handle: Any) -> None:
        return None  # a handle holds no engine resource; its batches are freed as they end

    # -- notifications
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        """Queue ``notice`` behind everything already posted to the peer; False if the peer is unknown.

        Delivery is asynchronous (a stalled peer must not stall the caller): a notice that still fails
        after retries is logged and handed out by ``drain_notify_failures``.
        """
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None or self._closed:
            return False
        try:
            self._submit(peer, NotifyJob(peer=peer_id, session=peer.endpoint.session,
                                         local_scratch=self._scratch.ctypes.data,
                                         peer_scratch=peer.endpoint.scratch, sender=self.endpoint_name,
                                         notice=bytes(notice),
                                         failures=self._notify_failures))
        except RegionError:
            return False
        return True

    def drain_notify_failures(self) -> list[NotifyFailure]:
        """Notices accepted by ``notify_completion`` that could not be delivered, oldest first."""
        out = []
        while self._notify_failures:
            out.append(self._notify_failures.popleft())
        return out

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        engine = self._engine
        if engine is None or self._closed:
            return []
        out: list[tuple[str, bytes]] = []
        for note in engine.get_notifies():
            try:
                out.append((note.name, note.msg.encode("latin-1")))
            except (UnicodeError, ValueError) as exc:  # not from kvbridge: a notice we cannot have sent
                log.warning("mooncake: dropped a notice that kvbridge did not encode (%s)", exc)
        return out

    # -- lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closing.set()
        self._closed = True
        stuck = [w for w in self._workers if not w.stop(_CLOSE_WAIT_S)]
        with self._lock:
            addrs = [addr for addr, _ in self._refs] + [self._scratch.ctypes.data]
            self._refs.clear()
            self._registered.clear()
            self._peers.clear()
        if stuck:  # a transfer is still inside the engine: keep the engine (and memory) alive, say so
            log.warning("mooncake backend %s: %d transfer thread(s) still busy after %.0f s; engine left "
                        "running", self.endpoint_name, len(stuck), _CLOSE_WAIT_S)
            return
        self._engine.batch_unregister_memory(addrs)
        self._workers = []
        self._engine = None  # the last reference: the engine stops its threads and closes its sockets

    def _check_open(self) -> None:
        if self._closed:
            raise RegionError("mooncake backend is closed")

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.endpoint_name!r}, {self.options.protocol}, session={self.session})"

"""The ``ascend`` transfer backend: Huawei Ascend NPU transfers through ``memfabric_hybrid.TransferEngine``.

memfabric addresses writes absolutely (local address, peer session id, peer address, length), so a
component transfer is the plan's three uint64 arrays handed to ``batch_transfer_sync_write``. That call
blocks until the bytes moved, so it runs on a small worker pool and ``send_component`` returns a handle
at once; ``poll`` reports the call's return code (0 = done, anything else = failed, with the code's
``smem.h`` name). A failure is never made sticky per peer: each send tries again.

The engine joins a config store (``store_url``, ``tcp://host:port``) under a session id ``host:port``;
peers reach each other by session id, which is what the endpoint carries. memfabric has no
notifications, so ``notify_completion`` returns False and the core's control plane carries notices.

The engine module is injectable: ``options={"api": "kvbridge_ascend.standin"}`` or ``api=<module>``.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvbridge.plugin import (
    ComponentTransfer,
    DeviceKind,
    EngineTables,
    IncompatiblePeer,
    MemoryRegion,
    NoNotifications,
    PeerInfo,
    PluginUnavailableError,
    Poll,
    RegionError,
    RegisteredBuffers,
    TransferPlan,
    check_within,
    default_host,
    import_engine,
    settled,
)
from kvbridge_ascend.codes import SmemCode, describe

log = logging.getLogger("kvbridge.ascend")


class Protocol(str, enum.Enum):
    """memfabric's data path; the value names a ``TransDataOpType`` member."""

    SDMA = "sdma"
    HOST_RDMA = "host_rdma"
    DEVICE_RDMA = "device_rdma"
    DEVICE_URMA = "device_urma"
    DEVICE_UBOE = "device_uboe"


class Role(str, enum.Enum):
    PREFILL = "Prefill"
    DECODE = "Decode"


class AscendOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Backend options (all arrive as strings)."""

    api: str = "memfabric_hybrid"         # module (or "module:attr") providing TransferEngine
    store_url: str = ""                    # config store, tcp://host:port; default $ASCEND_MF_STORE_URL
    role: Role = Role.PREFILL
    device_id: int = 0                     # NPU id
    protocol: Protocol = Protocol.SDMA     # default $ASCEND_MF_TRANSFER_PROTOCOL, else sdma
    host: str = ""                         # host part of the session id; "" = this host's address
    session_id: str = ""                   # "" = host:<rpc port>
    host_store: bool = False               # start the config store here (create_config_store) first
    store_server_role: Role | None = None  # memfabric's own store-hosting role (engine default: Decode)
    nic: str = ""
    workers: int = 1                       # threads running the blocking writes
    max_batch: int = 0                     # descriptors per batch_transfer_sync_write call; 0 = all
    close_timeout_s: float = 30.0          # close() waits this long for writes still running

    @classmethod
    def parse(cls, options: dict[str, str] | None) -> AscendOptions:
        raw = dict(options or {})
        raw.setdefault("store_url", os.environ.get("ASCEND_MF_STORE_URL", ""))
        raw.setdefault("protocol", os.environ.get("ASCEND_MF_TRANSFER_PROTOCOL", "sdma").lower())
        for key in ("role", "store_server_role"):
            if key in raw:
                raw[key] = raw[key].capitalize()
        try:
            parsed = msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            known = ", ".join(cls.__struct_fields__)
            raise ValueError(f"ascend backend option error: {exc} (known options: {known})") from None
        if not parsed.store_url:
            raise ValueError("ascend backend needs a config store: set option store_url (tcp://host:port) or "
                             "ASCEND_MF_STORE_URL")
        if parsed.workers < 1 or parsed.max_batch < 0:
            raise ValueError("ascend backend options: workers must be >= 1 and max_batch >= 0")
        return parsed


class _Endpoint(msgspec.Struct, frozen=True, array_like=True):
    session: str
    store_url: str


@dataclass(slots=True, eq=False)
class _Peer:
    name: str
    session: str
    failure: str = ""   # set only by remove_peer: engine errors stay per transfer


@dataclass(slots=True, eq=False)
class AscendHandle:
    """A posted write: the worker's future (its return code) and the peer it targets."""

    peer: _Peer
    future: cf.Future[int] | None
    result: Poll | None = None
    released: bool = False


SESSION_ATTEMPTS = 8      # session ids drawn (from free ports) before a duplicate one is reported


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


class AscendBackend(NoNotifications):
    """kvbridge backend over one memfabric ``TransferEngine``. See the module docstring."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None, api: Any = None) -> None:
        from kvbridge_ascend import INSTALL_HINT, NPU_HINT

        self.name = "ascend"
        self.options = opts = AscendOptions.parse(options)
        self.api = api if api is not None else import_engine(opts.api, "ascend", INSTALL_HINT)
        if opts.host_store:
            rc = self.api.create_config_store(opts.store_url)
            if rc != 0:
                raise PluginUnavailableError("ascend", f"create_config_store({opts.store_url!r}) returned "
                                             f"{describe(rc)}", "is the port free and the URL tcp://host:port?")
        self._te = self.api.TransferEngine()
        host = opts.host or default_host()
        extra: dict[str, str] = {}
        if opts.store_server_role is not None:
            extra["store_server_role"] = opts.store_server_role.value
        if opts.nic:
            extra["nic"] = opts.nic
        op_type = getattr(self.api.TransDataOpType, opts.protocol.name)
        # a session id of our own choosing takes a port that was free when asked and is not held: another
        # engine of the store may have been given the same one meanwhile (SMEM_DUPLICATED; a clean-clone CI run
        # failed a kit class so). Such an id is drawn again; a configured one is the operator's and is not.
        for _ in range(1 if opts.session_id else SESSION_ATTEMPTS):
            self.session_id = opts.session_id or f"{host}:{self._te.get_rpc_port() or _free_port(host)}"
            rc = self._te.initialize(opts.store_url, self.session_id, opts.role.value, opts.device_id, op_type,
                                     **extra)
            if rc != SmemCode.DUPLICATED:
                break
        if rc != 0:
            raise PluginUnavailableError(
                "ascend", f"TransferEngine.initialize(store {opts.store_url!r}, session {self.session_id!r}, "
                          f"role {opts.role.value}, NPU {opts.device_id}, {opts.protocol.name}) returned "
                          f"{describe(rc)}", NPU_HINT)
        self.endpoint: bytes = msgspec.msgpack.encode(_Endpoint(self.session_id, opts.store_url))
        self._tables: EngineTables[_Peer] = EngineTables("ascend")
        self._lock = self._tables.lock
        self._running: set[cf.Future[int]] = set()
        self._pool = cf.ThreadPoolExecutor(opts.workers, thread_name_prefix=f"kvbridge-ascend-{name}")

    # ------------------------------------------------------------------ memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        for region in regions:
            if region.device not in (DeviceKind.CPU, DeviceKind.NPU):
                raise RegionError(f"ascend registers NPU or host memory; {component} has a {region.device.value} "
                                  "region")
        addrs = tuple(r.addr for r in regions)
        rc = self._te.batch_register_memory(list(addrs), [r.nbytes for r in regions])
        if rc != 0:
            raise RegionError(f"memfabric batch_register_memory of {len(addrs)} regions of {component!r} returned "
                              f"{describe(rc)}")
        return self._tables.register(component, regions, addrs)   # handle: the address of each region

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        for addr in self._tables.deregister(registered):
            self._te.unregister_memory(addr)

    # ------------------------------------------------------------------- peers
    def add_peer(self, peer: PeerInfo) -> str:
        endpoint = msgspec.msgpack.decode(peer.endpoint, type=_Endpoint)
        if endpoint.store_url != self.options.store_url:
            raise IncompatiblePeer(f"peer {peer.name!r} is in config store {endpoint.store_url!r}, this engine in "
                                   f"{self.options.store_url!r}; memfabric sessions only reach peers of one store")
        return self._tables.add_peer(peer.name, _Peer(peer.name, endpoint.session))

    def remove_peer(self, peer_id: str) -> None:
        peer = self._tables.pop_peer(peer_id)
        if peer is not None:
            peer.failure = f"peer {peer_id!r} was removed"

    # --------------------------------------------------------------- transfers
    def send_component(self, transfer: ComponentTransfer) -> AscendHandle:
        peer, local = self._tables.for_send(transfer)
        plan = transfer.plan
        check_within(plan.src_addr, plan.nbytes, local.regions, f"source ({transfer.component})")
        check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, f"destination ({transfer.component})")
        if len(plan) == 0:
            return AscendHandle(peer, None, result=Poll.done())
        future = self._pool.submit(self._write, peer.session, plan)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._finished)
        return AscendHandle(peer, future)

    def _finished(self, future: cf.Future[int]) -> None:
        with self._lock:
            self._running.discard(future)

    def _write(self, session: str, plan: TransferPlan) -> int:
        """Worker thread: the blocking memfabric call(s); the first non-zero return code wins."""
        step = self.options.max_batch or len(plan)
        for lo in range(0, len(plan), step):   # one call per max_batch descriptors, not per page
            hi = lo + step
            rc = self._te.batch_transfer_sync_write(session, plan.src_addr[lo:hi].tolist(),
                                                    plan.dst_addr[lo:hi].tolist(), plan.nbytes[lo:hi].tolist())
            if rc != 0:
                return int(rc)
        return 0

    def poll(self, handle: Any) -> Poll:
        early = settled(handle, AscendHandle, "ascend")
        if early is not None:
            return early
        future = handle.future
        assert future is not None
        if not future.done():
            return Poll.failed(handle.peer.failure) if handle.peer.failure else Poll.pending()
        exc = None if future.cancelled() else future.exception()
        if future.cancelled():
            handle.result = Poll.failed("write was cancelled: the backend closed before it started")
        elif exc is not None:
            handle.result = Poll.failed(f"memfabric batch_transfer_sync_write to {handle.peer.name!r} raised "
                                        f"{type(exc).__name__}: {exc}")
        elif future.result() != 0:
            handle.result = Poll.failed(f"memfabric batch_transfer_sync_write to {handle.peer.name!r} (session "
                                        f"{handle.peer.session!r}) returned {describe(future.result())}")
        else:
            handle.result = Poll.done()
        return handle.result

    def release(self, handle: Any) -> None:
        if isinstance(handle, AscendHandle):
            handle.released = True   # a running write finishes on its worker; close() waits for it

    # notifications: memfabric has none; the control plane carries them (NoNotifications)

    def close(self) -> None:
        held = self._tables.close()
        if held is None:
            return
        registrations, _ = held
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._running)
        _, stuck = cf.wait(running, timeout=self.options.close_timeout_s)
        if stuck:   # un-initialising under a running write could crash the process; leak the engine instead
            log.warning("ascend backend %s: %d writes still running after %.0f s; leaving the engine initialised",
                        self.session_id, len(stuck), self.options.close_timeout_s)
            return
        for registered in registrations:
            for addr in registered.handle.per_region:
                self._te.unregister_memory(addr)
        self._te.unInitialize()
        self._te.destroy()

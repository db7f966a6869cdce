"""The ``mori`` transfer backend: one-sided RDMA writes through AMD MoRI-IO (``mori.io``).

MoRI addresses a write as (registered ``MemoryDesc``, byte offset), not by absolute address. Each region
of a component is registered once and becomes one ``MemoryDesc``; the peer-visible descriptor of a
component is the msgpack list of their ``pack()`` blobs, and the endpoint is the packed ``EngineDesc``.
A component transfer becomes one ``batch_write`` in the 1.2.x list form with one entry per buffer
(source desc, destination desc, offset lists, sizes, its own transfer uid); the older single-descriptor
form is detected on first use and then posted entry by entry.

Completion: MoRI carries no notice payload, so ``notify_completion`` returns False and the core's control
plane carries notices. The target side can still confirm that the writes of a transfer landed with
:meth:`MoriBackend.inbound_status` (``pop_inbound_transfer_status``) given the sender's uids
(:meth:`MoriBackend.transfer_uids`). Peer death reported by ``pop_peer_failure`` (where the engine has
it) fails that peer's pending handles.

The engine module is injectable: ``options={"api": "kvbridge_mori.standin"}`` or ``api=<module>``.
"""

from __future__ import annotations

import enum
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    ComponentTransfer,
    DeviceKind,
    EngineTables,
    MemoryRegion,
    NoNotifications,
    PeerInfo,
    Poll,
    RegionError,
    RegionWire,
    RegisteredBuffers,
    RemoteBuffers,
    TransferPlan,
    default_host,
    import_engine,
    settled,
)

_U64 = np.uint64
_MAX_FAILURE_EVENTS = 1024  # drained per call, so a chatty engine cannot stall a poll


class BatchForm(str, enum.Enum):
    """Which ``batch_write`` signature to call."""

    AUTO = "auto"      # try the 1.2.x list form, fall back to the single form on TypeError
    LIST = "list"      # batch_write([src], [[loff]], [dst], [[roff]], [[size]], [uid]) -> [status]
    SINGLE = "single"  # batch_write(src, [loff], dst, [roff], [size], uid) -> status


class CqMode(str, enum.Enum):
    POLLING = "polling"
    EVENT = "event"


class MoriOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Backend options (all arrive as strings). ``None`` knobs are left at the engine's default."""

    api: str = "mori.io"               # module (or "module:attr") providing the mori.io surface
    host: str = ""                      # out-of-band TCP host peers reach; "" = this host's address
    port: int = 0                       # 0 = let MoRI bind a free port
    engine_key: str = ""                # "" = kvbridge-<name>-<host>-<pid>-<random>
    rdma_devices: str = ""              # exported as MORI_RDMA_DEVICES (process-wide) before the engine starts
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = 1
    poll_cq_mode: CqMode = CqMode.POLLING
    enable_notification: bool = True    # target-side inbound status (needed by inbound_status)
    notif_per_qp: int | None = None
    enable_transfer_chunking: bool | None = None
    chunk_bytes: int | None = None
    max_chunks_per_transfer: int | None = None
    num_nics_per_transfer: int | None = None
    batch_form: BatchForm = BatchForm.AUTO
    close_timeout_ms: int = 5000        # how long close() waits for released in-flight writes

    @classmethod
    def parse(cls, options: dict[str, str] | None) -> MoriOptions:
        try:
            return msgspec.convert(dict(options or {}), cls, strict=False)
        except msgspec.ValidationError as exc:
            known = ", ".join(cls.__struct_fields__)
            raise ValueError(f"mori backend option error: {exc} (known options: {known})") from None

    def rdma_config_kwargs(self, api: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "qp_per_transfer": self.qp_per_transfer, "post_batch_size": self.post_batch_size,
            "num_worker_threads": self.num_worker_threads,
            "poll_cq_mode": getattr(api.PollCqMode, self.poll_cq_mode.name),
            "enable_notification": self.enable_notification,
        }
        for knob in ("notif_per_qp", "enable_transfer_chunking", "chunk_bytes", "max_chunks_per_transfer",
                     "num_nics_per_transfer"):
            value = getattr(self, knob)
            if value is not None:
                kwargs[knob] = value
        return kwargs


def _import_engine(spec: str) -> Any:
    from kvbridge_mori import (
        INSTALL_HINT,  # no amd-mori, or no ROCm runtime under it (OSError: libamdhip64...)
    )

    return import_engine(spec, "mori", INSTALL_HINT)


@dataclass(slots=True, eq=False)
class _Peer:
    name: str
    desc: Any                                                   # EngineDesc
    components: dict[str, tuple[bytes, tuple[Any, ...]]]        # component -> (descriptor, MemoryDescs)
    failure: str = ""


@dataclass(slots=True, eq=False, kw_only=True)
class MoriHandle:
    """What ``send_component`` returns: one TransferStatus and uid per batch entry (per buffer)."""

    peer: _Peer
    statuses: list[Any]
    uids: tuple[int, ...]
    cursor: int = 0                     # statuses before it have succeeded
    result: Poll | None = None          # sticky once DONE or FAILED
    released: bool = field(default=False)


def _code_name(code: Any) -> str:
    return str(getattr(code, "name", code))


def _failure_key(event: Any) -> str:
    for attr in ("engine_key", "remote_engine_key", "key"):
        value = getattr(event, attr, None)
        if value:
            return str(value)
    return ""


class MoriBackend(NoNotifications):
    """kvbridge backend over one MoRI-IO engine. See the module docstring."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None, api: ModuleType | Any = None) -> None:
        self.name = "mori"
        self.options = MoriOptions.parse(options)
        self.api = api if api is not None else _import_engine(self.options.api)
        if self.options.rdma_devices:
            os.environ["MORI_RDMA_DEVICES"] = self.options.rdma_devices
        key = self.options.engine_key or f"kvbridge-{name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        host = self.options.host or default_host()
        self._engine = self.api.IOEngine(key, self.api.IOEngineConfig(host=host, port=self.options.port))
        self._engine.create_backend(self.api.BackendType.RDMA,
                                    self.api.RdmaBackendConfig(**self.options.rdma_config_kwargs(self.api)))
        desc = self._engine.get_engine_desc()
        self.engine_key: str = desc.key
        self.endpoint: bytes = desc.pack()
        self._form = self.options.batch_form
        self._tables: EngineTables[_Peer] = EngineTables("mori")
        self._lock = self._tables.lock
        self._parked: list[list[Any]] = []   # statuses of released, still in-flight handles (kept alive)

    # ------------------------------------------------------------------ memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        loc = self.api.MemoryLocationType
        descs = []
        for region in regions:
            if region.device is DeviceKind.CPU:
                descs.append(self._engine.register_memory(region.addr, region.nbytes, -1, loc.CPU))
            elif region.device in (DeviceKind.ROCM, DeviceKind.CUDA):   # HIP memory shows up as "cuda" in torch
                descs.append(self._engine.register_memory(region.addr, region.nbytes, region.device_id, loc.GPU))
            else:
                for md in descs:
                    self._engine.deregister_memory(md)
                raise RegionError(f"mori registers host or GPU memory; {component} has a {region.device.value} region")
        descriptor = msgspec.msgpack.encode([md.pack() for md in descs])
        return self._tables.register(component, regions, descs, descriptor)   # handle: one MemoryDesc per region

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        for md in self._tables.deregister(registered):
            self._engine.deregister_memory(md)

    # ------------------------------------------------------------------- peers
    def add_peer(self, peer: PeerInfo) -> str:
        desc = self.api.EngineDesc.unpack(peer.endpoint)
        components = {buf.component: (buf.descriptor, self._remote_descs(desc, buf)) for buf in peer.buffers}
        self._engine.register_remote_engine(desc)
        return self._tables.add_peer(peer.name, _Peer(peer.name, desc, components))

    def _remote_descs(self, desc: Any, buffers: RemoteBuffers) -> tuple[Any, ...]:
        blobs = msgspec.msgpack.decode(buffers.descriptor, type=list[bytes]) if buffers.descriptor else []
        mds = tuple(self.api.MemoryDesc.unpack(blob) for blob in blobs)
        if len(mds) != len(buffers.regions):
            raise RegionError(f"peer component {buffers.component!r}: {len(buffers.regions)} regions but "
                              f"{len(mds)} MoRI memory descriptors")
        for i, (md, region) in enumerate(zip(mds, buffers.regions, strict=True)):
            if md.engine_key != desc.key:
                raise RegionError(f"peer component {buffers.component!r} region {i} belongs to engine "
                                  f"{md.engine_key!r}, not the peer's engine {desc.key!r}")
            if int(md.data) != region.addr or int(md.size) != region.nbytes:
                raise RegionError(f"peer component {buffers.component!r} region {i} is [{region.addr:#x}, "
                                  f"+{region.nbytes}) but its MemoryDesc says [{int(md.data):#x}, +{int(md.size)})")
        return mds

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._tables.pop_peer(peer_id)
            still_used = peer is not None and any(p.desc.key == peer.desc.key for p in self._tables.peers.values())
        if peer is None:
            return
        peer.failure = peer.failure or f"peer {peer_id!r} was removed"
        if not still_used:
            self._engine.deregister_remote_engine(peer.desc)

    # --------------------------------------------------------------- transfers
    def send_component(self, transfer: ComponentTransfer) -> MoriHandle:
        peer, local = self._tables.for_send(transfer)
        self._drain_peer_failures()
        if peer.failure:
            return MoriHandle(peer=peer, statuses=[], uids=(), result=Poll.failed(peer.failure))
        remote = self._dst_descs(peer, transfer.dst)
        entries = _entries(transfer.plan, local.regions, transfer.dst.regions, transfer.component)
        if not entries[0].size:
            return MoriHandle(peer=peer, statuses=[], uids=(), result=Poll.done())
        buffers, loffs, roffs, sizes = entries
        src_descs: tuple[Any, ...] = local.handle.per_region
        lmds = [src_descs[b] for b in buffers.tolist()]
        rmds = [remote[b] for b in buffers.tolist()]
        uids = [self._engine.allocate_transfer_uid() for _ in lmds]
        try:
            statuses = self._post(lmds, loffs, rmds, roffs, sizes, uids)
        except (RuntimeError, ValueError, OSError) as exc:   # the engine refused the whole batch
            return MoriHandle(peer=peer, statuses=[], uids=tuple(uids), result=Poll.failed(
                f"MoRI batch_write to {peer.name!r} raised {type(exc).__name__}: {exc}"))
        return MoriHandle(peer=peer, statuses=statuses, uids=tuple(uids))

    def _dst_descs(self, peer: _Peer, dst: RemoteBuffers) -> tuple[Any, ...]:
        known = peer.components.get(dst.component)
        if known is not None and known[0] == dst.descriptor:
            return known[1]
        mds = self._remote_descs(peer.desc, dst)   # the peer re-registered (or a component added late)
        peer.components[dst.component] = (dst.descriptor, mds)
        return mds

    def _post(self, lmds: list[Any], loffs: list[list[int]], rmds: list[Any], roffs: list[list[int]],
              sizes: list[list[int]], uids: list[int]) -> list[Any]:
        if self._form is not BatchForm.SINGLE:
            try:
                statuses = list(self._engine.batch_write(lmds, loffs, rmds, roffs, sizes, uids))
            except TypeError:
                if self._form is BatchForm.LIST:
                    raise
                self._form = BatchForm.SINGLE
            else:
                self._form = BatchForm.LIST
                return statuses
        return [self._engine.batch_write(lmds[i], loffs[i], rmds[i], roffs[i], sizes[i], uids[i])
                for i in range(len(lmds))]

    def poll(self, handle: Any) -> Poll:
        early = settled(handle, MoriHandle, "mori")
        if early is not None:
            return early
        self._drain_peer_failures()
        statuses = handle.statuses
        while handle.cursor < len(statuses) and statuses[handle.cursor].Succeeded():
            handle.cursor += 1
        if handle.cursor == len(statuses):
            handle.result = Poll.done()
            return handle.result
        for i in range(handle.cursor, len(statuses)):
            status = statuses[i]
            if status.Failed():
                handle.result = Poll.failed(
                    f"MoRI write to {handle.peer.name!r} failed (entry {i} of {len(statuses)}, uid "
                    f"{handle.uids[i]}): {_code_name(status.Code())}: {status.Message()}")
                return handle.result
            if status.Init():
                handle.result = Poll.failed(f"MoRI never posted entry {i} of {len(statuses)} to "
                                            f"{handle.peer.name!r} (no usable backend for that memory pair)")
                return handle.result
        if handle.peer.failure:
            handle.result = Poll.failed(handle.peer.failure)
            return handle.result
        return Poll.pending()

    def release(self, handle: Any) -> None:
        if not isinstance(handle, MoriHandle) or handle.released:
            return
        handle.released = True
        if handle.result is None and any(s.InProgress() for s in handle.statuses):
            with self._lock:   # the engine writes into these objects until the transfer ends
                self._parked = [p for p in self._parked if any(s.InProgress() for s in p)]
                self._parked.append(handle.statuses)
        handle.statuses = []

    def transfer_uids(self, handle: MoriHandle) -> tuple[int, ...]:
        """The MoRI transfer uids of a handle (one per batch entry), for target-side confirmation."""
        return handle.uids

    def inbound_status(self, peer_id: str, uid: int) -> Poll | None:
        """Target side: did the write ``uid`` from peer ``peer_id`` land? None until MoRI knows (needs
        ``enable_notification``); popping consumes the record."""
        peer = self._tables.peer(peer_id)
        status = self._engine.pop_inbound_transfer_status(peer.desc.key, uid)
        if status is None:
            return None
        if status.Failed():
            return Poll.failed(f"MoRI inbound uid {uid} from {peer_id!r}: {_code_name(status.Code())}: "
                               f"{status.Message()}")
        return Poll.done() if status.Succeeded() else Poll.pending()

    def _drain_peer_failures(self) -> None:
        pop = getattr(self._engine, "pop_peer_failure", None)
        if not callable(pop):
            return
        for _ in range(_MAX_FAILURE_EVENTS):
            event = pop()
            if event is None:
                return
            key = _failure_key(event)
            message = getattr(event, "message", "") or str(event)
            with self._lock:
                for peer in self._tables.peers.values():
                    if peer.desc.key == key and not peer.failure:
                        peer.failure = f"MoRI reports peer engine {key!r} ({peer.name!r}) failed: {message}"

    # notifications: MoRI has no notice payload; the control plane carries them (NoNotifications)

    def close(self) -> None:
        held = self._tables.close()
        if held is None:
            return
        registrations, peers = held
        deadline = time.monotonic() + self.options.close_timeout_ms / 1000
        with self._lock:
            parked, self._parked = self._parked, []
        for statuses in parked:
            for status in statuses:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                status.WaitFor(left_ms)
        for registered in registrations:
            for md in registered.handle.per_region:
                self._engine.deregister_memory(md)
        for peer in {p.desc.key: p for p in peers}.values():
            self._engine.deregister_remote_engine(peer.desc)


def _entries(plan: TransferPlan, src_regions: Sequence[MemoryRegion], dst_regions: Sequence[RegionWire],
             component: str) -> tuple[np.ndarray, list[list[int]], list[list[int]], list[list[int]]]:
    """Split the plan by buffer into per-entry offset lists, bounds-checked against each buffer's region.

    Returns (buffer index per entry, local offsets, remote offsets, sizes); vectorized except for the
    final per-buffer split (one iteration per buffer, never per page or token).
    """
    buf = plan.buffer.astype(np.int64, copy=False)
    if buf.size == 0:
        return buf, [], [], []
    n = min(len(src_regions), len(dst_regions))
    if int(buf.min()) < 0 or int(buf.max()) >= n:
        raise RegionError(f"{component}: plan names buffer {int(buf.max())} but {n} buffers are registered")
    loff = _offsets(plan.src_addr, plan.nbytes, buf, src_regions, f"source ({component})")
    roff = _offsets(plan.dst_addr, plan.nbytes, buf, dst_regions, f"destination ({component})")
    lens = plan.nbytes
    if buf.size > 1 and np.any(buf[1:] < buf[:-1]):
        order = np.argsort(buf, kind="stable")
        buf, loff, roff, lens = buf[order], loff[order], roff[order], lens[order]
    cuts = np.flatnonzero(buf[1:] != buf[:-1]) + 1
    starts = np.concatenate((np.zeros(1, np.int64), cuts))
    return buf[starts], _split(loff, cuts), _split(roff, cuts), _split(lens, cuts)


def _split(values: np.ndarray, cuts: np.ndarray) -> list[list[int]]:
    return [part.tolist() for part in np.split(values, cuts)]


def _offsets(addr: np.ndarray, lens: np.ndarray, buf: np.ndarray, regions: Sequence[Any], side: str) -> np.ndarray:
    base = np.array([r.addr for r in regions], dtype=_U64)[buf]
    size = np.array([r.nbytes for r in regions], dtype=_U64)[buf]
    off = addr - base
    bad = (addr < base) | (off + lens > size) | (lens == 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        b = int(buf[i])
        raise RegionError(f"{side} descriptor {i} [{int(addr[i]):#x}, +{int(lens[i])}) is outside buffer {b} "
                          f"[{int(base[i]):#x}, +{int(size[i])}) ({int(bad.sum())} of {bad.size} descriptors out of "
                          "bounds)")
    return off

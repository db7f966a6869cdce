"""An in-process stand-in for ``mori.io`` (AMD MoRI-IO, amd-mori 1.2.x), for hosts without ROCm.

It mirrors the public surface the MoRI backend uses - class, method and enum names, argument names and
defaults, and return conventions (``batch_write`` in the 1.2.x list form returns one ``TransferStatus``
per entry; ``pop_inbound_transfer_status`` returns a status or None) - and refuses what the real engine
refuses. Engines of one process find each other through a process-global table keyed by engine key;
a "write" is a memmove between registered host addresses, executed on a per-engine worker thread so
statuses really go ``IN_PROGRESS`` -> ``SUCCESS``/``ERR_*``.

How each refusal is reported (real engine behaviour in brackets, from the MoRI sources):

* no backend created: the entry fails ``ERR_BAD_STATE`` and the remaining entries of the batch stay
  ``INIT`` [``SELECT_BACKEND_AND_RETURN_IF_NONE`` returns from the whole batch];
* mismatched offset/size list lengths: ``ERR_INVALID_ARGS`` [``RdmaBatchReadWrite``];
* local memory not registered with this engine, or remote engine not registered: ``RuntimeError`` at
  the call [session creation throws ``std::runtime_error``; exact text differs];
* remote memory gone or a remote range out of bounds: ``ERR_RDMA_OP`` "remote access error", local
  range out of bounds: ``ERR_RDMA_OP`` "local protection error" [CQE errors, asynchronously];
* a dead peer: ``ERR_RDMA_OP`` "transport retry counter exceeded", and a ``PeerFailureEvent`` for every
  engine that registered it (``pop_peer_failure``; not in upstream HEAD's Python wrapper - see README).

Test knobs (not part of MoRI): :func:`fail_next_writes`, :func:`pause`, :func:`resume`, :func:`kill`,
:func:`reset`. :data:`legacy` is the same engine with the pre-1.2 single-descriptor ``batch_write``.
"""

from __future__ import annotations

import enum
import itertools
import os
import queue
import socket
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import copy_descriptors

_ERR_BEGIN = 10  # codes above this are failures (not exported by the real binding either)
_IPC_HANDLE_SIZE = 64


class BackendType(enum.IntEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.IntEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


class PollCqMode(enum.IntEnum):
    POLLING = 0
    EVENT = 1


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0) -> None:
        self.host, self.port = host, port


class BackendConfig:
    """Base of the backend configs (as in the binding)."""


class RdmaBackendConfig(BackendConfig):
    def __init__(self, qp_per_transfer: int = 1, post_batch_size: int = -1, num_worker_threads: int = -1,
                 poll_cq_mode: PollCqMode = PollCqMode.POLLING, enable_notification: bool = True,
                 notif_per_qp: int = 1024, enable_transfer_chunking: bool = False, chunk_bytes: int = 65536,
                 max_chunks_per_transfer: int = 64, num_nics_per_transfer: int = 1) -> None:
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = PollCqMode(poll_cq_mode)
        self.enable_notification = bool(enable_notification)
        self.notif_per_qp = notif_per_qp
        self.enable_transfer_chunking = bool(enable_transfer_chunking)
        self.chunk_bytes = chunk_bytes
        self.max_chunks_per_transfer = max_chunks_per_transfer
        self.num_nics_per_transfer = num_nics_per_transfer


class XgmiBackendConfig(BackendConfig):
    def __init__(self, num_streams: int = 64, num_events: int = 64) -> None:
        self.num_streams, self.num_events = num_streams, num_events


class TransferStatus:
    """Completion state of one transfer (one batch entry). Thread-safe; a failure is sticky."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._code = StatusCode.INIT
        self._msg = ""

    def Code(self) -> StatusCode:  # MoRI's names
        return self._code

    def Message(self) -> str:
        with self._cond:
            return self._msg

    def Update(self, code: StatusCode, message: str) -> None:
        with self._cond:
            if self._code > _ERR_BEGIN:
                return
            self._code, self._msg = StatusCode(code), message
            self._cond.notify_all()

    def SetCode(self, code: StatusCode) -> None:
        with self._cond:
            self._code = StatusCode(code)
            self._cond.notify_all()

    def SetMessage(self, message: str) -> None:
        with self._cond:
            self._msg = message

    def Init(self) -> bool:
        return self._code == StatusCode.INIT

    def InProgress(self) -> bool:
        return self._code == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._code == StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self._code > _ERR_BEGIN

    def Wait(self) -> None:
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        with self._cond:
            if timeout_ms != 0:
                self._cond.wait_for(lambda: self._code != StatusCode.IN_PROGRESS,
                                    None if timeout_ms < 0 else timeout_ms / 1000)
            return self._code


class _EngineWire(msgspec.Struct, array_like=True, kw_only=True):
    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int


class EngineDesc:
    """Who an engine is and where its out-of-band server listens. ``pack()`` is a msgpack array."""

    def __init__(self, key: str = "", node_id: str = "", hostname: str = "", host: str = "", port: int = 0,
                 pid: int = 0) -> None:
        self.key, self.node_id, self.hostname, self.host, self.port, self.pid = key, node_id, hostname, host, port, pid

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(_EngineWire(key=self.key, node_id=self.node_id, hostname=self.hostname,
                                                  host=self.host, port=self.port,
                                                  pid=self.pid))

    @staticmethod
    def unpack(blob: bytes) -> EngineDesc:
        w = msgspec.msgpack.decode(blob, type=_EngineWire)
        return EngineDesc(w.key, w.node_id, w.hostname, w.host, w.port, w.pid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineDesc) and self.pack() == other.pack()

    def __hash__(self) -> int:
        return hash(self.pack())


class _MemoryWire(msgspec.Struct, array_like=True, kw_only=True):
    # field order of the C++ MSGPACK_DEFINE; not byte-checked against a real engine
    engine_key: str
    id: int
    device_id: int
    device_bus_id: str
    data: int
    size: int
    loc: int
    ipc_handle: bytes
    numa_node: int
    ipc_offset: int = 0
    fabric_handle: bytes = bytes(_IPC_HANDLE_SIZE)
    vpod_id: int = -1
    vpod_ppod_id: str = ""
    fabric_offset: int = 0
    fabric_alloc_size: int = 0


class MemoryDesc:
    """A registered memory region as a peer sees it (engine key, id, address, size, location)."""

    def __init__(self) -> None:
        self.engine_key = ""
        self.id = 0
        self.device_id = -1
        self.device_bus_id = ""
        self.data = 0
        self.size = 0
        self.loc = MemoryLocationType.Unknown
        self.ipc_handle = bytes(_IPC_HANDLE_SIZE)
        self.numa_node = -1

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(_MemoryWire(engine_key=self.engine_key, id=self.id,
                                                  device_id=self.device_id, device_bus_id=self.device_bus_id,
                                                  data=self.data, size=self.size, loc=int(self.loc),
                                                  ipc_handle=self.ipc_handle,
                                                  numa_node=self.numa_node))

    @staticmethod
    def unpack(blob: bytes) -> MemoryDesc:
        w = msgspec.msgpack.decode(blob, type=_MemoryWire)
        md = MemoryDesc()
        md.engine_key, md.id, md.device_id, md.device_bus_id = w.engine_key, w.id, w.device_id, w.device_bus_id
        md.data, md.size, md.loc, md.ipc_handle, md.numa_node = (w.data, w.size, MemoryLocationType(w.loc),
                                                                  w.ipc_handle, w.numa_node)
        return md

    def _ident(self) -> tuple[str, int, int, int]:
        return self.engine_key, self.id, self.data, self.size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryDesc) and self._ident() == other._ident()

    def __hash__(self) -> int:
        return hash(self._ident())


@dataclass(frozen=True, slots=True)
class PeerFailureEvent:
    """A remote engine this engine registered has died."""

    engine_key: str
    message: str


# ---------------------------------------------------------------------------------------- the fabric
@dataclass(slots=True)
class _Knobs:
    fail_writes: int = 0
    fail_code: StatusCode = StatusCode.ERR_RDMA_OP
    fail_message: str = "injected failure"
    running: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.running.set()


_LOCK = threading.RLock()
_ENGINES: dict[str, IOEngine] = {}
_PORTS = itertools.count(47000)


def _lookup(key: str) -> IOEngine:
    with _LOCK:
        engine = _ENGINES.get(key)
    if engine is None:
        raise KeyError(f"no live stand-in engine {key!r}")
    return engine


def fail_next_writes(key: str, n: int, code: StatusCode = StatusCode.ERR_RDMA_OP,
                     message: str = "injected failure") -> None:
    """Make the next ``n`` write entries posted by engine ``key`` fail with ``code``/``message``."""
    knobs = _lookup(key)._knobs
    knobs.fail_writes, knobs.fail_code, knobs.fail_message = n, StatusCode(code), message


def pause(key: str) -> None:
    """Hold engine ``key``'s posted transfers IN_PROGRESS until :func:`resume`."""
    _lookup(key)._knobs.running.clear()


def resume(key: str) -> None:
    _lookup(key)._knobs.running.set()


def kill(key: str, reason: str = "killed by test") -> None:
    """Engine ``key`` dies: its peers get a PeerFailureEvent and writes to or from it fail."""
    with _LOCK:
        engine = _ENGINES.pop(key, None)
        others = list(_ENGINES.values())
    if engine is None:
        return
    engine._dead = reason
    engine._stop()
    for other in others:
        if key in other._remotes:
            other._failures.put(PeerFailureEvent(key, reason))


def reset() -> None:
    """Forget every engine (between tests)."""
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine._stop()


# ------------------------------------------------------------------------------------------ engine
@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    local: MemoryDesc
    local_offsets: np.ndarray
    remote: MemoryDesc
    remote_offsets: np.ndarray
    sizes: np.ndarray
    status: TransferStatus
    uid: int
    is_read: bool


def _u64(values: Sequence[int]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and int(arr.min()) < 0):
        raise TypeError("incompatible function arguments: offsets and sizes must be lists of size_t")
    return arr.astype(np.uint64)


def _check_desc_list(name: str, value: object, want: type) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, want) for v in value):
        raise TypeError(f"incompatible function arguments: {name} must be a list of {want.__name__}")


class IOEngineSession:
    """A transfer context bound to one (local, remote) memory pair."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine, self._local, self._remote = engine, local, remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], transfer_uid)

    def write(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_write([local_offset], [remote_offset], [size], transfer_uid)

    def batch_read(self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                   transfer_uid: int) -> TransferStatus:
        return self._engine._post_one(self._local, local_offsets, self._remote, remote_offsets, sizes,
                                      transfer_uid, is_read=True)

    def batch_write(self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                    transfer_uid: int) -> TransferStatus:
        return self._engine._post_one(self._local, local_offsets, self._remote, remote_offsets, sizes,
                                      transfer_uid, is_read=False)

    def alive(self) -> bool:
        return self._engine._dead == "" and self._remote.engine_key in _ENGINES


class IOEngine:
    """One MoRI-IO engine. ``key`` must be unique among the live engines of the process."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        with _LOCK:
            if key in _ENGINES:
                raise RuntimeError(f"engine key {key!r} is already in use")
            port = config.port or next(_PORTS)
            self._desc = EngineDesc(key, socket.gethostname(), socket.gethostname(), config.host, port, os.getpid())
            self._backends: dict[BackendType, BackendConfig] = {}
            self._memory: dict[int, MemoryDesc] = {}
            self._remotes: dict[str, EngineDesc] = {}
            self._inbound: dict[tuple[str, int], TransferStatus] = {}
            self._failures: queue.SimpleQueue[PeerFailureEvent] = queue.SimpleQueue()
            self._uids = itertools.count()
            self._mem_ids = itertools.count()
            self._knobs = _Knobs()
            self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            self._worker: threading.Thread | None = None
            self._dead = ""
            _ENGINES[key] = self

    # -- identity and backends
    def get_engine_desc(self) -> EngineDesc:
        return self._desc

    def create_backend(self, type: BackendType, config: BackendConfig | None = None) -> None:
        if type is not BackendType.RDMA:
            raise RuntimeError(f"the stand-in models the RDMA backend only, not {BackendType(type).name}")
        self._backends[BackendType.RDMA] = config if config is not None else RdmaBackendConfig()

    def remove_backend(self, type: BackendType) -> None:
        self._backends.pop(BackendType(type), None)

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remotes[engine_desc.key] = engine_desc

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remotes.pop(engine_desc.key, None)

    # -- memory
    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        md = MemoryDesc()
        md.engine_key, md.id, md.device_id = self._desc.key, next(self._mem_ids), device_id
        md.data, md.size, md.loc = int(ptr), int(size), MemoryLocationType(mem_loc)
        self._memory[md.id] = md
        return md

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        loc = MemoryLocationType.GPU if tensor.device.type == "cuda" else MemoryLocationType.CPU
        device = tensor.device.index if tensor.device.index is not None else -1
        return self.register_memory(tensor.data_ptr(), tensor.nelement() * tensor.element_size(), device, loc)

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        self._memory.pop(mem_desc.id, None)

    # -- transfers
    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def read(self, local_dest_mem_desc: MemoryDesc, local_offset: int, remote_src_mem_desc: MemoryDesc,
             remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self._post_one(local_dest_mem_desc, [local_offset], remote_src_mem_desc, [remote_offset], [size],
                              transfer_uid, is_read=True)

    def write(self, local_src_mem_desc: MemoryDesc, local_offset: int, remote_dest_mem_desc: MemoryDesc,
              remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self._post_one(local_src_mem_desc, [local_offset], remote_dest_mem_desc, [remote_offset], [size],
                              transfer_uid, is_read=False)

    def batch_read(self, local_dest_mem_desc: Sequence[MemoryDesc], local_offsets: Sequence[Sequence[int]],
                   remote_src_mem_desc: Sequence[MemoryDesc], remote_offsets: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], transfer_uid: Sequence[int]) -> list[TransferStatus]:
        return self._post_list(local_dest_mem_desc, local_offsets, remote_src_mem_desc, remote_offsets, sizes,
                               transfer_uid, is_read=True)

    def batch_write(self, local_src_mem_desc: Sequence[MemoryDesc], local_offsets: Sequence[Sequence[int]],
                    remote_dest_mem_desc: Sequence[MemoryDesc], remote_offsets: Sequence[Sequence[int]],
                    sizes: Sequence[Sequence[int]], transfer_uid: Sequence[int]) -> list[TransferStatus]:
        return self._post_list(local_src_mem_desc, local_offsets, remote_dest_mem_desc, remote_offsets, sizes,
                               transfer_uid, is_read=False)

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        if not self._backends:
            return None
        return IOEngineSession(self, local_mem, remote_mem)

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> TransferStatus | None:
        with _LOCK:
            return self._inbound.pop((remote_key, transfer_uid), None)

    def wait_all(self, statuses: Sequence[TransferStatus], timeout_ms: int = -1) -> StatusCode:
        worst = StatusCode.SUCCESS
        for status in statuses:
            code = status.WaitFor(timeout_ms)
            if code > _ERR_BEGIN:
                return code
            if code == StatusCode.IN_PROGRESS:
                worst = StatusCode.IN_PROGRESS
        return worst

    def pop_peer_failure(self) -> PeerFailureEvent | None:
        try:
            return self._failures.get_nowait()
        except queue.Empty:
            return None

    # -- internals
    def _post_list(self, local: Sequence[MemoryDesc], local_offsets: Sequence[Sequence[int]],
                   remote: Sequence[MemoryDesc], remote_offsets: Sequence[Sequence[int]],
                   sizes: Sequence[Sequence[int]], uids: Sequence[int], *, is_read: bool) -> list[TransferStatus]:
        _check_desc_list("local memory descriptors", local, MemoryDesc)
        _check_desc_list("remote memory descriptors", remote, MemoryDesc)
        n = len(local)
        if not (len(remote) == len(local_offsets) == len(remote_offsets) == len(sizes) == len(uids) == n):
            raise RuntimeError("batch lists differ in length")  # the real engine asserts
        statuses = [TransferStatus() for _ in range(n)]
        for i in range(n):
            if not self._backends:  # the real engine returns from the whole batch here
                statuses[i].Update(StatusCode.ERR_BAD_STATE, "No available backend found, create backend first")
                break
            self._submit(local[i], local_offsets[i], remote[i], remote_offsets[i], sizes[i], statuses[i], uids[i],
                         is_read)
        return statuses

    def _post_one(self, local: MemoryDesc, local_offsets: Sequence[int], remote: MemoryDesc,
                  remote_offsets: Sequence[int], sizes: Sequence[int], uid: int, *, is_read: bool) -> TransferStatus:
        if not isinstance(local, MemoryDesc) or not isinstance(remote, MemoryDesc):
            raise TypeError("incompatible function arguments: expected MemoryDesc")
        status = TransferStatus()
        if not self._backends:
            status.Update(StatusCode.ERR_BAD_STATE, "No available backend found, create backend first")
            return status
        self._submit(local, local_offsets, remote, remote_offsets, sizes, status, uid, is_read)
        return status

    def _submit(self, local: MemoryDesc, local_offsets: Sequence[int], remote: MemoryDesc,
                remote_offsets: Sequence[int], sizes: Sequence[int], status: TransferStatus, uid: int,
                is_read: bool) -> None:
        lo, ro, sz = _u64(local_offsets), _u64(remote_offsets), _u64(sizes)
        if local.engine_key != self._desc.key or self._memory.get(local.id) != local:
            raise RuntimeError(f"local memory {local.id} at {local.data:#x} is not registered with engine "
                               f"{self._desc.key!r}")
        if remote.engine_key not in self._remotes:
            raise RuntimeError(f"remote engine {remote.engine_key!r} is not registered with {self._desc.key!r}")
        if not (lo.size == ro.size == sz.size):
            status.Update(StatusCode.ERR_INVALID_ARGS, "lengths of local offsets, remote offsets or sizes mismatch")
            return
        if sz.size == 0:
            status.SetCode(StatusCode.SUCCESS)
            return
        status.SetCode(StatusCode.IN_PROGRESS)
        knobs = self._knobs
        if knobs.fail_writes > 0 and not is_read:
            knobs.fail_writes -= 1
            fail: tuple[StatusCode, str] | None = (knobs.fail_code, knobs.fail_message)
        else:
            fail = None
        entry = _Entry(local=local, local_offsets=lo, remote=remote, remote_offsets=ro, sizes=sz,
                       status=status, uid=uid, is_read=is_read)
        self._jobs.put(lambda: self._execute(entry, fail))
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name=f"mori-standin-{self._desc.key}", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._knobs.running.wait()
            job()

    def _stop(self) -> None:
        self._dead = self._dead or "engine reset"
        self._knobs.running.set()
        if self._worker is not None:
            self._jobs.put(None)

    def _execute(self, entry: _Entry, fail: tuple[StatusCode, str] | None) -> None:
        status = entry.status
        if fail is not None:
            status.Update(fail[0], fail[1])
            return
        with _LOCK:
            target = _ENGINES.get(entry.remote.engine_key)
        if self._dead or target is None or target._dead:
            status.Update(StatusCode.ERR_RDMA_OP, "transport retry counter exceeded (peer engine "
                                                  f"{entry.remote.engine_key!r} is unreachable)")
            return
        if target._memory.get(entry.remote.id) != entry.remote:
            status.Update(StatusCode.ERR_RDMA_OP, f"remote access error: memory {entry.remote.id} is not registered "
                                                  f"at {entry.remote.engine_key!r}")
            return
        if self._memory.get(entry.local.id) != entry.local:
            status.Update(StatusCode.ERR_RDMA_OP, "local protection error: local memory was deregistered")
            return
        lo_end = entry.local_offsets + entry.sizes
        ro_end = entry.remote_offsets + entry.sizes
        if int(lo_end.max()) > entry.local.size:
            status.Update(StatusCode.ERR_RDMA_OP, "local protection error: offset + size exceeds the local region")
            return
        if int(ro_end.max()) > entry.remote.size:
            status.Update(StatusCode.ERR_RDMA_OP, "remote access error: offset + size exceeds the remote region")
            return
        local = np.uint64(entry.local.data) + entry.local_offsets
        remote = np.uint64(entry.remote.data) + entry.remote_offsets
        if entry.is_read:
            copy_descriptors(remote, local, entry.sizes)
        else:
            copy_descriptors(local, remote, entry.sizes)
        status.Update(StatusCode.SUCCESS, "")
        if getattr(self._backends.get(BackendType.RDMA), "enable_notification", False):
            inbound = TransferStatus()
            inbound.Update(StatusCode.SUCCESS, "")
            with _LOCK:
                target._inbound[(self._desc.key, entry.uid)] = inbound


# ------------------------------------------------------------------------------- pre-1.2 variant
class LegacyIOEngine(IOEngine):
    """The engine as the older ``examples/io/example.py`` shows it: single-descriptor ``batch_write``."""

    def batch_read(self, local_dest_mem_desc: MemoryDesc, local_offsets: Sequence[int],  # type: ignore[override]
                   remote_src_mem_desc: MemoryDesc, remote_offsets: Sequence[int], sizes: Sequence[int],
                   transfer_uid: int) -> TransferStatus:
        return self._post_one(local_dest_mem_desc, local_offsets, remote_src_mem_desc, remote_offsets, sizes,
                              transfer_uid, is_read=True)

    def batch_write(self, local_src_mem_desc: MemoryDesc, local_offsets: Sequence[int],  # type: ignore[override]
                    remote_dest_mem_desc: MemoryDesc, remote_offsets: Sequence[int], sizes: Sequence[int],
                    transfer_uid: int) -> TransferStatus:
        return self._post_one(local_src_mem_desc, local_offsets, remote_dest_mem_desc, remote_offsets, sizes,
                              transfer_uid, is_read=False)

    #: the legacy surface has no peer-failure queue (callers feature-detect it)
    pop_peer_failure = None  # type: ignore[assignment]


#: A module-like namespace of the pre-1.2 surface (single-form ``batch_write``, no ``pop_peer_failure``).
legacy = types.SimpleNamespace(
    IOEngine=LegacyIOEngine,
    IOEngineConfig=IOEngineConfig, BackendType=BackendType, RdmaBackendConfig=RdmaBackendConfig,
    MemoryDesc=MemoryDesc, EngineDesc=EngineDesc, MemoryLocationType=MemoryLocationType, StatusCode=StatusCode,
    PollCqMode=PollCqMode, TransferStatus=TransferStatus,
)

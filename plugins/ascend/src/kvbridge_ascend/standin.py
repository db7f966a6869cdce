"""An in-process stand-in for ``memfabric_hybrid`` (memfabric-hybrid 1.3.0), for hosts without an NPU.

It mirrors the ``TransferEngine`` surface - method and argument names, defaults, the ``TransDataOpType``
and ``TransferOpcode`` enums (also as class attributes), ``create_config_store`` - and its return
conventions: every call returns an int, 0 on success, and the synchronous writes block their caller.
Engines of one process find each other through process-global config stores keyed by store URL, and a
write is a memmove between registered host addresses.

Behaviour observed on the real module without a driver, and mirrored: ``get_rpc_port()`` is 0 before
``initialize``; ``batch_register_memory`` works before ``initialize`` (registrations are replayed) and
returns -1 for lists of different lengths; ``initialize`` returns -1 for a role other than
"Prefill"/"Decode"; writes before ``initialize`` and batches of unequal lengths return -1. Codes the
real engine's failure paths return once initialised could not be observed here; the stand-in uses the
``smem.h`` codes that fit (INVALID_PARAM for ranges outside registered memory, NOT_EXIST for an unknown
session, NOT_CONNECTED for a dead peer, DUPLICATED for a session id already in the store).

Test knobs (not part of memfabric): :func:`fail_next_writes`, :func:`hold`, :func:`release`,
:func:`kill`, :func:`reset`.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.plugin import copy_descriptors
from kvbridge_ascend.codes import SmemCode

_ROLES = ("Prefill", "Decode")


class TransDataOpType(enum.IntEnum):
    SDMA = 1
    HOST_RDMA = 2
    DEVICE_RDMA = 8
    DEVICE_URMA = 64
    DEVICE_UBOE = 128


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


@dataclass(slots=True)
class _Knobs:
    fail_writes: int = 0
    fail_rc: int = SmemCode.ERROR
    gate: threading.Event = field(default_factory=threading.Event)
    dead: bool = False

    def __post_init__(self) -> None:
        self.gate.set()


@dataclass(slots=True)
class _Store:
    sessions: dict[str, TransferEngine] = field(default_factory=dict)


_LOCK = threading.RLock()
_STORES: dict[str, _Store] = {}
_PORTS = itertools.count(51000)


def create_config_store(store_url: str) -> int:
    """Start a config store server at ``tcp://host:port`` (here: a process-global table)."""
    host, sep, port = store_url.removeprefix("tcp://").rpartition(":")
    if not store_url.startswith("tcp://") or not sep or not host or not port.isdigit():
        return SmemCode.INVALID_PARAM
    with _LOCK:
        if store_url in _STORES:
            return SmemCode.ERROR   # the port is taken
        _STORES[store_url] = _Store()
    return SmemCode.OK


def _engine(session_id: str) -> TransferEngine:
    with _LOCK:
        for store in _STORES.values():
            if session_id in store.sessions:
                return store.sessions[session_id]
    raise KeyError(f"no stand-in session {session_id!r}")


def fail_next_writes(session_id: str, n: int, rc: int = SmemCode.ERROR) -> None:
    """The next ``n`` write calls of the engine with this session id return ``rc``."""
    knobs = _engine(session_id)._knobs
    knobs.fail_writes, knobs.fail_rc = n, rc


def hold(session_id: str) -> None:
    """Writes of this session block (as a slow link would) until :func:`release`."""
    _engine(session_id)._knobs.gate.clear()


def release(session_id: str) -> None:
    _engine(session_id)._knobs.gate.set()


def kill(session_id: str) -> None:
    """The engine with this session id dies: writes to it return NOT_CONNECTED, its own writes too."""
    knobs = _engine(session_id)._knobs
    knobs.dead = True
    knobs.gate.set()


def reset() -> None:
    """Forget every store and session (between tests); held writers are let go."""
    with _LOCK:
        engines = [e for store in _STORES.values() for e in store.sessions.values()]
        _STORES.clear()
    for engine in engines:
        engine._knobs.gate.set()


def _inside(addr: np.ndarray, lens: np.ndarray, regions: dict[int, int]) -> bool:
    if not regions:
        return False
    starts = np.array(sorted(regions), dtype=np.uint64)
    ends = starts + np.array([regions[s] for s in sorted(regions)], dtype=np.uint64)
    pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    return bool(np.all((pos >= 0) & (addr + lens <= ends[np.clip(pos, 0, None)]) & (lens > 0)))


_OpType = TransDataOpType  # the enum, for annotations inside TransferEngine (whose attribute shares its name)


class TransferEngine:
    """One memfabric transfer engine; one session id in one config store once initialised."""

    TransDataOpType = TransDataOpType
    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._memory: dict[int, int] = {}        # base address -> capacity
        self._store: _Store | None = None
        self._session = ""
        self._rpc_port = 0
        self._knobs = _Knobs()

    # -- lifecycle
    def initialize(self, store_url: str, session_id: str, role: str, device_id: int,
                   data_op_type: _OpType = TransDataOpType.SDMA, store_server_role: str = "Decode",
                   nic: str = "") -> int:
        if not isinstance(data_op_type, TransDataOpType) or not isinstance(device_id, int):
            raise TypeError("initialize(): incompatible function arguments")
        if role not in _ROLES or self._store is not None:
            return SmemCode.ERROR
        with _LOCK:
            store = _STORES.get(store_url)
            if store is None and role == store_server_role and create_config_store(store_url) == SmemCode.OK:
                store = _STORES[store_url]
            if store is None:
                return SmemCode.ERROR   # no config store to connect to
            if session_id in store.sessions:
                return SmemCode.DUPLICATED
            store.sessions[session_id] = self
        _, _, port = session_id.rpartition(":")
        self._store, self._session = store, session_id
        self._rpc_port = int(port) if port.isdigit() and int(port) > 0 else next(_PORTS)
        return SmemCode.OK

    def get_rpc_port(self) -> int:
        return self._rpc_port

    def unInitialize(self) -> None:  # memfabric's name
        with _LOCK:
            if self._store is not None and self._store.sessions.get(self._session) is self:
                del self._store.sessions[self._session]
        self._store, self._rpc_port = None, 0

    def destroy(self) -> None:
        self.unInitialize()
        self._memory.clear()

    # -- memory
    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        return self.batch_register_memory([buffer_addr], [capacity])

    def batch_register_memory(self, buffer_addrs: Sequence[int], capacities: Sequence[int]) -> int:
        if len(buffer_addrs) != len(capacities):
            return SmemCode.ERROR
        if any(int(c) <= 0 for c in capacities) or any(int(a) <= 0 for a in buffer_addrs):
            return SmemCode.INVALID_PARAM
        for addr, cap in zip(buffer_addrs, capacities, strict=True):
            self._memory[int(addr)] = int(cap)
        return SmemCode.OK

    def unregister_memory(self, buffer_addr: int) -> int:
        if self._memory.pop(int(buffer_addr), None) is None and self._store is not None:
            return SmemCode.NOT_EXIST
        return SmemCode.OK

    # -- transfers
    def transfer_sync_write(self, dest_session: str, buffer: int, peer_buffer: int, length: int,
                            flags: int = 0) -> int:
        return self.batch_transfer_sync_write(dest_session, [buffer], [peer_buffer], [length], flags)

    def batch_transfer_sync_write(self, dest_session: str, buffers: Sequence[int], peer_buffers: Sequence[int],
                                  lengths: Sequence[int], flags: int = 0) -> int:
        return self._transfer(dest_session, buffers, peer_buffers, lengths, write=True)

    def transfer_sync_read(self, dest_session: str, buffer: int, peer_buffer: int, length: int,
                           flags: int = 0) -> int:
        return self.batch_transfer_sync_read(dest_session, [buffer], [peer_buffer], [length], flags)

    def batch_transfer_sync_read(self, dest_session: str, buffers: Sequence[int], peer_buffers: Sequence[int],
                                 lengths: Sequence[int], flags: int = 0) -> int:
        return self._transfer(dest_session, buffers, peer_buffers, lengths, write=False)

    # The async forms queue on an NPU stream in memfabric; the stand-in has no streams and runs them inline.
    def transfer_async_write_submit(self, dest_session: str, buffer: int, peer_buffer: int, length: int,
                                    stream: int, flags: int = 0) -> int:
        return self._transfer(dest_session, [buffer], [peer_buffer], [length], write=True)

    def transfer_async_read_submit(self, dest_session: str, buffer: int, peer_buffer: int, length: int,
                                   stream: int, flags: int = 0) -> int:
        return self._transfer(dest_session, [buffer], [peer_buffer], [length], write=False)

    def batch_transfer_async_write_submit(self, dest_session: str, buffers: Sequence[int],
                                          peer_buffers: Sequence[int], lengths: Sequence[int], stream: int,
                                          flags: int = 0) -> int:
        return self._transfer(dest_session, buffers, peer_buffers, lengths, write=True)

    def batch_transfer_async_read_submit(self, dest_session: str, buffers: Sequence[int],
                                         peer_buffers: Sequence[int], lengths: Sequence[int], stream: int,
                                         flags: int = 0) -> int:
        return self._transfer(dest_session, buffers, peer_buffers, lengths, write=False)

    def batch_transfer_write_with_quant(self, dest_session: str, buffers: Sequence[int], peer_buffers: Sequence[int],
                                        lengths: Sequence[int], scale_buffers: Sequence[int],
                                        offset_buffers: Sequence[int], unit_num: int, input_type: int = 0,
                                        stream: int = 0, flags: int = 0) -> int:
        return SmemCode.ERROR   # quantising writes are not modelled

    def _transfer(self, dest_session: str, buffers: Sequence[int], peer_buffers: Sequence[int],
                  lengths: Sequence[int], *, write: bool) -> int:
        if self._store is None or not (len(buffers) == len(peer_buffers) == len(lengths)):
            return SmemCode.ERROR
        knobs = self._knobs
        knobs.gate.wait()
        if write and knobs.fail_writes > 0:
            knobs.fail_writes -= 1
            return knobs.fail_rc
        with _LOCK:
            peer = self._store.sessions.get(dest_session)
        if peer is None:
            return SmemCode.NOT_EXIST
        if knobs.dead or peer._knobs.dead:
            return SmemCode.NOT_CONNECTED
        if len(lengths) == 0:
            return SmemCode.OK
        local = np.asarray(buffers, dtype=np.uint64)
        remote = np.asarray(peer_buffers, dtype=np.uint64)
        lens = np.asarray(lengths, dtype=np.uint64)
        if not _inside(local, lens, self._memory) or not _inside(remote, lens, peer._memory):
            return SmemCode.INVALID_PARAM
        if write:
            copy_descriptors(local, remote, lens)
        else:
            copy_descriptors(remote, local, lens)
        return SmemCode.OK

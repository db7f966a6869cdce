"""The raw NIXL baseline: NIXL alone through its own API (``nixl._api.nixl_agent``), no kvbridge code and no
backend plugin in the timed path. The one implementation both baselines use:

* ``kvbridge bench transfer``: one contiguous descriptor from prefill rank 0's process to decode rank 0's
  (:func:`contiguous_write`), the same number of bytes as the request;
* ``kvbridge bench --backend nixl`` (:mod:`kvbridge_bench.nixl_backend`): the per-page descriptors kvbridge
  posts, prepped once and indexed per request, or built by ``initialize_xfer`` on every request.

NIXL is optional (``pip install 'kvbridge-bench[nixl]'``): without it :func:`available` says why and the
benchmarks print "not measured" for this baseline.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge import DeviceKind, MemoryRegion

INSTALL = ("the raw NIXL baseline needs NIXL: pip install 'kvbridge-bench[nixl]' (install torch first: "
           "kvbridge-nixl's README says how)")
_MEM = {DeviceKind.CPU: "DRAM", DeviceKind.CUDA: "VRAM", DeviceKind.ROCM: "VRAM"}
LOCAL = "NIXL_INIT_AGENT"        # prep_xfer_dlist's name for the agent's own memory


class NixlMissing(RuntimeError):
    """NIXL cannot be imported here; the message says what to install."""


#: NIXL's backend wheels; ``import nixl`` picks one of them (see :func:`load_api`)
BACKEND_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def load_api() -> Any:
    """NIXL's Python API module, or :class:`NixlMissing` with what to install. The module a NIXL backend already
    loaded in this process when there is one (``import nixl`` imports all of torch to detect CUDA: ~4.5 CPU-s
    where torch is a CPU build), else ``nixl._api``."""
    for wheel in BACKEND_WHEELS:
        loaded = sys.modules.get(f"{wheel}._api")
        if loaded is not None:
            return loaded
    try:
        from nixl import _api
    except Exception as exc:  # any import failure (missing wheel, native library) means "missing"
        raise NixlMissing(f"{INSTALL} ({type(exc).__name__}: {exc})") from exc
    return _api


def available() -> str | None:
    """None when NIXL can be imported here, else why not (with what to install)."""
    try:
        load_api()
    except NixlMissing as exc:
        return str(exc)
    return None


def installed() -> str | None:
    """:func:`available` without importing NIXL (for a launcher whose rank processes use it): None when NIXL's
    package and one of its backend wheels are installed, else what to install."""
    for name in ("nixl", "nixl_meta_utils"):
        if importlib.util.find_spec(name) is None:
            return f"{INSTALL} (no module {name!r})"
    if not any(importlib.util.find_spec(wheel) is not None for wheel in BACKEND_WHEELS):
        return f"{INSTALL} (none of {', '.join(BACKEND_WHEELS)} is installed)"
    return None


def mem_type(region: MemoryRegion) -> str:
    """NIXL's memory type of ``region``: ``DRAM`` or ``VRAM``."""
    if region.device not in _MEM:
        raise ValueError(f"raw NIXL moves host or GPU memory, not {region.device.value}")
    return _MEM[region.device]


def rows(addrs: np.ndarray, nbytes: np.ndarray | int, device_id: int) -> np.ndarray:
    """``[n, 3]`` uint64 descriptor rows (address, length, device id), NIXL's array form of a descriptor list."""
    addrs = np.asarray(addrs, dtype=np.uint64)
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out


class RawNixl:
    """One NIXL agent with the UCX backend: registers memory, loads peers' metadata, posts WRITEs. Close it
    (or use it as a context manager); it releases what it prepped, loaded and registered."""

    def __init__(self, name: str, *, ucx_tls: str = "") -> None:
        api = load_api()
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.agent: Any = api.nixl_agent(self.name, api.nixl_agent_config(backends=[]))
        self.agent.create_backend("UCX", {"engine_config": f"TLS={ucx_tls}"} if ucx_tls else {})
        self._registered: list[Any] = []
        self._dlists: list[Any] = []
        self._peers: list[str] = []

    def __enter__(self) -> RawNixl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register ``regions`` (one memory type) with this agent; take :meth:`metadata` after the last one."""
        mem = mem_type(regions[0])
        reg_rows = [(r.addr, r.nbytes, r.device_id if mem == "VRAM" else 0, "") for r in regions]
        self._registered.append(self.agent.register_memory(reg_rows, mem))

    def metadata(self) -> bytes:
        """This agent's metadata (covers the memory registered so far), for a peer's :meth:`add_peer`."""
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its agent name."""
        loaded = self.agent.add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)   # nixl 1.5.1 returns bytes
        self._peers.append(name)
        return name

    def prep(self, desc_rows: np.ndarray, mem: str, peer: str | None = None) -> Any:
        """A prepped descriptor list of this agent's memory (``peer`` None) or of ``peer``'s."""
        handle = self.agent.prep_xfer_dlist(peer or LOCAL, desc_rows, mem)
        self._dlists.append(handle)
        return handle

    def initialize(self, src_rows: np.ndarray, src_mem: str, dst_rows: np.ndarray, dst_mem: str, peer: str,
                   notice: bytes = b"") -> Any:
        """A WRITE built from descriptor rows on this call (``get_xfer_descs`` twice + ``initialize_xfer``)."""
        src = self.agent.get_xfer_descs(src_rows, src_mem)
        dst = self.agent.get_xfer_descs(dst_rows, dst_mem)
        return self.agent.initialize_xfer("WRITE", src, dst, peer, notice)

    def prepped(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                notice: bytes = b"") -> Any:
        """A WRITE from prepped lists, indexed per request (``make_prepped_xfer``)."""
        return self.agent.make_prepped_xfer("WRITE", local, local_idx, remote, remote_idx, notice)

    def post(self, xfer: Any) -> str:
        """Start ``xfer``; NIXL's state after posting (``PROC`` or ``DONE``)."""
        return str(self.agent.transfer(xfer))

    def wait(self, xfer: Any, state: str) -> str:
        """Poll ``xfer`` (posted, in ``state``) until it is no longer in progress; its final state."""
        while state == "PROC":
            state = str(self.agent.check_xfer_state(xfer))
        return state

    def release(self, xfer: Any, state: str) -> None:
        """Release ``xfer`` (ended in ``state``); raises unless it ended DONE."""
        self.agent.release_xfer_handle(xfer)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended in {state}")

    def finish(self, xfer: Any, state: str) -> None:
        """:meth:`wait`, then :meth:`release`."""
        self.release(xfer, self.wait(xfer, state))

    def notices(self) -> int:
        """Drain the notices peers' WRITEs carried; how many there were."""
        return sum(len(msgs) for msgs in self.agent.get_new_notifs().values())

    def close(self) -> None:
        for handle in self._dlists:
            self.agent.release_dlist_handle(handle)
        for peer in self._peers:
            self.agent.remove_remote_agent(peer)
        for handle in self._registered:
            self.agent.deregister_memory(handle)
        self._dlists, self._peers, self._registered = [], [], []


def contiguous_write(raw: RawNixl, src: MemoryRegion, dst: MemoryRegion, peer: str, nbytes: int,
                     repeats: int, pieces: int = 1, scatter: bool = False) -> dict[str, Any]:
    """``repeats`` WRITEs of ``nbytes`` from ``src`` (registered with ``raw``) to ``dst`` (registered by agent
    ``peer``) as ``pieces`` descriptors of one transfer (one: the whole span), after one warm-up: seconds from
    post to DONE each, and the median CPU cost of building the transfer (``initialize_xfer``). ``scatter``: the
    pieces land in a shuffled order (the per-page method: one descriptor per page and buffer, pages anywhere)."""
    piece = nbytes // pieces
    offsets = np.arange(pieces, dtype=np.uint64) * np.uint64(piece)
    dst_offsets = np.random.default_rng(7).permutation(offsets) if scatter else offsets
    src_rows = rows(np.uint64(src.addr) + offsets, piece, src.device_id)
    dst_rows = rows(np.uint64(dst.addr) + dst_offsets, piece, dst.device_id)
    seconds, init_us = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        xfer = raw.initialize(src_rows, mem_type(src), dst_rows, mem_type(dst), peer)
        t1 = time.perf_counter()
        state = raw.wait(xfer, raw.post(xfer))
        t2 = time.perf_counter()
        raw.release(xfer, state)
        seconds.append(t2 - t1)
        init_us.append((t1 - t0) * 1e6)
    return {"seconds": seconds[1:], "initialize_us": statistics.median(init_us[1:])}

"""``NixlBackend``: kvbridge's transfer backend over one NIXL agent (UCX), host DRAM or GPU VRAM.

Life of a transfer: the decode side registers its buffers, then ships ``PeerInfo(name, endpoint,
buffers)`` (``endpoint`` carries the agent's NIXL metadata, so take it *after* registering). The prefill
side ``add_peer``s it, and per request posts one ``send_component`` per component: a one-sided WRITE
made from two prepped descriptor lists (built on first use per peer, component and slice pattern, then
only indexed), with the request's notice attached so that it reaches the peer after the data.

Buffers should be touched (written once, e.g. zero-filled) before they are registered: the first WRITE
into never-touched host pages runs ~20x slower while the kernel faults them in. The buffer owner does it;
the backend never writes memory it is only told about.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.plugin import (
    ComponentTransfer,
    DeviceKind,
    MemoryRegion,
    PeerInfo,
    PluginUnavailableError,
    Poll,
    ProtocolError,
    RegionError,
    RegionWire,
    RegisteredBuffers,
    RemoteBuffers,
    Segments,
    TransferError,
    check_within,
)
from kvbridge_nixl import INSTALL_HINT
from kvbridge_nixl import api as nixl_api
from kvbridge_nixl.dlists import Pattern, SideGeometry, derive_side, dlist_rows, indices
from kvbridge_nixl.options import NixlOptions, cma_blocked
from kvbridge_nixl.wire import (
    WIRE_VERSION,
    NixlBuffers,
    NixlEndpoint,
    decode_buffers,
    decode_endpoint,
    encode,
)

log = logging.getLogger("kvbridge.nixl")

_MEM_TYPE = {DeviceKind.CPU: "DRAM", DeviceKind.CUDA: "VRAM", DeviceKind.ROCM: "VRAM"}
_AGENT_SEP = "#"          # agent name = endpoint name + "#" + random suffix (unique per instance)
_PATTERN_CACHE = 256      # segment tuples remembered by identity
MERGE_GAIN = 4            # post the merged plan when it has this many times fewer descriptors than items


def _load_api() -> Any:
    try:
        return nixl_api.load()
    except Exception as exc:  # any import failure means "unavailable", with its text
        raise PluginUnavailableError("nixl", f"cannot import nixl: {type(exc).__name__}: {exc}",
                                     INSTALL_HINT) from exc


def _make_agent(api: Any, agent_name: str, config: Any, options: NixlOptions) -> Any:
    """Create the agent and its UCX backend with ``options``' UCX settings passed through NIXL's API (the UCX
    plugin's ``engine_config``), not the process environment. NIXL refuses a pinned ``UCX_TLS`` without a CUDA
    transport on a host with NVIDIA GPUs; such a list is retried once with ``cuda_copy`` added."""
    for key, value in options.overridden_by_environment().items():
        log.warning("nixl: %s=%s in the environment overrides the backend option (NIXL lets it win)", key, value)
    agent = api.nixl_agent(agent_name, config)
    if "UCX" not in agent.get_plugin_list():
        raise PluginUnavailableError("nixl", "NIXL has no UCX plugin here", INSTALL_HINT)

    def params(extra_tls: str = "") -> dict[str, str]:
        init = {"num_threads": str(options.num_threads)} if options.num_threads > 0 else {}
        engine_config = options.engine_config(extra_tls)
        return init | ({"engine_config": engine_config} if engine_config else {})

    try:
        agent.create_backend("UCX", params())
    except Exception:
        if not options.ucx_tls or "cuda" in options.ucx_tls:
            raise
        log.warning("nixl: UCX_TLS=%s was refused (a GPU host needs a CUDA transport); using %s,cuda_copy",
                    options.ucx_tls, options.ucx_tls)
        agent.create_backend("UCX", params("cuda_copy"))
    return agent


def endpoint_name(agent: str) -> str:
    """The kvbridge endpoint name an agent name was made from."""
    return agent.rsplit(_AGENT_SEP, 1)[0]


@dataclass(slots=True, eq=False)
class _Dlist:
    handle: Any          # nixl_prepped_dlist_handle
    starts: np.ndarray   # first index of each active buffer


@dataclass(slots=True, eq=False)
class _Peer:
    info: PeerInfo
    agent: str
    metadata: bytes
    dlists: dict[tuple[str, bytes], _Dlist] = field(default_factory=dict)


@dataclass(slots=True, eq=False, kw_only=True)
class NixlHandle:
    """What ``send_component`` returns; opaque to callers."""

    xfer: Any            # nixl_xfer_handle, or None when nothing was posted
    peer: str
    ndesc: int
    done: bool = False
    reason: str = ""


class NixlBackend:
    """One NIXL agent with the UCX backend. ``name`` must be unique per endpoint; see ``NixlOptions``."""

    name = "nixl"
    options_schema = NixlOptions     # what kvbridge.settings checks backend_options against

    def __init__(self, *, name: str, options: Mapping[str, str] | None = None) -> None:
        self.options = NixlOptions.parse(options)
        api = _load_api()
        self.endpoint_name = name
        self.agent_name = f"{name}{_AGENT_SEP}{uuid.uuid4().hex[:12]}"
        sync = getattr(api.nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{self.options.sync_mode.upper()}")
        config = api.nixl_agent_config(enable_prog_thread=self.options.progress_thread, backends=[],
                                       num_threads=self.options.num_threads, sync_mode=sync)
        self._agent = _make_agent(api, self.agent_name, config, self.options)
        if "UCX" not in self._agent.backends:
            raise PluginUnavailableError("nixl", "NIXL has no UCX plugin here", INSTALL_HINT)
        self._lock = threading.Lock()
        self._registered: dict[str, list[RegisteredBuffers]] = {}
        self._local: dict[tuple[str, bytes], _Dlist] = {}
        self._peers: dict[str, _Peer] = {}
        self._patterns: OrderedDict[tuple[int, ...], tuple[tuple[Segments, ...], Pattern]] = OrderedDict()
        self._live: set[NixlHandle] = set()
        self._stuck: list[Any] = []   # handles NIXL refused to release; retried on close
        self._endpoint: bytes | None = None
        self._closed = False

    # -- memory
    @property
    def endpoint(self) -> bytes:
        """Agent name and NIXL metadata; it covers the regions registered so far, so take it last."""
        with self._lock:
            self._check_open()
            if self._endpoint is None:
                self._endpoint = encode(NixlEndpoint(WIRE_VERSION, self.agent_name,
                                                     bytes(self._agent.get_agent_metadata())))
            return self._endpoint

    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        if not regions:
            raise RegionError(f"{component}: no regions to register")
        kinds = {r.device for r in regions}
        if len(kinds) != 1 or next(iter(kinds)) not in _MEM_TYPE:
            raise RegionError(f"{component}: nixl registers one memory kind per component, host or GPU; got "
                              f"{sorted(k.value for k in kinds)}")
        mem = _MEM_TYPE[next(iter(kinds))]
        rows = [(r.addr, r.nbytes, r.device_id if mem == "VRAM" else 0, "") for r in regions]
        with self._lock:
            self._check_open()
            try:
                handle = self._agent.register_memory(rows, mem)
            except Exception as exc:  # NIXL raises its own exception types
                raise RegionError(f"{component}: NIXL refused to register {len(rows)} {mem} region(s): "
                                  f"{type(exc).__name__}: {exc}") from exc
            registered = RegisteredBuffers(component, tuple(regions),
                                           encode(NixlBuffers(WIRE_VERSION, self.agent_name, mem)), handle)
            self._registered.setdefault(component, []).append(registered)
            self._endpoint = None
        return registered

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        with self._lock:
            entries = self._registered.get(registered.component, [])
            if not any(e is registered for e in entries):
                return
            entries[:] = [e for e in entries if e is not registered]
            if not entries:
                self._registered.pop(registered.component, None)
            for key in [k for k in self._local if k[0] == registered.component]:
                self._release_dlist(self._local.pop(key))
            self._endpoint = None
            if not self._closed:
                self._agent.deregister_memory(registered.handle)

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        ep = decode_endpoint(peer.endpoint)
        for buffers in peer.buffers:
            owner = decode_buffers(buffers.descriptor).agent
            if owner != ep.agent:
                raise ProtocolError(f"peer {peer.name!r}: buffers of {buffers.component!r} were registered by "
                                    f"agent {owner!r}, but the endpoint is agent {ep.agent!r}")
        with self._lock:
            self._check_open()
            old = self._peers.pop(peer.name, None)
            if old is not None and old.agent == ep.agent and old.metadata == ep.metadata:
                self._peers[peer.name] = _Peer(peer, old.agent, old.metadata, old.dlists)
                return peer.name
            if old is not None:
                self._drop_peer(old, disconnect=old.agent != ep.agent)
            loaded = self._agent.add_remote_agent(ep.metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)  # 1.5.1 returns bytes
            if loaded != ep.agent:
                self._agent.remove_remote_agent(loaded)
                raise ProtocolError(f"peer {peer.name!r}: metadata is of agent {loaded!r}, endpoint says {ep.agent!r}")
            self._peers[peer.name] = _Peer(peer, ep.agent, ep.metadata)
        return peer.name

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is not None:
                self._drop_peer(peer, disconnect=True)

    def _drop_peer(self, peer: _Peer, *, disconnect: bool) -> None:
        for dlist in peer.dlists.values():
            self._release_dlist(dlist)
        peer.dlists.clear()
        if disconnect:
            try:
                self._agent.remove_remote_agent(peer.agent)
            except Exception as exc:  # noqa: BLE001 - best effort: the peer may be gone already
                log.debug("remove_remote_agent(%s): %s", peer.agent, exc)

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> NixlHandle:
        """Post one WRITE (bounds-checked first). NIXL errors come back as a failed handle, not raised."""
        plan = transfer.plan
        with self._lock:
            if self._closed:
                raise TransferError(transfer.room, "nixl backend is closed")
            peer = self._peers.get(transfer.peer)
            if peer is None:
                raise RegionError(f"unknown peer {transfer.peer!r}; add_peer first")
            local = self._registered.get(transfer.component, [])
            if not any(reg is transfer.src for reg in local):
                raise RegionError(f"source buffers of {transfer.component!r} are not registered with this backend")
            regions = [r for reg in local for r in reg.regions]
            check_within(plan.src_addr, plan.nbytes, regions, f"source ({transfer.component})")
            check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, f"destination ({transfer.component})")
            if len(plan) == 0:
                return self._post_notice_only(peer, transfer.notice)
            structured = (len(transfer.segments) == len(transfer.src.regions) == len(transfer.dst.regions)
                          and transfer.src_items.size > 0 and transfer.src_items.size == transfer.dst_items.size)
            if structured:
                return self._post_prepped(peer, transfer)
            return self._post_listed(peer, transfer)

    def _post_prepped(self, peer: _Peer, transfer: ComponentTransfer) -> NixlHandle:
        pattern = self._pattern(transfer.segments)
        src_items = np.asarray(transfer.src_items, dtype=np.int64)
        dst_items = np.asarray(transfer.dst_items, dtype=np.int64)
        if src_items.size * pattern.item_bytes != transfer.plan.total_nbytes:
            raise RegionError(f"{transfer.component}: the plan moves {transfer.plan.total_nbytes} B but its items "
                              f"and segments say {src_items.size * pattern.item_bytes} B")
        if len(transfer.plan) * MERGE_GAIN <= src_items.size * int(pattern.nseg.sum()):
            # the planner merged adjacent runs (contiguous pages: one descriptor per buffer); prepped lists
            # index one descriptor per item and segment, and NIXL does not merge them: post the merged plan
            return self._post_listed(peer, transfer)
        try:
            local = self._local_dlist(transfer, pattern, src_items)
            remote = self._remote_dlist(peer, transfer, pattern, dst_items)
        except RegionError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL refused to prepare a dlist
            return self._failed(peer, "prep_xfer_dlist", exc)
        local_idx = indices(local.starts, pattern.groups, src_items)
        remote_idx = indices(remote.starts, pattern.groups, dst_items)
        # Prepped (prep once, index per request), never initialize_xfer here: initialize_xfer builds, checks
        # and resolves every descriptor against the registrations on each call, a per-request CPU cost that
        # grows with the descriptor count (`kvbridge bench --backend nixl` prints both calls' cost), and it does
        # not merge adjacent descriptors (engines.md §2.4: 8x slower on contiguous 4 KiB blocks). Bandwidth is
        # the same once the planner has merged runs: NIXL's ~6-10 us per descriptor dominates scattered pages
        # either way.
        try:
            xfer = self._agent.make_prepped_xfer("WRITE", local.handle, local_idx, remote.handle, remote_idx,
                                                 transfer.notice)
        except Exception as exc:  # noqa: BLE001
            return self._failed(peer, "make_prepped_xfer", exc)
        return self._post(peer, xfer, local_idx.size)

    def _post_listed(self, peer: _Peer, transfer: ComponentTransfer) -> NixlHandle:
        """Fallback for a plan without its structured form (third-party callers): one-off descriptor lists."""
        plan = transfer.plan
        src_mem = decode_buffers(transfer.src.descriptor).mem_type
        dst_mem = decode_buffers(transfer.dst.descriptor).mem_type
        src_dev = np.array([r.device_id for r in transfer.src.regions], dtype=np.uint64)[plan.buffer]
        dst_dev = np.array([r.device_id for r in transfer.dst.regions], dtype=np.uint64)[plan.buffer]
        try:
            src = self._agent.get_xfer_descs(np.stack([plan.src_addr, plan.nbytes, src_dev], axis=1), src_mem)
            dst = self._agent.get_xfer_descs(np.stack([plan.dst_addr, plan.nbytes, dst_dev], axis=1), dst_mem)
            xfer = self._agent.initialize_xfer("WRITE", src, dst, peer.agent, transfer.notice)
        except Exception as exc:  # noqa: BLE001
            return self._failed(peer, "initialize_xfer", exc)
        return self._post(peer, xfer, len(plan))

    def _post(self, peer: _Peer, xfer: Any, ndesc: int) -> NixlHandle:
        handle = NixlHandle(xfer=xfer, peer=peer.info.name, ndesc=ndesc)
        self._live.add(handle)
        try:
            state = self._agent.transfer(xfer)
        except Exception as exc:  # noqa: BLE001
            handle.reason = self._reason("transfer", exc)
            return handle
        if state == "DONE":
            handle.done = True
        elif state == "ERR":
            handle.reason = self._reason("transfer", "NIXL returned ERR")
        return handle

    def _post_notice_only(self, peer: _Peer, notice: bytes) -> NixlHandle:
        handle = NixlHandle(xfer=None, peer=peer.info.name, ndesc=0, done=True)
        if notice:
            try:
                self._agent.send_notif(peer.agent, notice)
            except Exception as exc:  # noqa: BLE001
                handle.done, handle.reason = False, self._reason("send_notif", exc)
        return handle

    def _failed(self, peer: _Peer, call: str, exc: BaseException) -> NixlHandle:
        return NixlHandle(xfer=None, peer=peer.info.name, ndesc=0, reason=self._reason(call, exc))

    def _reason(self, call: str, exc: BaseException | str) -> str:
        text = f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else exc
        reason = f"nixl {call}: {text}"
        if not self.options.ucx_tls:
            blocked = cma_blocked()
            reason += (" (if the peer is another process, UCX may have chosen CMA, which needs ptrace permission "
                       "between the processes" + (f"; here {blocked}" if blocked else "") +
                       "; pin the transport with options={'ucx_tls': 'tcp'} or UCX_TLS=tcp)")
        return reason

    def _pattern(self, segments: tuple[Segments, ...]) -> Pattern:
        """Patterns are remembered by the identity of their Segments objects (a sender reuses them)."""
        key = tuple(map(id, segments))
        hit = self._patterns.get(key)
        if hit is not None:
            self._patterns.move_to_end(key)
            return hit[1]
        pattern = Pattern.of(segments)
        self._patterns[key] = (tuple(segments), pattern)   # holding the objects keeps their ids unique
        if len(self._patterns) > _PATTERN_CACHE:
            self._patterns.popitem(last=False)
        return pattern

    def _local_dlist(self, transfer: ComponentTransfer, pattern: Pattern, items: np.ndarray) -> _Dlist:
        plan, regions = transfer.plan, transfer.src.regions
        geo = derive_side(plan.src_addr, plan.nbytes, plan.buffer, *_bases_sizes(regions), pattern, items, "src",
                          getattr(transfer, "src_item_nbytes", ()))   # a field the core may add
        key = (transfer.component, geo.key() + pattern.src_key)
        dlist = self._local.get(key)
        if dlist is None:
            mem = decode_buffers(transfer.src.descriptor).mem_type
            dlist = self._prep("NIXL_INIT_AGENT", geo, pattern.src_off, pattern, regions, pattern.active, mem)
            self._local[key] = dlist
        return dlist

    def _remote_dlist(self, peer: _Peer, transfer: ComponentTransfer, pattern: Pattern, items: np.ndarray) -> _Dlist:
        plan, dst = transfer.plan, transfer.dst
        geo = derive_side(plan.dst_addr, plan.nbytes, plan.buffer, *_bases_sizes(dst.regions), pattern, items, "dst",
                          getattr(transfer, "dst_item_nbytes", ()))
        key = (transfer.component, geo.key() + pattern.dst_key)
        dlist = peer.dlists.get(key)
        if dlist is None:
            _check_peer_owns(peer, dst)
            mem = decode_buffers(dst.descriptor).mem_type
            dlist = self._prep(peer.agent, geo, pattern.dst_off, pattern, dst.regions, pattern.active, mem)
            peer.dlists[key] = dlist
        return dlist

    def _prep(self, agent: str, geo: SideGeometry, offsets: tuple[np.ndarray, ...], pattern: Pattern,
              regions: Sequence[MemoryRegion] | Sequence[RegionWire], active: np.ndarray, mem: str) -> _Dlist:
        devices = np.array([regions[b].device_id if mem == "VRAM" else 0 for b in active], dtype=np.uint64)
        rows, starts = dlist_rows(geo, offsets, pattern.seg_len, devices)
        return _Dlist(self._agent.prep_xfer_dlist(agent, rows, mem), starts)

    def _release_dlist(self, dlist: _Dlist) -> None:
        try:
            self._agent.release_dlist_handle(dlist.handle)
        except Exception as exc:  # noqa: BLE001 - nothing more to do with it
            log.warning("nixl: releasing a prepped dlist failed: %s", exc)

    def poll(self, handle: Any) -> Poll:
        if not isinstance(handle, NixlHandle):
            return Poll.failed(f"not a nixl handle: {handle!r}")
        if handle.reason:
            return Poll.failed(handle.reason)
        if handle.done:
            return Poll.done()
        if handle.xfer is None or self._closed:
            return Poll.failed("nixl: handle was released or the backend closed")
        try:
            state = self._agent.check_xfer_state(handle.xfer)
        except Exception as exc:  # noqa: BLE001
            handle.reason = self._reason("check_xfer_state", exc)
            return Poll.failed(handle.reason)
        if state == "DONE":
            handle.done = True
            return Poll.done()
        if state == "PROC":
            return Poll.pending()
        handle.reason = self._reason("check_xfer_state", f"NIXL returned {state}")
        return Poll.failed(handle.reason)

    def release(self, handle: Any) -> None:
        if not isinstance(handle, NixlHandle):
            return
        with self._lock:
            self._live.discard(handle)
            xfer, handle.xfer = handle.xfer, None
            if xfer is not None and not self._closed:
                self._release_xfer(xfer)

    def _release_xfer(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:  # noqa: BLE001 - NIXL could not cancel it yet: retry on close
            log.debug("nixl: release_xfer_handle deferred: %s", exc)
            self._stuck.append(xfer)

    # -- notifications
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None or self._closed:
                return False
            try:
                self._agent.send_notif(peer.agent, notice)
            except Exception as exc:  # noqa: BLE001 - the control plane can still carry it
                log.warning("nixl: send_notif to %s failed: %s", peer_id, exc)
                return False
        return True

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        notifs = self._agent.get_new_notifs()
        return [(endpoint_name(agent), bytes(msg)) for agent, msgs in notifs.items() for msg in msgs]

    # -- introspection (benchmarks, diagnostics)
    @property
    def agent(self) -> Any:
        """The underlying ``nixl_agent`` (for benchmarks and diagnostics; do not post through it)."""
        return self._agent

    def peer_agent(self, peer_id: str) -> str:
        """The NIXL agent name behind a peer id."""
        with self._lock:
            return self._peers[peer_id].agent

    # -- lifecycle
    def resources(self) -> dict[str, int]:
        """Counts of what this backend holds (for leak checks)."""
        with self._lock:
            return {"handles": len(self._live), "peers": len(self._peers),
                    "registrations": sum(len(v) for v in self._registered.values()),
                    "dlists": len(self._local) + sum(len(p.dlists) for p in self._peers.values())}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for handle in list(self._live):
                if handle.xfer is not None:
                    self._release_xfer(handle.xfer)
                    handle.xfer = None
            self._live.clear()
            for dlist in self._local.values():
                self._release_dlist(dlist)
            self._local.clear()
            for peer in self._peers.values():
                self._drop_peer(peer, disconnect=True)
            self._peers.clear()
            for entries in self._registered.values():
                for reg in entries:
                    try:
                        self._agent.deregister_memory(reg.handle)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("nixl: deregister_memory failed on close: %s", exc)
            self._registered.clear()
            for xfer in self._stuck:
                try:
                    self._agent.release_xfer_handle(xfer)
                except Exception as exc:  # noqa: BLE001 - the agent's destructor is the last resort
                    log.warning("nixl: a transfer handle could not be released: %s", exc)
            self._stuck.clear()
            self._patterns.clear()
            self._closed = True
            self._agent = None   # the agent (and its UCX workers) goes with its last reference

    def _check_open(self) -> None:
        if self._closed:
            raise RegionError("nixl backend is closed")

    def __enter__(self) -> NixlBackend:  # not typing.Self: that needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bases_sizes(regions: Sequence[MemoryRegion] | Sequence[RegionWire]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([r.addr for r in regions], dtype=np.uint64),
            np.array([r.nbytes for r in regions], dtype=np.int64))


def _check_peer_owns(peer: _Peer, dst: RemoteBuffers) -> None:
    """The destination regions must be ones the peer registered (checked once per dlist)."""
    theirs = {r for buf in peer.info.buffers if buf.component == dst.component for r in buf.regions}
    if not theirs:
        raise RegionError(f"peer {peer.info.name!r} registered no component {dst.component!r}")
    missing = [r for r in dst.regions if r not in theirs]
    if missing:
        raise RegionError(f"destination region at {missing[0].addr:#x} of {dst.component!r} was not registered "
                          f"by peer {peer.info.name!r}")

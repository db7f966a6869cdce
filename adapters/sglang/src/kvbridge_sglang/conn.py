"""SGLang's KV manager, sender, receiver and bootstrap server on kvbridge.

The classes implement SGLang's own abstract interfaces (``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver``, ``BaseKVBootstrapServer`` from ``sglang.srt.disaggregation.base.conn``) and return
SGLang's ``KVPoll`` integers. Each prefill rank runs one kvbridge ``TransferAgent`` (its PP stage's
layers, published as the kvbridge instance of its DP rank and PP stage); each decode rank runs one agent
per prefill PP stage it reads from (a sub-layout of its own pool: that stage's layers), so a PP 2 prefill
feeds a PP 1 decode and completion waits for every stage. A request's ``Sender`` / ``Receiver`` wrap the
agents' per-room handles; KV travels with every chunk, state components and the aux (metadata) row with
the last one, resharded between any TP sizes that divide each other.

Beyond the abstract methods, the attributes SGLang's scheduler reads on every backend are here too
(``prefill_info_table``, ``try_ensure_parallel_info``, ``poll_pp_consensus``, ``conclude_state``,
``abort_notified``, deferred-release hooks, ...), so its unmodified event loops drive these classes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvbridge.agent import Receiver, Sender, TransferAgent
from kvbridge.errors import GeometryError, KVBridgeError
from kvbridge.geometry import DeviceKind, MemoryRegion, PoolLayout
from kvbridge.protocol.states import PeerState
from kvbridge.protocol.wire import KVPoll as KVBridgePoll
from kvbridge.protocol.wire import Role
from kvbridge.zmq_link import ZmqLink
from kvbridge_sglang import bootstrap
from kvbridge_sglang.bootstrap import Stage, Topology, TopologyServer
from kvbridge_sglang.layout import AUX, KV, RankPool, rank_pool
from kvbridge_sglang.settings import Settings

log = logging.getLogger("kvbridge.sglang")

ABORTED = "Aborted by AbortReq."
MAX_ROOM = (1 << 63) - 1


def _room_error(room: Any) -> str:
    """Why ``room`` cannot name a kvbridge room ("" when it can)."""
    if isinstance(room, bool) or not isinstance(room, (int, np.integer)):
        return f"bootstrap_room {room!r:.40} is not an integer"
    return "" if 0 <= int(room) <= MAX_ROOM else f"bootstrap_room {int(room)} is outside 0..2**63-1"


def _pages(kv_indices: Any) -> np.ndarray:
    """SGLang's page indices as int64, refusing what a cast would silently change (floats, bools)."""
    arr = np.ravel(np.asarray(kv_indices))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise KVBridgeError(f"kv_indices must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class _RefusedRoom:
    """The sender of a room that could not be opened (a reused or invalid ``bootstrap_room``): Failed with the
    reason from the start, nothing in flight, so SGLang fails that request alone."""

    decode_prefix_len = 0
    safe_to_reuse = True
    stats = (0, 0)

    def __init__(self, reason: str) -> None:
        self.failure_reason = reason

    def poll(self) -> KVBridgePoll:
        return KVBridgePoll.Failed

    def send(self, *_: Any, **__: Any) -> None:
        raise KVBridgeError(self.failure_reason)

    def abort(self, reason: str = "") -> None:
        pass

    def clear(self) -> None:
        pass

    def clear_when_safe(self) -> None:
        pass

__all__ = ["KVBridgeKVBootstrapServer", "KVBridgeKVManager", "KVBridgeKVReceiver", "KVBridgeKVSender"]


def _parallel(args: KVArgs, server_args: Any) -> dict[str, int]:
    """This rank's attention TP / DP and PP position: SGLang's runtime context when published, else
    ``server_args`` (tp_size, dp_size, enable_dp_attention, pp_size) and ``kv_args.engine_rank``."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return {"attn_tp_size": int(par.attn_tp_size), "attn_tp_rank": int(par.attn_tp_rank),
                "attn_dp_size": int(par.attn_dp_size), "attn_dp_rank": int(par.attn_dp_rank),
                "pp_size": int(par.pp_size), "pp_rank": int(getattr(args, "pp_rank", 0) or 0)}
    except Exception:   # noqa: BLE001 - no runtime context in this process: read the arguments
        pass
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1) if getattr(server_args, "enable_dp_attention", False) else 1
    attn_tp = max(1, tp // dp)
    engine = int(getattr(args, "engine_rank", 0) or 0)
    return {"attn_tp_size": attn_tp, "attn_tp_rank": engine % attn_tp, "attn_dp_size": dp,
            "attn_dp_rank": int(getattr(args, "system_dp_rank", 0) or 0) if dp == 1 else engine // attn_tp,
            "pp_size": int(getattr(server_args, "pp_size", 1) or 1),
            "pp_rank": int(getattr(args, "pp_rank", 0) or 0)}


def _server_host(server_args: Any) -> str:
    """SGLang's ``--host`` (where the prefill's HTTP bootstrap server binds)."""
    return str(getattr(server_args, "host", None) or "127.0.0.1")


def _own_bootstrap(server_args: Any) -> str:
    """``host:port`` of this prefill server's bootstrap server."""
    host = port = None
    try:
        from sglang.srt.runtime_context import get_disagg, get_serving

        host, port = get_serving().host, get_disagg().disaggregation_bootstrap_port
    except Exception:   # noqa: BLE001 - not published in this process
        pass
    host = host or getattr(server_args, "host", None) or "127.0.0.1"
    port = port or getattr(server_args, "disaggregation_bootstrap_port", None) or 8998
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{int(port)}"


def _flat(value: Any, what: str) -> np.ndarray:
    """SGLang's per-component state indices (an array, or a list of arrays for Mamba) as one int64 array."""
    if value is None:
        raise GeometryError(f"SGLang passed no indices for state component {what!r} with the last chunk")
    if isinstance(value, (list, tuple)):
        parts = [np.ravel(np.asarray(v)) for v in value]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if hasattr(value, "cpu"):
        value = value.cpu().numpy()
    return np.ravel(np.asarray(value)).astype(np.int64)


def component_indices(layout: PoolLayout, pool: RankPool, *, kv: np.ndarray | None,
                      state_indices: Sequence[Any] | None, aux_index: int | None,
                      total_pages: int) -> dict[str, Any]:
    """Indices of every component of ``layout`` other than KV (and KV when given), as kvbridge takes them.

    SWA window pages are positioned from the end of the sequence (``total_pages - len``): both sides list
    the pages of the same window, SGLang gives no position. DSA pages are the suffix after the decode's
    prefix on both sides (SGLang 0.5.23), paired from their first entry.
    """
    out: dict[str, Any] = {}
    for comp in layout.components:
        if comp.name == KV:
            if kv is not None:
                out[KV] = kv
            continue
        if comp.name == AUX:
            if aux_index is None:
                raise GeometryError("SGLang passed no metadata (aux) slot with the last chunk")
            out[AUX] = np.array([int(aux_index)], dtype=np.int64)
            continue
        part = pool.part(comp.name)
        assert part is not None and part.state_index is not None
        if part.state_type == "block_scale":          # the pages' own ids: in chunks with them (prefill: send())
            if kv is not None:
                out[comp.name] = kv
            continue
        if state_indices is None or part.state_index >= len(state_indices):
            raise GeometryError(f"SGLang passed no state indices for component {comp.name!r} with the last chunk")
        items = _flat(state_indices[part.state_index], comp.name)
        windowed = part.state_type in ("swa", "block_scale_swa")
        out[comp.name] = (items, max(0, total_pages - len(items))) if windowed else items
    return out


def _cuda_view(region: MemoryRegion) -> Any:
    """A uint8 torch tensor over raw CUDA memory (no copy), so the agent's staging path can gather from it."""
    import torch

    class _Raw:
        __cuda_array_interface__ = {"shape": (region.nbytes,), "typestr": "|u1",
                                    "data": (region.addr, False), "version": 3}

    return torch.as_tensor(_Raw(), device=f"cuda:{region.device_id}")


def _agent_buffers(buffers: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    return {name: [_cuda_view(r) if r.device is DeviceKind.CUDA else r for r in regions]
            for name, regions in buffers.items()}


class KVBridgeKVManager(BaseKVManager):
    """One SGLang rank's kvbridge side: its pool (from KVArgs) and its agent(s)."""

    enable_deferred_decode_kv_release: bool = True
    supports_deferred_decode_kv_release: bool = True
    supports_host_destination: bool = False
    supports_role_switch: bool = False
    is_dummy_cp_rank: bool = False
    enable_all_cp_ranks_for_transfer: bool = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        # no secret configured and everything on loopback: this user's secret file on this host (secure by default)
        self.settings = Settings.from_env(server_args).with_local_secret(_server_host(server_args))
        par = _parallel(args, server_args)
        self.attn_tp_size, self.attn_tp_rank = par["attn_tp_size"], par["attn_tp_rank"]
        self.attn_dp_size, self.attn_dp_rank = par["attn_dp_size"], par["attn_dp_rank"]
        self.pp_size, self.pp_rank = par["pp_size"], par["pp_rank"]
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.page_size = int(args.page_size)
        self.kv_cache_dtype_str = str(getattr(args, "kv_cache_dtype_str", "auto"))
        self.device = self._device()
        self.pool = rank_pool(args, tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
                              is_mla=self.is_mla_backend, device=self.device,
                              device_id=int(getattr(args, "gpu_id", 0) or 0), swa_window=self.settings.swa_window)
        self.last_stage = self.pp_rank == self.pp_size - 1
        self._lock = threading.RLock()
        self._closed = False
        self._shm: list[shared_memory.SharedMemory] = []
        self._receivers: weakref.WeakValueDictionary[int, KVBridgeKVReceiver] = weakref.WeakValueDictionary()
        self.agent: TransferAgent | None = None
        self.agents: dict[tuple[str, int, int], TransferAgent] = {}   # decode: (bootstrap, dp, pp) -> agent
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.topologies: dict[str, Topology] = {}
        # decode: each prefill server's life (its bootstrap server's epoch) the cached topology is of; agents
        # of a server that was replaced at its address since (with why), closed once their rooms are cleared;
        # ``restarts`` counts replacements, so a receiver notices one with a single comparison
        self.epochs: dict[str, str] = {}
        self.retired: dict[TransferAgent, tuple[str, float]] = {}     # agent -> (why, when)
        self.restarts = 0
        self._unreachable: dict[str, int] = {}     # decode: failed topology fetches in a row, per server
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.failure_records: dict[int, str] = {}
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.bootstrap_addr = _own_bootstrap(server_args)
            self.register_to_bootstrap()
        elif disaggregation_mode != DisaggregationMode.DECODE:
            raise ValueError(f"kvbridge-sglang: unsupported disaggregation mode {disaggregation_mode}")

    def _device(self) -> DeviceKind:
        choice = self.settings.device
        if choice == "cpu":
            return DeviceKind.CPU
        if choice == "cuda":
            return DeviceKind.CUDA
        try:
            import torch

            return DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU
        except ImportError:
            return DeviceKind.CPU

    # ------------------------------------------------------------------ prefill
    def register_to_bootstrap(self) -> None:
        """Build this prefill rank's agent (its stage's layers), publish it as instance (DP rank, PP stage)
        at the kvbridge bootstrap, and register the rank's topology row at the bootstrap server."""
        s = self.settings
        answer = bootstrap.wait_for(self.bootstrap_addr, secret=s.secret, timeout_s=s.bootstrap_timeout_s)
        layers = self.pool.layers()
        start = int(getattr(self.kv_args, "prefill_start_layer", 0) or 0)
        end = getattr(self.kv_args, "prefill_end_layer", None)
        end = int(end) if end is not None else (max(layers) + 1 if layers else start)
        if layers and (min(layers) < start or max(layers) >= end):
            start, end = min(start, min(layers)), max(end, max(layers) + 1)
        layout, buffers = self.pool.layout(None, tail=self.last_stage)
        self.layout = layout
        instance = bootstrap.instance_name(self.attn_dp_rank, self.pp_rank)
        link = ZmqLink(bootstrap=str(answer["bootstrap"]), host=s.host, secret=s.secret,
                       allow_insecure=s.allow_insecure)
        try:
            self.agent = TransferAgent(layout=layout, buffers=_agent_buffers(buffers), role=Role.PREFILL, link=link,
                                       backend=s.backend, instance=instance, config=s.agent_config())
        except BaseException:
            link.close()
            raise
        self.agent.start()
        lbm = str(getattr(self.server_args, "load_balance_method", "") or "")
        row = {"dp_rank": self.attn_dp_rank, "pp_rank": self.pp_rank, "tp_rank": self.attn_tp_rank,
               "dp_size": self.attn_dp_size, "pp_size": self.pp_size, "tp_size": self.attn_tp_size,
               "start_layer": start, "end_layer": end, "page_size": self.page_size,
               "kv_cache_dtype": self.kv_cache_dtype_str, "instance": instance, "backend": s.backend,
               "follow_bootstrap_room": lbm in ("", "follow_bootstrap_room")}
        bootstrap.register(self.bootstrap_addr, row, secret=s.secret)
        log.info("kvbridge-sglang: prefill rank dp %d pp %d tp %d/%d (layers %d..%d) on %s as %r", self.attn_dp_rank,
                 self.pp_rank, self.attn_tp_rank, self.attn_tp_size, start, end - 1, s.backend, instance)

    # ------------------------------------------------------------------ decode
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Fetch the prefill server's topology (once complete) and fill ``prefill_info_table``. Cached per
        address; a watcher thread fetches it again every ``KVBRIDGE_TOPOLOGY_RECHECK_S`` and notices a server
        restarted at the same address (see ``_recheck``)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            answer = bootstrap.fetch(bootstrap_addr, secret=self.settings.secret, timeout_s=2.0)
            topo = Topology.parse(answer)
        except Exception as exc:   # noqa: BLE001 - the scheduler retries
            log.debug("kvbridge-sglang: topology of %s not available: %s", bootstrap_addr, exc)
            return False
        if topo is None:
            return False
        with self._lock:
            if self.epochs.get(bootstrap_addr, None) not in (None, str(answer.get("epoch", ""))):
                self._retire(bootstrap_addr, self.epochs[bootstrap_addr], str(answer.get("epoch", "")))
            self._install(bootstrap_addr, topo, str(answer.get("epoch", "")))
        self._watch()
        return True

    def _install(self, bootstrap_addr: str, topo: Topology, epoch: str) -> None:
        """Cache a complete topology of the server's life ``epoch`` (call with the lock held)."""
        self.topologies[bootstrap_addr] = topo
        self.epochs[bootstrap_addr] = epoch
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=topo.tp_size, attn_cp_size=1, dp_size=topo.dp_size, pp_size=topo.pp_size,
            page_size=topo.page_size, kv_cache_dtype=topo.kv_cache_dtype,
            follow_bootstrap_room=topo.follow_bootstrap_room)

    def _retire(self, bootstrap_addr: str, old: str, new: str) -> None:
        """The prefill server at ``bootstrap_addr`` was replaced (epoch ``old`` -> ``new``): forget its topology
        and retire its agents; their receivers fail, or reopen on the new server (``KVBridgeKVReceiver.poll``).
        Call with the lock held."""
        why = (f"the prefill server at {bootstrap_addr} was restarted (bootstrap server life {old[:8] or '?'} -> "
               f"{new[:8] or '?'})")
        now = time.monotonic()
        for key in [k for k in self.agents if k[0] == bootstrap_addr]:
            self.retired[self.agents.pop(key)] = (why, now)
        self.topologies.pop(bootstrap_addr, None)
        self.prefill_info_table.pop(bootstrap_addr, None)
        self.epochs[bootstrap_addr] = new
        self.restarts += 1
        log.warning("kvbridge-sglang: %s: its requests in flight fail, new ones go to the new server", why)

    def _watch(self) -> None:
        with self._lock:
            if self._watcher is not None or self._closed:
                return
            self._watcher = threading.Thread(target=self._watch_loop, name="kvbridge-sglang-topology", daemon=True)
        self._watcher.start()

    def _watch_loop(self) -> None:
        """Every ``topology_recheck_s``: each known prefill server's topology again (``_recheck``), and the
        retired agents whose rooms are all cleared closed. One failure is logged; the thread never dies."""
        while not self._stop.wait(self.settings.topology_recheck_s):
            for addr in list(self.epochs):
                try:
                    self._recheck(addr)
                except Exception:
                    log.exception("kvbridge-sglang: rechecking the prefill server at %s failed", addr)
            self._close_retired(idle_only=True)

    def _recheck(self, bootstrap_addr: str) -> None:
        """Fetch the server's topology again. Another server life (it restarted at the same host:port, maybe
        with another topology) retires what this decode holds of the old one and caches the new topology once
        complete. An unreachable server's rooms fail by kvbridge's own peer timeout or proof of its exit; after
        ``health_failures`` failed fetches in a row it is gone as SGLang judges it (its heartbeat), and its ranks
        silent past their write lease are declared gone (:meth:`_declare_gone`)."""
        try:
            answer = bootstrap.fetch(bootstrap_addr, secret=self.settings.secret,
                                     timeout_s=min(2.0, self.settings.topology_recheck_s))
        except Exception as exc:   # noqa: BLE001 - down or restarting: try again next time
            log.debug("kvbridge-sglang: rechecking %s: %s", bootstrap_addr, exc)
            with self._lock:
                failed = self._unreachable[bootstrap_addr] = self._unreachable.get(bootstrap_addr, 0) + 1
            if failed >= self.settings.health_failures:
                self._declare_gone(bootstrap_addr, f"{failed} failed fetches in a row ({exc})")
            return
        with self._lock:
            self._unreachable.pop(bootstrap_addr, None)
        epoch = str(answer.get("epoch", ""))
        try:
            topo = Topology.parse(answer)
        except Exception as exc:   # noqa: BLE001 - SGLang's own call raises it to the scheduler
            log.error("kvbridge-sglang: the prefill server at %s now answers an unusable topology: %s",
                      bootstrap_addr, exc)
            topo = None
        with self._lock:
            known = self.epochs.get(bootstrap_addr)
            if known is None:
                return
            cached = self.topologies.get(bootstrap_addr)
            if epoch != known or (cached is not None and topo is not None and cached.bootstrap != topo.bootstrap):
                self._retire(bootstrap_addr, known, epoch)
                cached = None
            if cached is None and topo is not None:
                self._install(bootstrap_addr, topo, epoch)

    def _declare_gone(self, bootstrap_addr: str, why: str) -> None:
        """The prefill server at ``bootstrap_addr`` is gone as SGLang's heartbeat judges it: each of its ranks that
        kvbridge also found silent, for longer than its write lease (it posts nothing more to us: docs/integrity.md)
        or, without a lease, the peer timeout, is declared gone, and the rooms it was writing become safe to reuse
        (a dead host or a partition leaves no other proof; SGLang itself releases those requests' KV then).
        A rank still talking is never declared gone, whatever the HTTP server says."""
        with self._lock:
            agents = [agent for key, agent in self.agents.items() if key[0] == bootstrap_addr]
            agents += [agent for agent in self.retired if agent.decode is not None and agent.decode.rooms]
        for agent in agents:
            timeout = agent.context.config.peer_timeout_s
            with agent.context.lock:
                now = agent.context.clock()
                silent = [peer for peer in agent.peers.peers.values()
                          if peer.state is PeerState.SILENT
                          and now - peer.last_seen >= max(peer.writer_lease_s, timeout)]
                for peer in silent:
                    log.warning("kvbridge-sglang: prefill rank %s of %s declared gone: the server is unreachable "
                                "(%s) and the rank silent for %.1f s", peer.agent, bootstrap_addr, why,
                                now - peer.last_seen)
                    agent.declare_gone(peer.agent)

    def _close_retired(self, *, idle_only: bool) -> None:
        """Close retired agents; ``idle_only``: those without rooms (one may still be fenced) retired at least one
        recheck interval ago (a receiver that took the agent just before it was retired has opened its room)."""
        settle = time.monotonic() - self.settings.topology_recheck_s
        with self._lock:
            done = [a for a, (_, at) in self.retired.items()
                    if not idle_only or (at < settle and (a.decode is None or not a.decode.rooms))]
            for agent in done:
                del self.retired[agent]
        for agent in done:
            try:
                agent.close()
            except Exception:
                log.exception("kvbridge-sglang: closing retired agent %s", agent.name)

    def decode_stages(self, bootstrap_addr: str, dp_rank: int) -> list[tuple[Stage, TransferAgent]]:
        """The agent of every prefill PP stage this decode rank reads from (built and handshaking on first use)."""
        if not self.try_ensure_parallel_info(bootstrap_addr):
            raise KVBridgeError(f"prefill topology at {bootstrap_addr} is not available (yet)")
        topo = self.topologies[bootstrap_addr]
        if not 0 <= dp_rank < topo.dp_size:
            raise KVBridgeError(f"prefill DP rank {dp_rank} is outside the prefill's DP size {topo.dp_size}")
        own = set(self.pool.layers())
        out = []
        with self._lock:
            for stage in topo.stages_of(dp_rank):
                layers = [i for i in stage.layers if i in own]
                if not layers:              # (a decode PP stage reads every prefill stage holding its layers)
                    continue
                key = (bootstrap_addr, dp_rank, stage.pp_rank)
                agent = self.agents.get(key)
                if agent is None:
                    agent = self.agents[key] = self._decode_agent(topo, stage)
                out.append((stage, agent))
        if not out:
            raise KVBridgeError(f"no prefill stage at {bootstrap_addr} holds this decode rank's layers")
        return out

    def _decode_agent(self, topo: Topology, stage: Stage) -> TransferAgent:
        s = self.settings
        tail = stage.last and self.last_stage
        layout, buffers = self.pool.layout(stage.layers, tail=tail)
        staging = None
        if s.backend == "loopback" and s.staging_bytes > 0 and self.device is DeviceKind.CPU:
            shm = shared_memory.SharedMemory(create=True, size=s.staging_bytes)   # a peer process maps it
            self._shm.append(shm)
            staging = np.ndarray((s.staging_bytes,), dtype=np.uint8, buffer=shm.buf)
            staging[:] = 0
        link = ZmqLink(bootstrap=topo.bootstrap, host=s.host, secret=s.secret, allow_insecure=s.allow_insecure)
        try:
            agent = TransferAgent(layout=layout, buffers=_agent_buffers(buffers), role=Role.DECODE, link=link,
                                  backend=s.backend, config=s.agent_config(), staging=staging)
        except BaseException:
            link.close()
            raise
        agent.start()
        agent.connect_async(stage.instance, timeout_s=s.bootstrap_timeout_s)
        log.info("kvbridge-sglang: decode rank tp %d/%d reads prefill %s (layers %d..%d) over %s", self.attn_tp_rank,
                 self.attn_tp_size, stage.instance, stage.layers.start, stage.layers.stop - 1, s.backend)
        return agent

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        receiver = self._receivers.get(bootstrap_room)
        return True if receiver is None else receiver.is_abort_release_safe()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        pass

    def check_status(self, bootstrap_room: int) -> int:
        receiver = self._receivers.get(bootstrap_room)
        return int(receiver.poll()) if receiver is not None else int(KVPoll.Failed)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        self.failure_records[bootstrap_room] = failure_reason

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's digest covers the prefill rank's whole pages; it is comparable only at equal TP."""
        topo = self.topologies.get(bootstrap_addr)
        return topo is not None and topo.tp_size == self.attn_tp_size and topo.pp_size == 1

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._close_retired(idle_only=False)
        agents = [self.agent] if self.agent is not None else []
        agents += list(self.agents.values())
        for agent in agents:         # drain: rooms in flight finish (or fail cleanly), the peers hear it
            try:
                log.info("kvbridge-sglang: %s drained: %s", agent.name,
                         agent.drain(self.settings.drain_timeout_s, "SGLang shut down"))
            except Exception:
                log.exception("kvbridge-sglang: draining agent %s", agent.name)
                agent.close()
        for shm in self._shm:
            try:
                shm.close()
                shm.unlink()
            except (FileNotFoundError, BufferError):
                pass
        self._shm.clear()

    teardown = close


class KVBridgeKVSender(BaseKVSender):
    """The prefill side of one request on one rank."""

    supports_host_tensor_indices = False

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        if mgr.agent is None:
            raise KVBridgeError("kvbridge-sglang: sender on a manager without a prefill agent")
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        why = _room_error(bootstrap_room)
        self.bootstrap_room = int(bootstrap_room) if not why else -1
        self._sender: Sender | _RefusedRoom
        try:
            if why:
                raise KVBridgeError(why)
            self._sender = mgr.agent.sender(self.bootstrap_room)
        except KVBridgeError as exc:     # e.g. the room is in use by another request: fail this one alone
            log.error("kvbridge-sglang: room %s: %s", bootstrap_room, exc)
            self._sender = _RefusedRoom(str(exc))
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._sent = 0
        self._posted = False
        self._final: int | None = None      # cached once the kvbridge room was cleared
        self._reason = ""
        self._cleared = False
        self._prefix: int | None = None
        self._from_start = False            # SGLang counts the chunks from position 0 (see pop_decode_prefix_len)
        self._t_first: float | None = None
        self._t_done: float | None = None
        self.conclude_state: int | None = None
        if mgr.attn_dp_size > 1 and not req_has_disagg_prefill_dp_rank:
            try:
                bootstrap.register_dp_rank(mgr.bootstrap_addr, self.bootstrap_room, mgr.attn_dp_rank,
                                           secret=mgr.settings.secret)
            except Exception as exc:   # noqa: BLE001 - decode then routes by room % dp_size
                log.warning("kvbridge-sglang: room %d: registering prefill DP rank failed: %s", self.bootstrap_room,
                            exc)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages = int(num_kv_indices)
        self._aux_index = None if aux_index is None else int(aux_index)

    def pop_decode_prefix_len(self) -> int:
        """The decode's cached prefix (tokens); SGLang sends the pages after it. Under PP only stage 0's poll gates
        bootstrap, so a later stage may get here before the decode's request reached it: wait for it (bounded). If
        it still has not come, the answer is 0 and SGLang sends the request from position 0: the chunks go as
        ``from_start`` sends, held by kvbridge until the request comes, which then drops the prefix's pages."""
        if self._prefix is None:
            deadline = time.monotonic() + self.kv_mgr.settings.bootstrap_timeout_s
            while self._sender.poll() == KVBridgePoll.Bootstrapping and time.monotonic() < deadline:
                time.sleep(0.001)
            self._from_start = self._sender.poll() == KVBridgePoll.Bootstrapping
            self._prefix = 0 if self._from_start else int(self._sender.decode_prefix_len)
        return self._prefix

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk          # an empty last chunk still carries aux and state

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None,
             **_: Any) -> None:
        try:
            pages = _pages(kv_indices)
        except KVBridgeError as exc:
            log.warning("kvbridge-sglang: room %d: bad kv_indices: %s", self.bootstrap_room, exc)
            self._sender.abort(f"bad kv_indices: {exc}")
            self._reason = self._reason or str(exc)
            return
        if self._t_first is None:
            self._t_first = time.monotonic()
        self._sent += len(pages)
        last = self._num_pages is not None and self._sent >= self._num_pages
        mgr = self.kv_mgr
        state: dict[str, Any] = {}
        try:
            if last:
                prefix_pages = self.pop_decode_prefix_len() // mgr.page_size
                state = component_indices(mgr.layout, mgr.pool, kv=None, state_indices=state_indices,
                                          aux_index=self._aux_index, total_pages=prefix_pages + self._sent)
        except KVBridgeError as exc:
            self._sender.abort(f"bad state indices: {exc}")
            self._reason = str(exc)
            raise
        prefix = self.pop_decode_prefix_len()          # SGLang asked it first; 0 if the request never came
        if self._cleared or self._sender.poll() == KVBridgePoll.Failed:
            return                         # let go, or failed (with the reason on both sides): it goes nowhere
        self._posted = True
        try:                               # held by kvbridge while the decode's request is on its way
            self._sender.send(pages, last=last, state=state or None, from_start=self._from_start)
        except KVBridgeError as exc:       # the room failed with the reason on both sides
            log.warning("kvbridge-sglang: room %d: send failed (decode prefix %d tokens): %s", self.bootstrap_room,
                        prefix, exc)

    def poll(self) -> int:
        if self._final is not None:
            return self._final
        status = self._sender.poll()
        if status == KVBridgePoll.Failed:
            self._reason = self._sender.failure_reason or self._reason
            self.conclude_state = int(KVPoll.Failed)
            return int(KVPoll.Failed)
        if status == KVBridgePoll.Success:
            if self._t_done is None:
                self._t_done = time.monotonic()
            return int(KVPoll.Success)
        if self._posted and status < KVBridgePoll.Transferring:
            return int(KVPoll.Transferring)
        return int(status)

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self._t_first is not None and self._t_done is not None:
            latency = self._t_done - self._t_first
        nbytes = None
        if not self._cleared:
            nbytes = int(self._sender.stats[0])
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=nbytes)

    def failure_exception(self) -> None:
        reason = self._reason or (self._sender.failure_reason if not self._cleared else "") or "transfer failed"
        raise KVTransferError(self.bootstrap_room, reason)

    def abort(self) -> None:
        if self._cleared:
            return
        self._sender.abort(ABORTED)
        self._reason = self._reason or ABORTED
        self.conclude_state = int(KVPoll.Failed)
        self._let_go()

    def clear(self) -> None:
        self._let_go()

    def _let_go(self) -> None:
        """The scheduler is done with the request: its final status is kept here, and kvbridge forgets the room
        once no write from its pages is in flight (``clear_when_safe``: no thread of ours comes back for it). A
        room not over yet is aborted first (SGLang lets it go: nothing will send its remaining chunks)."""
        if self._cleared:
            return
        status = self.poll()
        if status not in (int(KVPoll.Success), int(KVPoll.Failed)):
            self._sender.abort("released by SGLang before it ended")
            status = self.poll()
        self._final = status
        self._reason = self._reason or self._sender.failure_reason
        self._sender.clear_when_safe()
        self._cleared = True


class KVBridgeKVReceiver(BaseKVReceiver):
    """The decode side of one request on one rank: one kvbridge receiver per prefill PP stage."""

    require_staging = False

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        why = _room_error(bootstrap_room or 0)
        self.bootstrap_room = int(bootstrap_room or 0) if not why else -1
        self._parts: list[tuple[Stage, TransferAgent, Receiver]] = []
        self._reason = ""
        self._failed = False
        self._metadata = False
        self.abort_notified = False
        self.conclude_state: int | None = None
        self.bootstrap_infos: list[Stage] = []
        self.prefill_dp_rank: int | None = None
        self._restarts = mgr.restarts       # prefill server replacements seen (the manager's count)
        self._reopen_by: float | None = None   # set while waiting to reopen on a restarted prefill server
        if not why and mgr._receivers.get(self.bootstrap_room) is not None:
            why = f"bootstrap_room {self.bootstrap_room} is in use by another request on this rank"
        if why:                      # fails alone; the room's live receiver stays the one SGLang's release asks
            self._fail(why, record=self.bootstrap_room < 0)
        else:
            mgr._receivers[self.bootstrap_room] = self

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = int(prefill_dp_rank)
        if self._failed:
            return
        self._open()

    def _open(self) -> None:
        """Open the room on the agent of every prefill stage this rank reads from."""
        assert self.prefill_dp_rank is not None
        self._restarts = self.kv_mgr.restarts       # before: a replacement from now on is noticed by poll()
        try:
            for stage, agent in self.kv_mgr.decode_stages(self.bootstrap_addr, self.prefill_dp_rank):
                self._parts.append((stage, agent, agent.receiver(self.bootstrap_room, stage.instance)))
                self.bootstrap_infos.append(stage)
        except Exception as exc:   # noqa: BLE001 - the request fails with the reason, the scheduler goes on
            self._fail(f"kvbridge-sglang could not open the room: {type(exc).__name__}: {exc}")

    def _server_replaced(self) -> None:
        """The prefill server this room was opened on was replaced at its address (the manager retired its
        agents). A room that never reached it (every stage still bootstrapping, no metadata given) is opened
        again on the new server; any other fails with the reason (its old rooms are the old server's)."""
        mgr = self.kv_mgr
        self._restarts = mgr.restarts
        if self._failed or not self._parts:
            return
        with mgr._lock:
            current = {id(a) for a in mgr.agents.values()}
            stale = [a for _, a, _ in self._parts if id(a) not in current]
            why = next((mgr.retired[a][0] for a in stale if a in mgr.retired),
                       f"the prefill server at {self.bootstrap_addr} was restarted")
        if not stale:
            return
        if not self._metadata and all(r.poll() == KVBridgePoll.Bootstrapping for _, _, r in self._parts):
            for _, _, receiver in self._parts:       # nothing requested: no writer, safe at once
                receiver.abort(why)
                receiver.clear()
            self._parts.clear()
            self.bootstrap_infos.clear()
            self._reopen_by = time.monotonic() + mgr.settings.bootstrap_timeout_s
            log.info("kvbridge-sglang: room %d had not reached the prefill server yet (%s): opening it on the new "
                     "one", self.bootstrap_room, why)
            return
        self._fail(f"{why}; this request was in flight on the old server")

    def _reopen(self) -> None:
        """Open the room on the new server once its topology is complete (bounded by the bootstrap timeout)."""
        assert self._reopen_by is not None
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is not None:
            self._reopen_by = None
            if info.dp_size == 1:       # the new server may have another DP size: route as SGLang's loop does
                self.prefill_dp_rank = 0
            elif info.follow_bootstrap_room:
                self.prefill_dp_rank = self.bootstrap_room % info.dp_size
            self._open()
        elif time.monotonic() > self._reopen_by:
            self._reopen_by = None
            self._fail(f"the prefill server at {self.bootstrap_addr} was restarted and did not publish all its ranks "
                       f"within {self.kv_mgr.settings.bootstrap_timeout_s} s")

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, **_: Any) -> None:
        if self._failed:
            return
        if destination != KVTransferDestination.DEVICE:
            self._fail("kvbridge-sglang moves KV into the device pool only (host destinations are not supported)")
            return
        mgr = self.kv_mgr
        prefix = int(decode_prefix_len or 0)
        try:
            pages = _pages(kv_indices)
        except KVBridgeError as exc:
            self._fail(f"send_metadata: {exc}")
            return
        total = prefix // mgr.page_size + len(pages)
        self._metadata = True
        try:
            for _stage, agent, receiver in self._parts:
                indices = component_indices(agent.layout, mgr.pool, kv=pages, state_indices=state_indices,
                                            aux_index=aux_index, total_pages=total)
                receiver.send_metadata(indices, prefix_len=prefix)
        except Exception as exc:   # noqa: BLE001 - reported through poll()/failure_exception()
            self._fail(f"send_metadata: {type(exc).__name__}: {exc}")

    def poll(self) -> int:
        if self._failed and not self._parts:
            return int(KVPoll.Failed)
        if self.kv_mgr.restarts != self._restarts:
            self._server_replaced()
        if self._reopen_by is not None and not self._failed:
            self._reopen()
        if self._failed and not self._parts:
            return int(KVPoll.Failed)
        if not self._parts:
            return int(KVPoll.Bootstrapping)
        statuses = [receiver.poll() for _, _, receiver in self._parts]
        worst = min(statuses)
        if worst == KVBridgePoll.Failed or self._failed:
            if not self._reason:
                self._reason = next(r.failure_reason for (_, _, r), st in zip(self._parts, statuses)
                                    if st == KVBridgePoll.Failed)
            if not self._failed:
                self._fail(self._reason)
            return int(KVPoll.Failed)
        return int(worst)

    def _fail(self, reason: str, *, record: bool = True) -> None:
        self._reason = self._reason or reason
        self._failed = True
        self.conclude_state = int(KVPoll.Failed)
        if record:                   # (not for a duplicate room: the record is the other request's)
            self.kv_mgr.record_failure(self.bootstrap_room, self._reason)
        for _, _, receiver in self._parts:
            receiver.abort(self._reason)
        self.abort_notified = self._metadata

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room, self._reason or "transfer failed")

    def abort(self) -> None:
        if not self._failed:
            self._fail(ABORTED)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self._failed:
            self._fail(ABORTED)
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        """True once no write into this request's pages can still land (every stage's senders fenced)."""
        return all(receiver.safe_to_reuse for _, _, receiver in self._parts)

    def clear(self) -> None:
        for _, _, receiver in self._parts:
            receiver.clear_when_safe()      # freed (staging too) once no write can land, not kept for good
        self._parts_cleared = True
        if self.kv_mgr._receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr._receivers[self.bootstrap_room]


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):
    """Started by SGLang on the prefill instance at ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int) -> None:
        settings = Settings.from_env().with_local_secret(host or "127.0.0.1")   # decided as the KV manager does
        self.host, self.port = host, int(port)
        self.server = TopologyServer(host or "127.0.0.1", self.port, secret=settings.secret,
                                     allow_insecure=settings.allow_insecure)

    def run(self) -> None:
        pass                       # serving since construction

    def close(self) -> None:
        self.server.close()

    def poll(self) -> int:
        return int(KVPoll.Success)

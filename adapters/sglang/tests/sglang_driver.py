"""One SGLang rank (prefill or decode) driving kvbridge-sglang in the call order of SGLang 0.5.23's
``disaggregation/prefill.py`` and ``decode.py`` event loops, run under .venv-sglang by the tests.

    python sglang_driver.py '<scenario json>' <role> <dp> <pp> <tp_rank> <result.json>

SGLang's classes come from its wheel: ``load_plugins()`` runs the kvbridge-sglang entry point, then
``get_kv_class(TransferBackend("kvbridge"), ...)`` gives the manager, sender, receiver and bootstrap
server, ``KVArgs`` is SGLang's, and the rank's parallel position is published with SGLang's
``get_parallel().override_permanently``. Pools are raw host memory in /dev/shm (so the loopback backend
reaches them from the other process); every source byte is a hash of its coordinates (request, component,
buffer, position, token, global head/channel, byte), and decode checks every byte it owns against the
same hash, computed independently of kvbridge's slicing. The result file lists what was verified.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import traceback
from multiprocessing import shared_memory
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cpu_torch import allow_cpu_torchvision

SEG = f"kvbridge-sglangtest-{os.getpid()}-"
_SEGS: list[shared_memory.SharedMemory] = []


def shm_array(nbytes: int, fill: int) -> np.ndarray:
    shm = shared_memory.SharedMemory(name=f"{SEG}{len(_SEGS)}", create=True, size=max(nbytes, 1))
    _SEGS.append(shm)
    arr = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
    arr[:] = fill
    return arr


def release_shm() -> None:
    for shm in _SEGS:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def h64(*parts: Any) -> np.ndarray:
    """A splitmix64-style hash of broadcast integer coordinates, one byte per element."""
    x = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        acc = np.zeros(1, dtype=np.uint64) + x
        for p in parts:
            acc = acc ^ np.asarray(p, dtype=np.uint64)
            acc = acc * np.uint64(0xBF58476D1CE4E5B9)
            acc = acc ^ (acc >> np.uint64(31))
            acc = acc * np.uint64(0x94D049BB133111EB)
            acc = acc ^ (acc >> np.uint64(29))
    return (acc >> np.uint64(56)).astype(np.uint8)


# ------------------------------------------------------------------------------------------ the model


class Model:
    """The scenario's model and this rank's slice of it; byte patterns of every buffer kind."""

    def __init__(self, sc: dict[str, Any], tp: int, rank: int, layers: list[int], page: int | None = None) -> None:
        self.sc, self.tp, self.rank, self.layers = sc, tp, rank, layers
        self.P = page or sc["page"]           # a side may set its own ("prefill": {"page": 16}); KV only then
        self.H = sc.get("heads", 4)
        self.hb = sc.get("head_bytes", 8)
        self.mla = sc.get("mla", False)
        self.pages = sc["pool_pages"]
        self.seed = sc["seed"]

    def heads(self) -> list[int]:
        if self.H >= self.tp:
            n = self.H // self.tp
            return list(range(self.rank * n, self.rank * n + n))
        return [self.rank // (self.tp // self.H)]

    def kv_page(self, req: int, tensor: int, layer: int, pos: int) -> np.ndarray:
        """Bytes of one page at request position ``pos``: [P, heads_local, hb] (MLA: [P, D]), a function of
        each token's position in the request (so pages of two sizes hold the same tokens alike)."""
        if self.mla:
            t = pos * self.P + np.arange(self.P)[:, None]
            b = np.arange(self.hb * 4)[None, :]
            return h64(self.seed, req, 1, tensor, layer, t, 0, b)
        t = pos * self.P + np.arange(self.P)[:, None, None]
        hh = np.array(self.heads())[None, :, None]
        b = np.arange(self.hb)[None, None, :]
        return h64(self.seed, req, 1, tensor, layer, t, hh, b)

    def kv_item(self) -> int:
        return self.P * (self.hb * 4 if self.mla else len(self.heads()) * self.hb)


def owned(total: int, tp: int, rank: int) -> list[int]:
    if total >= tp:
        n = total // tp
        return list(range(rank * n, rank * n + n))
    return [rank // (tp // total)]


class Pools:
    """Every buffer of this rank (numpy views over /dev/shm) and the KVArgs lists that describe them."""

    def __init__(self, model: Model, sc: dict[str, Any], fill: int) -> None:
        self.m = model
        P, pages = model.P, model.pages
        self.kv: dict[tuple[int, int], np.ndarray] = {}
        for tensor in ((0,) if model.mla else (0, 1)):
            for layer in model.layers:
                self.kv[(tensor, layer)] = shm_array(pages * model.kv_item(), fill).reshape(pages, -1)
        self.aux = [shm_array(sc["aux_slots"] * nb, fill).reshape(sc["aux_slots"], nb) for nb in sc["aux_bytes"]]
        self.state: list[dict[str, Any]] = []
        for comp in sc.get("state", []):
            entry: dict[str, Any] = {"type": comp["type"], "bufs": []}
            kind = comp["type"]
            if kind == "mamba":
                groups, kernel = comp["groups"], comp["kernel"]
                local = [owned(g, model.tp, model.rank) for g in groups]
                entry["conv_units"] = [sum(groups[:gi]) + u for gi, units in enumerate(local) for u in units]
                entry["ssm_units"] = owned(comp["ssm_heads"], model.tp, model.rank)
                for layer in comp["layers"]:
                    if layer not in model.layers:
                        continue
                    conv = shm_array(comp["slots"] * len(entry["conv_units"]) * (kernel - 1) * 2, fill)
                    entry["bufs"].append(("conv", layer, conv.reshape(comp["slots"], -1), len(entry["conv_units"])))
                for layer in comp["layers"]:
                    if layer not in model.layers:
                        continue
                    ssm = shm_array(comp["slots"] * len(entry["ssm_units"]) * comp["ssm_bytes"], fill)
                    entry["bufs"].append(("ssm", layer, ssm.reshape(comp["slots"], -1), len(entry["ssm_units"])))
            elif kind == "swa":
                for tensor in (0, 1):
                    for layer in comp["layers"]:
                        if layer in model.layers:
                            arr = shm_array(comp["pages"] * model.kv_item(), fill).reshape(comp["pages"], -1)
                            entry["bufs"].append((tensor, layer, arr, 0))
            elif kind == "dsa":
                for layer in model.layers:
                    arr = shm_array(pages * P * 132, fill).reshape(pages, -1)
                    entry["bufs"].append(("idx", layer, arr, 0))
            else:       # a state type kvbridge-sglang refuses: any buffer will do
                arr = shm_array(64 * 8, fill).reshape(8, 64)
                entry["bufs"].append(("x", 0, arr, 0))
            self.state.append(entry)

    def kv_args(self, sc: dict[str, Any], engine_rank: int, pp_rank: int, StateType: Any) -> Any:
        from sglang.srt.disaggregation.base.conn import KVArgs

        m = self.m
        args = KVArgs()
        args.engine_rank = engine_rank
        keys = sorted(self.kv)
        args.kv_data_ptrs = [self.kv[k].ctypes.data for k in keys]
        args.kv_data_lens = [self.kv[k].nbytes for k in keys]
        args.kv_item_lens = [self.kv[k].shape[1] for k in keys]
        args.kv_layer_ids = [k[1] for k in keys]
        args.kv_cache_dtype_str = "bfloat16"
        args.kv_layout = None
        args.num_draft_entries = 0
        args.aux_data_ptrs = [a.ctypes.data for a in self.aux]
        args.aux_data_lens = [a.nbytes for a in self.aux]
        args.aux_item_lens = [a.shape[1] for a in self.aux]
        args.kv_head_num = len(m.heads())
        args.total_kv_head_num = m.H
        args.page_size = m.P
        args.pp_rank = pp_rank
        args.prefill_start_layer = min(m.layers)
        args.prefill_end_layer = max(m.layers) + 1
        args.system_dp_rank = 0
        args.gpu_id = 0
        args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
        args.state_dim_per_tensor, args.state_conv_shard_groups, args.state_layer_ids = [], [], []
        args.state_slice_outer_counts = []
        args.swa_kv_cache_layout = None
        for comp, entry in zip(sc.get("state", []), self.state):
            args.state_types.append(StateType(comp["type"]))
            bufs = entry["bufs"]
            args.state_data_ptrs.append([b[2].ctypes.data for b in bufs])
            args.state_data_lens.append([b[2].nbytes for b in bufs])
            args.state_item_lens.append([b[2].shape[1] for b in bufs])
            args.state_layer_ids.append([b[1] for b in bufs])
            if comp["type"] == "mamba":
                args.state_dim_per_tensor.append([b[3] for b in bufs])
                args.state_conv_shard_groups.append([comp["groups"] if b[0] == "conv" else None for b in bufs])
                args.state_slice_outer_counts.append([1 for _ in bufs])
            else:
                args.state_dim_per_tensor.append([])
                args.state_conv_shard_groups.append([])
                args.state_slice_outer_counts.append([])
        return args

    # --- patterns
    def fill_pages(self, req: int, positions: range, pages: np.ndarray) -> None:
        for (tensor, layer), arr in self.kv.items():
            for pos, page in zip(positions, pages):
                arr[page] = self.m.kv_page(req, tensor, layer, pos).ravel()

    def aux_row(self, req: int, i: int, nbytes: int) -> np.ndarray:
        return h64(self.m.seed, req, 2, i, np.arange(nbytes))

    def state_item(self, req: int, ci: int, buf: tuple[Any, ...], pos: int, entry: dict[str, Any],
                   comp: dict[str, Any]) -> np.ndarray:
        kind, layer, arr, _ = buf
        seed = self.m.seed
        if entry["type"] == "mamba":
            if kind == "conv":
                units = np.array(entry["conv_units"])[:, None]
                return h64(seed, req, 3, ci, 0, layer, units, np.arange((comp["kernel"] - 1) * 2)[None, :]).ravel()
            units = np.array(entry["ssm_units"])[:, None]
            return h64(seed, req, 3, ci, 1, layer, units, np.arange(comp["ssm_bytes"])[None, :]).ravel()
        if entry["type"] == "swa":
            t = np.arange(self.m.P)[:, None, None]
            hh = np.array(self.m.heads())[None, :, None]
            b = np.arange(self.m.hb)[None, None, :]
            return h64(seed, req, 4, ci, kind, layer, pos, t, hh, b).ravel()
        return h64(seed, req, 5, ci, layer, pos, np.arange(arr.shape[1])).ravel()     # dsa: replicated


# ------------------------------------------------------------------------------------------ requests


def requests(sc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every request, identical in every process: lengths, prefix hits, chunks, pages on both sides."""
    rng = np.random.default_rng(sc["seed"])
    P = sc["decode"].get("page", sc["page"])         # a decode radix hit is whole decode pages
    PP = sc["prefill"].get("page", sc["page"])
    out = []
    p_free = list(rng.permutation(np.arange(1, sc["pool_pages"])))
    d_free = list(rng.permutation(np.arange(1, sc["pool_pages"])))
    swa_p = list(rng.permutation(np.arange(1, sc.get("swa_pages", 2))))
    swa_d = list(rng.permutation(np.arange(1, sc.get("swa_pages", 2))))
    for k in range(sc["requests"]):
        length = int(rng.integers(sc.get("min_len", 1), sc["max_len"] + 1))
        prefix = 0
        if rng.random() < sc.get("prefix_prob", 0.0):
            prefix = int(rng.integers(0, length // P + 1)) * P          # decode radix hit, page-aligned, may be full
            prefix = min(prefix, (length // P) * P)
        npages = math.ceil(length / P)
        ppages = [int(p_free.pop()) for _ in range(math.ceil(length / PP))]
        dpages = [int(d_free.pop()) for _ in range(npages)]
        cuts = sorted({int(c) for c in rng.integers(1, length, size=int(rng.integers(0, 4)))}) if length > 1 else []
        win = []
        if sc.get("window"):
            first = max(prefix, length - sc["window"]) // P
            win = list(range(first, npages))
        room = int(rng.integers(1, 2**63 - 1))
        follow = sc.get("lbm", "follow_bootstrap_room") == "follow_bootstrap_room"
        req = {"k": k, "room": room, "len": length, "prefix": prefix, "ppages": ppages,
               "dpages": dpages, "cuts": cuts, "aux_p": k % sc["aux_slots"], "aux_d": (k * 7 + 3) % sc["aux_slots"],
               "slot_p": k + 1, "slot_d": k + 2, "win": win,
               "swa_p": [int(swa_p.pop()) for _ in win], "swa_d": [int(swa_d.pop()) for _ in win],
               "dp": int((room if follow else k) % sc["prefill"].get("dp", 1)),
               "abort": sc.get("aborts", {}).get(str(k), "")}
        out.append(req)
    return out


# ------------------------------------------------------------------------------------------ ranks


def setup(sc: dict[str, Any], role: str, dp: int, pp: int, tp_rank: int) -> tuple[Any, Any, Any]:
    allow_cpu_torchvision()
    from sglang.srt.plugins import load_plugins

    load_plugins()                                 # runs kvbridge-sglang's sglang.srt.plugins entry point
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    side = sc[role]
    tp, pp_size, dp_size = side["tp"], side.get("pp", 1), side.get("dp", 1)
    get_parallel().override_permanently(tp_size=tp * dp_size, attn_tp_size=tp, attn_tp_rank=tp_rank,
                                        attn_dp_size=dp_size, attn_dp_rank=dp, attn_cp_size=1, pp_size=pp_size)
    backend = TransferBackend("kvbridge")
    classes = {c: get_kv_class(backend, c) for c in (KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER,
                                                      KVClassType.BOOTSTRAP_SERVER)}
    n_layers = sc["layers"]
    per = n_layers // pp_size
    layers = list(range(pp * per, (pp + 1) * per))
    model = Model(sc, tp, tp_rank, layers, side.get("page"))
    pools = Pools(model, sc, fill=0x00 if role == "prefill" else 0xEE)
    server_args = type("ServerArgs", (), {"host": "127.0.0.1", "disaggregation_bootstrap_port": sc["port"],
                                          "load_balance_method": sc.get("lbm", "follow_bootstrap_room")})()
    bootstrap_server = None
    if role == "prefill" and dp == 0 and pp == 0 and tp_rank == 0:
        bootstrap_server = classes[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=sc["port"])
    args = pools.kv_args(sc, tp_rank + dp * tp, pp, StateType)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = classes[KVClassType.MANAGER](args, mode, server_args, sc.get("mla", False))
    return mgr, classes, (pools, model, bootstrap_server, KVClassType)


def run_prefill(sc: dict[str, Any], dp: int, pp: int, tp_rank: int, out: dict[str, Any]) -> None:
    mgr, classes, (pools, model, server, KVClassType) = setup(sc, "prefill", dp, pp, tp_rank)
    from sglang.srt.disaggregation.base.conn import KVPoll

    P = model.P
    addr = f"127.0.0.1:{sc['port']}"
    reqs = [r for r in requests(sc) if r["dp"] == dp]
    # PrefillBootstrapQueue.add -> create_sender
    for r in reqs:
        r["sender"] = classes[KVClassType.SENDER](mgr=mgr, bootstrap_addr=addr, bootstrap_room=r["room"],
                                                  req_has_disagg_prefill_dp_rank=sc.get("lbm", "follow_bootstrap_room")
                                                  == "follow_bootstrap_room")
    queue, inflight = list(reqs), []
    deadline = time.monotonic() + sc.get("timeout", 120)
    kill_after = sc.get("kill_prefill_after_chunks")
    chunks_sent = 0
    while (queue or inflight) and time.monotonic() < deadline:
        # pop_bootstrapped (PP > 1: stage 0's poll_pp_consensus)
        for r in list(queue):
            poll = r["sender"].poll_pp_consensus() if mgr.pp_size > 1 else r["sender"].poll()
            if poll == KVPoll.Failed:
                try:
                    r["sender"].failure_exception()
                except Exception as exc:   # noqa: BLE001
                    out["failed"][str(r["room"])] = str(exc)
                queue.remove(r)
            elif poll == KVPoll.WaitingForInput:
                prefix = r["sender"].pop_decode_prefix_len()        # finalize_bootstrap
                num_pages = math.ceil(r["len"] / P) - prefix // P
                r["sender"].init(num_pages, r["aux_p"])
                queue.remove(r)
                # the forward pass, chunk by chunk (send_kv_chunk after each; page-floored unless last)
                start = prefix
                bounds = [c for c in r["cuts"] if c > prefix] + [r["len"]]
                for ci, end in enumerate(bounds):
                    last = ci == len(bounds) - 1
                    lo_page = start // P
                    stop = end if last else end - end % P
                    pos = range(lo_page, math.ceil(stop / P))
                    pages = np.array(r["ppages"][pos.start:pos.stop], dtype=np.int32)
                    pools.fill_pages(r["k"], pos, pages)
                    state = None
                    if last:
                        for i, nb in enumerate(sc["aux_bytes"]):
                            pools.aux[i][r["aux_p"]] = pools.aux_row(r["k"], i, nb)
                        state = []
                        for ci2, (comp, entry) in enumerate(zip(sc.get("state", []), pools.state)):
                            if comp["type"] == "mamba":
                                for buf in entry["bufs"]:
                                    buf[2][r["slot_p"]] = pools.state_item(r["k"], ci2, buf, 0, entry, comp)
                                state.append([np.array([r["slot_p"]], dtype=np.int32)])
                            elif comp["type"] == "swa":
                                for buf in entry["bufs"]:
                                    for p_abs, page in zip(r["win"], r["swa_p"]):
                                        buf[2][page] = pools.state_item(r["k"], ci2, buf, p_abs, entry, comp)
                                state.append(np.array(r["swa_p"], dtype=np.int32))
                            elif comp["type"] == "dsa":
                                first = prefix // P
                                for buf in entry["bufs"]:
                                    for p_abs in range(first, math.ceil(r["len"] / P)):
                                        buf[2][r["ppages"][p_abs]] = pools.state_item(r["k"], ci2, buf, p_abs, entry,
                                                                                      comp)
                                state.append(np.array(r["ppages"][first:], dtype=np.int32))
                    if r["abort"] == "prefill" and last:
                        r["sender"].abort()                    # _retire_aborted_prefill_result: before the last chunk
                        break
                    if stop > start or last:
                        if r["sender"].should_send_kv_chunk(len(pages), last):
                            r["sender"].send(pages, state if last else None, num_kv_tokens=stop - start)
                            chunks_sent += 1
                    start = stop
                    if sc.get("pause_prefill_after_chunks") is not None and \
                            chunks_sent >= sc["pause_prefill_after_chunks"]:
                        out["paused"] = True
                        flush(out)
                        os.kill(os.getpid(), signal.SIGSTOP)   # the test resumes or kills us
                    if kill_after is not None and chunks_sent >= kill_after and tp_rank == 0:
                        out["killed_self"] = True
                        flush(out)
                        os._exit(0)
                inflight.append(r)
        # process_disagg_prefill_inflight_queue
        for r in list(inflight):
            poll = r["sender"].poll()
            if poll == KVPoll.Success:
                out["sent"].append(r["room"])
                out["bytes"] += int(r["sender"].get_transfer_metric().transfer_total_bytes or 0)
                r["sender"].clear()
                inflight.remove(r)
            elif poll == KVPoll.Failed:
                try:
                    r["sender"].failure_exception()
                except Exception as exc:   # noqa: BLE001
                    out["failed"][str(r["room"])] = str(exc)
                inflight.remove(r)
        time.sleep(0.002)
    out["unfinished"] = [r["room"] for r in queue + inflight]
    hold = sc.get("prefill_hold_s", 3.0)       # keep serving late requests (aborts, acks) a moment
    end = time.monotonic() + hold
    while time.monotonic() < end:
        time.sleep(0.05)
    mgr.close()
    if server is not None:
        server.close()


def plant_one_byte(out: dict[str, Any]) -> None:
    """Flip one landed byte of the first notice with items, before the agent counts it (scenario "plant")."""
    from kvbridge.agent import decode as decode_module

    real = decode_module.DecodeSide.on_notice

    def corrupt(self: Any, notice: Any, env: Any) -> None:
        if "planted" not in out and notice.count and not notice.staged:
            room = self.rooms.get(notice.room)
            if room is not None:
                peer = self._peers.get(room.targets[notice.sender])
                comp_index = self._ctx.layout.component_names.index(notice.component)
                segs = self._plans.slice_for(peer, comp_index)
                layers = range(notice.layer_first, notice.layer_first + max(1, notice.layer_count))
                buffer = next(b for b in self._plans.layers(comp_index).buffers(layers) if len(segs.buffers[b]))
                item = int(room.indices[notice.component][notice.first])
                byte = int(self._plans.run_bytes(peer, comp_index, buffer, "dst").index[0])
                self._ctx.buffers.views[notice.component][buffer][item, byte] ^= 0x42
                out["planted"] = {"room": notice.room, "component": notice.component,
                                  "buffer": self._ctx.layout.components[comp_index].buffers[buffer].name,
                                  "item": item}
        real(self, notice, env)

    decode_module.DecodeSide.on_notice = corrupt


def run_decode(sc: dict[str, Any], dp: int, pp: int, tp_rank: int, out: dict[str, Any]) -> None:
    mgr, classes, (pools, model, server, KVClassType) = setup(sc, "decode", dp, pp, tp_rank)
    if sc.get("plant") and tp_rank == 0:
        plant_one_byte(out)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    P = model.P
    addr = f"127.0.0.1:{sc['port']}"
    reqs = requests(sc)
    deadline = time.monotonic() + sc.get("timeout", 120)
    # DecodePreallocQueue.add -> _create_receiver_and_enqueue; _resolve_prefill_dp_rank / _ensure_prefill_info
    for r in reqs:
        r["rx"] = classes[KVClassType.RECEIVER](mgr=mgr, bootstrap_addr=addr, bootstrap_room=r["room"])
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise TimeoutError("prefill topology never complete")
        time.sleep(0.05)
    info = mgr.prefill_info_table[addr]
    out["prefill_info"] = {"tp": info.attn_tp_size, "dp": info.dp_size, "pp": info.pp_size}
    unknown = [r for r in reqs if info.dp_size > 1 and not info.follow_bootstrap_room]
    routed: dict[str, int] = {}
    while unknown and len(routed) < len(unknown) and time.monotonic() < deadline:
        routed = CommonKVReceiver.query_prefill_dp_ranks(addr, [r["room"] for r in unknown])   # SGLang's own query
        time.sleep(0.05)
    for r in reqs:
        if info.dp_size == 1:
            dp_rank = 0
        elif info.follow_bootstrap_room:
            dp_rank = r["room"] % info.dp_size
        else:
            dp_rank = int(routed[str(r["room"])])
        r["dp_rank"] = dp_rank
        r["rx"].init(dp_rank)                               # _init_receiver
    out["routed"] = {str(r["room"]): r["dp_rank"] for r in reqs}
    pending, transfer = list(reqs), []
    while (pending or transfer) and time.monotonic() < deadline:
        for r in list(pending):                               # _update_handshake_waiters + pop_preallocated
            poll = r["rx"].poll()
            if poll == KVPoll.Failed:
                try:
                    r["rx"].failure_exception()
                except Exception as exc:   # noqa: BLE001
                    out["failed"][str(r["room"])] = str(exc)
                pending.remove(r)
                r["released"] = True
            elif poll == KVPoll.WaitingForInput:
                first = r["prefix"] // P
                kv = np.array(r["dpages"][first:], dtype=np.int32)
                state = []
                for comp in sc.get("state", []):
                    if comp["type"] == "mamba":
                        state.append([np.array([r["slot_d"]], dtype=np.int32)])
                    elif comp["type"] == "swa":
                        state.append(np.array(r["swa_d"], dtype=np.int32))
                    elif comp["type"] == "dsa":
                        state.append(np.array(r["dpages"][first:], dtype=np.int32))
                r["rx"].send_metadata(kv, r["aux_d"], state or None, decode_prefix_len=r["prefix"])
                pending.remove(r)
                transfer.append(r)
                if r["abort"] == "decode":
                    r["rx"].abort()
        for r in list(transfer):                              # DecodeTransferQueue.pop_transferred
            poll = r["rx"].poll()
            if poll == KVPoll.Success:
                out["errors"] += verify(sc, pools, model, r)
                out["verified"].append(r["room"])
                r["rx"].clear()
                transfer.remove(r)
            elif poll == KVPoll.Failed:
                try:
                    r["rx"].failure_exception()
                except Exception as exc:   # noqa: BLE001
                    out["failed"][str(r["room"])] = str(exc)
                r["safe_at_fail"] = r["rx"].is_abort_release_safe()
                out["safe_at_fail"][str(r["room"])] = r["safe_at_fail"]
                flush(out)
                transfer.remove(r)
                r["wait_safe"] = True
                pending_safe.append(r)
        for r in list(pending_safe):                          # resolve_deferred_releases
            if r["rx"].is_abort_release_safe():
                out["safe"].append(r["room"])
                r["rx"].clear()
                pending_safe.remove(r)
                flush(out)
        time.sleep(0.002)
    out["backends"] = sorted({agent.backend_name for agent in mgr.agents.values()})   # what really moved the bytes
    end = time.monotonic() + sc.get("safe_wait_s", 10)
    while pending_safe and time.monotonic() < end:
        for r in list(pending_safe):
            if r["rx"].is_abort_release_safe():
                out["safe"].append(r["room"])
                r["rx"].clear()
                pending_safe.remove(r)
                flush(out)
        time.sleep(0.05)
    out["unsafe"] = [r["room"] for r in pending_safe]
    out["unfinished"] = [r["room"] for r in pending + transfer]
    mgr.close()


pending_safe: list[dict[str, Any]] = []


def verify(sc: dict[str, Any], pools: Pools, model: Model, r: dict[str, Any]) -> list[str]:
    """Every byte this decode rank owns of the request, against the hash; the prefix pages untouched."""
    errs: list[str] = []
    P = model.P
    first = r["prefix"] // P
    for (tensor, layer), arr in pools.kv.items():
        for pos in range(math.ceil(r["len"] / P)):
            page = r["dpages"][pos]
            want = model.kv_page(r["k"], tensor, layer, pos).ravel() if pos >= first else np.full(arr.shape[1], 0xEE,
                                                                                                  np.uint8)
            got = arr[page]
            if pos >= first and sc["prefill"].get("page", sc["page"]) != P:
                valid = (min(r["len"], (pos + 1) * P) - pos * P) * (arr.shape[1] // P)
                got, want = got[:valid], want[:valid]      # a page of two sizes: the tokens past the request vary
            if not np.array_equal(got, want):
                errs.append(f"room {r['room']} kv tensor {tensor} layer {layer} position {pos} page {page}")
    if model.layers[-1] == sc["layers"] - 1:        # aux rows come with the last stage
        for i, nb in enumerate(sc["aux_bytes"]):
            if not np.array_equal(pools.aux[i][r["aux_d"]], pools.aux_row(r["k"], i, nb)):
                errs.append(f"room {r['room']} aux buffer {i} slot {r['aux_d']}")
    for ci, (comp, entry) in enumerate(zip(sc.get("state", []), pools.state)):
        for buf in entry["bufs"]:
            if comp["type"] == "mamba":
                if not np.array_equal(buf[2][r["slot_d"]], pools.state_item(r["k"], ci, buf, 0, entry, comp)):
                    errs.append(f"room {r['room']} mamba {buf[0]} layer {buf[1]}")
            elif comp["type"] == "swa":
                for p_abs, page in zip(r["win"], r["swa_d"]):
                    if not np.array_equal(buf[2][page], pools.state_item(r["k"], ci, buf, p_abs, entry, comp)):
                        errs.append(f"room {r['room']} swa tensor {buf[0]} layer {buf[1]} position {p_abs}")
            elif comp["type"] == "dsa":
                for p_abs in range(first, math.ceil(r["len"] / P)):
                    page = r["dpages"][p_abs]
                    if not np.array_equal(buf[2][page], pools.state_item(r["k"], ci, buf, p_abs, entry, comp)):
                        errs.append(f"room {r['room']} dsa layer {buf[1]} position {p_abs}")
    return errs


RESULT = ""


def flush(out: dict[str, Any]) -> None:
    tmp = RESULT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, RESULT)


def main() -> None:
    global RESULT
    sc = json.loads(sys.argv[1])
    role, dp, pp, tp_rank = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    RESULT = sys.argv[6]
    out: dict[str, Any] = {"role": role, "dp": dp, "pp": pp, "tp_rank": tp_rank, "sent": [], "verified": [],
                           "failed": {}, "errors": [], "safe": [], "safe_at_fail": {}, "bytes": 0, "done": False}
    try:
        if sc.get("refuse"):
            out["refused"] = {}
            for kind in sc["refuse"]:
                try:
                    mgr, _, _ = setup(dict(sc, state=[{"type": kind}]), role, dp, pp, tp_rank)
                    mgr.close()
                    out["refused"][kind] = ""
                except Exception as exc:   # noqa: BLE001
                    out["refused"][kind] = f"{type(exc).__name__}: {exc}"
        elif role == "prefill":
            run_prefill(sc, dp, pp, tp_rank, out)
        else:
            run_decode(sc, dp, pp, tp_rank, out)
        out["done"] = True
    except Exception:   # noqa: BLE001
        out["exception"] = traceback.format_exc()
    finally:
        flush(out)
        release_shm()


if __name__ == "__main__":
    main()

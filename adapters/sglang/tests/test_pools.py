"""SGLang's pools through the adapter's layout (no SGLang needed), host memory over loopback and, where two GPUs
and NIXL are present, GPU memory over NIXL with prefill ranks on cuda:0 and decode ranks on cuda:1: KVArgs laid out
as SGLang's pools lay them out, a request moved at TP 1 -> 1, 2 -> 1 and 1 -> 2, every byte of every component the
decode asked for equal to an independent reference (the logical TP-1 tensors the test cut each rank's share from),
nothing outside the request's pages or slots written.

Pools: MHA KV (token-major pages, 4 KV heads) with its MXFP8 block scales, an SWA pool (window pages paired by
position), a Mamba state (conv and temporal tensors, sharded by their units, one slot per request); and MLA KV
(one latent per token, replicated on every rank).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.geometry import DeviceKind
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll
from kvbridge_sglang.layout import rank_pool

pytest.importorskip("kvbridge_fp8", reason="needs kvbridge-fp8")

HEADS, DIM, LAYERS, PAGES, PAGE, SLOTS = 4, 64, 2, 8, 16, 4
MAMBA_UNITS = (8, 4)                 # conv channels, temporal heads (model-wide); inner bytes per unit below
MAMBA_INNER = (6, 32)


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    try:
        import kvbridge_nixl
    except ImportError:
        return False
    return bool(kvbridge_nixl.probe().available)


GPU = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices and NIXL")


def _logical(mla: bool, seed: int) -> dict[str, np.ndarray]:
    """TP-1 tensors, keyed by (component, index in KVArgs order): pages or slots first."""
    rng = np.random.default_rng(seed)

    def fill(*shape: int) -> np.ndarray:
        return rng.integers(1, 255, shape, dtype=np.uint8)

    if mla:
        return {f"kv.{j}": fill(PAGES, PAGE, DIM) for j in range(LAYERS)}
    out = {f"kv.{j}": fill(PAGES, PAGE, HEADS, DIM) for j in range(2 * LAYERS)}           # K layers, V layers
    out |= {f"bs.{j}": fill(PAGES * PAGE, HEADS, DIM // 32) for j in range(2 * LAYERS)}   # scales per slot
    out |= {f"swa.{j}": fill(PAGES, PAGE, HEADS, DIM) for j in range(2)}                  # one SWA layer: K, V
    out |= {f"mamba.{j}": fill(SLOTS, units, inner) for j, (units, inner) in enumerate(zip(MAMBA_UNITS,
                                                                                         MAMBA_INNER))}
    return out


def _cut(key: str, array: np.ndarray, mla: bool, tp: int, rank: int) -> np.ndarray:
    if mla:
        return array.copy()                            # the latent is the same on every rank
    if key.startswith("mamba."):
        per = array.shape[1] // tp
        return np.ascontiguousarray(array[:, rank * per:(rank + 1) * per])
    per = HEADS // tp
    axis = 1 if key.startswith("bs.") else 2
    index = [slice(None)] * array.ndim
    index[axis] = slice(rank * per, (rank + 1) * per)
    return np.ascontiguousarray(array[tuple(index)])


def _item(key: str, local: np.ndarray) -> int:
    """SGLang's item length: a page (KV, SWA), a page of per-slot scales, a slot (Mamba)."""
    return local[0].nbytes * (PAGE if key.startswith("bs.") else 1)


def _kv_args(local: dict[str, Any], ptr: dict[str, int], mla: bool, tp: int) -> SimpleNamespace:
    keys = sorted(local, key=lambda k: (k.split(".")[0], int(k.split(".")[1])))
    comp = {name: [k for k in keys if k.startswith(f"{name}.")] for name in ("kv", "bs", "swa", "mamba")}
    args = SimpleNamespace(
        kv_data_ptrs=[ptr[k] for k in comp["kv"]], kv_data_lens=[local[k].nbytes for k in comp["kv"]],
        kv_item_lens=[_item(k, local[k]) for k in comp["kv"]], kv_layer_ids=list(range(LAYERS)) * (1 if mla else 2),
        kv_head_num=HEADS // tp, total_kv_head_num=HEADS, page_size=PAGE, prefill_start_layer=0,
        num_draft_entries=0, kv_cache_dtype_str="fp8_e4m3", kv_layout=None, aux_data_ptrs=[],
        state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[], state_layer_ids=[],
        state_dim_per_tensor=[], state_conv_shard_groups=[], state_slice_outer_counts=[], swa_kv_cache_layout="nhd")
    for kind, name, dims in (("block_scale", "bs", []), ("swa", "swa", []),
                             ("mamba", "mamba", [u // tp for u in MAMBA_UNITS])):
        if not comp[name]:
            continue
        args.state_types.append(kind)
        args.state_data_ptrs.append([ptr[k] for k in comp[name]])
        args.state_data_lens.append([local[k].nbytes for k in comp[name]])
        args.state_item_lens.append([_item(k, local[k]) for k in comp[name]])
        args.state_layer_ids.append([])
        args.state_dim_per_tensor.append(dims)
        args.state_conv_shard_groups.append([])
        args.state_slice_outer_counts.append([])
    return args


def _agent(local: dict[str, np.ndarray], device: str, mla: bool, tp: int, rank: int, role: Role, hub: LocalHub,
           registry: Any) -> tuple[TransferAgent, dict[str, Any]]:
    """An agent over this rank's pools; its memory (numpy, or torch on ``device``) by the same keys."""
    if device == "cpu":
        memory: dict[str, Any] = local
        ptr = {k: int(v.ctypes.data) for k, v in local.items()}
    else:
        import torch

        memory = {k: torch.from_numpy(v).to(device) for k, v in local.items()}
        ptr = {k: int(t.data_ptr()) for k, t in memory.items()}
    kind = DeviceKind.CPU if device == "cpu" else DeviceKind.CUDA
    pool = rank_pool(_kv_args(local, ptr, mla, tp), tp_size=tp, tp_rank=rank, is_mla=mla, with_aux=False,
                     device=kind, device_id=int(device.split(":")[1]) if device != "cpu" else 0,
                     swa_window=PAGE * 3)
    layout, regions = pool.layout()
    buffers: dict[str, list[Any]] = dict(regions)
    if device != "cpu":                  # the agent's GPU path wants tensors: rows of each buffer, in wire order
        by_ptr = {int(t.data_ptr()): t for t in memory.values()}
        buffers = {name: [by_ptr[r.addr].view(-1).view(c.buffers[i].num_items, -1)
                          for i, r in enumerate(regions[name])]
                   for name, c in ((c.name, c) for c in layout.components)}
    agent = TransferAgent(layout=layout, buffers=buffers, role=role, link=hub.link(f"{role.value}{rank}"),
                          name=f"{role.value}{rank}", instance="inst" if role is Role.PREFILL else "",
                          backend="loopback" if device == "cpu" else "nixl", registry=registry,
                          config=AgentConfig(staging="never" if device == "cpu" else "auto"))
    agent.start()
    return agent, memory


CASES = [pytest.param(mla, pt, dt, "cpu", id=f"{'mla' if mla else 'mha-scales-swa-mamba'}-{pt}-{dt}-host")
         for mla in (False, True) for pt, dt in ((1, 1), (2, 1), (1, 2))]
CASES += [pytest.param(mla, pt, dt, "cuda", id=f"{'mla' if mla else 'mha-scales-swa-mamba'}-{pt}-{dt}-2gpu",
                       marks=GPU) for mla in (False, True) for pt, dt in ((1, 1), (2, 1), (1, 2))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mla, pt, dt, device", CASES)
def test_sglang_pools_move_byte_exact(mla: bool, pt: int, dt: int, device: str) -> None:
    from kvbridge.registry import Registry

    registry = None
    if device == "cuda":
        import kvbridge_nixl

        registry = Registry.build(plugins=[kvbridge_nixl])
    full = _logical(mla, seed=7 + pt + dt)
    hub = LocalHub()
    agents: list[TransferAgent] = []
    try:
        prefills, decodes, dst, src_memory = [], [], [], []
        for r in range(pt):
            agent, held = _agent({k: _cut(k, v, mla, pt, r) for k, v in full.items()}, "cuda:0" if device == "cuda"
                              else "cpu", mla, pt, r, Role.PREFILL, hub, registry)
            prefills.append(agent)
            agents.append(agent)
            src_memory.append(held)          # registered memory must outlive its agent
        for r in range(dt):
            zeros = {k: np.zeros_like(_cut(k, v, mla, dt, r)) for k, v in full.items()}
            agent, memory = _agent(zeros, "cuda:1" if device == "cuda" else "cpu", mla, dt, r, Role.DECODE, hub,
                                   registry)
            decodes.append(agent)
            agents.append(agent)
            dst.append(memory)
        src_pages, dst_pages = np.array([1, 6, 2, 4]), np.array([5, 0, 3, 7])
        swa_src, swa_dst = np.array([6, 2]), np.array([0, 3])      # the window: the last two pages' positions
        src_slot, dst_slot = np.array([2]), np.array([1])
        receivers = []
        for d in decodes:
            d.connect("inst", timeout_s=60)
            receiver = d.receiver(11, "inst")
            want: dict[str, Any] = {"kv": dst_pages}
            if not mla:
                want |= {"block_scale": dst_pages, "swa": (swa_dst, 2), "mamba": dst_slot}
            receiver.send_metadata(want)
            receivers.append(receiver)
        senders = [p.sender(11) for p in prefills]
        deadline = time.monotonic() + 90
        while any(s.poll() < KVPoll.WaitingForInput for s in senders) and time.monotonic() < deadline:
            time.sleep(0.002)
        state = {} if mla else {"swa": (swa_src, 2), "mamba": src_slot}
        for s in senders:
            s.send(src_pages[:2])
            s.send(src_pages[2:], last=True, state=state)
        while any(r.poll() not in (KVPoll.Success, KVPoll.Failed) for r in receivers) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [r.poll() for r in receivers] == [KVPoll.Success] * dt, [r.failure_reason for r in receivers]
        for r, memory in enumerate(dst):
            for key, logical in full.items():
                got = memory[key] if device == "cpu" else memory[key].cpu().numpy()
                want_all = _cut(key, logical, mla, dt, r)
                if key.startswith("bs."):                    # per slot: page p is slots [p * PAGE, (p + 1) * PAGE)
                    got, want_all = (a.reshape(PAGES, PAGE, *a.shape[1:]) for a in (got, want_all))
                src, dsts = ((src_slot, dst_slot) if key.startswith("mamba.") else
                             (swa_src, swa_dst) if key.startswith("swa.") else (src_pages, dst_pages))
                assert np.array_equal(got[dsts], want_all[src]), f"decode rank {r}: {key}"
                others = np.setdiff1d(np.arange(got.shape[0]), dsts)
                assert not got[others].any(), f"decode rank {r}: {key}: bytes outside the request"
    finally:
        for agent in agents:
            agent.close()

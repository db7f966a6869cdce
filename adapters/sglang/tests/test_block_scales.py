"""MXFP8 block scales through the SGLang adapter (no SGLang needed): KVArgs laid out as SGLang's
``MHATokenToKVPoolMXFP8`` lays them out (FP8 pages, UE8M0 scales per slot or, for 128-token pages, interleaved
per page), prefill TP 2 -> decode TP 1 and 1 -> 2 over loopback with 4 KV heads; every KV and scale byte of the
decode's pages equals an independent reference: the logical (TP-1) tensors the test cut the prefill ranks from,
head by head. SGLang's own transports refuse this pair (different attention TP sizes with MXFP8)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll
from kvbridge_sglang.layout import rank_pool

pytest.importorskip("kvbridge_fp8", reason="needs kvbridge-fp8")

HEADS, DIM, LAYERS, PAGES = 4, 64, 2, 6
SF = DIM // 32                      # scale bytes per head and token


def _logical(page: int, seed: int) -> dict[str, np.ndarray]:
    """The TP-1 tensors of one side: per layer and K/V, pages [pages, page, heads, dim] (FP8 bytes) and scales
    in SGLang's layout for this page size."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for t in "kv":
        for layer in range(LAYERS):
            out[f"kv.{t}.{layer}"] = rng.integers(1, 255, (PAGES, page, HEADS, DIM), dtype=np.uint8)
            if page == 128:            # interleaved: (pages, heads, 32, page // 32, sf)
                out[f"bs.{t}.{layer}"] = rng.integers(1, 255, (PAGES, HEADS, 32, page // 32, SF), dtype=np.uint8)
            else:                      # per slot: (slots, heads, sf), a page = page_size consecutive slots
                out[f"bs.{t}.{layer}"] = rng.integers(1, 255, (PAGES * page, HEADS, SF), dtype=np.uint8)
    return out


def _cut(array: np.ndarray, name: str, tp: int, rank: int) -> np.ndarray:
    """What ``rank`` of ``tp`` holds of a logical tensor (heads split evenly; 4 heads, TP <= 4)."""
    per = HEADS // tp
    heads = slice(rank * per, (rank + 1) * per)
    if name.startswith("kv."):                         # [pages, page, heads, dim]
        return np.ascontiguousarray(array[:, :, heads])
    return np.ascontiguousarray(array[:, heads])       # [pages, heads, ...] interleaved, [slots, heads, sf]


def _kv_args(arrays: dict[str, np.ndarray], page: int, tp: int) -> SimpleNamespace:
    kv = [arrays[f"kv.{t}.{layer}"] for t in "kv" for layer in range(LAYERS)]
    bs = [arrays[f"bs.{t}.{layer}"] for t in "kv" for layer in range(LAYERS)]
    return SimpleNamespace(
        kv_data_ptrs=[a.ctypes.data for a in kv], kv_data_lens=[a.nbytes for a in kv],
        kv_item_lens=[a[0].nbytes for a in kv], kv_layer_ids=list(range(LAYERS)) * 2, kv_head_num=HEADS // tp,
        total_kv_head_num=HEADS, page_size=page, prefill_start_layer=0, num_draft_entries=0,
        kv_cache_dtype_str="fp8_e4m3", kv_layout=None, aux_data_ptrs=[],
        state_types=["block_scale"], state_data_ptrs=[[a.ctypes.data for a in bs]],
        state_data_lens=[[a.nbytes for a in bs]],
        # SGLang's item_lens: a page's row (interleaved) or a slot's row times the page size (per slot)
        state_item_lens=[[a[0].nbytes if page == 128 else a[0].nbytes * page for a in bs]],
        state_layer_ids=[list(range(LAYERS)) * 2])


def _agent(arrays: dict[str, np.ndarray], page: int, tp: int, rank: int, role: Role, hub: LocalHub,
           name: str) -> TransferAgent:
    pool = rank_pool(_kv_args(arrays, page, tp), tp_size=tp, tp_rank=rank, is_mla=False, with_aux=False)
    layout, buffers = pool.layout()
    assert layout.component_names == ("kv", "block_scale")
    agent = TransferAgent(layout=layout, buffers=buffers, role=role, link=hub.link(name), name=name,
                          instance="inst" if role is Role.PREFILL else "", config=AgentConfig(staging="never"))
    agent.start()
    return agent


@pytest.mark.parametrize("page", [16, 128], ids=["per-slot", "interleaved"])
@pytest.mark.parametrize("pt, dt", [(2, 1), (1, 2)])
def test_fp8_pages_and_their_scales_reslice_by_kv_head(page: int, pt: int, dt: int) -> None:
    full = _logical(page, seed=page + pt)
    hub = LocalHub()
    keep: list[Any] = []
    prefills = []
    for r in range(pt):
        local = {k: _cut(v, k, pt, r) for k, v in full.items()}
        keep.append(local)
        prefills.append(_agent(local, page, pt, r, Role.PREFILL, hub, f"p{r}"))
    decodes, dst = [], []
    for r in range(dt):
        local = {k: np.zeros_like(_cut(v, k, dt, r)) for k, v in full.items()}
        dst.append(local)
        decodes.append(_agent(local, page, dt, r, Role.DECODE, hub, f"d{r}"))
    try:
        src_pages, dst_pages = np.array([1, 4, 2]), np.array([5, 0, 3])
        receivers = []
        for d in decodes:
            d.connect("inst", timeout_s=20)
            receiver = d.receiver(7, "inst")
            receiver.send_metadata({"kv": dst_pages, "block_scale": dst_pages})
            receivers.append(receiver)
        senders = [p.sender(7) for p in prefills]
        deadline = time.monotonic() + 30
        while any(s.poll() < KVPoll.WaitingForInput for s in senders) and time.monotonic() < deadline:
            time.sleep(0.002)
        for s in senders:
            s.send(src_pages[:2])                     # two chunks: the scales travel with their pages
            s.send(src_pages[2:], last=True)
        while any(r.poll() not in (KVPoll.Success, KVPoll.Failed) for r in receivers) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [r.poll() for r in receivers] == [KVPoll.Success] * dt, [r.failure_reason for r in receivers]
        for r, local in enumerate(dst):
            for key, logical in full.items():
                want = _cut(logical, key, dt, r)
                got = local[key]
                if key.startswith("bs.") and page != 128:          # per slot: page p is slots [p*page, (p+1)*page)
                    want = want.reshape(PAGES, page, *want.shape[1:])
                    got = got.reshape(PAGES, page, *got.shape[1:])
                assert np.array_equal(got[dst_pages], want[src_pages]), key
                untouched = np.setdiff1d(np.arange(PAGES), dst_pages)
                assert not got[untouched].any(), f"{key}: bytes outside the request's pages"
    finally:
        for agent in prefills + decodes:
            agent.close()

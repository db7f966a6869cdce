"""A backend-level reshard rig for plugin tests: Pt prefill and Dt decode ranks of paged token-major KV,
one backend per rank, driven through the backend protocol directly (no agent, no control plane).

Plans come from kvbridge (``buffer_segments`` + ``plan_transfer``); the expected decode pools come from
:func:`reference_heads` and plain numpy fancy indexing, which share no code with kvbridge.slicing.

    run_reshard(lambda name: MyBackend(name=name), pt=4, dt=2, model=Model())
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.base import ComponentTransfer, PeerInfo, Poll, RegisteredBuffers
from kvbridge.geometry import BufferGeometry, DType, Rank, ShardAxis, region_of
from kvbridge.planner import BufferPair, TransferPlan, plan_transfer
from kvbridge.slicing import buffer_segments, target_ranks

__all__ = ["COMPONENT", "Model", "Rig", "make_rank", "peer_info", "plan_for", "reference_heads", "run_reshard",
           "transfer", "wait"]


COMPONENT = "kv"


def reference_heads(total: int, tp: int, rank: int) -> np.ndarray:
    """Global KV heads a rank of a TP group holds (contiguous share, or one replicated head)."""
    if total >= tp:
        per = total // tp
        return np.arange(rank * per, rank * per + per)
    return np.array([rank // (tp // total)])


@dataclass
class Rig:
    """One side's rank: its backend, its pool arrays (one per buffer) and their registration."""

    backend: Any
    arrays: list[np.ndarray]
    geometry: list[BufferGeometry]
    registered: RegisteredBuffers


@dataclass(frozen=True)
class Model:
    heads: int = 4
    page: int = 4
    head_dim: int = 8
    layers: int = 2
    src_pages: int = 16
    dst_pages: int = 12

    @property
    def buffers(self) -> int:
        return 2 * self.layers   # K and V per layer


def make_rank(model: Model, tp: int, rank: int, num_pages: int, backend: Any,
              fill: list[np.ndarray] | None) -> Rig:
    heads = reference_heads(model.heads, tp, rank)
    shape = (num_pages, model.page, heads.size, model.head_dim)
    arrays = [np.ascontiguousarray(f[:, :, heads, :]) if f is not None else np.zeros(shape, np.uint16)
              for f in (fill or [None] * model.buffers)]
    geometry = [BufferGeometry(f"{'kv'[b % 2]}.{b // 2}", num_pages, shape[1:], DType.FLOAT16,
                               ShardAxis(axis=1, total=model.heads)) for b in range(model.buffers)]
    registered = backend.register_buffers(COMPONENT, [region_of(a) for a in arrays])
    return Rig(backend, arrays, geometry, registered)


def plan_for(src: Rig, dst: Rig, src_rank: Rank, dst_rank: Rank, src_idx: np.ndarray,
             dst_idx: np.ndarray) -> TransferPlan:
    pairs = []
    for sg, dg, sa, da in zip(src.geometry, dst.geometry, src.arrays, dst.arrays, strict=True):
        seg = buffer_segments(sg, dg, src_rank, dst_rank)
        pairs.append(BufferPair(sa.ctypes.data, sg.item_nbytes, sg.num_items, da.ctypes.data, dg.item_nbytes,
                                dg.num_items, seg))
    return plan_transfer(pairs, src_idx, dst_idx)


def wait(backend: Any, handle: Any, timeout: float = 10.0) -> Poll:
    deadline = time.monotonic() + timeout
    while True:
        result = backend.poll(handle)
        if result.state.name != "PENDING" or time.monotonic() > deadline:
            return result
        time.sleep(0.001)


def transfer(src: Rig, dst: Rig, peer_id: str, plan: TransferPlan, room: int = 1) -> ComponentTransfer:
    return ComponentTransfer(room=room, component=COMPONENT, peer=peer_id, chunk=0, last=True, src=src.registered,
                             dst=dst.registered.remote(), plan=plan)


def peer_info(name: str, rig: Rig) -> PeerInfo:
    return PeerInfo(name, rig.backend.endpoint, (rig.registered.remote(),))


def run_reshard(make_backend: Callable[[str], Any], pt: int, dt: int, model: Model, seed: int = 0) -> None:
    """Move one request from Pt prefill ranks to Dt decode ranks and check every decode pool byte for byte."""
    rng = np.random.default_rng(seed)
    logical = [rng.integers(0, 2**16, (model.src_pages, model.page, model.heads, model.head_dim), dtype=np.uint16)
               for _ in range(model.buffers)]
    prefill = [make_rank(model, pt, p, model.src_pages, make_backend(f"prefill-{p}"), logical) for p in range(pt)]
    decode = [make_rank(model, dt, d, model.dst_pages, make_backend(f"decode-{d}"), None) for d in range(dt)]
    n = 7
    src_idx = np.concatenate((np.arange(3, 6), rng.choice(np.arange(8, model.src_pages), n - 3, replace=False)))
    dst_idx = np.concatenate((np.arange(0, 3), rng.choice(np.arange(4, model.dst_pages), n - 3, replace=False)))
    try:
        pending = []
        for d in range(dt):
            for p in target_ranks(pt, dt, d):
                plan = plan_for(prefill[p], decode[d], Rank(p, pt), Rank(d, dt), src_idx, dst_idx)
                if len(plan) == 0:
                    continue   # not the elected writer of a replicated head
                sender = prefill[p].backend
                peer_id = sender.add_peer(peer_info(f"decode-{d}", decode[d]))
                pending.append((sender, sender.send_component(transfer(prefill[p], decode[d], peer_id, plan))))
        for sender, handle in pending:
            result = wait(sender, handle)
            assert result == Poll.done(), result
            sender.release(handle)
        for d in range(dt):
            heads = reference_heads(model.heads, dt, d)
            for b in range(model.buffers):
                want = np.zeros_like(decode[d].arrays[b])
                want[dst_idx] = logical[b][src_idx][:, :, heads, :]
                assert np.array_equal(decode[d].arrays[b], want), f"decode rank {d} buffer {b} differs"
    finally:
        for rig in prefill + decode:
            rig.backend.close()

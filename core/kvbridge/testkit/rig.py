"""Backend-level pieces for plugin tests: Pt prefill and Dt decode ranks of paged token-major KV, one
backend per rank, driven through the backend protocol directly (no agent, no control plane).

:func:`run_backend_reshard` is the whole round trip, run by the kit's one reshard rig
(:func:`kvbridge.testkit.reshard.run_reshard`); the other helpers build single ranks, plans and transfers
for tests that break one step on purpose. Expected pools come from :func:`reference_heads` and plain numpy
fancy indexing, which share no code with kvbridge.slicing.

    run_backend_reshard(lambda name: MyBackend(name=name), pt=4, dt=2, model=Model())
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.base import ComponentTransfer, RegisteredBuffers
from kvbridge.geometry import BufferGeometry, Component, DType, Rank, ShardAxis, region_of
from kvbridge.planner import BufferPair, TransferPlan, plan_transfer
from kvbridge.protocol.records import PeerInfo
from kvbridge.slicing import buffer_segments
from kvbridge.state.kv import KVState, kv_component
from kvbridge.testkit.reshard import COMPONENT, run_reshard, wait

__all__ = ["COMPONENT", "Model", "Rig", "connected_backends", "connected_ranks", "make_rank", "peer_info", "plan_for",
           "page_plan", "reference_heads", "run_backend_reshard", "transfer", "wait"]


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


@dataclass(frozen=True, kw_only=True)
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
    sources: list[np.ndarray | None] = [*fill] if fill else [None] * model.buffers
    arrays = [np.ascontiguousarray(f[:, :, heads, :]) if f is not None else np.zeros(shape, np.uint16) for f in sources]
    geometry = [BufferGeometry(name=f"{'kv'[b % 2]}.{b // 2}", num_items=num_pages, item_shape=shape[1:],
                               dtype=DType.FLOAT16,
                               shard=ShardAxis(axis=1, total=model.heads)) for b in range(model.buffers)]
    registered = backend.register_buffers(COMPONENT, [region_of(a) for a in arrays])
    return Rig(backend, arrays, geometry, registered)


_ALONE = Rank(0, 1)   # the one rank of TP 1


def connected_ranks(model: Model, src_backend: Any, dst_backend: Any, *, fill: int | Sequence[int] = 1,
                    src_rank: Rank = _ALONE, dst_rank: Rank = _ALONE) -> tuple[Rig, Rig, str]:
    """A prefill rank on ``src_backend`` and a decode rank on ``dst_backend``, the sender already knowing the
    receiver (as peer ``"d"``): returns (src, dst, peer id). Every source buffer holds ``fill`` (one value
    for all, or one per buffer); the decode pool is zero."""
    values = [fill] * model.buffers if isinstance(fill, int) else list(fill)
    logical = [np.full((model.src_pages, model.page, model.heads, model.head_dim), v, np.uint16) for v in values]
    src = make_rank(model, src_rank.size, src_rank.rank, model.src_pages, src_backend, logical)
    dst = make_rank(model, dst_rank.size, dst_rank.rank, model.dst_pages, dst_backend, None)
    return src, dst, src_backend.add_peer(peer_info("d", dst))


@contextmanager
def connected_backends(model: Model, make_backend: Callable[[str], Any], *, fill: int | Sequence[int] = 1
                       ) -> Iterator[tuple[Rig, Rig, str]]:
    """:func:`connected_ranks` (TP 1 each) on two new backends, ``make_backend("p")`` and
    ``make_backend("d")``, both closed on leaving."""
    src_backend, dst_backend = make_backend("p"), make_backend("d")
    try:
        yield connected_ranks(model, src_backend, dst_backend, fill=fill)
    finally:
        src_backend.close()
        dst_backend.close()


def page_plan(src: Rig, dst: Rig, pages: int) -> TransferPlan:
    """The plan of pages 0 to ``pages - 1`` of a TP 1 source onto the same pages of a TP 1 destination."""
    return plan_for(src, dst, _ALONE, _ALONE, np.arange(pages), np.arange(pages))


def plan_for(src: Rig, dst: Rig, src_rank: Rank, dst_rank: Rank, src_idx: np.ndarray,
             dst_idx: np.ndarray) -> TransferPlan:
    pairs = []
    for sg, dg, sa, da in zip(src.geometry, dst.geometry, src.arrays, dst.arrays, strict=True):
        seg = buffer_segments(sg, dg, src_rank, dst_rank)
        pairs.append(BufferPair(src_base=sa.ctypes.data, src_item_nbytes=sg.item_nbytes,
                                src_num_items=sg.num_items, dst_base=da.ctypes.data, dst_item_nbytes=dg.item_nbytes,
                                dst_num_items=dg.num_items, segments=seg))
    return plan_transfer(pairs, src_idx, dst_idx)


def transfer(src: Rig, dst: Rig, peer_id: str, plan: TransferPlan, room: int = 1) -> ComponentTransfer:
    return ComponentTransfer(room=room, component=COMPONENT, peer=peer_id, chunk=0, last=True, src=src.registered,
                             dst=dst.registered.remote(), plan=plan)


def peer_info(name: str, rig: Rig) -> PeerInfo:
    return PeerInfo(name, rig.backend.endpoint, (rig.registered.remote(),))


def run_backend_reshard(make_backend: Callable[[str], Any], pt: int, dt: int, model: Model, seed: int = 0) -> None:
    """Move one request from Pt prefill ranks to Dt decode ranks, one backend per rank, and check every
    decode pool byte for byte (:func:`kvbridge.testkit.reshard.run_reshard` with ``backend``)."""
    rng = np.random.default_rng(seed)
    n = 7
    src_idx = np.concatenate((np.arange(3, 6), rng.choice(np.arange(8, model.src_pages), n - 3, replace=False)))
    dst_idx = np.concatenate((np.arange(0, 3), rng.choice(np.arange(4, model.dst_pages), n - 3, replace=False)))

    def component(pages: int) -> Callable[[int], Component]:
        return lambda tp: kv_component(COMPONENT, layers=model.layers, page_size=model.page, kv_heads=model.heads,
                                       head_dim=model.head_dim, tp=tp, dtype=DType.FLOAT16, num_pages=pages)

    run_reshard(KVState(), component(model.src_pages), pt, dt, src_idx, dst_idx, seed, backend=make_backend,
                make_dst=component(model.dst_pages)).assert_exact()

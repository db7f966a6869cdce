"""Test helpers: one small KV model described twice - as kvbridge geometry and as reference specs.

The kvbridge side (``component``) is what the planner sees; the reference side (``spec``) is what the
independent reshard in ``kvbridge.testkit.reference`` uses to compute the bytes every rank must hold.
Buffers are uint8 numpy arrays ``[num_pages, *page bytes]`` whose byte layout matches the geometry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.geometry import BufferGeometry, Component, DType, ShardAxis, region_of
from kvbridge.planner import TransferPlan
from kvbridge.testkit import reference as ref

SEED = 20240611
SRC_BACKGROUND = 101
DST_BACKGROUND = 202


@dataclass(frozen=True)
class KVModel:
    """A paged KV cache: ``num_layers`` layers of one tensor per entry of ``head_dims`` (K, V for MHA;
    the latent for MLA), each page ``page_size`` tokens of ``total_heads`` heads (MLA: no heads)."""

    layout: str
    total_heads: int
    page_size: int
    head_dims: tuple[int, ...]
    num_layers: int = 2
    dtype: DType = DType.BFLOAT16

    def __post_init__(self) -> None:
        if self.layout == ref.MLA and self.total_heads != 1:
            raise ValueError("MLA models are built with total_heads=1")

    @property
    def num_buffers(self) -> int:
        return len(self.head_dims) * self.num_layers

    def tensor_layer(self, buffer: int) -> tuple[int, int]:
        """Buffers are all layers of tensor 0 (K), then all layers of tensor 1 (V)."""
        return divmod(buffer, self.num_layers)

    def spec(self, buffer: int) -> ref.KVSpec:
        tensor, _ = self.tensor_layer(buffer)
        head_bytes = self.head_dims[tensor] * self.dtype.itemsize
        return ref.KVSpec(self.layout, self.total_heads, self.page_size, head_bytes)

    def geometry(self, buffer: int, tp_size: int, num_pages: int, *, local_heads: int | None = None
                 ) -> BufferGeometry:
        tensor, layer = self.tensor_layer(buffer)
        name = f"{'kv' if self.layout == ref.MLA else ('k', 'v')[tensor]}.{layer}"
        dim = self.head_dims[tensor]
        if self.layout == ref.MLA:
            return BufferGeometry(name=name, num_items=num_pages, item_shape=(self.page_size, dim), dtype=self.dtype)
        heads = self.spec(buffer).local_heads(tp_size) if local_heads is None else local_heads
        if self.layout == ref.TOKEN_MAJOR:
            return BufferGeometry(name=name, num_items=num_pages, item_shape=(self.page_size, heads, dim),
                                  dtype=self.dtype,
                                  shard=ShardAxis(axis=1, total=self.total_heads))
        return BufferGeometry(name=name, num_items=num_pages, item_shape=(heads, self.page_size, dim), dtype=self.dtype,
                              shard=ShardAxis(axis=0, total=self.total_heads))

    def component(self, tp_size: int, num_pages: int) -> Component:
        buffers = tuple(self.geometry(b, tp_size, num_pages) for b in range(self.num_buffers))
        return Component(name="kv", state_type="kv", buffers=buffers)

    def buffers(self, tp_size: int, rank: int, num_pages: int, pages: Sequence[int] | np.ndarray,
                positions: Sequence[int] | np.ndarray, background_seed: int) -> list[np.ndarray]:
        """Every buffer of one rank: background, plus the rank's share of ``positions`` at ``pages``."""
        out = []
        for b in range(self.num_buffers):
            tensor, layer = self.tensor_layer(b)
            out.append(ref.source_buffer(self.spec(b), SEED, layer, tensor, tp_size, rank, num_pages, pages,
                                         positions, background_seed, buffer_key=b))
        return out

    def source_buffers(self, tp_size: int, rank: int, num_pages: int, pages: Sequence[int] | np.ndarray,
                       positions: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        return self.buffers(tp_size, rank, num_pages, pages, positions, SRC_BACKGROUND + rank)

    def empty_destination(self, tp_size: int, rank: int, num_pages: int) -> list[np.ndarray]:
        return self.buffers(tp_size, rank, num_pages, [], [], DST_BACKGROUND + rank)

    def expected_destination(self, tp_size: int, rank: int, num_pages: int, pages: Sequence[int] | np.ndarray,
                             positions: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        return self.buffers(tp_size, rank, num_pages, pages, positions, DST_BACKGROUND + rank)


def bases(buffers: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([region_of(b).addr for b in buffers], dtype=np.uint64)


def count_writes(plan: TransferPlan, dst_buffers: Sequence[np.ndarray],
                 counters: Sequence[np.ndarray]) -> None:
    """Add one to ``counters[b][i]`` for every byte ``i`` of destination buffer ``b`` that ``plan``
    writes (difference arrays; ``counters[b]`` is int64 of length nbytes + 1, cumsum it to read)."""
    if len(plan) == 0:
        return
    dst_base = bases(dst_buffers)
    which = _owning_buffer(plan.dst_addr, dst_buffers)
    start = (plan.dst_addr - dst_base[which]).astype(np.int64)
    stop = start + plan.nbytes.astype(np.int64)
    for b in np.unique(which):
        sel = which == b
        np.add.at(counters[b], start[sel], 1)
        np.add.at(counters[b], stop[sel], -1)


def _owning_buffer(addr: np.ndarray, buffers: Sequence[np.ndarray]) -> np.ndarray:
    lo = bases(buffers)
    hi = lo + np.array([b.nbytes for b in buffers], dtype=np.uint64)
    inside = (addr[:, None] >= lo[None, :]) & (addr[:, None] < hi[None, :])
    assert inside.sum(axis=1).tolist() == [1] * addr.size, "a descriptor is outside every destination buffer"
    return np.argmax(inside, axis=1)


def mergeable_pairs(plan: TransferPlan) -> list[tuple[int, int]]:
    """Descriptor pairs (i, j) where j starts exactly where i ends on both sides (so they should
    have been one descriptor). Order-independent: checks every descriptor against every start."""
    starts = {(int(s), int(d)): j for j, (s, d) in enumerate(zip(plan.src_addr, plan.dst_addr))}
    out = []
    for i, (s, d, n) in enumerate(zip(plan.src_addr, plan.dst_addr, plan.nbytes)):
        j = starts.get((int(s) + int(n), int(d) + int(n)))
        if j is not None:
            out.append((i, j))
    return out


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs (src start, dst start, length) of page pairs contiguous on both sides, computed the
    slow way after sorting by source page."""
    pairs = sorted(zip(src_pages.tolist(), dst_pages.tolist()))
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def plan_pair(src_comp: Component, dst_comp: Component, src_buffers: Sequence[np.ndarray],
              dst_buffers: Sequence[np.ndarray], segments: Sequence[object], src_pages: np.ndarray,
              dst_pages: np.ndarray) -> TransferPlan:
    """Plan one (prefill rank, decode rank) pair of one component with the real planner."""
    from kvbridge.planner import BufferPair, plan_transfer

    pairs = [BufferPair(src_base=region_of(sb).addr, src_item_nbytes=sg.item_nbytes,
                        src_num_items=sg.num_items, dst_base=region_of(db).addr, dst_item_nbytes=dg.item_nbytes,
                        dst_num_items=dg.num_items, segments=seg)  # type: ignore[arg-type]
             for sb, db, sg, dg, seg in zip(src_buffers, dst_buffers, src_comp.buffers, dst_comp.buffers,
                                            segments)]
    return plan_transfer(pairs, src_pages, dst_pages)


def post_component(registry: Any, backend: Any, *, peer: str, src: Any, dst: Any, src_comp: Component,
                   dst_comp: Component, cut: Any, src_items: np.ndarray, dst_items: np.ndarray,
                   chunk: int = 0, last: bool = True, room: int = 7) -> TransferPlan:
    """Plan one component for one peer from registered buffers and post it through the registry facade
    (as the Sender does); assert the backend reports it done. Returns the plan."""
    from kvbridge.backends.base import ComponentTransfer, HandleState
    from kvbridge.planner import BufferPair, plan_transfer

    pairs = [BufferPair(src_base=r.addr, src_item_nbytes=sg.item_nbytes, src_num_items=sg.num_items,
                        dst_base=rr.addr, dst_item_nbytes=dg.item_nbytes, dst_num_items=dg.num_items, segments=seg)
             for r, rr, sg, dg, seg in zip(src.regions, dst.regions, src_comp.buffers, dst_comp.buffers,
                                            cut.buffers)]
    plan = plan_transfer(pairs, src_items, dst_items)
    transfer = ComponentTransfer(room=room, component=src_comp.name, peer=peer, chunk=chunk, last=last,
                                 src=src, dst=dst, plan=plan, src_items=src_items, dst_items=dst_items,
                                 segments=cut.buffers)
    handle = registry.send_component(backend, transfer)
    assert backend.poll(handle).state is HandleState.DONE
    backend.release(handle)
    return plan

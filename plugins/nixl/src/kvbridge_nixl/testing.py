"""A token-major paged KV case for the NIXL tests: pools, plans, and an independent reference reshard.

The expected destination bytes are computed here with plain numpy head slicing of the full (unsharded)
KV; ``kvbridge.slicing`` is used only to build the plans under test, never the expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.backends.base import ComponentTransfer, RegisteredBuffers, RemoteBuffers
from kvbridge.geometry import BufferGeometry, DType, MemoryRegion, Rank, ShardAxis, region_of
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.slicing import buffer_segments

PAGE = 4            # tokens per page
HEAD_DIM = 8        # fp16 -> 16 B per head per token
LAYERS = 2          # K and V per layer -> 4 buffers
SRC_PAGES = 24
DST_PAGES = 20
SENTINEL = 0xA5


def heads_of(total: int, tp: int, rank: int) -> tuple[int, int]:
    """Head range a TP rank holds (one head replicated over tp/total ranks when total < tp)."""
    if total >= tp:
        per = total // tp
        return rank * per, rank * per + per
    unit = rank // (tp // total)
    return unit, unit + 1


def full_kv(seed: int, heads: int) -> list[np.ndarray]:
    """Unsharded K/V of every layer: ``[page, token, head, dim]`` fp16 with random bit patterns."""
    rng = np.random.default_rng(seed)
    shape = (SRC_PAGES, PAGE, heads, HEAD_DIM)
    return [rng.integers(0, 256, size=(*shape[:-1], HEAD_DIM * 2), dtype=np.uint8).view(np.float16)
            for _ in range(2 * LAYERS)]


def prefill_pool(full: list[np.ndarray], tp: int, rank: int) -> list[np.ndarray]:
    lo, hi = heads_of(full[0].shape[2], tp, rank)
    return [np.ascontiguousarray(buf[:, :, lo:hi, :]) for buf in full]   # written -> pages are touched


def decode_pool(heads: int, tp: int, rank: int) -> list[np.ndarray]:
    lo, hi = heads_of(heads, tp, rank)
    shape = (DST_PAGES, PAGE, hi - lo, HEAD_DIM)
    return [np.full((*shape[:-1], HEAD_DIM * 2), SENTINEL, dtype=np.uint8).view(np.float16)
            for _ in range(2 * LAYERS)]


def expected_decode(full: list[np.ndarray], tp: int, rank: int, src_idx: np.ndarray,
                    dst_idx: np.ndarray) -> list[np.ndarray]:
    """Reference reshard: decode rank ``rank``'s pool after pages ``src_idx -> dst_idx`` landed."""
    heads = full[0].shape[2]
    lo, hi = heads_of(heads, tp, rank)
    out = decode_pool(heads, tp, rank)
    for dst, src in zip(out, full):
        dst[dst_idx] = src[src_idx][:, :, lo:hi, :]
    return out


def geometry(pool: list[np.ndarray], heads: int) -> list[BufferGeometry]:
    return [BufferGeometry(name=f"{'kv'[i % 2]}.{i // 2}", num_items=b.shape[0], item_shape=b.shape[1:],
                           dtype=DType.FLOAT16, shard=ShardAxis(axis=1, total=heads)) for i, b in enumerate(pool)]


def regions(pool: list[np.ndarray]) -> list[MemoryRegion]:
    return [region_of(b) for b in pool]


@dataclass(frozen=True)
class Side:
    """One rank's pool as the planner needs it."""

    rank: Rank
    pool: list[np.ndarray]
    heads: int

    @property
    def geometry(self) -> list[BufferGeometry]:
        return geometry(self.pool, self.heads)


def make_transfer(src: Side, dst: Side, src_reg: RegisteredBuffers, dst_remote: RemoteBuffers, peer: str,
                  src_idx: np.ndarray, dst_idx: np.ndarray, room: int, notice: bytes) -> ComponentTransfer | None:
    """The ComponentTransfer ``src`` posts to ``dst`` for these pages (None when it writes nothing)."""
    segs = tuple(buffer_segments(s, d, src.rank, dst.rank) for s, d in zip(src.geometry, dst.geometry))
    if all(len(s) == 0 for s in segs):
        return None
    pairs = [BufferPair(sr.addr, sg.item_nbytes, sg.num_items, dr.addr, dg.item_nbytes, dg.num_items, seg)
             for sr, dr, sg, dg, seg in zip(src_reg.regions, dst_remote.regions, src.geometry, dst.geometry, segs)]
    plan = plan_transfer(pairs, src_idx, dst_idx)
    order = np.argsort(src_idx, kind="stable")
    return ComponentTransfer(room=room, component="kv", peer=peer, chunk=0, last=True, src=src_reg,
                             dst=dst_remote, plan=plan, notice=notice,
                             src_items=np.asarray(src_idx, np.int64)[order],
                             dst_items=np.asarray(dst_idx, np.int64)[order], segments=segs)


def request_pages(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Scattered, unsorted source and destination pages, with one adjacent run so merging is exercised."""
    rng = np.random.default_rng(seed)
    run_src, run_dst = np.array([5, 6, 7]), np.array([10, 11, 12])
    src = np.concatenate((run_src, rng.choice(np.setdiff1d(np.arange(SRC_PAGES), run_src), n - 3, replace=False)))
    dst = np.concatenate((run_dst, rng.choice(np.setdiff1d(np.arange(DST_PAGES), run_dst), n - 3, replace=False)))
    perm = rng.permutation(n)
    return src[perm].astype(np.int64), dst[perm].astype(np.int64)


def same_bytes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))

"""Host staging gather and scatter against a memcpy of the same bytes (issue 14's CPU goal: >= 0.7x).

GQA 8 KV heads x 128 x bf16, 16-token pages; per TP pair and page layout, the slice one prefill rank writes
into one decode rank, for as many pages as make 64 MiB of staged bytes (beyond the last-level cache, so that
the memcpy is not served from it), scattered over a pool half as large again. Times are CPU time of this
thread (the host is shared), best of 7, the candidates interleaved. "old" is the implementation before issue
14 (a fancy index, then an assignment), "new" ``kvbridge.staging``.

    .venv/bin/python scripts/staging_host_ratio.py              # torch imported (as in a serving engine)
    .venv/bin/python scripts/staging_host_ratio.py --no-torch   # numpy only
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

if "--no-torch" not in sys.argv:
    import torch

    torch.set_num_threads(1)

from kvbridge.geometry import BufferGeometry, DType, Rank, ShardAxis
from kvbridge.slicing import buffer_segments
from kvbridge.staging import Rows, gather_rows, regular_rows, scatter_rows

HEADS, DIM, PAGE = 8, 128, 16


def old_gather(buf: np.ndarray, r: Rows, items: np.ndarray, out: np.ndarray) -> None:
    src = buf.reshape(buf.shape[0], r.rows, r.src_stride)[items, :, r.src_col: r.src_col + r.cols]
    out.reshape(len(items), r.rows, r.cols)[...] = src


def old_scatter(buf: np.ndarray, r: Rows, items: np.ndarray, staged: np.ndarray) -> None:
    dst = buf.reshape(buf.shape[0], r.rows, r.dst_stride)
    dst[items, :, r.dst_col: r.dst_col + r.cols] = staged.reshape(len(items), r.rows, r.cols)


def measure(fns: dict[str, Callable[[], None]], reps: int = 7) -> dict[str, float]:
    t: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.process_time()
            f()
            t[k].append(time.process_time() - t0)
    return {k: min(v) for k, v in t.items()}


def geom(tp: int, layout: str) -> BufferGeometry:
    shape = (PAGE, HEADS // tp, DIM) if layout == "token-major" else (HEADS // tp, PAGE, DIM)
    return BufferGeometry(name="k", num_items=1, item_shape=shape, dtype=DType.BFLOAT16,
                          shard=ShardAxis(1 if layout == "token-major" else 0, HEADS))


def case(rng: np.random.Generator, layout: str, pt: int, dt: int, p: int, d: int) -> str:
    sg, dg = geom(pt, layout), geom(dt, layout)
    r = regular_rows(buffer_segments(sg, dg, Rank(p, pt), Rank(d, dt)), sg.item_nbytes, dg.item_nbytes)
    assert r is not None
    n = (64 << 20) // r.nbytes
    pool = n + n // 2
    src = rng.integers(0, 255, (pool, sg.item_nbytes), dtype=np.uint8)
    dst = np.zeros((pool, dg.item_nbytes), np.uint8)
    si, di = rng.permutation(pool)[:n].astype(np.int64), rng.permutation(pool)[:n].astype(np.int64)
    out = np.empty((n, r.nbytes), np.uint8)
    a, b = np.ones(out.nbytes, np.uint8), np.zeros(out.nbytes, np.uint8)
    t = measure({"memcpy": lambda: np.copyto(b, a),
                 "old gather": lambda: old_gather(src, r, si, out),
                 "new gather": lambda: gather_rows(src, r, si, out),
                 "old scatter": lambda: old_scatter(dst, r, di, out),
                 "new scatter": lambda: scatter_rows(dst, r, di, out)})
    gather_rows(src, r, si, out)
    dst[:] = 0
    scatter_rows(dst, r, di, out)
    exact = np.array_equal(dst.reshape(pool, r.rows, r.dst_stride)[di, :, r.dst_col:r.dst_col + r.cols],
                           src.reshape(pool, r.rows, r.src_stride)[si, :, r.src_col:r.src_col + r.cols])
    m = t["memcpy"]
    return (f"{layout:11s} TP {pt}->{dt}: {r.rows:2d} run(s)/page of {r.cols:5d} B, {out.nbytes >> 20:2d} MiB, "
            f"memcpy {out.nbytes / m / 1e9:4.1f} GB/s | gather old {m / t['old gather']:.2f}x new "
            f"{m / t['new gather']:.2f}x | scatter old {m / t['old scatter']:.2f}x new {m / t['new scatter']:.2f}x"
            f" | exact {exact}")


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"torch: {'yes' if 'torch' in sys.modules else 'no'}")
    for layout, pt, dt, p, d in (("token-major", 1, 1, 0, 0), ("token-major", 2, 1, 1, 0), ("token-major", 1, 2, 0, 1),
                                 ("token-major", 4, 2, 3, 1), ("token-major", 8, 1, 5, 0),
                                 ("head-major", 2, 1, 1, 0), ("head-major", 1, 2, 0, 1)):
        print(case(rng, layout, pt, dt, p, d))


if __name__ == "__main__":
    main()

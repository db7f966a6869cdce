"""What checksums cost on GPU memory, against a raw NIXL write of the same run (issue 24 item 4: the digests
should cost <= 5 % of a 1 GiB request's transfer).

Digests of a 1 GiB request (64 buffers: 32 layers x K/V, 512 pages of 16 tokens x 8 heads x 128 bf16, TP 1 -> 1,
whole pages, and the same pages' head slice of a TP 1 -> 2 pair) computed on cuda:0, timed to the digests on the
host, two ways in the same run: ``digest_buffers`` (what the agent calls: every buffer of a notice at once, one
fused Triton kernel per group of buffers where Triton is importable, one wait) and ``digest_items`` per buffer (the
unfused torch ops, a wait per buffer: what the agent did before). The baseline is raw NIXL writing 64 MiB from
cuda:0 in this process to cuda:1 in another one (``kvbridge_nixl.routes``, as ``kvbridge doctor`` measures it;
cuda:0 -> cuda:0 on a one-GPU machine, said in the output), scaled to 1 GiB. A request is digested twice, on the
prefill before its writes and on the decode after they landed (each on its own GPU), so the cost printed is one
side's digests over the transfer, and both sides' (the sum: their worst case, when neither overlaps the other).
Needs a CUDA device and NIXL.

    python scripts/gpu_checksum_cost.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvbridge.device_digests import _kernel, digest_buffers
from kvbridge.digests import digest_items, run_bytes
from kvbridge.slicing import Segments
from kvbridge_nixl import routes

BUFFERS, PAGES, PAGE_BYTES = 64, 512, 16 * 8 * 128 * 2


def digest_seconds(repeat: int, head_slice: bool, batched: bool) -> list[float]:
    views = [torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda:0") for _ in range(BUFFERS)]
    if head_slice:        # TP 1 -> 2, token-major pages: the first 4 of 8 heads of every token row
        row = PAGE_BYTES // 16
        seg = Segments(np.arange(16, dtype=np.int64) * row, np.arange(16, dtype=np.int64) * row // 2,
                       np.full(16, row // 2, np.int64))
    else:
        seg = Segments(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, PAGE_BYTES, np.int64))
    runs = run_bytes(seg, "src")
    items = np.random.default_rng(0).permutation(PAGES)
    check = np.concatenate([digest_items(v.cpu().numpy(), items, runs) for v in views[:2]])
    assert np.array_equal(digest_buffers(views[:2], items, [runs] * 2), check), "device digests differ from numpy's"
    times = []
    for attempt in range(repeat + 1):                  # the first warms up (weights, allocator, the kernel)
        torch.cuda.synchronize()
        started = time.perf_counter()
        if batched:
            digest_buffers(views, items, [runs] * len(views))
        else:
            for view in views:
                digest_items(view, items, runs)
        if attempt:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    gib = BUFFERS * PAGES * PAGE_BYTES / (1 << 30)
    dst = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    probe = routes._probe(0, "cuda:0", dst)
    assert "error" not in probe, probe
    transfer = gib * (1 << 30) / (probe["gbps"] * 1e9)
    print(f"{gib:.2f} GiB request, {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
          f"Triton kernel: {'yes' if _kernel() is not None else 'no (not importable)'}")
    print(f"raw NIXL cuda:0 -> {dst} (another process): {probe['gbps']:.1f} GB/s, {transfer * 1000:.2f} ms for it")
    for head_slice in (False, True):
        for batched in (True, False):
            d = statistics.median(digest_seconds(args.repeat, head_slice, batched))
            what = "digest_buffers (all buffers, one wait)" if batched else "digest_items per buffer (before)"
            runs = "head slice of each token row (TP 1 -> 2)" if head_slice else "whole pages"
            print(f"{runs}, {what}: median {d * 1000:.2f} ms = {100 * d / transfer:.1f} % of the transfer per side, "
                  f"{200 * d / transfer:.1f} % both sides")


if __name__ == "__main__":
    main()

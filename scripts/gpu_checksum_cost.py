"""What checksums cost on GPU memory, against a raw NIXL write of the same run (issue 24 item 4: the digests
should cost <= 5 % of a 1 GiB request's transfer).

Digests of a 1 GiB request (64 buffers: 32 layers x K/V, 512 pages of 16 tokens x 8 heads x 128 bf16, TP 1 -> 1,
whole pages) computed by ``kvbridge.digests.digest_items`` on cuda:0, timed to the digests on the host; the
baseline is raw NIXL writing 64 MiB from cuda:0 in this process to cuda:1 in another one
(``kvbridge_nixl.routes``, as ``kvbridge doctor`` measures it), scaled to 1 GiB. A request is digested twice, on
the prefill before its writes and on the decode after they landed, so the cost printed is both over the transfer.
Needs two CUDA devices and NIXL.

    python scripts/gpu_checksum_cost.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvbridge.digests import digest_items, run_bytes
from kvbridge.slicing import Segments
from kvbridge_nixl import routes

BUFFERS, PAGES, PAGE_BYTES = 64, 512, 16 * 8 * 128 * 2


def digest_seconds(repeat: int) -> list[float]:
    views = [torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda:0") for _ in range(BUFFERS)]
    runs = run_bytes(Segments(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, PAGE_BYTES, np.int64)), "src")
    items = np.random.default_rng(0).permutation(PAGES)
    times = []
    for attempt in range(repeat + 1):                  # the first warms up (weights, allocator)
        torch.cuda.synchronize()
        started = time.perf_counter()
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
    probe = routes._probe(0, "cuda:0", "cuda:1")
    assert "error" not in probe, probe
    transfer = gib * (1 << 30) / (probe["gbps"] * 1e9)
    digests = digest_seconds(args.repeat)
    d = statistics.median(digests)
    print(f"{gib:.2f} GiB request, {torch.cuda.get_device_name(0)} x2")
    print(f"raw NIXL cuda:0 -> cuda:1 (another process): {probe['gbps']:.1f} GB/s, {transfer * 1000:.2f} ms for it")
    print(f"digests of it on cuda:0: median {d * 1000:.2f} ms  {[round(t * 1000, 2) for t in digests]}")
    print(f"checksums (both sides) cost {100 * 2 * d / transfer:.0f} % of the raw transfer time")


if __name__ == "__main__":
    main()

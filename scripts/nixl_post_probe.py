"""What one NIXL ``transfer()`` (post) costs the calling process while K writes are already in flight, and whether
the call holds Python's GIL meanwhile (issue 22: a prefill's engine loop lost 99 % of its steps with 8-32 staged
64 MiB requests in flight, its profile dominated by 7-15 ms ``transfer()`` calls).

NIXL alone (``kvbridge_bench.raw_nixl``): a target process registers ``K x size`` bytes on GPU 1 (or the host);
the writer, on GPU 0, posts K writes of ``size`` back to back (each its own transfer), then waits for all. A
Python thread counts loop turns all along (``--no-busy-thread``: none): turns per millisecond while the main thread
is inside ``transfer()`` against the same thread's rate while the main thread sleeps tell whether the post releases
the GIL; the post's own time with and without that thread, and with ``--switch-interval-ms``, tell what getting the
GIL back costs a thread that made a GIL-releasing call while another thread runs Python.

    PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 scripts/nixl_post_probe.py [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any


def _alloc(nbytes: int, device: str) -> Any:
    import torch

    out = torch.ones(nbytes, dtype=torch.uint8, device=device)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out


def _target(conn: Any, nbytes: int, device: str) -> None:
    from kvbridge import region_of
    from kvbridge_bench.raw_nixl import RawNixl

    raw = RawNixl("probe-target")
    arr = _alloc(nbytes, device)
    region = region_of(arr)
    raw.register([region])
    conn.send({"metadata": raw.metadata(), "region": (region.addr, region.nbytes, region.device.value,
                                                      region.device_id)})
    conn.recv()
    raw.close()


class Counter(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.turns = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.turns += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--inflight", default="1,2,4,8,16,32")
    parser.add_argument("--no-busy-thread", action="store_true", help="no Python thread runs beside the posts")
    parser.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval for the run")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        import sys

        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    from kvbridge import DeviceKind, MemoryRegion, region_of
    from kvbridge_bench.raw_nixl import RawNixl, mem_type, rows

    size = args.size_mib << 20
    counts = [int(k) for k in args.inflight.split(",")]
    most = max(counts)
    src_dev, dst_dev = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, size * most, dst_dev), daemon=True)
    proc.start()
    target = parent.recv()
    addr, nbytes, kind, device_id = target["region"]
    dst = MemoryRegion(addr, nbytes, DeviceKind(kind), device_id)
    arr = _alloc(size * most, src_dev)
    counter = Counter()
    if not args.no_busy_thread:
        counter.start()
    results = []
    with RawNixl("probe-writer") as raw:
        src = region_of(arr)
        raw.register([src])
        peer = raw.add_peer(target["metadata"])
        for k in counts:
            for attempt in range(3):
                xfers = [raw.initialize(rows([src.addr + i * size], size, src.device_id), mem_type(src),
                                        rows([dst.addr + i * size], size, dst.device_id), mem_type(dst), peer)
                         for i in range(k)]
                t_sleep0, c_sleep0 = time.perf_counter(), counter.turns
                time.sleep(0.005)
                idle_rate = (counter.turns - c_sleep0) / (time.perf_counter() - t_sleep0) / 1e3
                post_ms, post_turns, states = [], [], []
                t0 = time.perf_counter()
                for xfer in xfers:
                    c0, p0 = counter.turns, time.perf_counter()
                    states.append(raw.post(xfer))
                    post_ms.append((time.perf_counter() - p0) * 1e3)
                    post_turns.append(counter.turns - c0)
                t_posted = time.perf_counter()
                for xfer, state in zip(xfers, states):
                    raw.finish(xfer, state)
                t_done = time.perf_counter()
                if attempt == 0:
                    continue                               # warm-up
                row = {"inflight": k, "size_mib": args.size_mib, "busy_thread": not args.no_busy_thread,
                       "switch_interval_ms": args.switch_interval_ms, "post_ms_median": statistics.median(post_ms),
                       "post_ms_max": max(post_ms), "post_ms_last": post_ms[-1],
                       "counter_turns_per_ms_idle": idle_rate,
                       "counter_turns_per_ms_in_post": sum(post_turns) / max(1e-9, sum(post_ms)),
                       "all_posted_ms": (t_posted - t0) * 1e3, "all_done_ms": (t_done - t0) * 1e3,
                       "gbps": k * size / (t_done - t0) / 1e9}
                results.append(row)
                print(json.dumps(row), flush=True)
        counter.stop = True
    parent.send("done")
    proc.join(30)


if __name__ == "__main__":
    main()

"""The demo launcher: a bootstrap server, Pt prefill and Dt decode rank processes, a progress bar, a summary."""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TextIO

import numpy as np

from kvbridge.demo.presets import get_preset
from kvbridge.demo.worker import WorkerConfig, reap_segments, run_worker
from kvbridge.wire import Role
from kvbridge.zmq_link import BootstrapServer


@dataclass(kw_only=True)
class Summary:
    requests: int
    verified: int = 0
    failed: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bytes: int = 0
    descriptors: int = 0
    latencies: list[float] = field(default_factory=list)
    transfers: list[float] = field(default_factory=list)      # per (request, prefill rank): first chunk -> Success
    wall_s: float = 0.0
    crashed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verified == self.requests and not (self.failed or self.mismatched or self.crashed)


def default_backend() -> str:
    """NIXL when it is installed and usable here, else the built-in loopback."""
    from kvbridge.registry import Registry

    return "nixl" if "nixl" in Registry.build().backend_names() else "loopback"


def run_demo(*, backend: str, preset: str, prefill_tp: int, decode_tp: int, requests: int, seed: int,
             window: int = 4, region_pages: int = 24, timeout_s: float = 300.0, dump: str | None = None,
             out: TextIO = sys.stdout) -> Summary:
    model = get_preset(preset)
    model.check_tp(prefill_tp, decode_tp)
    server = BootstrapServer().start()
    base = WorkerConfig(role=Role.PREFILL, rank=0, prefill_tp=prefill_tp, decode_tp=decode_tp, preset=preset,
                        backend=backend, bootstrap=server.address, requests=requests, seed=seed,
                        window=window, region_pages=region_pages, timeout_s=timeout_s, dump=dump)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    configs = [replace(base, role=Role.PREFILL, rank=r) for r in range(prefill_tp)]
    configs += [replace(base, role=Role.DECODE, rank=r) for r in range(decode_tp)]
    procs = [ctx.Process(target=run_worker, args=(c, results), name=f"{c.role.value}{c.rank}", daemon=True)
             for c in configs]
    summary = Summary(requests=requests)
    per_request: dict[int, list[tuple[bool, int, float, int, str]]] = {}
    finished = 0
    print(f"kvbridge demo: {model.description}", file=out)
    print(f"  backend {backend}, prefill TP {prefill_tp} -> decode TP {decode_tp}, {requests} requests, seed {seed}",
          file=out)
    started = time.perf_counter()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30
        while finished < len(procs):
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead and len(summary.crashed) < len(dead):
                    summary.crashed.extend(f"{n} exited with an error" for n in dead if n not in summary.crashed)
                    break
                if time.monotonic() > deadline:
                    summary.crashed.append(f"timed out after {timeout_s} s")
                    break
                continue
            kind = msg[0]
            if kind == "received":
                _, rank, index, ok, bad, latency, nbytes, reason = msg
                per_request.setdefault(index, []).append((ok, bad, latency, nbytes, reason))
                if len(per_request[index]) == decode_tp:
                    _settle(summary, index, per_request[index])
                    _progress(summary, out)
            elif kind == "sent":
                _, rank, index, ok, nbytes, descriptors, reason, transfer_s = msg
                summary.bytes += nbytes
                summary.descriptors += descriptors
                if ok:
                    summary.transfers.append(transfer_s)
            elif kind == "crashed":
                summary.crashed.append(f"{msg[1]} rank {msg[2]}: {msg[3]}")
                finished += 1
            elif kind == "finished":
                finished += 1
        summary.wall_s = time.perf_counter() - started
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            if p.pid is not None:
                reap_segments(p.pid)     # a rank that crashed or was killed cannot unlink its own
        server.close()
        results.close()
    print(file=out)
    _print_summary(summary, out)
    return summary


def _settle(summary: Summary, index: int, reports: list[tuple[bool, int, float, int, str]]) -> None:
    if not all(ok for ok, *_ in reports):
        summary.failed.append(f"request {index}: " + "; ".join(r[4] for r in reports if not r[0]))
    elif any(bad for _, bad, *_ in reports):
        summary.mismatched.append(f"request {index}: {sum(r[1] for r in reports)} bytes differ")
    else:
        summary.verified += 1
    summary.latencies.append(max(r[2] for r in reports))


def _progress(summary: Summary, out: TextIO) -> None:
    done = len(summary.latencies)
    width = 30
    fill = int(width * done / max(1, summary.requests))
    print(f"\r  [{'#' * fill}{'.' * (width - fill)}] {done}/{summary.requests} requests", end="", file=out, flush=True)


def _print_summary(s: Summary, out: TextIO) -> None:
    lat = np.array(s.latencies) * 1000 if s.latencies else np.zeros(1)
    gbps = s.bytes / s.wall_s / 1e9 if s.wall_s else 0.0
    print(f"  requests     {len(s.latencies)}/{s.requests} completed, {len(s.failed)} failed", file=out)
    xfer = np.array(s.transfers) * 1000 if s.transfers else np.zeros(1)
    print(f"  bytes        {s.bytes / 1e6:.1f} MB moved; run took {s.wall_s:.2f} s ({gbps:.2f} GB/s including "
          "computing and checking the reference pattern of every byte)", file=out)
    print(f"  transfer     p50 {np.percentile(xfer, 50):.2f} ms, p99 {np.percentile(xfer, 99):.2f} ms per request and "
          "prefill rank (first chunk posted -> every byte landed and notified)", file=out)
    print(f"  latency      p50 {np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms per request "
          "(decode asks -> decode has it all; includes the prefill computing its pages)", file=out)
    print(f"  descriptors  {s.descriptors} ({s.descriptors / max(1, s.requests):.1f} per request)", file=out)
    print(f"  verified: {s.verified}/{s.requests} byte-exact", file=out)
    for line in (s.crashed + s.failed + s.mismatched)[:10]:
        print(f"  ! {line}", file=out)

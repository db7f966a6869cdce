"""Profiling probe for issue 14 (not a benchmark): 128-token request latency per staging mode, or a 1 GiB
same-TP sweep; run under py-spy to see where a request's fixed cost goes.

    PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 scripts/probe_latency.py cuda latency 200 never,always,auto
    PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 scripts/probe_latency.py cuda sweep 10 scattered
    (sweep: PROBE_SIZE_MIB, default 1024, PROBE_PIECE_MIB, staged pieces, default the agent's, PROBE_STAGING_MIB,
    default 1200, and PROBE_LATENCY_REQUESTS, default 20)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from kvbridge.zmq_link import BootstrapServer
from kvbridge_bench import transfer as bt


def main() -> None:
    device, what, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["auto"]
    plugins = tuple(p for p in os.environ.get("PROBE_PLUGINS", "").split(",") if p)
    poll = float(os.environ.get("PROBE_POLL_S", "0"))
    dev, _why = bt.detect_device(device)
    backend = bt.choose_backend(None, dev, plugins)
    if what == "sweep":
        placements = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else None
        piece = int(os.environ["PROBE_PIECE_MIB"]) if os.environ.get("PROBE_PIECE_MIB") else None
        size = int(os.environ.get("PROBE_SIZE_MIB", "1024")) << 20
        opts = bt.Options(device=device, sizes=(size,), tp_pairs=((1, 1),), layouts=("token-major",),
                          page_tokens=(16,), repeats=count,
                          latency_requests=int(os.environ.get("PROBE_LATENCY_REQUESTS", "20")),
                          staging_mib=int(os.environ.get("PROBE_STAGING_MIB", "1200")), plugins=plugins,
                          placements=placements, piece_mib=piece)
        result = bt.run(opts)
        print(bt.format_report(result), flush=True)
        for case in result["cases"]:
            post = [round(x * 1e3, 3) for x in case.get("post_s") or []]
            print(f"{case['case']}: median {case.get('median_s', 0) * 1e3:.3f} ms, post_ms {post}", flush=True)
        return
    for mode in modes:
        opts = bt.Options(device=device, staging_mode=mode, staging_mib=64, latency_requests=count, plugins=plugins)
        r = dataclasses.replace(bt.resolve_options(opts, dev, backend), poll_s=poll)
        server = BootstrapServer().start()
        ranks = bt.Ranks(r, 1, 1, bt._devices(dev), plugins, 120)
        try:
            res = bt.Bench(r, ranks, server.address, sys.stdout).latency(count)
        finally:
            ranks.close()
            server.close()
        keys = ("p50_ms", "p99_ms", "baseline_ms", "raw_transfer_ms", "control_rtt_ms", "error", "failed")
        print(mode, json.dumps({k: res.get(k) for k in keys}), flush=True)


if __name__ == "__main__":
    main()

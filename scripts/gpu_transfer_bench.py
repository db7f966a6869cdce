"""Issue 14's GPU measurements in one command, for a host with two NVIDIA GPUs (H100/H200, NVLink):

    KVBRIDGE_REV=<rev> PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 scripts/gpu_transfer_bench.py --out DIR

needs torch with CUDA, ``nixl`` + ``nixl-cu13`` (or ``nixl-cu12``, matching torch's CUDA), ``msgspec``, ``pyzmq``,
``pluggy``, ``numpy`` and, for the plots, ``matplotlib``; kvbridge itself comes from this source tree (no install).
Takes 3-6 minutes; a time budget (``--budget``, default 300 s) skips the sweep's remaining cases beyond it and
says so, and no step may take more than ``--timeout`` (90 s), so the whole run stays under 8 minutes.

1. ``kvbridge bench transfer`` on the GPUs (prefill ranks on GPU 0, decode ranks on GPU 1, NIXL VRAM): the
   issue's "before" cases first (4 GiB requests of a 32-layer GQA pool, 16-token token-major pages: same TP
   contiguous and scattered, prefill TP 2 -> decode TP 1 scattered with ``--staging-mib`` of staging (5 GiB
   when not given, as measured before; a smaller area stages through rings), the sweep (1 GiB requests,
   16- and 64-token pages, TP 1-1, 2-1, 1-2, 4-2, token- and head-major, scattered, + contiguous for 1-1),
   128-token latency, layer-wise streaming, and last TP 2 -> 1 with staging off (4.2M per-token descriptors).
2. ``kvbridge_bench.nixl_backend`` (``kvbridge bench --backend nixl``) two-process GPU 0 -> GPU 1, 64 layers x
   255 pages of 32 KiB: 1 GiB as one descriptor and as 32,640 scattered ones (the issue's first two rows).
3. ``gpu-before-after.md``: the issue's table, today's numbers next to the new ones (ratios to the same run's
   raw NIXL and copy; no fixed targets).

Writes into DIR (at most 8 files): gpu-transfer.json, gpu-throughput-vs-page.png, gpu-throughput-vs-tp.png,
gpu-layerwise-timeline.png, gpu-nixl-plugin-1GiB.json, gpu-before-after.md. ``--device cpu`` is a small dry run
of the same steps on host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvbridge_bench import transfer as bt

GIB = 1 << 30
#: the issue's table as measured on main, 2026-11-26, 2x H200 (NV18), two processes, torch 2.11 cu130, nixl-cu13 1.5.1
BEFORE = {
    "plugin-contiguous": ("kvbridge_nixl.bench, 1 GiB, 1 descriptor, GPU0->GPU1",
                          "267 GB/s; raw NIXL 264 GB/s; torch copy 396 GB/s"),
    "plugin-paged": ("same, 1 GiB in 32,640 scattered 32 KiB descriptors", "3.98 GB/s; raw NIXL prepped 3.18 GB/s"),
    "same TP contiguous": ("agent, 4 GiB, same TP, contiguous (64 descs)", "120 GB/s (0.45x raw NIXL)"),
    "same TP scattered": ("agent, 4 GiB, same TP, scattered (131,072 descs)", "6.3 GB/s (0.024x)"),
    "TP 2->1 staged": ("agent, 4 GiB, prefill TP 2 -> decode TP 1, scattered, staged (2 descs)", "75 GB/s (0.28x)"),
    "TP 2->1 per-token": ("agent, 4 GiB, prefill TP 2 -> decode TP 1, per-token descriptors (4.2M)", "0.26 GB/s"),
    "host staging": ("CPU host (2-core CI class): staging gather / scatter",
                     "5.0 / 4.3 GB/s; memcpy 14.7 GB/s (0.34x / 0.29x)"),
}


def issue_cases(dry: bool, staging_bytes: int | None,
                piece_bytes: int | None = None) -> tuple[tuple[bt.Case, ...], tuple[bt.Case, ...]]:
    """(cases before the sweep, cases after it): the shapes of scripts/gpu_nixl_check.py's four configs."""
    tokens, pool, layers = (32768, 2304 * 16, 32) if not dry else (512, 36 * 16, 4)
    common: dict[str, Any] = {"group": "issue14", "tokens": tokens, "page": 16, "layers": layers,
                              "layout": "token-major", "pool_tokens": pool, "repeats": 3, "piece_bytes": piece_bytes}
    first = (bt.Case(**common, prefill_tp=1, decode_tp=1, placement="contiguous", label="same TP contiguous"),
             bt.Case(**common, prefill_tp=1, decode_tp=1, placement="scattered", label="same TP scattered",
                     staging_bytes=staging_bytes),
             bt.Case(**common, prefill_tp=2, decode_tp=1, placement="scattered",
                     staging_bytes=staging_bytes or ((5 * GIB) if not dry else (64 << 20)), label="TP 2->1 staged"))
    last = (bt.Case(**{**common, "repeats": 1}, prefill_tp=2, decode_tp=1, placement="scattered", staging_bytes=0,
                    warmup=False, label="TP 2->1 per-token"),)
    return first, last


def plugin_bench(dry: bool) -> dict[str, Any]:
    from kvbridge_bench.nixl_backend import run_bench

    if dry:
        return run_bench(layers=4, pages=15, page_kib=32, pool_pages=20, repeats=2, device="cpu", two_process=True)
    return run_bench(layers=64, pages=255, page_kib=32, pool_pages=320, repeats=5, device="cuda:0",
                     dst_device="cuda:1", two_process=True)


def _gbps(c: dict[str, Any] | None) -> str:
    if not c:
        return "not measured"
    if c.get("error"):
        return "FAILED: " + c["error"].splitlines()[0][:80]
    ratio = f" ({c['vs_raw_nixl']:.3f}x raw NIXL)" if c.get("vs_raw_nixl") else ""
    return f"{c['gbps']:.2f} GB/s{ratio}, {c['descriptors']:,} descs, verified={c.get('verified')}"


def before_after(result: dict[str, Any], plugin: dict[str, Any] | None) -> str:
    m = result["machine"]
    gpus = "; ".join(m.get("gpus") or []) or m["cpu"]
    by_label = {c["label"]: c for c in result["cases"] if c.get("group") == "issue14"}
    after: dict[str, str] = {k: _gbps(by_label.get(k)) for k in
                             ("same TP contiguous", "same TP scattered", "TP 2->1 staged", "TP 2->1 per-token")}
    if plugin and "cases" in plugin:
        for key, name in (("plugin-contiguous", "contiguous"), ("plugin-paged", "paged")):
            c = plugin["cases"].get(name)
            if c:
                g = c["gbps"]
                after[key] = (f"{g['kvbridge']:.2f} GB/s; raw NIXL prepped {g['raw_prepped']:.2f} GB/s; copy "
                              f"{g['memcpy']:.2f} GB/s ({c['descriptors']:,} descs, kvbridge/raw "
                              f"{c['kvbridge_over_raw']:.3f})")
    elif plugin:
        after["plugin-contiguous"] = after["plugin-paged"] = plugin.get("error", "not run")
    hs = result.get("host_staging") or {}
    if "gather_gbps" in hs:
        after["host staging"] = (f"this host's CPU (not the CI class): {hs['gather_gbps']:.1f} / "
                                 f"{hs['scatter_gbps']:.1f} GB/s; memcpy {hs['memcpy_gbps']:.1f} GB/s "
                                 f"({hs['gather_vs_memcpy']:.2f}x / {hs['scatter_vs_memcpy']:.2f}x)")
    lines = [f"# Issue 14: before / after ({m['date']})", "",
             f"After: {gpus}; link GPU0<->GPU1 {m.get('link')}; "
             f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}; git {m.get('git')}; "
             f"command `{m['command']}`.", "",
             "Before: main on 2026-11-26, 2x H200 (NV18), two processes, torch 2.11 cu130, nixl-cu13 1.5.1 "
             "(issue 14's table).", "",
             "| case | before | after (same run's raw NIXL, 1 descriptor, as the reference) |", "|---|---|---|"]
    for key, (name, before) in BEFORE.items():
        lines.append(f"| {name} | {before} | {after.get(key, 'not measured')} |")
    lines += ["", "## Every case", "", "```", bt.format_report(result), "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON, PNG and markdown files")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a small dry run")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds after which sweep cases are skipped")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds any one step may take")
    parser.add_argument("--skip-plugin-bench", action="store_true")
    parser.add_argument("--staging-mib", type=int, default=None,
                        help="staging area per rank for the sweep and the same-TP scattered case (default: the "
                             "agent's); a request is staged only when its slice fits the decode's area")
    parser.add_argument("--piece-mib", type=int, default=None,
                        help="staged pieces of at most this many MiB (default: the agent's staging_piece_bytes)")
    args = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = args.device == "cpu"
    tag = "cpu" if dry else "gpu"
    staging_mib = args.staging_mib if not dry or args.staging_mib is None else min(args.staging_mib, 64)
    piece = None if args.piece_mib is None else args.piece_mib << 20
    first, last = issue_cases(dry, None if staging_mib is None else staging_mib << 20, piece)
    opts = bt.Options(device=args.device, backend="nixl", layerwise=True, json_path=str(out / f"{tag}-transfer.json"),
                      plots=str(out), plugins=("kvbridge_nixl",), extra_cases=first, last_cases=last,
                      budget_s=args.budget, timeout_s=args.timeout, quick=dry, latency_requests=10 if dry else None,
                      staging_mib=staging_mib, piece_mib=args.piece_mib,
                      command="PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 " + " ".join(sys.argv))
    result = bt.run(opts)
    print(bt.format_report(result), flush=True)
    bt.write_outputs(result, opts)
    plugin: dict[str, Any] | None = None
    if not args.skip_plugin_bench:
        if time.perf_counter() - started > args.budget + 100:
            plugin = {"error": "skipped: the sweep used the time budget"}
        else:
            print("kvbridge_bench.nixl_backend, two processes, 1 GiB as 1 and as 32,640 descriptors", flush=True)
            try:
                plugin = plugin_bench(dry)
            except Exception as exc:  # noqa: BLE001 - report it in the table, keep the sweep's files
                plugin = {"error": f"{type(exc).__name__}: {exc}"}
            (out / f"{tag}-nixl-plugin-1GiB.json").write_text(json.dumps(plugin, indent=1) + "\n")
    md = before_after(result, plugin)
    (out / f"{tag}-before-after.md").write_text(md)
    print(md)
    print(f"total {time.perf_counter() - started:.0f} s; files in {out}: {sorted(p.name for p in out.iterdir())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

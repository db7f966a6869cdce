"""The ``kvbridge`` command: ``plugins``, ``demo``, ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _plugins(args: argparse.Namespace) -> int:
    from kvbridge.registry import Registry

    records = Registry.build().records()
    if args.json:
        print(json.dumps([r.as_json() for r in records], indent=2))
        return 0
    rows = [("NAME", "KIND", "DISTRIBUTION", "VERSION", "STATUS", "CAPABILITIES / REASON")]
    for r in records:
        detail = ", ".join(r.capabilities) if r.status.value == "available" else r.reason.splitlines()[0][:90]
        if r.hint and r.status.value == "unavailable":
            detail += f" (hint: {r.hint})"
        rows.append((r.name, r.kind.value if r.kind else "?", r.distribution, r.version, r.status.value, detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5])
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvbridge.demo.run import default_backend, run_demo
    from kvbridge.errors import KVBridgeError

    backend = args.backend or default_backend()
    try:
        summary = run_demo(backend=backend, preset=args.model, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                           requests=args.requests, seed=args.seed, window=args.window, timeout_s=args.timeout,
                           dump=args.dump)
    except (KVBridgeError, ValueError) as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return 2
    return 0 if summary.ok else 1


def _bench(args: argparse.Namespace) -> int:
    from kvbridge import bench
    from kvbridge.bench_transfer import TRANSFER_ARGS

    if args.what == "transfer":
        return bench.main_transfer(args)
    given = [name for name in TRANSFER_ARGS if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + {"json_path": "json"}.get(n, n).replace("_", "-") for n in given)
        print(f"kvbridge bench: {flags} apply to `kvbridge bench transfer` only", file=sys.stderr)
        return 2
    if args.backend:
        return bench.main_backend(args.backend)
    return {"planner": bench.main_planner, "control": bench.main_control}[args.what]()


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.bench_transfer import add_arguments as add_transfer_arguments

    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list installed backends and state types, and whether they run here")
    p.add_argument("--json", action="store_true", help="machine-readable list")
    p.set_defaults(func=_plugins)
    d = sub.add_parser("demo", help="run prefill and decode rank processes on this host and verify every byte")
    d.add_argument("--backend", default=None, help="transfer backend (default: nixl if usable, else loopback)")
    d.add_argument("--model", default="dense-gqa",
                   help="model preset: dense-gqa, dense-gqa-headmajor, mla, qwen3-next, swa, deepseek-v32")
    d.add_argument("--prefill-tp", type=int, default=2)
    d.add_argument("--decode-tp", type=int, default=1)
    d.add_argument("--requests", type=int, default=32)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--window", type=int, default=4, help="requests in flight per rank")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is declared hung")
    d.add_argument("--dump", default=None, metavar="DIR", help="write decode buffers and indices as .npy")
    d.set_defaults(func=_demo)
    b = sub.add_parser("bench", help="benchmarks, printed as ratios against a baseline of the same run")
    b.add_argument("what", nargs="?", choices=("planner", "control", "transfer"), default="planner",
                   help="planner, control, or transfer (kvbridge end to end vs raw NIXL and a copy; JSON, plots)")
    b.add_argument("--backend", default=None,
                   help="run this backend plugin's benchmark instead; with `transfer`: the backend kvbridge uses "
                        "(default nixl when usable, else loopback)")
    add_transfer_arguments(b)
    b.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

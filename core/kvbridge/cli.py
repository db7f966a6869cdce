"""The ``kvbridge`` command: ``plugins``, ``demo``, ``bench``.

Exit codes: 0 success; 1 verification failure (a byte differs); 2 a backend or state type is not installed or
cannot run here (with the reason and what to install); 3 transfer failure (a request failed, a rank died,
the run timed out); 64 usage error (unknown flag, bad value, TP sizes the model forbids).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_OK, EXIT_MISMATCH, EXIT_UNAVAILABLE, EXIT_TRANSFER, EXIT_USAGE = 0, 1, 2, 3, 64


class _Parser(argparse.ArgumentParser):
    """argparse with the usage error's exit code (64, EX_USAGE) instead of 2, which means "unavailable"."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _plugins(args: argparse.Namespace) -> int:
    from kvbridge.registry import Registry

    records = Registry.build().records()
    if args.json:
        print(json.dumps([r.as_json() for r in records], indent=2))
        return 0
    rows = [("NAME", "KIND", "DISTRIBUTION", "VERSION", "STATUS", "CAPABILITIES / REASON")]
    for r in records:
        detail = ", ".join(r.capabilities) if r.status.value == "available" else " ".join(r.reason.split())
        if r.hint and r.status.value == "unavailable":
            detail += f" (hint: {r.hint})"
        rows.append((r.name, r.kind.value if r.kind else "?", r.distribution, r.version, r.status.value, detail))
    print(format_table(rows, width=_width()))
    return 0


def _width() -> int:
    """The terminal's width; 100 columns for a pipe or a file (COLUMNS overrides both)."""
    return shutil.get_terminal_size((100, 24)).columns


def format_table(rows: Sequence[Sequence[str]], width: int = 100, min_last: int = 40) -> str:
    """Columns padded to their widest cell; the last column wraps at word boundaries to fit ``width`` (at
    least ``min_last`` wide) with its continuation lines under it, so nothing is cut."""
    head = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    indent = sum(head) + 2 * len(head)
    room = max(min_last, width - indent)
    lines = []
    for row in rows:
        lead = "  ".join(cell.ljust(w) for cell, w in zip(row, head)) + "  "
        parts = textwrap.wrap(row[-1], room, break_on_hyphens=False, break_long_words=True) or [""]
        lines.append((lead + parts[0]).rstrip())
        lines += [" " * indent + part for part in parts[1:]]
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from kvbridge.demo.run import default_backend, run_demo
    from kvbridge.errors import KVBridgeError, PluginError
    from kvbridge.settings import load_settings

    def stop(signum: int, _frame: Any) -> NoReturn:
        raise SystemExit(128 + signum)        # run_demo's cleanup stops and reaps every rank

    signal.signal(signal.SIGTERM, stop)
    try:
        settings = load_settings(args.config, check_backend=False)
        backend = args.backend or settings.backend or default_backend()
        summary = run_demo(backend=backend, preset=args.model, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                           requests=args.requests, seed=args.seed, window=args.window, timeout_s=args.timeout,
                           dump=args.dump, metrics_port=args.metrics_port or settings.metrics_port,
                           settings_file=args.config)
    except PluginError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (KVBridgeError, ValueError) as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return summary.exit_code


def _bench(args: argparse.Namespace) -> int:
    from kvbridge import bench, bench_flood, bench_transfer
    from kvbridge.bench_transfer import TRANSFER_ARGS

    if args.what == "transfer":
        return bench_transfer.main(args)
    given = [name for name in TRANSFER_ARGS if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + {"json_path": "json"}.get(n, n).replace("_", "-") for n in given)
        print(f"kvbridge bench: {flags} apply to `kvbridge bench transfer` only", file=sys.stderr)
        return 2
    if args.backend:
        return bench.main_backend(args.backend)
    if args.what == "flood":
        return bench_flood.main()
    return {"planner": bench.main_planner, "control": bench.main_control}[args.what]()


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.bench_transfer import add_arguments as add_transfer_arguments

    parser = _Parser(prog="kvbridge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvbridge {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list installed backends and state types, and whether they run here")
    p.add_argument("--json", action="store_true", help="machine-readable list")
    p.set_defaults(func=_plugins)
    d = sub.add_parser("demo", help="run prefill and decode rank processes on this host and verify every byte")
    d.add_argument("--backend", default=None,
                   help="transfer backend (default: the settings' backend, else nixl if usable, else loopback)")
    d.add_argument("--model", default="dense-gqa",
                   help="model preset: dense-gqa, dense-gqa-headmajor, mla, qwen3-next, swa, deepseek-v32")
    d.add_argument("--prefill-tp", type=int, default=2)
    d.add_argument("--decode-tp", type=int, default=1)
    d.add_argument("--requests", type=int, default=32)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--window", type=int, default=4, help="requests in flight per rank")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is declared hung")
    d.add_argument("--dump", default=None, metavar="DIR", help="write decode buffers and indices as .npy")
    d.add_argument("--config", default=None, metavar="FILE",
                   help="TOML settings of the ranks' agents (default: $KVBRIDGE_CONFIG; KVBRIDGE_* variables too); "
                        "see README Configuration")
    d.add_argument("--metrics-port", type=int, default=0, metavar="N",
                   help="serve the ranks' Prometheus metrics on 127.0.0.1:N while the demo runs "
                        "(needs kvbridge[metrics])")
    d.set_defaults(func=_demo)
    b = sub.add_parser("bench", help="benchmarks, printed as ratios against a baseline of the same run")
    b.add_argument("what", nargs="?", choices=("planner", "control", "transfer", "flood"), default="planner",
                   help="planner, control, transfer (kvbridge end to end vs raw NIXL and a copy; JSON, plots), or "
                        "flood (healthy requests' latency under 10 s of bad-MAC frames at 10k/s, vs a baseline)")
    b.add_argument("--backend", default=None,
                   help="run this backend plugin's benchmark instead; with `transfer`: the backend kvbridge uses "
                        "(default nixl when usable, else loopback)")
    add_transfer_arguments(b)
    b.set_defaults(func=_bench)
    return parser


def _version() -> str:
    import kvbridge

    return str(kvbridge.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

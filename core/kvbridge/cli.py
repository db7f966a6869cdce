"""The ``kvbridge`` command: ``plugins``, ``demo``, and the commands other distributions add through the
``kvbridge.cli`` entry point group (``bench``, from ``kvbridge-bench``).

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
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_OK, EXIT_MISMATCH, EXIT_UNAVAILABLE, EXIT_TRANSFER, EXIT_USAGE = 0, 1, 2, 3, 64

#: Entry point group of subcommands other distributions add: each entry point names a callable that takes the
#: ``kvbridge`` parser's subparsers and adds one subparser of the entry point's name (with ``func`` set).
COMMAND_GROUP = "kvbridge.cli"
#: Commands that live in another distribution, and what to install for them.
ELSEWHERE = {"bench": "kvbridge-bench"}


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

    drain = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        if drain.is_set():
            raise SystemExit(128 + signum)    # the second one: run_demo's cleanup stops and reaps every rank
        drain.set()                           # the first one: run_demo drains every rank (EXIT_TERMINATED)

    signal.signal(signal.SIGTERM, stop)
    try:
        settings = load_settings(args.config, check_backend=False)
        backend = args.backend or settings.backend or default_backend()
        summary = run_demo(backend=backend, preset=args.model, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                           requests=args.requests, seed=args.seed, window=args.window, timeout_s=args.timeout,
                           dump=args.dump, metrics_port=args.metrics_port or settings.metrics_port,
                           metrics_host=settings.metrics_host,
                           settings_file=args.config, drain_on=drain, trace=args.trace)
    except PluginError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (KVBridgeError, ValueError) as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return summary.exit_code


def _doctor(args: argparse.Namespace) -> int:
    from kvbridge.doctor import exit_status, run_checks, serve_probe

    if args.serve_probe:
        try:
            served = serve_probe(address=args.serve_probe, seconds=args.serve_s)
        except Exception as exc:  # noqa: BLE001 - a bad address or no backend that can: said, not a traceback
            print(f"kvbridge doctor: cannot serve probes: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"answered {served} probe(s)")
        return 0
    findings = run_checks(bootstrap=args.bootstrap, ranks=args.ranks, port_range=args.port_range,
                          instance=args.instance, probe_peers=args.probe_peer)
    for finding in findings:
        print(finding.line())
    return exit_status(findings)


def _not_installed(name: str, dist: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        print(f"kvbridge {name}: the {name!r} command comes with the {dist} distribution, which is not installed "
              f"here: pip install {dist}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return run


def _add_commands(sub: Any, builtin: set[str]) -> None:
    """Add the subcommands of the ``kvbridge.cli`` entry points; one that fails to load or names a built-in
    command is reported on stderr and left out (the other commands keep working). A command of
    :data:`ELSEWHERE` that nothing added answers with what to install."""
    import importlib.metadata as md

    seen: set[tuple[str, str]] = set()
    for ep in sorted(md.entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        if (ep.name, ep.value) in seen:           # the same distribution seen twice on the path: not a conflict
            continue
        seen.add((ep.name, ep.value))
        if ep.name in builtin or ep.name in sub.choices:
            print(f"kvbridge: ignoring the {ep.name!r} command of entry point {ep.value!r}: a command of that name "
                  "exists already", file=sys.stderr)
            continue
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - a broken extension must not take the core commands down
            sub.choices.pop(ep.name, None)
            print(f"kvbridge: the {ep.name!r} command ({ep.value}) could not be loaded: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            continue
        if ep.name not in sub.choices:
            print(f"kvbridge: entry point {ep.value!r} added no {ep.name!r} command", file=sys.stderr)
    for name, dist in ELSEWHERE.items():
        if name not in sub.choices:
            p = sub.add_parser(name, help=f"not installed here: pip install {dist}", add_help=False)
            p.set_defaults(func=_not_installed(name, dist), any_arguments=True)


def build_parser() -> argparse.ArgumentParser:
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
    d.add_argument("--trace", default=None, metavar="FILE",
                   help="write one OpenTelemetry trace per request (every rank's spans, one JSON line each) to FILE "
                        "and print the first request's (needs kvbridge[tracing])")
    d.set_defaults(func=_demo)
    doc = sub.add_parser("doctor", help="check this host (and a bootstrap server) for what makes transfers slow or "
                                        "fail; exit status 1 on a warning, 2 on an error")
    doc.add_argument("--bootstrap", default=None, metavar="URL",
                     help="the ranks' discovery: a ZMQ bootstrap server (tcp://HOST:PORT: reachable, and how far its "
                          "clock is from ours) or a plugin's service (etcd://HOST:PORT/...: installed, answering)")
    doc.add_argument("--port-range", default=None, metavar="LOW-HIGH",
                     help="the ranks' control-link port range: how many of its ports are free here")
    doc.add_argument("--instance", default=None, metavar="NAME",
                     help="with --bootstrap: the prefill instance whose ranks this host's decodes use (each rank's "
                          "control port reachable from here)")
    doc.add_argument("--ranks", type=int, default=1, help="ranks this host runs (each with its staging area)")
    doc.add_argument("--probe-peer", action="append", default=[], metavar="URL",
                     help="another host's probe server (tcp://HOST:PORT, started there with --serve-probe): which "
                          "transport the backend picks towards it and how fast it writes (repeatable)")
    doc.add_argument("--serve-probe", default=None, metavar="URL",
                     help="answer other hosts' --probe-peer at this address (tcp://HOST:PORT) instead of checking; "
                          "each probe writes into scratch memory of its own, nothing else of this host")
    doc.add_argument("--serve-s", type=float, default=300.0, metavar="SECONDS",
                     help="with --serve-probe: how long to answer (default 300)")
    doc.set_defaults(func=_doctor)
    _add_commands(sub, {"plugins", "demo", "doctor"})
    return parser


def _version() -> str:
    import kvbridge

    return str(kvbridge.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_arguments", False):    # only a not-installed command takes any
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func = getattr(args, "func", None)
    if func is None:                                            # an extension's parser that set no func
        parser.error(f"the {args.command!r} command has nothing to run (its distribution set no func)")
    return int(func(args))


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvbridge bench``: the subcommand the core's ``kvbridge`` command finds through the ``kvbridge.cli`` entry
point group (:func:`add_command`), and ``python -m kvbridge_bench`` (:func:`main`, the same options).

Exit codes as ``kvbridge``'s: 0 success, 1 a case failed or a byte differs, 2 a bad option of a benchmark or a
backend without a benchmark, 64 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvbridge_bench import flood, micro, transfer

EXIT_USAGE = 64
WHAT = ("planner", "control", "transfer", "flood")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvbridge bench`` (its positional ``what`` and every benchmark's flags)."""
    parser.add_argument("what", nargs="?", choices=WHAT, default="planner",
                        help="planner, control, transfer (kvbridge end to end vs raw NIXL and a copy; JSON, plots), "
                             "or flood (healthy requests' latency under 10 s of bad-MAC frames at 10k/s, vs a "
                             "baseline)")
    parser.add_argument("--backend", default=None,
                        help="run this backend's benchmark instead; with `transfer`: the backend kvbridge uses "
                             "(default nixl when usable, else loopback)")
    transfer.add_arguments(parser)


def add_command(sub: Any) -> argparse.ArgumentParser:
    """Entry point ``kvbridge.cli: bench``: add ``bench`` to the ``kvbridge`` command's subparsers ``sub``."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench", help="benchmarks, printed as ratios against a baseline of the same run")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` name (parsed by :func:`add_arguments`)."""
    if args.what == "transfer":
        return transfer.main(args)
    given = [name for name in transfer.TRANSFER_ARGS if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + {"json_path": "json"}.get(n, n).replace("_", "-") for n in given)
        print(f"kvbridge bench: {flags} apply to `kvbridge bench transfer` only", file=sys.stderr)
        return 2
    if args.backend:
        return micro.main_backend(args.backend)
    if args.what == "flood":
        return flood.main()
    return {"planner": micro.main_planner, "control": micro.main_control}[args.what]()


class _Parser(argparse.ArgumentParser):
    """A usage error exits 64 (EX_USAGE), as ``kvbridge``'s do; 2 means a benchmark refused an option."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge_bench [what] [options]``: ``kvbridge bench`` without the core's command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="python -m kvbridge_bench", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["kvbridge", "bench", *argv])
    return run(args)

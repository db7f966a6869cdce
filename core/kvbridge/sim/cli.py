"""``python -m kvbridge.sim``: replay one seed, or sweep many and summarise."""

from __future__ import annotations

import argparse
import os
import sys

from kvbridge.sim.scheduler import run_seed
from kvbridge.sim.sweep import sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.sim", description=__doc__)
    parser.add_argument("--seed", type=int, help="replay this one schedule")
    parser.add_argument("--trace", action="store_true", help="print the event trace even when it passes")
    parser.add_argument("--schedules", type=int, default=0, help="run this many schedules")
    parser.add_argument("--start-seed", type=int, default=0)
    parser.add_argument("--faults", help="pin the fault profile (comma-separated, e.g. kill,pause; 'none'; "
                                         "'drain' is drawn only when pinned)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for --schedules (0: every core)")
    parser.add_argument("--nice", type=int, default=0, help="lower the worker processes' CPU priority by this much "
                                                            "(os.nice), to sweep beside other work")
    args = parser.parse_args(argv)
    faults = None if args.faults is None else frozenset(f for f in args.faults.split(",") if f and f != "none")
    if args.seed is not None:
        result = run_seed(args.seed, faults=faults)
        if args.trace or result.failure:
            print("\n".join(result.trace))
        s = result.scenario
        print(f"seed {args.seed}: TP {s.pt}->{s.dt}, faults {sorted(s.faults)}, {result.events} events, "
              f"{result.requests} requests, {result.successes} decode-rank successes: "
              f"{'FAILED: ' + result.failure if result.failure else 'ok'}")
        return 1 if result.failure else 0
    if args.schedules <= 0:
        parser.error("give --seed N or --schedules N")
    jobs = args.jobs or os.cpu_count() or 1
    summary = sweep(range(args.start_seed, args.start_seed + args.schedules), jobs=jobs, faults=faults,
                    niceness=args.nice)
    print(summary.text())
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())

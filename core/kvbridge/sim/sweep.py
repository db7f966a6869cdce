"""Running many schedules: in this process or spread over worker processes, summarised."""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvbridge.sim.scheduler import run_seed


@dataclass(slots=True, kw_only=True)
class Summary:
    schedules: int = 0
    events: int = 0
    max_events: int = 0
    requests: int = 0
    successes: int = 0
    failures: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0
    pinned: str = ""             # the replay command's --faults argument, when pinned

    def add(self, seed: int, events: int, requests: int, successes: int, failure: str | None) -> None:
        self.schedules += 1
        self.events += events
        self.max_events = max(self.max_events, events)
        self.requests += requests
        self.successes += successes
        if failure is not None:
            self.failures[seed] = failure

    def text(self) -> str:
        mean = self.events / self.schedules if self.schedules else 0.0
        lines = [f"{self.schedules} schedules, events per schedule mean {mean:.1f} max {self.max_events}, "
                 f"{self.requests} requests, {self.successes} decode-rank successes verified, "
                 f"{len(self.failures)} failures, {self.wall_s:.1f} s"]
        lines += [f"  seed {seed}: {why}  (replay: python -m kvbridge.sim --seed {seed} --trace{self.pinned})"
                  for seed, why in sorted(self.failures.items())]
        return "\n".join(lines)


def _one(seed: int, faults: frozenset[str] | None = None) -> tuple[int, int, int, int, str | None]:
    r = run_seed(seed, faults=faults)
    return seed, r.events, r.requests, r.successes, r.failure


def sweep(seeds: Iterable[int], jobs: int = 1, faults: frozenset[str] | None = None, *, niceness: int = 0) -> Summary:
    """Run every seed (``jobs`` worker processes when > 1; ``faults`` pins the fault profile); failures are
    collected, never raised. ``niceness`` lowers the worker processes' CPU priority (``os.nice``): a sweep beside
    tests that wait on real time takes the CPU they leave, not theirs. Example::

        print(sweep(range(1000), jobs=2, niceness=5).text())
    """
    summary = Summary(pinned="" if faults is None else f" --faults {','.join(sorted(faults)) or 'none'}")
    started = time.perf_counter()
    seeds = list(seeds)
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs, initializer=os.nice, initargs=(niceness,)) as pool:
            for row in pool.imap_unordered(functools.partial(_one, faults=faults), seeds, chunksize=64):
                summary.add(*row)
    else:
        for seed in seeds:
            summary.add(*_one(seed, faults))
    summary.wall_s = time.perf_counter() - started
    return summary

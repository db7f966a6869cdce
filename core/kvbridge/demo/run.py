"""The demo launcher: a bootstrap server, Pt prefill and Dt decode rank processes, a progress bar, a summary."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import numpy as np

from kvbridge import tracing
from kvbridge.demo.presets import get_preset
from kvbridge.demo.ranks import rank_context
from kvbridge.demo.worker import Gate, WorkerConfig, reap_segments, run_worker
from kvbridge.errors import PluginError, PluginUnavailableError, UnknownPluginError
from kvbridge.protocol.wire import Role
from kvbridge.registry import Registry
from kvbridge.settings import check_backend_options, load_settings
from kvbridge.specs import Capability, PluginKind, PluginStatus
from kvbridge.zmq_link import BootstrapServer

#: Exit codes of ``kvbridge demo`` (and the other subcommands where they apply), see README "Exit codes".
EXIT_OK = 0
EXIT_MISMATCH = 1        # a byte differs from the reference (verification failure)
EXIT_UNAVAILABLE = 2     # a backend or state type is not installed or cannot run here
EXIT_TRANSFER = 3        # a request failed, a rank died, or the run timed out
EXIT_USAGE = 64          # the command line is wrong (EX_USAGE): unknown flag, bad value, TP sizes the model forbids
EXIT_TERMINATED = 143    # SIGTERM (128 + 15): every rank drained, every request started finished byte-exact, the
#                          rest were refused (a failure or mismatch among them still gives 3 or 1)


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
    refused: int = 0             # never started: the run was cut by SIGTERM (``Gate``)
    drained: list[str] = field(default_factory=list)      # each rank's drain report, after a SIGTERM

    @property
    def ok(self) -> bool:
        return self.verified == self.requests - self.refused and not (self.failed or self.mismatched or self.crashed)

    @property
    def exit_code(self) -> int:
        """EXIT_MISMATCH when any byte differed (it outranks everything), else EXIT_TRANSFER when a request
        failed, a rank died or the run did not finish, else EXIT_TERMINATED when SIGTERM cut the run (every
        request started finished byte-exact), else EXIT_OK."""
        if self.mismatched:
            return EXIT_MISMATCH
        if not self.ok:
            return EXIT_TRANSFER
        return EXIT_TERMINATED if self.refused else EXIT_OK


def default_backend() -> str:
    """NIXL when it is installed and usable here, else the built-in loopback."""
    from kvbridge.registry import Registry

    return "nixl" if "nixl" in Registry.build().backend_names() else "loopback"


#: The distribution of each backend this repository ships (named when one is not installed).
BACKEND_DISTRIBUTIONS = {"nixl": "kvbridge-nixl", "mooncake": "kvbridge-mooncake", "mori": "kvbridge-mori",
                         "ascend": "kvbridge-ascend"}


def check_backend(backend: str, registry: Registry | None = None) -> None:
    """Refuse, before any rank starts, a backend that is not installed, cannot run here, or cannot reach
    another process (the ranks are processes): PluginError naming the reason and what to install."""
    registry = registry or Registry.build()
    record = next((r for r in registry.records() if r.name == backend and r.kind is PluginKind.BACKEND), None)
    if record is None:
        dist = BACKEND_DISTRIBUTIONS.get(backend)
        installed = ", ".join(registry.backend_names(available_only=False)) or "none"
        hint = f"pip install {dist}" if dist else "install the plugin that provides it"
        raise UnknownPluginError(f"backend {backend!r} is not installed (installed: {installed}); "
                                 f"install: {hint}")
    if record.status is PluginStatus.UNAVAILABLE:
        raise PluginUnavailableError(backend, record.reason, record.hint)
    if record.status is not PluginStatus.AVAILABLE:
        raise PluginError(f"backend {backend!r} failed to load: {record.reason}")
    if Capability.MULTI_PROCESS.value not in record.capabilities:
        raise PluginUnavailableError(backend, "it cannot move data between processes (no multi-process "
                                     "capability), and the demo runs every rank as a process",
                                     "use --backend loopback, nixl or mooncake")


def run_demo(*, backend: str, preset: str, prefill_tp: int, decode_tp: int, requests: int, seed: int,
             window: int = 4, region_pages: int = 24, timeout_s: float = 300.0, dump: str | None = None,
             out: TextIO = sys.stdout, err: TextIO | None = None, metrics_port: int = 0,
             metrics_host: str = "127.0.0.1",
             progress: bool | None = None, settings_file: str | None = None,
             drain_on: threading.Event | None = None, trace: str | None = None) -> Summary:
    """Run the demo; returns its Summary (``exit_code`` says how it went). Refuses (PluginError,
    UnsupportedTopology, ValueError) before starting anything when the backend or a state type is missing,
    the settings (``settings_file``, ``KVBRIDGE_*``: the ranks' agent options) are invalid, or the TP sizes do
    not fit the preset. A rank that dies stops the run at once: the others are stopped, every
    process is reaped and its shared-memory segments removed. ``progress``: a bar (default: on a terminal
    only; elsewhere a line per tenth of the run). ``drain_on`` (the CLI sets it on SIGTERM): once set, the run
    stops after the requests some rank already started (:class:`~kvbridge.demo.worker.Gate`), those finish and
    are verified, every rank drains its agent and exits; the rest count as refused (``EXIT_TERMINATED``).
    ``trace``: write every rank's spans to this file, one JSON line each (needs kvbridge[tracing]), and print the
    trace of the first request."""
    err = err if err is not None else sys.stderr
    settings = load_settings(settings_file, check_backend=False)    # the ranks' agent settings, checked here
    registry = Registry.build()
    check_backend(backend, registry)
    if settings.backend_options:
        check_backend_options(backend, settings.backend_options, registry)
    model = get_preset(preset, registry)
    model.check_tp(prefill_tp, decode_tp)
    metrics_dir = tempfile.mkdtemp(prefix="kvbridge-metrics-") if metrics_port else None
    if trace is not None:
        tracing.require()
    trace_dir = tempfile.mkdtemp(prefix="kvbridge-trace-") if trace is not None else None
    # secure by default: one secret for the bootstrap server, every rank's link and agent — the configured one,
    # else a fresh one that only this run's processes hold (handed to them over the pipe that carries each rank's
    # config, never in argv or the environment), so another local user's forged frames have no effect on the demo
    secret = settings.secret.encode() if settings.secret else secrets.token_bytes(32)
    server = BootstrapServer(secret=secret, clock_window_s=settings.clock_window_s).start()
    exporter = None
    base = WorkerConfig(role=Role.PREFILL, rank=0, prefill_tp=prefill_tp, decode_tp=decode_tp, preset=preset,
                        backend=backend, bootstrap=server.address, requests=requests, seed=seed,
                        window=window, region_pages=region_pages, timeout_s=timeout_s, dump=dump,
                        metrics_dir=metrics_dir, settings_file=settings_file, secret=secret, trace_dir=trace_dir)
    ctx = rank_context(backend)   # forkserver: the heavy imports happen once, not in every rank
    results: mp.Queue = ctx.Queue()
    go = ctx.Event()          # set once every rank is up: no prefill room's bootstrap clock runs before that
    gate = Gate.make(ctx, requests)   # the shutdown's cut, shared with every rank
    configs = [replace(base, role=Role.PREFILL, rank=r) for r in range(prefill_tp)]
    configs += [replace(base, role=Role.DECODE, rank=r) for r in range(decode_tp)]
    procs = [ctx.Process(target=run_worker, args=(c, results, go, gate), name=f"{c.role.value}{c.rank}", daemon=True)
             for c in configs]
    ranks = {p.name: f"{c.role.value} rank {c.rank}" for p, c in zip(procs, configs)}
    summary = Summary(requests=requests)
    per_request: dict[int, list[tuple[bool, int, float, int, str]]] = {}
    bar = Progress(requests, out, progress)
    print(f"kvbridge demo: {model.description}", file=out)
    print(f"  backend {backend}, prefill TP {prefill_tp} -> decode TP {decode_tp}, {requests} requests, seed {seed}",
          file=out)
    started = time.perf_counter()
    try:
        if metrics_dir is not None:
            from kvbridge import metrics

            exporter = metrics.serve_multiprocess(metrics_port, metrics_dir, addr=metrics_host)
            print(f"  metrics on http://{metrics_host}:{metrics_port}/metrics", file=out)
        for p in procs:
            p.start()
        # starting the ranks (importing an engine takes tens of seconds on a loaded host) has its own bound;
        # the run's --timeout counts from the moment every rank is up
        deadline = time.monotonic() + timeout_s + 30
        finished: set[str] = set()
        ready: set[str] = set()
        exited_at: dict[str, float] = {}
        next_look = time.monotonic() + _POLL_S
        draining = False
        while len(finished) < len(procs):
            if drain_on is not None and drain_on.is_set() and not draining:
                draining = True
                cut = gate.close()
                print(f"kvbridge demo: SIGTERM: draining every rank; the {cut} requests started finish, the other "
                      f"{requests - cut} are refused (SIGTERM again: stop at once)", file=err, flush=True)
            try:
                msg = results.get(timeout=_POLL_S)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind = msg[0]
                if kind == "received":
                    _, rank, index, ok, bad, latency, nbytes, reason = msg
                    per_request.setdefault(index, []).append((ok, bad, latency, nbytes, reason))
                    if len(per_request[index]) == decode_tp:
                        _settle(summary, index, per_request[index])
                        bar.update(len(summary.latencies))
                elif kind == "sent":
                    _, rank, index, ok, nbytes, descriptors, reason, transfer_s = msg
                    summary.bytes += nbytes
                    summary.descriptors += descriptors
                    if ok:
                        summary.transfers.append(transfer_s)
                    else:                # e.g. a bootstrap timeout before the decode asked: never silent
                        summary.failed.append(f"request {index}: prefill rank {rank}: {reason}")
                elif kind == "crashed":
                    name = f"{msg[1]}{msg[2]}"
                    finished.add(name)
                    first = msg[3].splitlines()[0] if msg[3] else "?"
                    _dead(summary, err, f"{ranks.get(name, name)} failed: {first}")
                    break
                elif kind == "ready":
                    ready.add(f"{msg[1]}{msg[2]}")
                    if len(ready) == len(procs):
                        go.set()
                        deadline = time.monotonic() + timeout_s + 30
                elif kind == "finished":
                    finished.add(f"{msg[1]}{msg[2]}")
                elif kind == "drained":
                    summary.drained.append(f"{msg[1]} rank {msg[2]}: {msg[3]}")
            now = time.monotonic()
            if msg is not None and now < next_look:
                continue          # a steady stream of results must not hide a dead rank: look every _POLL_S
            next_look = now + _POLL_S
            gone = [p for p in procs if p.name not in finished and p.exitcode is not None]
            for p in gone:
                exited_at.setdefault(p.name, now)
            dead = [p for p in gone if p.exitcode != 0 or now - exited_at[p.name] > _REPORT_GRACE_S]
            if dead:
                for p in dead:
                    _dead(summary, err, f"{ranks[p.name]} (pid {p.pid}) {_how(p.exitcode)}")
                break
            if now > deadline:
                summary.crashed.append(f"timed out after {timeout_s} s" if go.is_set() else
                                       f"the ranks were not all up after {timeout_s + 30:.0f} s "
                                       f"({len(ready)} of {len(procs)} ready)")
                break
        summary.wall_s = time.perf_counter() - started
        summary.refused = requests - gate.limit        # a rank's own SIGTERM may have cut the run too
    except BaseException:
        summary.crashed.append("interrupted")
        raise
    finally:
        bar.close()
        _stop(procs, grace_s=0.0 if summary.crashed else 10.0)   # after a death: the others at once
        for p in procs:
            if p.pid is not None:
                reap_segments(p.pid)     # a rank that crashed or was killed cannot unlink its own
        server.close()
        results.close()
        results.join_thread()
        if exporter is not None:
            exporter.shutdown()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if trace_dir is not None and trace is not None:
            _merge_traces(trace_dir, trace, out)
    _print_summary(summary, out)
    return summary


def _merge_traces(trace_dir: str, path: str, out: TextIO) -> None:
    """Every rank's spans into ``path`` (by start time), and the trace of the first request on ``out``."""
    lines: list[str] = []
    for name in sorted(os.listdir(trace_dir)):
        with open(os.path.join(trace_dir, name), encoding="utf-8") as f:
            lines.extend(line for line in f if line.strip())
    shutil.rmtree(trace_dir, ignore_errors=True)
    spans = tracing.load_spans(lines)
    spans.sort(key=lambda s: s["start_time"])
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(s) + "\n" for s in spans)
    by_trace = tracing.traces(spans)
    print(f"  trace: {len(spans)} spans of {len(by_trace)} requests in {path}", file=out)
    if by_trace:
        print(tracing.render(next(iter(by_trace.values()))), file=out)


_POLL_S = 0.1             # how often the launcher looks at its ranks when no result arrives
_REPORT_GRACE_S = 3.0     # a rank that exited 0 without its "finished" report is dead after this
_STOP_GRACE_S = 2.0       # surviving ranks get this long after SIGTERM before SIGKILL


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (signal {-exitcode})"
    if exitcode == 0:
        return "exited without reporting its results"
    return f"exited with status {exitcode}"


def _dead(summary: Summary, err: TextIO, what: str) -> None:
    summary.crashed.append(what)
    print(f"kvbridge demo: {what}; stopping the other ranks", file=err, flush=True)


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join the ranks for ``grace_s``, then SIGTERM the rest and SIGKILL what is left after _STOP_GRACE_S:
    no rank outlives the run. ``grace_s == 0`` (a rank died): SIGKILL at once (a rank drains on SIGTERM, and
    there is nothing left to drain for)."""
    if grace_s == 0:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5)
        return
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _settle(summary: Summary, index: int, reports: list[tuple[bool, int, float, int, str]]) -> None:
    if not all(ok for ok, *_ in reports):
        summary.failed.append(f"request {index}: " + "; ".join(r[4] for r in reports if not r[0]))
    elif any(bad for _, bad, *_ in reports):
        summary.mismatched.append(f"request {index}: {sum(r[1] for r in reports)} bytes differ")
    else:
        summary.verified += 1
    summary.latencies.append(max(r[2] for r in reports))


class Progress:
    """Requests done so far: a rich progress bar on a terminal (a plain one without rich), and on anything
    else (a pipe, a file, a StringIO) one line per tenth of the run, never a carriage return."""

    def __init__(self, total: int, out: TextIO, live: bool | None = None) -> None:
        self.total, self.out = max(1, total), out
        isatty = getattr(out, "isatty", None)
        self.live = bool(isatty and isatty()) if live is None else live
        self._rich: Any = None
        self._task: Any = None
        self._step = -1
        self._last_line = 0.0
        self._done = 0
        if self.live:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress
            except ImportError:
                return
            self._rich = RichProgress(TextColumn("  requests"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(file=out), transient=False)
            self._task = self._rich.add_task("requests", total=total)

    def update(self, done: int) -> None:
        self._done = done
        if self._rich is not None:
            if not self._rich.live.is_started:
                self._rich.start()
            self._rich.update(self._task, completed=done)
        elif self.live:
            print(f"\r{self._line(done)}", end="", file=self.out, flush=True)
        else:
            step = 10 * done // self.total
            now = time.monotonic()
            if step != self._step or done == self.total or now - self._last_line > 10.0:
                self._step, self._last_line = step, now
                print(self._line(done), file=self.out, flush=True)

    def _line(self, done: int) -> str:
        width = 30
        fill = int(width * done / self.total)
        return f"  [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} requests"

    def close(self) -> None:
        if self._rich is not None:
            if self._rich.live.is_started:
                self._rich.stop()
        elif self.live and self._done:
            print(file=self.out)


def _print_summary(s: Summary, out: TextIO) -> None:
    lat = np.array(s.latencies) * 1000 if s.latencies else np.zeros(1)
    gbps = s.bytes / s.wall_s / 1e9 if s.wall_s else 0.0
    refused = f", {s.refused} refused (SIGTERM: the ranks drained)" if s.refused else ""
    print(f"  requests     {len(s.latencies)}/{s.requests} completed, {len(s.failed)} failed{refused}", file=out)
    xfer = np.array(s.transfers) * 1000 if s.transfers else np.zeros(1)
    print(f"  bytes        {s.bytes / 1e6:.1f} MB moved; run took {s.wall_s:.2f} s ({gbps:.2f} GB/s including "
          "computing and checking the reference pattern of every byte)", file=out)
    print(f"  transfer     p50 {np.percentile(xfer, 50):.2f} ms, p99 {np.percentile(xfer, 99):.2f} ms per request and "
          "prefill rank (first chunk posted -> every byte landed and notified)", file=out)
    print(f"  latency      p50 {np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms per request "
          "(decode asks -> decode has it all; includes the prefill computing its pages)", file=out)
    print(f"  descriptors  {s.descriptors} ({s.descriptors / max(1, s.requests):.1f} per request)", file=out)
    print(f"  verified: {s.verified}/{s.requests} byte-exact", file=out)
    for line in s.drained:
        print(f"  drained {line}", file=out)
    for line in (s.crashed + s.failed + s.mismatched)[:10]:
        print(f"  ! {line}", file=out)

"""One demo rank process: build the pool, connect, run every request, report to the launcher.

Requests are deterministic from the seed, so every rank derives the same schedule without a router:
request ``i`` uses region ``i % window`` of every component's pool (item 0 is padding) and starts on a
rank only after request ``i - window`` finished there. Each component allocates its own items in its
region: KV pages for the positions after the decode prefix, and for state components what their model
says (one Mamba slot, the SWA window's pages, every NSA indexer page from position 0). Prefill ranks
fill their source items with the reference pattern (as if they had computed them) and send the KV
pages in random chunks, every state component's items (with the absolute position of the first) on
the last chunk; decode ranks scrub their destination items, ask for the data, wait, and verify every
byte against the reference.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge import metrics, tracing
from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.demo.model import ComponentModel, RequestShape
from kvbridge.demo.presets import Preset, get_preset
from kvbridge.errors import TransferError
from kvbridge.geometry import PoolLayout
from kvbridge.hostpool import SEGMENT_PREFIX, HostPool, reap_segments
from kvbridge.logs import configure_logging
from kvbridge.protocol.events import RoomEvent
from kvbridge.protocol.states import strict
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.settings import load_settings
from kvbridge.zmq_link import ZmqLink

__all__ = ["INSTANCE", "SEGMENT_PREFIX", "Gate", "WorkerConfig", "allocate_items", "make_requests", "pool_items",
           "reap_segments", "request_items", "run_worker", "state_indices"]

INSTANCE = "prefill"
log = logging.getLogger("kvbridge.demo")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    role: Role
    rank: int
    prefill_tp: int
    decode_tp: int
    preset: str
    backend: str
    bootstrap: str
    requests: int
    seed: int
    window: int
    region_pages: int
    timeout_s: float
    dump: str | None = None
    secret: bytes | None = None
    pace_s: float = 0.0          # pause between prefill chunks (fault tests kill a rank mid-transfer)
    staging_bytes: int = 16 << 20  # staging area per rank (0: plain descriptors only)
    peer_timeout_s: float | None = None   # None: the settings' (kvbridge.settings: KVBRIDGE_*, the file)
    metrics_dir: str | None = None   # record Prometheus metrics there (the launcher serves them)
    settings_file: str | None = None  # TOML settings (None: $KVBRIDGE_CONFIG when set)
    trace_dir: str | None = None     # write the rank's spans there (kvbridge.tracing; the launcher merges them)

    @property
    def tp_size(self) -> int:
        return self.prefill_tp if self.role is Role.PREFILL else self.decode_tp


def make_requests(seed: int, count: int, page_size: int, region_pages: int) -> list[RequestShape]:
    """The run's requests: random lengths up to a region, some decode prefix hits (a few full hits)."""
    rng = np.random.default_rng([seed, 0xD3E0])
    out = []
    for i in range(count):
        seq_len = int(rng.integers(1, region_pages * page_size + 1))
        num_pages = -(-seq_len // page_size)
        roll = rng.random()
        prefix = 0 if roll < 0.65 else (num_pages if roll > 0.95 else int(rng.integers(0, num_pages)))
        out.append(RequestShape(index=i, room=int(rng.integers(1, 2**63 - 1)), seed=int(rng.integers(0, 2**62)),
                                seq_len=seq_len, prefix_pages=prefix, num_pages=num_pages))
    return out


def pool_items(cfg: WorkerConfig, model: ComponentModel) -> int:
    """Items of a component's pool: the padding item 0 and one region per request in flight."""
    return 1 + cfg.window * model.region_items(cfg.region_pages)


def allocate_items(cfg: WorkerConfig, request: RequestShape, model: ComponentModel | None = None,
                   which: int = 0) -> np.ndarray:
    """This instance's item ids for the request (the same on every rank of the instance): KV page ids for
    ``request.positions`` by default, else the items of ``model`` (the ``which``-th component)."""
    size, count = (cfg.region_pages, len(request.positions)) if model is None else \
        (model.region_items(cfg.region_pages), model.span(request)[1])
    if count > size:
        raise ValueError(f"request {request.index} needs {count} items of {getattr(model, 'name', 'kv')}, a region "
                         f"holds {size}")
    rng = np.random.default_rng([cfg.seed, request.index, 1 if cfg.role is Role.PREFILL else 2,
                                 *([which] if which else [])])
    start = 1 + (request.index % cfg.window) * size
    return start + rng.permutation(size)[:count].astype(np.int64)


def request_items(cfg: WorkerConfig, preset: Preset, request: RequestShape) -> dict[str, np.ndarray]:
    """Every component's item ids for the request on this instance."""
    return {m.name: allocate_items(cfg, request, m, i) for i, m in enumerate(preset.components)}


def state_indices(preset: Preset, request: RequestShape, items: dict[str, np.ndarray]
                  ) -> dict[str, tuple[np.ndarray, int]]:
    """The state components' ``{name: (items, first position)}`` for Sender.send / Receiver.send_metadata."""
    return {m.name: (items[m.name], m.span(request)[0]) for m in preset.components if not m.chunked}


@dataclass(frozen=True, slots=True)
class Gate:
    """Which requests the ranks may still start, shared by the launcher and every rank (a shutdown's cut).

    Every rank runs the same schedule, and a request needs every rank: so a shutdown stops the *run* at one
    index for all of them. Before starting request ``i`` a rank asks :meth:`admit`, which records the highest
    index any rank started; :meth:`close` (the launcher's SIGTERM, or a rank's own) sets the cut to it, so every
    request some rank already started is still started by the others and finishes, and none after it starts
    anywhere (the summary counts those as refused). Made by :meth:`make` before the ranks start (multiprocessing
    values travel to a rank only with its process object)."""

    lock: Any
    cut: Any          # multiprocessing Value('q'): requests below this index may start
    started: Any      # multiprocessing Value('q'): one more than the highest index a rank started

    @classmethod
    def make(cls, ctx: Any, requests: int) -> Gate:
        return cls(ctx.Lock(), ctx.Value("q", requests, lock=False), ctx.Value("q", 0, lock=False))

    def admit(self, index: int) -> bool:
        """May a rank start request ``index``? (Recorded as started when it may.)"""
        with self.lock:
            if index >= self.cut.value:
                return False
            self.started.value = max(self.started.value, index + 1)
            return True

    def close(self) -> int:
        """Stop the run after the requests some rank already started; returns the cut (idempotent)."""
        with self.lock:
            self.cut.value = min(self.cut.value, self.started.value)
            return int(self.cut.value)

    @property
    def limit(self) -> int:
        with self.lock:
            return int(self.cut.value)


def run_worker(cfg: WorkerConfig, results: Any, go: Any = None, gate: Gate | None = None) -> None:
    """Process entry point; every outcome (also a crash) is reported on ``results``. ``go`` (an event the
    launcher sets once every rank reported ready): wait for it before the first request, so that a rank that
    starts late (importing the engine takes tens of seconds on a loaded host) does not eat the other side's
    bootstrap timeout: a prefill room times out ``bootstrap_timeout_s`` after its sender() was made.

    ``gate``: the run's shutdown cut (:class:`Gate`). SIGTERM to this rank closes it too (an orchestrator that
    signals the whole process group); a rank whose run was cut drains its agent (``agent.drain``, the settings'
    ``drain_timeout_s``: its peers hear a Goodbye) and reports ``("drained", role, rank, report)``."""
    _die_with_parent()
    term = threading.Event()
    if gate is not None:
        signal.signal(signal.SIGTERM, lambda *_: term.set())     # acted on by the request loop, never in here
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")    # one INFO line per agent otherwise (NIXL spells it WARN)
    configure_logging(os.environ.get("KVBRIDGE_LOG") or "WARNING",
                      fmt=f"%(asctime)s {cfg.role.value}{cfg.rank} %(levelname)s %(message)s")
    pool = agent = None
    stop_tracing: Callable[[], None] | None = None
    try:
        if cfg.trace_dir is not None:
            stop_tracing = tracing.export_to(os.path.join(cfg.trace_dir, f"{cfg.role.value}-{cfg.rank}.jsonl"),
                                             service=f"{cfg.role.value}-{cfg.rank}")
        preset = get_preset(cfg.preset)
        layout = PoolLayout(components=tuple(m.component(cfg.tp_size, pool_items(cfg, m)) for m in preset.components),
                            tp_size=cfg.tp_size, tp_rank=cfg.rank, page_size=preset.page_size, model=preset.model)
        pool = HostPool(layout, shared=cfg.backend == "loopback", staging_bytes=cfg.staging_bytes)
        link = ZmqLink(bootstrap=cfg.bootstrap, secret=cfg.secret)
        registry = None
        if cfg.metrics_dir is not None:
            registry = Registry.build(plugins=[metrics.enable(multiprocess_dir=cfg.metrics_dir)])
        agent = TransferAgent(layout=layout, buffers=pool.buffers, role=cfg.role, link=link, backend=cfg.backend,
                              instance=INSTANCE if cfg.role is Role.PREFILL else "",
                              name=f"{cfg.role.value}-{cfg.rank}-{os.getpid()}", staging=pool.staging,
                              config=agent_config(cfg), registry=registry)
        if cfg.metrics_dir is not None:
            metrics.watch_agent(agent)
        agent.start()
        results.put(("ready", cfg.role.value, cfg.rank))
        if go is not None and not go.wait(cfg.timeout_s):
            raise TimeoutError(f"the other ranks were not up after {cfg.timeout_s} s")
        if cfg.role is Role.DECODE:
            agent.connect(INSTANCE, timeout_s=cfg.timeout_s)   # repeats its Hello until answered
        requests = make_requests(cfg.seed, cfg.requests, preset.page_size, cfg.region_pages)
        step = _prefill_request if cfg.role is Role.PREFILL else _decode_request

        def admit(index: int) -> bool:
            if gate is None:
                return True
            if term.is_set():
                gate.close()
            return gate.admit(index)

        done = _run_window(cfg, requests, lambda r: step(cfg, agent, preset, pool, r, results),
                           idle=lambda: agent.link_wait(0.001), events=agent.events, admit=admit)
        if done < len(requests):        # the run was cut (SIGTERM): nothing is in flight here any more
            report = agent.drain(load_settings(cfg.settings_file, check_backend=False).drain_timeout_s, "SIGTERM")
            results.put(("drained", cfg.role.value, cfg.rank, report))
        if cfg.dump and cfg.role is Role.DECODE:
            _dump(cfg, pool, requests)
        results.put(("finished", cfg.role.value, cfg.rank))
    except BaseException as exc:  # noqa: BLE001 - report, then exit non-zero
        results.put(("crashed", cfg.role.value, cfg.rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if agent is not None:
            agent.close()
        if pool is not None:
            pool.close()
        if stop_tracing is not None:
            stop_tracing()


def agent_config(cfg: WorkerConfig) -> AgentConfig:
    """The rank's AgentConfig: the settings (environment, file) with what the launcher fixed on top."""
    config = load_settings(cfg.settings_file, check_backend=False).agent_config()
    return replace(config, secret=cfg.secret if cfg.secret is not None else config.secret,
                   peer_timeout_s=cfg.peer_timeout_s if cfg.peer_timeout_s is not None else config.peer_timeout_s,
                   staging_bytes=cfg.staging_bytes)


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the launcher dies (killed launchers leave no orphan ranks). A spawned
    rank is the launcher's child: PR_SET_PDEATHSIG covers it. A rank forked by the fork server
    (:mod:`kvbridge.demo.ranks`) is the server's child, and the server outlives the launcher while any rank
    lives: a daemon thread waits on a pidfd of the launcher instead (and PDEATHSIG covers the server)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = mp.parent_process()
    if parent is None or parent.pid is None or os.getppid() == parent.pid:
        return
    try:
        launcher = os.pidfd_open(parent.pid)
    except ProcessLookupError:                           # the launcher died before this rank got here
        os._exit(1)
    except (OSError, AttributeError):                    # no pidfd (Linux < 5.3): only PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
        return
    threading.Thread(target=_die_with, args=(launcher,), name="kvbridge-launcher-watch", daemon=True).start()


def _die_with(pidfd: int) -> None:
    select.select([pidfd], [], [])                       # readable once the launcher has exited
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class Until:
    """What a request's step waits for: its room's next event (``TransferAgent.events()``). ``ready`` reads the
    room's state without acting (the sweep's check that no change came without its event); ``what`` names it."""

    what: str
    ready: Callable[[], bool]


Wait = Until | float | None      # a step yields an Until, or a time.monotonic() deadline (pacing between chunks)
SWEEP_S = 0.25                   # how often the driver checks that no waiting room moved on without its event


class EventMissed(RuntimeError):
    """A room's state moved on without the event that should have said so (raised under KVBRIDGE_STRICT_STATES)."""


def _run_window(cfg: WorkerConfig, requests: list[RequestShape], start: Callable[[RequestShape], Iterator[Wait]],
                idle: Callable[[], None], events: Callable[[], list[RoomEvent]],
                admit: Callable[[int], bool] | None = None) -> int:
    """Drive up to ``window`` requests at once. A step waiting on its room runs again only once the room has an
    event (or its pacing deadline passed): the driver takes the agent's events once a round instead of polling
    every room. Between rounds it waits for the next control frame (up to 1 ms) instead of spinning: several rank
    processes share few cores. ``admit(index)`` says whether a request may still start (a shutdown's cut; False
    is final: no later one starts). Returns how many requests ran.

    Every ``SWEEP_S`` the waiting rooms are read (``Until.ready``) *before* that round's events are taken: a
    change a read sees was made with its event queued (the core emits it in the same transition), so that take
    holds it. One without is a bug: raised under ``KVBRIDGE_STRICT_STATES`` (as in the tests), else logged, and
    the step is woken all the same. (Reading after the take and running the step first, as an earlier driver
    did, was wrong: a step that saw its room done cleared it, and the clear dropped the event queued meanwhile.)"""
    active: dict[int, Iterator[Wait]] = {}
    waits: dict[int, Wait] = {}
    woken: set[int] = set()                 # rooms with an event their step has not run for yet
    done: set[int] = set()
    nxt = 0
    limit = len(requests)
    deadline = time.monotonic() + cfg.timeout_s
    next_sweep = time.monotonic() + SWEEP_S
    while nxt < limit or active:
        while nxt < limit and len(active) < cfg.window and (nxt < cfg.window or nxt - cfg.window in done):
            if admit is not None and not admit(nxt):
                limit = nxt
                break
            active[nxt], waits[nxt] = start(requests[nxt]), None
            nxt += 1
        now = time.monotonic()
        moved: list[tuple[int, str]] = []
        if now >= next_sweep:
            next_sweep = now + SWEEP_S
            moved = [(requests[i].room, w.what) for i, w in waits.items() if isinstance(w, Until) and w.ready()]
        woken.update(event.room for event in events())
        for room, what in moved:
            if room not in woken:
                _missed(f"room {room} moved on from {what} without an event")
                woken.add(room)
        for index, gen in list(active.items()):
            room, wait = requests[index].room, waits[index]
            if isinstance(wait, Until):
                if room not in woken:
                    continue
                woken.discard(room)
            elif wait is not None and now < wait:
                continue
            try:
                waits[index] = next(gen)
            except StopIteration:
                del active[index], waits[index]
                woken.discard(room)
                done.add(index)
        if time.monotonic() > deadline:
            raise TimeoutError(f"run did not finish in {cfg.timeout_s} s ({len(done)} of {len(requests)} done)")
        idle()
    return limit


def _missed(what: str) -> None:
    if strict():
        raise EventMissed(what)
    log.warning("demo: %s (the sweep caught it)", what)


def _prefill_request(cfg: WorkerConfig, agent: TransferAgent, preset: Preset, pool: HostPool,
                     request: RequestShape, results: Any) -> Generator[Wait, None, None]:
    sender = agent.sender(request.room)
    metrics.room_state("prefill", None, "bootstrapping")
    ready = Until("READY", lambda: sender.poll() != KVPoll.Bootstrapping)
    done = Until("DONE", lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed))
    safe = Until("SAFE", lambda: sender.safe_to_reuse)
    while (status := sender.poll()) == KVPoll.Bootstrapping:
        yield ready
    metrics.room_state("prefill", "bootstrapping", "transferring")
    every = request_items(cfg, preset, request)
    items = every[preset.chunked.name]
    state = state_indices(preset, request, every)
    if status != KVPoll.Failed:
        for model in preset.components:
            model.fill(pool.buffers[model.name], cfg.tp_size, cfg.rank, request, every[model.name])
        rng = np.random.default_rng([cfg.seed, request.index, 7])
        cuts = np.sort(rng.choice(np.arange(1, max(2, len(items))), size=min(3, max(0, len(items) - 1)),
                                  replace=False)) if len(items) > 1 else np.zeros(0, np.int64)
        chunks = np.split(items, cuts)
        started = time.perf_counter()
        for k, chunk in enumerate(chunks):
            try:
                last = k == len(chunks) - 1
                sender.send(chunk, last=last, state=state if last else None)
            except TransferError:       # the room failed meanwhile (peer died, abort): stop sending
                break
            if cfg.pace_s:
                yield time.monotonic() + cfg.pace_s
        while (status := sender.poll()) not in (KVPoll.Success, KVPoll.Failed):
            yield done
        transfer_s = time.perf_counter() - started
    else:
        transfer_s = 0.0
    while not sender.safe_to_reuse:
        yield safe
    metrics.room_state("prefill", "transferring", None)
    metrics.observe_room("prefill", status == KVPoll.Success, transfer_s, sender.failure_reason or "")
    nbytes, descriptors = sender.stats
    results.put(("sent", cfg.rank, request.index, status == KVPoll.Success, nbytes, descriptors, sender.failure_reason,
                 transfer_s))
    sender.clear()


def _decode_request(cfg: WorkerConfig, agent: TransferAgent, preset: Preset, pool: HostPool,
                    request: RequestShape, results: Any) -> Generator[Wait, None, None]:
    every = request_items(cfg, preset, request)
    for model in preset.components:
        for buf in pool.buffers[model.name]:
            buf[every[model.name]] = 0xA5                       # scrub: stale bytes must not pass
    started = time.perf_counter()
    receiver = agent.receiver(request.room, INSTANCE)
    indices: dict[str, Any] = {preset.chunked.name: every[preset.chunked.name], **state_indices(preset, request, every)}
    receiver.send_metadata(indices, prefix_len=request.prefix_pages * preset.page_size)
    metrics.room_state("decode", None, "waiting")
    done = Until("DONE", lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
    while (status := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        yield done
    latency = time.perf_counter() - started
    metrics.room_state("decode", "waiting", None)
    metrics.observe_room("decode", status == KVPoll.Success, latency, receiver.failure_reason or "")
    bad = -1
    if status == KVPoll.Success:
        bad = sum(m.verify(pool.buffers[m.name], cfg.tp_size, cfg.rank, request, every[m.name])
                  for m in preset.components)
    safe = Until("SAFE", lambda: receiver.safe_to_reuse)
    while not receiver.safe_to_reuse:
        yield safe
    results.put(("received", cfg.rank, request.index, status == KVPoll.Success, bad, latency, receiver.nbytes,
                 receiver.failure_reason))
    if cfg.dump:
        _remember(request, every)
    receiver.clear()


_DUMPED: dict[int, dict[str, np.ndarray]] = {}


def _remember(request: RequestShape, items: dict[str, np.ndarray]) -> None:
    _DUMPED[request.index] = {name: ids.copy() for name, ids in items.items()}


def _dump(cfg: WorkerConfig, pool: HostPool, requests: list[RequestShape]) -> None:
    """Write this rank's buffers and per-request indices (see README "Checking a dump"): ``requests.npy``
    for the KV pages, ``<component>.requests.npy`` for each state component (position = absolute page
    position, 0 for a Mamba slot; page = the item id)."""
    out = Path(cfg.dump or ".") / f"decode-rank{cfg.rank}"
    out.mkdir(parents=True, exist_ok=True)
    for comp, arrays in pool.buffers.items():
        for i, arr in enumerate(arrays):
            np.save(out / f"{comp}.{i}.npy", arr)
    preset = get_preset(cfg.preset)
    kinds = [("request", "i8"), ("room", "u8"), ("seed", "u8"), ("seq_len", "i8"), ("prefix_pages", "i8"),
             ("position", "i8"), ("page", "i8")]
    for model in preset.components:
        rows = []
        for r in requests:
            if r.index in _DUMPED:
                first = model.span(r)[0]
                ids = _DUMPED[r.index][model.name]
                rows += [(r.index, r.room, r.seed, r.seq_len, r.prefix_pages, first + k, int(item))
                         for k, item in enumerate(ids)]
        name = "requests.npy" if model.chunked else f"{model.name}.requests.npy"
        np.save(out / name, np.array(rows, dtype=kinds))

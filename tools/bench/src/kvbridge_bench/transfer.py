"""``kvbridge bench transfer``: kvbridge end to end through the agent against raw NIXL and a plain copy of
the same bytes, measured side by side in one run.

Shape of the run. Prefill and decode ranks are separate processes (spawned once, reused by every case):
on a GPU host every prefill rank uses GPU 0 and every decode rank GPU 1 (ranks of one side share a GPU
when the TP size is above 1; the output says so); on a host without CUDA they use host memory, over
NIXL (DRAM) when it is installed, else the built-in ``loopback`` backend (decode pools in /dev/shm).
The pool is a dense GQA layout: ``layers`` x (K, V) buffers, 8 KV heads x 128 bf16, token-major or
head-major pages of 16 or 64 tokens; a request's pages are scattered at random over the pool (or
contiguous, for equal TP sizes only: hetero TP slices every page anyway).

Per case (request size x page size x TP pair x page layout x placement):

* ``kvbridge``: a request through ``TransferAgent`` / ``Sender`` / ``Receiver`` over ZMQ: the decode
  ranks ask (``send_metadata``), the prefill ranks wait until asked, then each posts the whole request
  (``Sender.send(last=True)``); time from the first prefill ``send`` to the last decode rank seeing
  Success. The first round is a warm-up whose bytes are verified on the decode ranks; the others are
  timed (median).
* ``raw NIXL``: the same number of bytes as one contiguous descriptor, prefill rank 0 -> decode rank 0,
  ``initialize_xfer`` + ``transfer`` polled to DONE, through NIXL's own API (:mod:`kvbridge_bench.raw_nixl`;
  only when NIXL is installed here: ``pip install 'kvbridge-bench[nixl]'``);
* ``copy``: the same bytes copied once (``Tensor.copy_`` GPU 0 -> GPU 1, or a host memcpy).

Also: 128-token request latency p50 against a ZMQ round trip + the raw transfer time of those bytes;
with ``--layerwise``, simulated per-layer compute (a matmul sized like a Llama-3-8B layer on GPU, a small
one on CPU) between layer-group posts (``Sender.send(..., layers=range)``), the transfer tail after the
last layer's compute against one group's transfer time and against sending everything at the end.
Results: a table with ratios, JSON (``--json``) and PNG plots (``--plots``, needs matplotlib:
``pip install 'kvbridge-bench[plots]'``). No timing is asserted anywhere: every figure is printed as a ratio
against a baseline of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata as md
import inspect
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

HEADS, HEAD_DIM, ELEM = 8, 128, 2          # GQA: 8 KV heads x 128, bf16
ROW = HEAD_DIM * ELEM                      # bytes of one head of one token
LAYER_PARAMS = 218_103_808                 # Llama-3-8B layer: attention 4096x(4096+2x1024+4096) + MLP 3x4096x14336
HIDDEN = 4096
LAYOUTS = ("token-major", "head-major")
PLACEMENTS = ("scattered", "contiguous")
TORCH_ENV = "KVBRIDGE_BENCH_TORCH"         # "1": torch tensors on the host too (dry run of the GPU code)
PROFILE_ENV = "KVBRIDGE_BENCH_PROFILE"     # a folder: each rank's engine thread profiled during a stream, as text
SLOW_S = 2.0                               # a warm-up round this slow: one timed round only
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
NOT_AVAILABLE = "layer-wise: not available in this build (Sender.send takes no layers=)"


# ----------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True, kw_only=True)
class Case:
    """One measured configuration. ``tokens`` of one request; the pool holds ``pool_tokens``."""

    group: str                 # "sweep", or a label of the caller's (extra cases, e.g. a recorded table's rows)
    tokens: int
    page: int
    layers: int
    prefill_tp: int
    decode_tp: int
    layout: str
    placement: str
    pool_tokens: int
    repeats: int
    staging_bytes: int | None = None   # None: the agent's default
    staging_mode: str | None = None    # AgentConfig.staging ("auto", "always", "never"), where the build has it
    piece_bytes: int | None = None     # AgentConfig.staging_piece_bytes (None: the agent's default)
    engine_progress_s: float | None = None   # AgentConfig.engine_progress_s (None: the agent's default, unset)
    warmup: bool = True                # an extra first round (verified, not timed)
    label: str = ""
    seed: int = 0

    @property
    def pages(self) -> int:
        return self.tokens // self.page

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page

    @property
    def nbytes(self) -> int:
        return self.tokens * self.layers * 2 * HEADS * ROW

    @property
    def name(self) -> str:
        text = (f"{fmt_bytes(self.nbytes)} p{self.page} TP {self.prefill_tp}->{self.decode_tp} {self.layout} "
                f"{self.placement}")
        return f"{text} [{self.label}]" if self.label else text


@dataclass(kw_only=True)
class Options:
    device: str = "auto"                       # auto | cpu | cuda
    backend: str | None = None                 # None: nixl when usable, else loopback
    sizes: tuple[int, ...] | None = None       # bytes per request (all ranks together)
    page_tokens: tuple[int, ...] | None = None
    tp_pairs: tuple[tuple[int, int], ...] | None = None
    layouts: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None
    layers: int | None = None
    pool_tokens: int | None = None
    repeats: int | None = None
    staging_mib: int | None = None
    staging_mode: str | None = None
    piece_mib: int | None = None               # staged pieces of at most this much (default: the agent's)
    layerwise: bool = False
    layer_group: int = 1
    latency_requests: int | None = None
    concurrency: tuple[int, ...] = ()          # request streams: this many requests in flight (each a run)
    rate: float = 0.0                          # ... started at most this many per second (0: closed loop)
    stream_requests: int | None = None         # requests per stream (default GPU 400, host 100)
    stream_size: int | None = None             # bytes per stream request (default GPU 64 MiB, host 4 MiB)
    switch_interval_ms: float | None = None    # streams: the ranks' interpreter switch interval (None: Python's)
    engine_progress_ms: float | None = None    # AgentConfig.engine_progress_s of every rank (None: unset)
    json_path: str | None = None
    plots: str | None = None
    quick: bool = False
    timeout_s: float = 300.0
    budget_s: float | None = None              # throughput cases starting later than this are skipped
    plugins: tuple[str, ...] = ()              # extra plugin modules (a source tree without entry points)
    extra_cases: tuple[Case, ...] = ()         # measured before the sweep (scripts/gpu_transfer_bench.py)
    last_cases: tuple[Case, ...] = ()          # measured after it (slow ones: the time budget may skip them)
    command: str = ""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def parse_size(text: str) -> int:
    """``64MiB``, ``1GiB``, ``512k``, ``4096`` (bytes)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"bad size {text!r}: use e.g. 64MiB, 1GiB, 512KiB")
    return int(float(num) * _UNITS[unit])


def parse_tp_pairs(text: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for part in text.split(","):
        p, _, d = part.strip().partition("-")
        try:
            pt, dt = int(p), int(d)
        except ValueError:
            raise ValueError(f"bad TP pair {part!r}: use PREFILL-DECODE, e.g. 2-1") from None
        for tp in (pt, dt):
            if tp < 1 or HEADS % tp:
                raise ValueError(f"TP {tp} in {part!r}: the pool's {HEADS} KV heads must split evenly (1, 2, 4, 8)")
        pairs.append((pt, dt))
    return tuple(pairs)


def _csv(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{what}: {', '.join(bad) or 'nothing given'}; choose from {', '.join(allowed)}")
    return items


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """The options with every default filled in for the device."""

    device: str
    backend: str
    sizes: tuple[int, ...]
    page_tokens: tuple[int, ...]
    tp_pairs: tuple[tuple[int, int], ...]
    layouts: tuple[str, ...]
    placements: tuple[str, ...]
    layers: int
    repeats: int
    latency_requests: int
    layerwise_rounds: int
    poll_s: float
    staging_bytes: int | None
    staging_mode: str | None
    piece_bytes: int | None
    pool_tokens: int | None
    engine_progress_s: float | None = None


def resolve_options(opts: Options, device: str, backend: str) -> Resolved:
    gpu, quick = device == "cuda", opts.quick
    if gpu:
        sizes, layers, repeats, latency, poll = (1 << 30,), 32, 5, 200, 0.0
    else:
        sizes, layers, repeats, latency, poll = (64 << 20,), 8, 3, 100, 0.0005
    pages: tuple[int, ...] = (16, 64)
    pairs: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2), (4, 2))
    layouts: tuple[str, ...] = LAYOUTS
    if quick:
        sizes = (256 << 20,) if gpu else (4 << 20,)
        layers, repeats, latency = (8 if gpu else 4), 2, 10
        pages, pairs, layouts = (16,), ((1, 1), (2, 1)), ("token-major",)
    return Resolved(device=device, backend=backend, sizes=opts.sizes or sizes, page_tokens=opts.page_tokens or pages,
                    tp_pairs=opts.tp_pairs or pairs, layouts=opts.layouts or layouts,
                    placements=opts.placements or PLACEMENTS, layers=opts.layers or layers,
                    repeats=opts.repeats or repeats, latency_requests=opts.latency_requests or latency,
                    layerwise_rounds=2 if quick else 3, poll_s=poll,
                    staging_bytes=None if opts.staging_mib is None else opts.staging_mib << 20,
                    staging_mode=opts.staging_mode,
                    piece_bytes=None if opts.piece_mib is None else opts.piece_mib << 20,
                    pool_tokens=opts.pool_tokens,
                    engine_progress_s=None if opts.engine_progress_ms is None else opts.engine_progress_ms / 1e3)


def sweep_cases(r: Resolved) -> list[Case]:
    align = math.lcm(*r.page_tokens)
    per_token = r.layers * 2 * HEADS * ROW
    cases = []
    for size in r.sizes:
        tokens = max(align, size // per_token // align * align)
        pool = r.pool_tokens or (max(32768, tokens * 5 // 4) if r.device == "cuda" else tokens * 5 // 4)
        pool = max(tokens, -(-pool // align) * align)
        for page in r.page_tokens:
            for pt, dt in r.tp_pairs:
                for layout in r.layouts:
                    for placement in r.placements:
                        if placement == "contiguous" and pt != dt:
                            continue
                        cases.append(Case(group="sweep", tokens=tokens, page=page, layers=r.layers, prefill_tp=pt,
                                          decode_tp=dt, layout=layout, placement=placement, pool_tokens=pool,
                                          repeats=r.repeats, staging_bytes=r.staging_bytes,
                                          staging_mode=r.staging_mode, piece_bytes=r.piece_bytes,
                                          engine_progress_s=r.engine_progress_s))
    return cases


def placement_pages(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(source pages, destination pages) of the case's request."""
    if case.placement == "contiguous":
        pages = np.arange(case.pages, dtype=np.int64)
        return pages, pages.copy()
    rng = np.random.default_rng([case.seed, 17])
    return (rng.permutation(case.pool_pages)[:case.pages].astype(np.int64),
            rng.permutation(case.pool_pages)[:case.pages].astype(np.int64))


def layerwise_supported() -> bool:
    from kvbridge.agent import Sender

    return "layers" in inspect.signature(Sender.send).parameters


# ----------------------------------------------------------------------------------------------- rank process
def _layout(case: Case, tp: int, rank: int) -> Any:
    from kvbridge import BufferGeometry, Component, DType, PoolLayout, ShardAxis

    hl = HEADS // tp
    token_major = case.layout == "token-major"
    shape = (case.page, hl, HEAD_DIM) if token_major else (hl, case.page, HEAD_DIM)
    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=case.pool_pages, item_shape=shape,
                                dtype=DType.BFLOAT16, shard=ShardAxis(1 if token_major else 0, HEADS))
                 for t in "kv" for layer in range(case.layers))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp, tp_rank=rank,
                      page_size=case.page, model="bench-transfer")


def _heads(tp: int, rank: int) -> tuple[int, int]:
    return rank * HEADS // tp, (rank + 1) * HEADS // tp


def _registry(plugins: Sequence[str]) -> Any:
    from kvbridge_bench._internals import Registry

    registry = Registry.build()
    if plugins:
        modules = [importlib.import_module(name) for name in plugins]
        registry = Registry.build(entry_points=True, plugins=modules)
    return registry


def _host_block(seed: int, rank: int, nbuf: int, pool: int, item: int) -> np.ndarray:
    """The source bytes of prefill rank ``rank``: ``[buffers, pool items, item bytes]``, random, writable."""
    rng = np.random.default_rng([seed, rank, 0x5EED])
    return np.frombuffer(bytearray(rng.bytes(nbuf * pool * item)), np.uint8).reshape(nbuf, pool, item)


def _torch_block(seed: int, rank: int, nbuf: int, pool: int, item: int, device: str) -> Any:
    """The same for a torch tensor on ``device`` (regenerated on the same device, it is the same bytes)."""
    import torch

    out = torch.empty((nbuf, pool, item), dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    out.random_(generator=gen)
    return out


class _Rank:
    """The state of one rank process: its agent and pool for the current case, baselines, compute."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.role: str = spec["role"]
        self.rank: int = spec["rank"]
        self.device: str = spec["device"]              # "cpu" or "cuda:N"
        self.peer_device: str = spec["peer_device"]    # where the prefill side's bytes live
        self.backend: str = spec["backend"]
        self.poll_s: float = spec["poll_s"]
        self.timeout_s: float = spec["timeout_s"]
        self.registry = _registry(spec["plugins"])
        self.cuda = self.device.startswith("cuda")
        # torch tensors: on a GPU, or on the host as a dry run of the GPU code paths (KVBRIDGE_BENCH_TORCH=1)
        self.use_torch = self.cuda or (os.environ.get(TORCH_ENV) == "1" and self.backend != "loopback")
        if self.cuda:
            import torch

            torch.cuda.set_device(int(self.device.split(":")[1]))
        self.agent: Any = None
        self.pool: Any = None
        self.data: Any = None
        self.case: Case | None = None
        self.sender: Any = None
        self.raw: list[Any] = []
        self.compute: Any = None

    # -- helpers
    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def _pause(self) -> None:
        if self.poll_s > 0:
            self.agent.link_wait(self.poll_s)

    def _spin(self, done: Callable[..., bool], what: str, *args: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done(*args):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} rank {self.rank}: {what} not reached in {self.timeout_s} s")
            self._pause()

    def idle(self, conn: Any) -> Any:
        """Wait for the launcher's next message, running the agent's progress meanwhile (heartbeats,
        handshakes, requests)."""
        while True:
            if self.agent is None:
                if conn.poll(0.05):
                    return conn.recv()
                continue
            if conn.poll(0):
                return conn.recv()
            self.agent.progress()
            self.agent.link_wait(0.005)    # wakes on control frames; nothing timed waits here

    # -- case set-up and tear-down
    def op_setup(self, conn: Any, msg: dict[str, Any]) -> None:
        from kvbridge.agent import AgentConfig, Role, TransferAgent, ZmqLink

        case = self.case = Case(**msg["case"])
        prefill = self.role == "prefill"
        tp = case.prefill_tp if prefill else case.decode_tp
        layout = _layout(case, tp, self.rank)
        nbuf, item = 2 * case.layers, layout.components[0].buffers[0].item_nbytes
        default = AgentConfig().staging_bytes
        staging_bytes = default if case.staging_bytes is None else case.staging_bytes
        staging = None
        if self.use_torch:
            import torch

            if prefill:
                self.data = _torch_block(case.seed, self.rank, nbuf, case.pool_pages, item, self.device)
            else:
                self.data = torch.zeros((nbuf, case.pool_pages, item), dtype=torch.uint8, device=self.device)
            buffers = [self.data[b] for b in range(nbuf)]
            self._sync()
        elif self.backend == "loopback":       # a peer process writes into our pool: /dev/shm
            from kvbridge_bench._internals import HostPool, segment_prefix

            self.pool = HostPool(layout, shared=True, staging_bytes=staging_bytes, prefix=segment_prefix("bench"))
            buffers = self.pool.buffers["kv"]
            staging = self.pool.staging
            if prefill:
                block = _host_block(case.seed, self.rank, nbuf, case.pool_pages, item)
                for b, buf in enumerate(buffers):
                    buf[...] = block[b]
                del block
        else:
            if prefill:
                self.data = _host_block(case.seed, self.rank, nbuf, case.pool_pages, item)
            else:
                self.data = np.empty((nbuf, case.pool_pages, item), np.uint8)
                self.data.fill(0)              # pre-touch
            buffers = [self.data[b] for b in range(nbuf)]
        extra: dict[str, Any] = {}
        if case.staging_mode is not None:
            if "staging" not in {f.name for f in dataclasses.fields(AgentConfig)}:
                raise ValueError(f"staging mode {case.staging_mode!r}: this build's AgentConfig has no staging=")
            extra["staging"] = case.staging_mode
        if case.piece_bytes is not None:
            extra["staging_piece_bytes"] = case.piece_bytes
        if case.engine_progress_s is not None:
            extra["engine_progress_s"] = case.engine_progress_s
        # Bench ranks drive progress from their own loop and run no heartbeat thread (an engine's agent does:
        # start()), so a send() of millions of descriptors (staging off) keeps the prefill silent for as long
        # as it takes: give those cases (no staging) a peer timeout beyond it instead of measuring a peer death.
        silent_s = 10 * self.timeout_s if case.staging_mode == "never" or case.staging_bytes == 0 else 0.0
        config = AgentConfig(peer_timeout_s=max(30.0, self.timeout_s / 4, silent_s),
                             bootstrap_timeout_s=self.timeout_s,
                             waiting_timeout_s=self.timeout_s, staging_bytes=staging_bytes, **extra)
        role = Role.PREFILL if prefill else Role.DECODE
        self.agent = TransferAgent(layout=layout, buffers={"kv": buffers}, role=role, backend=self.backend,
                                   registry=self.registry,
                                   link=ZmqLink(bootstrap=msg["bootstrap"]),
                                   instance=msg["instance"] if prefill else "",
                                   name=f"{self.role}-{self.rank}-{os.getpid()}-{msg['instance']}", config=config,
                                   staging=staging)
        if not prefill:
            self.agent.connect(msg["instance"], timeout_s=self.timeout_s)
        staged = self.agent.staging
        conn.send({"staging_bytes": int(staged.region.nbytes) if staged is not None else 0})

    def op_teardown(self, conn: Any, msg: dict[str, Any]) -> None:
        self._teardown()
        conn.send({})

    def _teardown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.data = self.sender = self.compute = None
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    # -- one request, throughput rounds
    def op_recv(self, conn: Any, msg: dict[str, Any]) -> None:
        """Decode: ask for the room, say so, then wait for it (no message is read meanwhile)."""
        from kvbridge.agent import KVPoll

        receiver = self.agent.receiver(msg["room"], msg["instance"])
        receiver.send_metadata({"kv": np.asarray(msg["pages"])})
        conn.send({"posted": time.perf_counter()})
        self._spin(_ended, "room end", receiver)
        t_done = time.perf_counter()
        status = receiver.poll()
        out = {"t_done": t_done, "ok": status == KVPoll.Success, "reason": receiver.failure_reason,
               "nbytes": int(receiver.nbytes)}
        self._spin(_safe, "safe_to_reuse", receiver)
        receiver.clear()
        conn.send(out)

    def op_arm(self, conn: Any, msg: dict[str, Any]) -> None:
        """Prefill: open the room, wait until every decode rank asked, say so, and wait (spinning, so ranks
        start together) for the go message, which runs right here."""
        self.sender = self.agent.sender(msg["room"])
        self._spin(_asked, "WaitingForInput", self.sender)
        conn.send({"armed": True})
        while not conn.poll(self.poll_s):
            self.agent.progress()
        go = conn.recv()
        getattr(self, f"go_{go['mode']}")(conn, go, np.asarray(msg["pages"]))

    def _finish_send(self) -> dict[str, Any]:
        from kvbridge.agent import KVPoll

        sender = self.sender
        self._spin(_ended, "send end", sender)
        t_end = time.perf_counter()
        self._spin(_safe, "safe_to_reuse", sender)
        nbytes, ndesc = sender.stats
        out = {"t_end": t_end, "ok": sender.poll() == KVPoll.Success, "reason": sender.failure_reason,
               "posted_bytes": int(nbytes), "descriptors": int(ndesc)}
        sender.clear()
        self.sender = None
        return out

    def go_whole(self, conn: Any, go: dict[str, Any], pages: np.ndarray) -> None:
        t_send = time.perf_counter()
        self.sender.send(pages, last=True)
        t_posted = time.perf_counter()
        conn.send({"t_send": t_send, "t_posted": t_posted, **self._finish_send()})

    def go_layers(self, conn: Any, go: dict[str, Any], pages: np.ndarray) -> None:
        """Simulated forward pass: compute each layer group, post it (layer-wise) or everything at the end."""
        layers: int = go["layers"]
        group: int = go["group"]
        groups = [range(a, min(a + group, layers)) for a in range(0, layers, group)]
        stream = go["stream"]
        timeline: list[dict[str, Any]] = []
        t_start = time.perf_counter()
        for i, grp in enumerate(groups):
            c0 = time.perf_counter()
            self._compute(len(grp))
            c1 = time.perf_counter()
            if stream:
                self.sender.send(pages, last=i == len(groups) - 1, layers=grp)
            timeline.append({"layers": [grp.start, grp.stop], "compute": [c0, c1], "post": [c1, time.perf_counter()]})
        t_compute_end = timeline[-1]["compute"][1]
        post = [t_compute_end, t_compute_end]
        if not stream:
            self.sender.send(pages, last=True)
            post[1] = time.perf_counter()
        conn.send({"t_send": t_start, "t_compute_end": t_compute_end, "timeline": timeline, "post_all": post,
                   **self._finish_send()})

    # -- verification
    def op_scrub(self, conn: Any, msg: dict[str, Any]) -> None:
        """Decode: zero the destination pages (so the next verified round proves its own writes)."""
        case = self.case
        assert case is not None
        pages = np.asarray(msg["pages"])
        buffers = self.pool.buffers["kv"] if self.pool is not None else [self.data[b] for b in range(2 * case.layers)]
        if self.use_torch:
            import torch

            idx = torch.as_tensor(pages, device=self.device)
            for buf in buffers:
                buf[idx] = 0
            self._sync()
        else:
            for buf in buffers:
                buf[pages] = 0
        conn.send({})

    def op_verify(self, conn: Any, msg: dict[str, Any]) -> None:
        """Decode: the destination pages hold, head slice by head slice, what every prefill rank we read
        from wrote (regenerated from its seed, on its device)."""
        from kvbridge.plugin import target_ranks

        case = self.case
        assert case is not None
        src, dst = np.asarray(msg["src"]), np.asarray(msg["dst"])
        order = np.argsort(src)            # compare in a fixed order (any order works)
        src, dst = src[order], dst[order]
        pt, dt = case.prefill_tp, case.decode_tp
        nbuf = 2 * case.layers
        d_lo, d_hi = _heads(dt, self.rank)
        buffers = self.pool.buffers["kv"] if self.pool is not None else [self.data[b] for b in range(nbuf)]
        ok = True
        for p in target_ranks(pt, dt, self.rank):
            p_lo, p_hi = _heads(pt, p)
            lo, hi = max(p_lo, d_lo), min(p_hi, d_hi)
            if lo >= hi:
                continue
            item = case.page * (p_hi - p_lo) * ROW
            block: Any
            s_idx: Any
            d_idx: Any
            if self.use_torch:
                import torch

                block = _torch_block(case.seed, p, nbuf, case.pool_pages, item, self.peer_device)
                s_idx = torch.as_tensor(src, device=self.peer_device)
                d_idx = torch.as_tensor(dst, device=self.device)
            else:
                block = _host_block(case.seed, p, nbuf, case.pool_pages, item)
                s_idx, d_idx = src, dst
            for b in range(nbuf):
                got = _heads_of(buffers[b][d_idx], case, d_hi - d_lo, lo - d_lo, hi - d_lo)
                want = _heads_of(block[b][s_idx], case, p_hi - p_lo, lo - p_lo, hi - p_lo)
                if self.use_torch:
                    import torch

                    ok = ok and bool(torch.equal(got, want.to(self.device)))
                else:
                    ok = ok and bool(np.array_equal(got, want))
            del block
        conn.send({"verified": ok})

    # -- baselines
    def op_raw_target(self, conn: Any, msg: dict[str, Any]) -> None:
        """Decode rank 0: a contiguous region registered with a raw NIXL agent of its own; answers the agent's
        metadata and the region."""
        from kvbridge import region_of
        from kvbridge_bench.raw_nixl import RawNixl

        raw = RawNixl(f"raw-decode-{os.getpid()}")
        self.raw = [raw]
        arr = self._alloc(msg["nbytes"], self.device)
        self.raw.append(arr)
        region = region_of(arr)
        raw.register([region])
        conn.send({"metadata": raw.metadata(), "region": (region.addr, region.nbytes, region.device.value,
                                                          region.device_id)})

    def op_raw_close(self, conn: Any, msg: dict[str, Any]) -> None:
        self._raw_close()
        conn.send({})

    def _raw_close(self) -> None:
        if self.raw:
            self.raw[0].close()
            self.raw = []
            if self.cuda:
                import torch

                torch.cuda.empty_cache()

    def op_raw_write(self, conn: Any, msg: dict[str, Any]) -> None:
        """Prefill rank 0: NIXL alone writes ``nbytes`` as one descriptor into the raw target."""
        from kvbridge import DeviceKind, MemoryRegion, region_of
        from kvbridge_bench.raw_nixl import RawNixl, contiguous_write

        addr, size, kind, device_id = msg["region"]
        dst = MemoryRegion(addr, size, DeviceKind(kind), device_id)
        arr = self._alloc(msg["nbytes"], self.device, fill=1)
        with RawNixl(f"raw-prefill-{os.getpid()}") as raw:
            region = region_of(arr)
            raw.register([region])
            peer = raw.add_peer(msg["metadata"])
            conn.send(contiguous_write(raw, region, dst, peer, msg["nbytes"], msg["repeats"], msg.get("pieces", 1),
                                       msg.get("scatter", False)))
        del arr

    def op_copy(self, conn: Any, msg: dict[str, Any]) -> None:
        """Prefill rank 0: a plain copy of ``nbytes`` (into the decode side's device on a GPU host)."""
        nbytes, seconds = msg["nbytes"], []
        src = self._alloc(nbytes, self.device, fill=1)
        dst = self._alloc(nbytes, msg["dst_device"])
        for _ in range(msg["repeats"] + 1):
            t0 = time.perf_counter()
            if self.use_torch:
                dst.copy_(src)
                if self.cuda:
                    import torch

                    torch.cuda.synchronize(src.device)
                    torch.cuda.synchronize(dst.device)
            else:
                np.copyto(dst, src)
            seconds.append(time.perf_counter() - t0)
        del src, dst
        self._sync()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()       # 2 x nbytes, one of them on the decode side's GPU
        conn.send({"seconds": seconds[1:]})

    def _alloc(self, nbytes: int, device: str, fill: int = 0) -> Any:
        if self.use_torch:
            import torch

            out = torch.full((nbytes,), fill, dtype=torch.uint8, device=device)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            return out
        arr = np.empty(nbytes, np.uint8)
        arr.fill(fill)
        return arr

    # -- latency
    def op_serve(self, conn: Any, msg: dict[str, Any]) -> None:
        """Prefill: answer every room of the list as soon as its decode ranks asked."""
        from kvbridge.agent import KVPoll

        pages, failed = np.asarray(msg["pages"]), []
        for room in msg["rooms"]:
            sender = self.agent.sender(room)
            self._spin(_asked, "asked", sender)
            if sender.poll() != KVPoll.Failed:
                sender.send(pages, last=True)
            self._spin(_ended, "sent", sender)
            self._spin(_safe, "safe_to_reuse", sender)
            if sender.poll() != KVPoll.Success:
                failed.append(sender.failure_reason)
            sender.clear()
        conn.send({"failed": failed})

    def op_latency(self, conn: Any, msg: dict[str, Any]) -> None:
        """Decode: send_metadata -> Success of each room, one after the other."""
        from kvbridge.agent import KVPoll

        pages, seconds, failed = np.asarray(msg["pages"]), [], []
        for room in msg["rooms"]:
            t0 = time.perf_counter()
            receiver = self.agent.receiver(room, msg["instance"])
            receiver.send_metadata({"kv": pages})
            self._spin(_ended, "room end", receiver)
            seconds.append(time.perf_counter() - t0)
            if receiver.poll() != KVPoll.Success:
                failed.append(receiver.failure_reason)
            self._spin(_safe, "safe_to_reuse", receiver)
            receiver.clear()
        conn.send({"seconds": seconds, "failed": failed})

    # -- request streams under an engine loop (--concurrency)
    def op_stream(self, conn: Any, msg: dict[str, Any]) -> None:
        """Both sides: kvbridge's progress thread on (as in an engine), the engine loop alone for ``baseline_s``,
        then (on the launcher's go) with the request stream; answers both loops and the stream's numbers."""
        self.agent.start()
        interval = sys.getswitchinterval()
        if msg.get("switch_interval_s"):       # what an engine could set for its process (sys.setswitchinterval)
            sys.setswitchinterval(msg["switch_interval_s"])
        try:
            self._stream(conn, msg)
        finally:
            sys.setswitchinterval(interval)    # the rank runs later cases with Python's own

    def _stream(self, conn: Any, msg: dict[str, Any]) -> None:
        from kvbridge_bench.streams import DecodeStream, EngineLoop, NoStream, PrefillStream, StreamDriver

        loop = EngineLoop(work_us=msg["work_us"], device=self.device)
        idle = loop.run(NoStream(), seconds=msg["baseline_s"])
        conn.send({"baseline": True})
        conn.recv()                                       # go
        driver: StreamDriver
        if self.role == "decode":
            driver = DecodeStream(agent=self.agent, instance=msg["instance"], rooms=msg["rooms"],
                                  dst_slots=[np.asarray(s) for s in msg["dst_slots"]],
                                  concurrency=msg["concurrency"], rate=msg["rate"])
        else:
            driver = PrefillStream(agent=self.agent, rooms=msg["rooms"], src=np.asarray(msg["src"]),
                                   window=2 * msg["concurrency"] + 2)
        profile_dir = os.environ.get(PROFILE_ENV)
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        busy = loop.run(driver, timeout_s=self.timeout_s)
        if profiler is not None and profile_dir:
            import pstats

            profiler.disable()
            path = Path(profile_dir) / f"{self.role}{self.rank}-stream{msg['concurrency']}.txt"
            with path.open("w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(45)
        # kvbridge's CPU: the engine thread's time in kvbridge calls, and the other threads' beyond their idle rate
        idle_threads = idle.other_threads_cpu_s / idle.seconds * busy.seconds
        out: dict[str, Any] = {"idle_steps_per_s": idle.steps_per_s, "busy_steps_per_s": busy.steps_per_s,
                               "kvbridge_cpu_s": busy.driver_cpu_s + max(0.0, busy.other_threads_cpu_s - idle_threads),
                               "engine_thread_cpu_s": busy.driver_cpu_s, "busy_s": busy.seconds,
                               "failed": list(getattr(driver, "failed", []))}
        if isinstance(driver, DecodeStream):
            out.update(latencies=driver.latencies, started_at=driver.started_at, ended_at=driver.ended_at)
        conn.send(out)

    # -- simulated compute (layer-wise)
    def op_prepare_compute(self, conn: Any, msg: dict[str, Any]) -> None:
        """Prefill: ``rows x cols`` @ ``cols x cols`` matmuls, ``reps`` per layer (``dtype``: bfloat16 on GPU)."""
        x: Any
        rows, cols = msg["rows"], msg["cols"]
        if self.use_torch:
            import torch

            dtype = getattr(torch, msg["dtype"])
            x = torch.randn((rows, cols), dtype=dtype, device=self.device)
            w = torch.randn((cols, cols), dtype=dtype, device=self.device) / 64
            self.compute = (x, w, torch.empty_like(x), msg["reps"])
        else:
            rng = np.random.default_rng(1)
            x = rng.standard_normal((rows, cols), dtype=np.float32)
            self.compute = (x, rng.standard_normal((cols, cols), dtype=np.float32), np.empty_like(x), msg["reps"])
        t0 = time.perf_counter()
        self._compute(1)
        self._compute(1)
        conn.send({"layer_s": (time.perf_counter() - t0) / 2})

    def _compute(self, layers: int) -> None:
        x, w, y, reps = self.compute
        if self.use_torch:
            import torch

            for _ in range(layers * reps):
                torch.mm(x, w, out=y)
            if self.cuda:
                torch.cuda.current_stream().synchronize()   # the layer's KV is written: it may travel
        else:
            for _ in range(layers * reps):
                np.matmul(x, w, out=y)


def _asked(sender: Any) -> bool:
    """Every decode rank asked for the room (or it failed)."""
    from kvbridge.agent import KVPoll

    status = sender.poll()
    return bool(status >= KVPoll.WaitingForInput or status == KVPoll.Failed)


def _ended(handle: Any) -> bool:
    from kvbridge.agent import KVPoll

    return bool(handle.poll() in (KVPoll.Success, KVPoll.Failed))


def _safe(handle: Any) -> bool:
    return bool(handle.safe_to_reuse)


def _heads_of(pages: Any, case: Case, heads: int, lo: int, hi: int) -> Any:
    """Heads ``[lo, hi)`` of ``pages`` (``[n, item bytes]``, a rank holding ``heads`` heads)."""
    n = pages.shape[0]
    if case.layout == "token-major":
        return pages.reshape(n, case.page, heads, ROW)[:, :, lo:hi]
    return pages.reshape(n, heads, case.page, ROW)[:, lo:hi]


def rank_main(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of a rank process: run the launcher's operations until told to quit."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    state = _Rank(spec)
    conn.send({"ready": True})
    try:
        while True:
            msg = state.idle(conn)
            if msg["op"] == "quit":
                break
            try:
                getattr(state, f"op_{msg['op']}")(conn, msg)
            except Exception as exc:  # noqa: BLE001 - reported to the launcher, which fails the case
                conn.send({"error": f"{state.role} rank {state.rank}: {type(exc).__name__}: {exc}\n"
                                    f"{traceback.format_exc()}"})
    finally:
        state._raw_close()
        state._teardown()


# ----------------------------------------------------------------------------------------------- launcher
class CaseError(RuntimeError):
    pass


class _Worker:
    def __init__(self, ctx: Any, spec: dict[str, Any]) -> None:
        self.role, self.rank = spec["role"], spec["rank"]
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, spec), name=f"{self.role}{self.rank}", daemon=True)
        self.proc.start()
        child.close()

    def send(self, msg: dict[str, Any]) -> None:
        self.conn.send(msg)

    def recv(self, timeout_s: float) -> dict[str, Any]:
        if not self.conn.poll(timeout_s):
            raise CaseError(f"{self.role} rank {self.rank} did not answer in {timeout_s:.0f} s")
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError:
            raise CaseError(f"{self.role} rank {self.rank} exited (code {self.proc.exitcode})") from None
        if "error" in reply:
            raise CaseError(reply["error"])
        return reply


class Ranks:
    """The rank processes: ``prefill[i]`` and ``decode[i]``, spawned once and reused by every case."""

    def __init__(self, r: Resolved, prefill: int, decode: int, devices: tuple[str, str], plugins: Sequence[str],
                 timeout_s: float) -> None:
        self.r, self.devices, self.timeout_s = r, devices, timeout_s
        self.sizes, self.plugins = (prefill, decode), tuple(plugins)
        self.prefill: list[_Worker] = []
        self.decode: list[_Worker] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        base = {"backend": self.r.backend, "poll_s": self.r.poll_s, "timeout_s": self.timeout_s,
                "plugins": self.plugins, "peer_device": self.devices[0]}
        self.prefill = [_Worker(ctx, {**base, "role": "prefill", "rank": i, "device": self.devices[0]})
                        for i in range(self.sizes[0])]
        self.decode = [_Worker(ctx, {**base, "role": "decode", "rank": i, "device": self.devices[1]})
                       for i in range(self.sizes[1])]
        self.recv(self.prefill + self.decode, timeout_s=max(120.0, self.timeout_s))

    def restart(self) -> None:
        self.close()
        self._start()

    def send(self, workers: Sequence[_Worker], msg: dict[str, Any]) -> None:
        for w in workers:
            w.send(msg)

    def recv(self, workers: Sequence[_Worker], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """One reply from each worker, in the given order, waiting on all of them at once: the first error
        (or a worker gone, or the timeout) raises at once, without waiting for the others."""
        from multiprocessing.connection import wait

        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while len(replies) < len(workers):
            pending = {id(w.conn): i for i, w in enumerate(workers) if i not in replies}
            ready = wait([workers[i].conn for i in pending.values()], max(0.0, deadline - time.monotonic()))
            if not ready:
                late = ", ".join(f"{workers[i].role} rank {workers[i].rank}" for i in pending.values())
                raise CaseError(f"no answer in {timeout_s or self.timeout_s:.0f} s from {late}")
            for conn in ready:
                i = pending[id(conn)]
                replies[i] = workers[i].recv(0)
        return [replies[i] for i in range(len(workers))]

    def ask(self, workers: Sequence[_Worker], msg: dict[str, Any]) -> list[dict[str, Any]]:
        self.send(workers, msg)
        return self.recv(workers)

    def close(self) -> None:
        for w in self.prefill + self.decode:
            try:
                w.send({"op": "quit"})
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10          # for all of them together: a stuck rank is killed
        for w in self.prefill + self.decode:
            w.proc.join(max(0.1, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
            if self.r.backend == "loopback":
                from kvbridge_bench._internals import reap_segments, segment_prefix

                if w.proc.pid is not None:
                    reap_segments(w.proc.pid, segment_prefix("bench"))
        self.prefill, self.decode = [], []


class Bench:
    """Runs the cases on a set of rank processes and collects one JSON-able result."""

    def __init__(self, r: Resolved, ranks: Ranks, bootstrap: str, out: TextIO) -> None:
        self.r, self.ranks, self.bootstrap, self.out = r, ranks, bootstrap, out
        self.index = 0
        from kvbridge_bench.raw_nixl import installed

        self.raw_missing = installed()       # None: NIXL is installed (the rank processes import it)
        self._baselines: dict[int, dict[str, Any]] = {}
        self._raw_cache: dict[tuple[int, int, bool], float | None] = {}

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _open(self, case: Case) -> tuple[list[_Worker], list[_Worker], str, list[dict[str, Any]]]:
        self.index += 1
        instance = f"bench{self.index}"
        pre, dec = self.ranks.prefill[:case.prefill_tp], self.ranks.decode[:case.decode_tp]
        msg = {"op": "setup", "case": dataclasses.asdict(case), "bootstrap": self.bootstrap, "instance": instance}
        setup = self.ranks.ask(pre, msg)
        self.ranks.ask(dec, msg)
        return pre, dec, instance, setup

    def _close(self, pre: list[_Worker], dec: list[_Worker]) -> None:
        """Prefill ranks first: they map the decode ranks' memory (CUDA IPC, /dev/shm) to write into it, so they
        let go of it before the decode ranks free it."""
        self.ranks.ask(pre, {"op": "teardown"})
        self.ranks.ask(dec, {"op": "teardown"})

    def _failed(self, row: dict[str, Any], what: str, exc: CaseError) -> None:
        """Record the error; the rank processes may be mid-operation: start fresh ones."""
        row["error"] = str(exc)
        self.say(f"  FAILED {what or row.get('case', '')}: {str(exc).splitlines()[0]}")
        self.ranks.restart()

    def _verify(self, dec: list[_Worker], src: np.ndarray, dst: np.ndarray) -> bool:
        return all(v["verified"] for v in self.ranks.ask(dec, {"op": "verify", "src": src, "dst": dst}))

    def _round(self, pre: list[_Worker], dec: list[_Worker], instance: str, room: int, src: np.ndarray,
               dst: np.ndarray, go: dict[str, Any]) -> dict[str, Any]:
        self.ranks.send(dec, {"op": "recv", "room": room, "instance": instance, "pages": dst})
        self.ranks.recv(dec)
        self.ranks.send(pre, {"op": "arm", "room": room, "pages": src})
        self.ranks.recv(pre)
        self.ranks.send(pre, go)
        both = self.ranks.recv(dec + pre)
        got, sent = both[:len(dec)], both[len(dec):]
        bad = [x["reason"] for x in got + sent if not x["ok"]]
        if bad:
            raise CaseError(f"room {room} failed: {bad[0]}")
        return {"seconds": max(g["t_done"] for g in got) - min(s["t_send"] for s in sent),
                "bytes": sum(g["nbytes"] for g in got), "descriptors": sum(s["descriptors"] for s in sent),
                "post_s": max(s["t_posted"] for s in sent) - min(s["t_send"] for s in sent) if "t_posted" in sent[0]
                else None, "got": got, "sent": sent}

    # -- throughput
    def describe(self, case: Case) -> dict[str, Any]:
        return {"case": case.name, "group": case.group, "label": case.label, "tokens": case.tokens,
                "page_tokens": case.page, "layers": case.layers, "prefill_tp": case.prefill_tp,
                "decode_tp": case.decode_tp, "layout": case.layout, "placement": case.placement,
                "pool_tokens": case.pool_tokens, "pages": case.pages, "bytes": case.nbytes,
                "staging_bytes": case.staging_bytes, "staging_mode": case.staging_mode,
                "engine_progress_s": case.engine_progress_s, "shared_gpu": self._shared(case), "error": None}

    def throughput(self, case: Case) -> dict[str, Any]:
        row = self.describe(case)
        started = time.perf_counter()
        try:
            pre, dec, instance, setup = self._open(case)
            row["staging_bytes_per_rank"] = setup[0]["staging_bytes"]
            src, dst = placement_pages(case)
            seconds: list[float] = []
            rounds, k = case.repeats + (1 if case.warmup else 0), 0
            while k < rounds:
                res = self._round(pre, dec, instance, 1000 * self.index + k + 1, src, dst, {"mode": "whole"})
                if k == 0:
                    row["bytes"], row["descriptors"] = res["bytes"], res["descriptors"]
                    row["verified"] = self._verify(dec, src, dst)
                    if case.warmup and res["seconds"] > SLOW_S and rounds > 2:
                        rounds = 2                # a slow case: one timed round after the warm-up
                        row["note"] = f"warm-up took {res['seconds']:.1f} s: one timed round"
                if k or not case.warmup:
                    seconds.append(res["seconds"])
                    row.setdefault("post_s", []).append(res["post_s"])
                k += 1
            self._close(pre, dec)
        except CaseError as exc:
            self._failed(row, "", exc)
            return row
        row["seconds"] = seconds
        row["median_s"] = statistics.median(seconds)
        row["gbps"] = row["bytes"] / row["median_s"] / 1e9
        row["best_gbps"] = row["bytes"] / min(seconds) / 1e9
        row["wall_s"] = time.perf_counter() - started
        base = self.baselines(row["bytes"])
        row["raw_nixl_gbps"] = base["raw_nixl"]["gbps"] if base.get("raw_nixl") else None
        row["copy_gbps"] = base["copy"]["gbps"]
        row["vs_raw_nixl"] = row["gbps"] / row["raw_nixl_gbps"] if row["raw_nixl_gbps"] else None
        row["vs_copy"] = row["gbps"] / row["copy_gbps"]
        # the per-page method other PD transports use: one descriptor per page and buffer (K and V of each layer)
        per_page = self._raw_gbps(row["bytes"], case.pages * 2 * case.layers, scatter=True) \
            if self.raw_missing is None and case.prefill_tp == case.decode_tp == 1 else None
        row["per_page_gbps"] = per_page
        row["vs_per_page"] = row["gbps"] / per_page if per_page else None
        return row

    def _shared(self, case: Case) -> str:
        if self.r.device != "cuda":
            return ""
        notes = []
        if case.prefill_tp > 1:
            notes.append(f"{case.prefill_tp} prefill ranks share {self.ranks.devices[0]}")
        if case.decode_tp > 1:
            notes.append(f"{case.decode_tp} decode ranks share {self.ranks.devices[1]}")
        return "; ".join(notes)

    def baselines(self, nbytes: int) -> dict[str, Any]:
        """Raw NIXL (one contiguous descriptor) and a plain copy of ``nbytes``, measured once per size."""
        if nbytes in self._baselines:
            return self._baselines[nbytes]
        p0 = self.ranks.prefill[0]
        repeats = max(3, self.r.repeats)
        out: dict[str, Any] = {"bytes": nbytes, "raw_nixl": None}
        if self.raw_missing is not None:
            out["raw_nixl_error"] = self.raw_missing
        else:
            try:
                raw = self._raw_write(nbytes, 1, False)
                med = statistics.median(raw["seconds"])
                out["raw_nixl"] = {"seconds": raw["seconds"], "median_s": med, "gbps": nbytes / med / 1e9,
                                   "descriptors": 1, "initialize_us": raw["initialize_us"]}
            except CaseError as exc:
                out["raw_nixl_error"] = str(exc)
                self.say(f"  raw NIXL baseline failed: {str(exc).splitlines()[0]}")
        copy = self.ranks.ask([p0], {"op": "copy", "nbytes": nbytes, "repeats": repeats,
                                     "dst_device": self.ranks.devices[1]})[0]
        med = statistics.median(copy["seconds"])
        out["copy"] = {"seconds": copy["seconds"], "median_s": med, "gbps": nbytes / med / 1e9,
                       "kind": "torch copy_ " + " -> ".join(self.ranks.devices) if self.r.device == "cuda"
                       else "numpy copyto (memcpy) in one process"}
        self._baselines[nbytes] = out
        return out

    # -- latency
    def latency(self, requests: int) -> dict[str, Any]:
        from kvbridge_bench.micro import zmq_rtt_ms

        case = Case(group="latency", tokens=128, page=16, layers=self.r.layers, prefill_tp=1, decode_tp=1,
                    layout="token-major", placement="scattered", pool_tokens=4096, repeats=requests,
                    staging_bytes=self.r.staging_bytes, staging_mode=self.r.staging_mode,
                    piece_bytes=self.r.piece_bytes, engine_progress_s=self.r.engine_progress_s)
        out: dict[str, Any] = {"tokens": 128, "page_tokens": 16, "layers": case.layers, "bytes": case.nbytes,
                               "requests": requests, "error": None}
        try:
            pre, dec, instance, _ = self._open(case)
            src, dst = placement_pages(case)
            rooms = [1000 * self.index + k + 1 for k in range(requests)]
            self.ranks.send(pre, {"op": "serve", "rooms": rooms, "pages": src})
            self.ranks.send(dec, {"op": "latency", "rooms": rooms, "pages": dst, "instance": instance})
            lat, served = self.ranks.recv(dec + pre)
            self._close(pre, dec)
        except CaseError as exc:
            self._failed(out, "latency", exc)
            return out
        ms = np.array(lat["seconds"][min(10, requests // 5):]) * 1e3     # the first rooms pay connection set-up
        out["failed"] = lat["failed"] + served["failed"]
        out["p50_ms"], out["p99_ms"] = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
        out["control_rtt_ms"] = zmq_rtt_ms(importlib.import_module("zmq"))
        out["control_rtt_kind"] = "ZMQ PUSH/PULL round trip between two threads, 64-byte frames"
        base = self.baselines(case.nbytes)
        raw = base["raw_nixl"] or base["copy"]
        out["raw_transfer_ms"] = raw["median_s"] * 1e3
        out["raw_transfer_kind"] = "raw NIXL, one descriptor" if base["raw_nixl"] else base["copy"]["kind"]
        out["baseline_ms"] = out["control_rtt_ms"] + out["raw_transfer_ms"]
        out["p50_over_baseline"] = out["p50_ms"] / out["baseline_ms"]
        return out

    # -- layer-wise
    # -- request streams (--concurrency N, --rate R)
    def stream(self, size: int, concurrency: int, rate: float, requests: int, *, work_us: float = 200.0,
               baseline_s: float = 1.0, switch_interval_s: float | None = None) -> dict[str, Any]:
        """``requests`` requests of ``size`` bytes (TP 1 -> 1, 16-token pages, scattered), ``concurrency`` in
        flight, at most ``rate`` per second (0: closed loop), each rank's engine loop timed against itself without
        traffic; the aggregate against raw NIXL posting ``concurrency`` requests' bytes as that many contiguous
        descriptors of one transfer."""
        per_token = self.r.layers * 2 * HEADS * ROW
        tokens = max(16, size // per_token // 16 * 16)
        slots = max(1, concurrency)
        case = Case(group="stream", tokens=tokens, page=16, layers=self.r.layers, prefill_tp=1, decode_tp=1,
                    layout="token-major", placement="scattered", pool_tokens=tokens * slots, repeats=1,
                    staging_bytes=self.r.staging_bytes, staging_mode=self.r.staging_mode,
                    piece_bytes=self.r.piece_bytes, engine_progress_s=self.r.engine_progress_s,
                    label=f"{concurrency} in flight" + (f", {rate:g}/s" if rate else ""))
        out: dict[str, Any] = {**self.describe(case), "concurrency": concurrency, "rate": rate, "requests": requests,
                               "engine_step_us": work_us, "switch_interval_s": switch_interval_s}
        try:
            pre, dec, instance, _ = self._open(case)
            rng = np.random.default_rng([case.seed, 23])
            src = rng.permutation(case.pool_pages)[:case.pages].astype(np.int64)
            dst_slots = np.array_split(rng.permutation(case.pool_pages).astype(np.int64), slots)
            rooms = [1000 * self.index + k + 1 for k in range(requests)]
            common = {"op": "stream", "rooms": rooms, "concurrency": concurrency, "rate": rate,
                      "work_us": work_us, "baseline_s": baseline_s, "instance": instance,
                      "switch_interval_s": switch_interval_s}
            self.ranks.send(pre, {**common, "src": src})
            self.ranks.send(dec, {**common, "dst_slots": dst_slots})
            self.ranks.recv(dec + pre)
            self.ranks.send(dec + pre, {"go": True})
            got, sent = self.ranks.recv(dec + pre)
            out["verified"] = all(self._verify(dec, src, slot) for slot in dst_slots[:min(slots, requests)])
            self._close(pre, dec)
        except CaseError as exc:
            self._failed(out, "stream", exc)
            return out
        out["failed"] = got["failed"] + sent["failed"]
        seconds = got["ended_at"] - got["started_at"]
        ms = np.array(got["latencies"]) * 1e3
        out.update(seconds=seconds, gbps=requests * case.nbytes / seconds / 1e9, requests_per_s=requests / seconds,
                   p50_ms=float(np.percentile(ms, 50)) if ms.size else None,
                   p99_ms=float(np.percentile(ms, 99)) if ms.size else None)
        for side, res in (("prefill", sent), ("decode", got)):
            out[side] = {"engine_steps_per_s_idle": res["idle_steps_per_s"],
                         "engine_steps_per_s_busy": res["busy_steps_per_s"],
                         "engine_steps_lost": 1 - res["busy_steps_per_s"] / res["idle_steps_per_s"],
                         "cpu_ms_per_request": res["kvbridge_cpu_s"] / requests * 1e3,
                         "engine_thread_ms_per_request": res["engine_thread_cpu_s"] / requests * 1e3}
        out["raw_nixl_gbps"] = None
        if self.raw_missing is None:
            out["raw_nixl_gbps"] = self._raw_gbps(case.nbytes * slots, slots)
            out["vs_raw_nixl"] = out["gbps"] / out["raw_nixl_gbps"] if out["raw_nixl_gbps"] else None
        return out

    def _raw_gbps(self, nbytes: int, pieces: int, *, scatter: bool = False) -> float | None:
        """Raw NIXL writing ``nbytes`` as ``pieces`` descriptors of one transfer (median of repeats; ``scatter``:
        landing in a shuffled order); measured once per (bytes, pieces, scatter) in a run."""
        key = (nbytes, pieces, scatter)
        if key in self._raw_cache:
            return self._raw_cache[key]
        self._raw_cache[key] = gbps = self._raw_measure(nbytes, pieces, scatter)
        return gbps

    def _raw_measure(self, nbytes: int, pieces: int, scatter: bool) -> float | None:
        try:
            raw = self._raw_write(nbytes, pieces, scatter)
        except CaseError as exc:
            self.say(f"  raw NIXL baseline failed: {str(exc).splitlines()[0]}")
            return None
        return nbytes / statistics.median(raw["seconds"]) / 1e9

    def _raw_write(self, nbytes: int, pieces: int, scatter: bool) -> dict[str, Any]:
        """NIXL alone, prefill rank 0 -> decode rank 0: ``nbytes`` as ``pieces`` descriptors of one transfer
        (see :func:`kvbridge_bench.raw_nixl.contiguous_write`); the writer's answer. Raises CaseError."""
        p0, d0 = self.ranks.prefill[0], self.ranks.decode[0]
        target = self.ranks.ask([d0], {"op": "raw_target", "nbytes": nbytes})[0]
        try:
            return self.ranks.ask([p0], {"op": "raw_write", "nbytes": nbytes, "metadata": target["metadata"],
                                         "region": target["region"], "repeats": max(3, self.r.repeats),
                                         "pieces": pieces, "scatter": scatter})[0]
        finally:
            self.ranks.ask([d0], {"op": "raw_close"})

    def layerwise(self, case: Case, group: int, rounds: int) -> dict[str, Any]:
        available = layerwise_supported()
        out: dict[str, Any] = {"available": available, "reason": "" if available else NOT_AVAILABLE,
                               "case": case.name, "layers": case.layers, "group": group, "bytes": case.nbytes,
                               "error": None, "modes": {}}
        gpu = self.r.device == "cuda"
        if gpu:
            reps = max(1, round(LAYER_PARAMS / (HIDDEN * HIDDEN) / case.prefill_tp))
            compute = {"rows": case.tokens, "cols": HIDDEN, "reps": reps, "dtype": "bfloat16"}
            out["compute"] = (f"{reps} x bf16 matmul [{case.tokens} x {HIDDEN}] @ [{HIDDEN} x {HIDDEN}] per layer "
                              f"and prefill rank (a Llama-3-8B layer over the request's tokens / TP)")
        else:
            compute = {"rows": 384, "cols": 384, "reps": 1, "dtype": "float32"}
            out["compute"] = "one float32 384 x 384 matmul per layer (a stand-in: CPU, not a real layer's size)"
        try:
            pre, dec, instance, _ = self._open(case)
            prep = self.ranks.ask(pre, {"op": "prepare_compute", **compute})
            out["compute_per_layer_s"] = max(p["layer_s"] for p in prep)
            src, dst = placement_pages(case)
            whole = [self._round(pre, dec, instance, 1000 * self.index + 900 + k, src, dst,
                                 {"mode": "whole"})["seconds"]
                     for k in range(rounds + 1)][1:]           # the whole request, no compute: all layers' transfer
            out["all_layers_transfer_s"] = statistics.median(whole)
            for mode, stream in (("at_end", False), ("layerwise", True)):
                if stream and not available:
                    continue
                tails, runs = [], []
                self.ranks.ask(dec, {"op": "scrub", "pages": dst})     # the warm-up round is verified
                for k in range(rounds + 1):
                    go = {"mode": "layers", "layers": case.layers, "group": group, "stream": stream}
                    res = self._round(pre, dec, instance, 1000 * self.index + 100 * stream + k + 1, src, dst, go)
                    if k == 0:
                        out[f"verified_{mode}"] = self._verify(dec, src, dst)
                        continue
                    t_done = max(g["t_done"] for g in res["got"])
                    t_compute_end = max(s["t_compute_end"] for s in res["sent"])
                    tails.append(t_done - t_compute_end)
                    runs.append(_timeline(res, t_done))
                median = sorted(range(len(tails)), key=tails.__getitem__)[(len(tails) - 1) // 2]
                out["modes"][mode] = {"tail_s": tails, "median_tail_s": statistics.median(tails),
                                      "timeline": runs[median]}
            self._close(pre, dec)
        except CaseError as exc:
            self._failed(out, "layer-wise", exc)
            return out
        at_end = out["modes"]["at_end"]
        transfer = out["all_layers_transfer_s"]
        out["one_group_transfer_s"] = transfer * group / case.layers
        out["one_group_transfer_note"] = ("estimated: the whole request's transfer time (median of rounds without "
                                          "compute, same pages) x group / layers")
        if "layerwise" in out["modes"]:
            out["tail_over_one_group"] = out["modes"]["layerwise"]["median_tail_s"] / out["one_group_transfer_s"]
        out["at_end_tail_over_all_layers"] = at_end["median_tail_s"] / transfer if transfer > 0 else None
        return out


def _timeline(res: dict[str, Any], t_done: float) -> dict[str, Any]:
    """Prefill rank 0's compute and post intervals, relative to its compute start, and the room's end."""
    s = res["sent"][0]
    t0 = s["t_send"]
    return {"groups": [{"layers": g["layers"], "compute": [g["compute"][0] - t0, g["compute"][1] - t0],
                        "post": [g["post"][0] - t0, g["post"][1] - t0]} for g in s["timeline"]],
            "post_all": [s["post_all"][0] - t0, s["post_all"][1] - t0],
            "compute_end": max(x["t_compute_end"] for x in res["sent"]) - t0, "done": t_done - t0}


# ----------------------------------------------------------------------------------------------- machine
def _run(cmd: Sequence[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(*dists: str) -> dict[str, str]:
    found = {}
    for dist in dists:
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return found


def gpu_link(topo: str | None, a: int = 0, b: int = 1) -> str | None:
    """The cell of ``nvidia-smi topo -m`` between GPU ``a`` and GPU ``b`` (e.g. ``NV18``, ``SYS``)."""
    if not topo:
        return None
    plain = re.sub(r"\x1b\[[0-9;]*m", "", topo)       # nvidia-smi underlines the header row
    lines = [ln.split() for ln in plain.splitlines() if ln.strip()]
    header = lines[0] if lines else []
    columns = [h for h in header if h.startswith("GPU")]
    for row in lines[1:]:
        if row and row[0] == f"GPU{a}" and f"GPU{b}" in columns:
            idx = columns.index(f"GPU{b}") + 1
            return row[idx] if idx < len(row) else None
    return None


def machine_info(device: str, devices: tuple[str, str], command: str) -> dict[str, Any]:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "cpu": cpu or platform.processor(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(),
        "versions": _version("kvbridge", "kvbridge-bench", "torch", "numpy", "nixl", "nixl-cu12", "nixl-cu13",
                             "pyzmq", "matplotlib"),
        # a copy of the tree (a GPU host) may sit in a stale or foreign git: KVBRIDGE_REV=<commit>, when set,
        # names what was measured
        "git": os.environ.get("KVBRIDGE_REV")
        or _run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]),
        "device": device, "devices": list(devices),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,   # other jobs at the start
    }
    if device == "cuda":
        gpus = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
        topo = _run(["nvidia-smi", "topo", "-m"])
        info["gpus"] = gpus.splitlines() if gpus else None
        info["topology"] = topo
        idx = [int(d.split(":")[1]) for d in devices]
        info["link"] = gpu_link(topo, idx[0], idx[1]) if idx[0] != idx[1] else "same GPU"
    return info


def detect_device(requested: str) -> tuple[str, str]:
    """(``cpu`` | ``cuda``, why)."""
    if requested == "cpu":
        return "cpu", "asked for"
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        if requested == "cuda":
            raise SystemExit("kvbridge bench transfer: --device cuda, but this host has no NVIDIA GPU")
        return "cpu", "no NVIDIA GPU here"
    try:
        import torch
    except ImportError:
        if requested == "cuda":
            raise SystemExit("kvbridge bench transfer: --device cuda needs torch") from None
        return "cpu", "torch is not installed"
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise SystemExit("kvbridge bench transfer: --device cuda, but torch sees no CUDA device")
        return "cpu", "torch sees no CUDA device"
    return "cuda", f"{torch.cuda.device_count()} CUDA device(s)"


def _devices(device: str) -> tuple[str, str]:
    if device != "cuda":
        return "cpu", "cpu"
    import torch

    return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")


def choose_backend(requested: str | None, device: str, plugins: Sequence[str]) -> str:
    registry = _registry(plugins)
    names = registry.backend_names()
    backend = requested or ("nixl" if "nixl" in names else "loopback")
    if backend not in names:
        raise SystemExit(f"kvbridge bench transfer: backend {backend!r} is not usable here "
                         f"(available: {', '.join(names) or 'none'})")
    caps = {str(getattr(c, "value", c)) for c in registry.backend_spec(backend).capabilities}
    if device == "cuda" and "cuda-memory" not in caps:
        raise SystemExit(f"kvbridge bench transfer: backend {backend!r} cannot move CUDA memory; GPU mode needs one "
                         f"that can (nixl). Available: {', '.join(names)}")
    if "multi-process" not in caps:
        raise SystemExit(f"kvbridge bench transfer: backend {backend!r} cannot reach another process")
    return backend


# ----------------------------------------------------------------------------------------------- run + report
def run(opts: Options, out: TextIO = sys.stdout) -> dict[str, Any]:
    from kvbridge.agent import BootstrapServer

    device, why = detect_device(opts.device)
    backend = choose_backend(opts.backend, device, opts.plugins)
    r = resolve_options(opts, device, backend)
    cases = list(opts.extra_cases) + sweep_cases(r) + list(opts.last_cases)
    devices = _devices(device)
    command = opts.command or " ".join(["kvbridge", *sys.argv[1:]])
    result: dict[str, Any] = {"kind": "kvbridge bench transfer", "machine": machine_info(device, devices, command),
                              "settings": {**{k: v for k, v in dataclasses.asdict(r).items()},
                                           "device_reason": why, "layer_group": opts.layer_group,
                                           "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
                              "cases": [], "baselines": [], "latency": None, "streams": [], "layerwise": None,
                              "host_staging": None, "checksums": None, "plots": [], "notes": []}
    m = result["machine"]
    print(f"kvbridge bench transfer: {device} ({why}), backend {backend}, {len(cases)} cases", file=out)
    if device == "cuda":
        print(f"  prefill ranks on {devices[0]}, decode ranks on {devices[1]}; GPUs: {m.get('gpus')}; "
              f"link {devices[0]}<->{devices[1]}: {m.get('link')}", file=out)
    else:
        print(f"  host memory, CPU {m['cpu']} x {m['cpus']}; prefill and decode ranks are separate processes",
              file=out)
    if opts.layerwise and not layerwise_supported():
        print(NOT_AVAILABLE, file=out)
        result["notes"].append(NOT_AVAILABLE)
    max_pt = max([c.prefill_tp for c in cases] + [1])
    max_dt = max([c.decode_tp for c in cases] + [1])
    server = BootstrapServer().start()
    ranks = Ranks(r, max_pt, max_dt, devices, opts.plugins, opts.timeout_s)
    bench = Bench(r, ranks, server.address, out)
    started = time.perf_counter()
    try:
        for i, case in enumerate(cases):
            if opts.budget_s is not None and time.perf_counter() - started > opts.budget_s:
                print(f"  [{i + 1}/{len(cases)}] {case.name}: SKIPPED (past the {opts.budget_s:.0f} s budget)",
                      file=out, flush=True)
                result["cases"].append({**bench.describe(case), "error": f"skipped: past the {opts.budget_s} s budget"})
                continue
            print(f"  [{i + 1}/{len(cases)}] {case.name}", file=out, flush=True)
            result["cases"].append(bench.throughput(case))
        print("  [latency] 128-token requests", file=out, flush=True)
        result["latency"] = bench.latency(r.latency_requests)
        for n in opts.concurrency:
            size = opts.stream_size or ((64 << 20) if device == "cuda" else (4 << 20))
            count = opts.stream_requests or (400 if device == "cuda" else 100)
            print(f"  [stream] {count} requests of {fmt_bytes(size)}, {n} in flight"
                  + (f", {opts.rate:g}/s" if opts.rate else ""), file=out, flush=True)
            result["streams"].append(bench.stream(size, n, opts.rate, count,
                                                  switch_interval_s=opts.switch_interval_ms / 1e3
                                                  if opts.switch_interval_ms else None))
        if opts.layerwise:
            first = next((c for c in cases if c.group == "sweep"), cases[0] if cases else None)
            if first is not None:
                lw_case = dataclasses.replace(first, prefill_tp=1, decode_tp=1, layout="token-major",
                                              placement="scattered", label="layer-wise")
                print(f"  [layer-wise] {lw_case.name}, groups of {opts.layer_group} layer(s)", file=out, flush=True)
                result["layerwise"] = bench.layerwise(lw_case, opts.layer_group, r.layerwise_rounds)
        result["baselines"] = list(bench._baselines.values())
    finally:
        ranks.close()
        server.close()
    result["host_staging"] = _host_staging()
    result["checksums"] = _checksum_cost()
    result["wall_s"] = time.perf_counter() - started
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result


def _host_staging() -> dict[str, Any]:
    """The staging path's host gather / scatter against memcpy (``kvbridge bench planner``'s staged row)."""
    from kvbridge_bench.micro import staged_row

    try:
        row = staged_row(HEADS, HEAD_DIM, 16, np.random.default_rng(0))
    except Exception as exc:  # noqa: BLE001 - the staging API may change under this benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}
    gather, scatter, memcpy = (float(row[k]) for k in ("gather_gbps", "scatter_gbps", "memcpy_gbps"))  # type: ignore[arg-type]
    return {"what": "token-major TP 4->2 slices of 512 pages x 8 buffers, host numpy",
            "gather_gbps": gather, "scatter_gbps": scatter, "memcpy_gbps": memcpy,
            "gather_vs_memcpy": gather / memcpy, "scatter_vs_memcpy": scatter / memcpy}


def _checksum_cost() -> dict[str, Any]:
    """What ``AgentConfig(checksums=True)`` costs each side: digesting the slices of a token-major TP 4 -> 2
    request (512 pages x 8 buffers of 512-byte runs per token row, host numpy) against memcpy of the bytes."""
    from kvbridge.plugin import Segments
    from kvbridge_bench._internals import digest_items, run_bytes

    rng = np.random.default_rng(1)
    page, cols, stride = 16, 512, 1024
    bufs = [rng.integers(0, 255, (1024, page * stride), dtype=np.uint8) for _ in range(8)]
    segs = Segments(np.arange(page, dtype=np.int64) * stride + cols, np.arange(page, dtype=np.int64) * cols,
                    np.full(page, cols, np.int64))
    index, items = run_bytes(segs, "src"), rng.permutation(1024)[:512]
    nbytes = 8 * len(items) * index.nbytes
    flat_src = rng.integers(0, 255, nbytes, dtype=np.uint8)
    flat_dst = np.empty_like(flat_src)
    best_digest = best_copy = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for buf in bufs:
            digest_items(buf, items, index)
        t1 = time.perf_counter()
        np.copyto(flat_dst, flat_src)
        t2 = time.perf_counter()
        best_digest, best_copy = min(best_digest, t1 - t0), min(best_copy, t2 - t1)
    return {"what": "token-major TP 4->2 slices of 512 pages x 8 buffers, host numpy", "bytes": nbytes,
            "digest_gbps": nbytes / best_digest / 1e9, "memcpy_gbps": nbytes / best_copy / 1e9,
            "digest_vs_memcpy": best_copy / best_digest}


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_report(result: dict[str, Any]) -> str:
    lines = []
    m = result["machine"]
    head = f"{m['device']}: " + (f"{m.get('gpus')} link {m.get('link')}" if m["device"] == "cuda" else
                                 f"{m['cpu']} x {m['cpus']}")
    lines.append(f"kvbridge bench transfer, {m['date']}, backend {result['settings']['backend']}; {head}")
    w = max([len(c["case"]) for c in result["cases"]] + [40])
    lines.append(f"{'case':<{w}} {'descs':>9} {'kvbridge':>9} {'raw NIXL':>9} {'per-page':>9} {'copy':>8} "
                 f"{'kvb/raw':>8} {'kvb/page':>8} {'kvb/copy':>8} {'ok':>3}")
    lines.append(f"{'':<{w}} {'/request':>9} {'GB/s':>9} {'GB/s':>9} {'GB/s':>9} {'GB/s':>8} {'':>8} {'':>8} {'':>8}")
    notes = []
    for c in result["cases"]:
        if c["error"]:
            word = "SKIPPED" if c["error"].startswith("skipped") else "FAILED"
            lines.append(f"{c['case']:<{w}} {word}: {c['error'].splitlines()[0][:120]}")
            continue
        ok = "yes" if c.get("verified") else "NO"
        lines.append(f"{c['case']:<{w}} {c['descriptors']:>9,} {c['gbps']:>9.2f} {_f(c['raw_nixl_gbps']):>9} "
                     f"{_f(c.get('per_page_gbps')):>9} {c['copy_gbps']:>8.2f} {_f(c['vs_raw_nixl'], '.3f'):>8} "
                     f"{_f(c.get('vs_per_page'), '.3f'):>8} {c['vs_copy']:>8.3f} {ok:>3}")
        if c["shared_gpu"] and c["shared_gpu"] not in notes:
            notes.append(c["shared_gpu"])
    if notes:
        lines.append("  (several ranks of one side share a GPU: " + "; ".join(notes) + ")")
    lat = result.get("latency")
    if lat and not lat.get("error"):
        lines.append(f"128-token request ({fmt_bytes(lat['bytes'])}, {lat['layers']} layers): "
                     f"p50 {lat['p50_ms']:.3f} ms, p99 {lat['p99_ms']:.3f} ms; "
                     f"control round trip {lat['control_rtt_ms']:.3f} ms + "
                     f"{lat['raw_transfer_kind']} {lat['raw_transfer_ms']:.3f} ms = {lat['baseline_ms']:.3f} ms "
                     f"(p50 / that = {lat['p50_over_baseline']:.2f})")
    elif lat:
        lines.append(f"128-token latency FAILED: {lat['error'].splitlines()[0]}")
    for st in result.get("streams") or []:
        if st.get("error"):
            lines.append(f"stream {st['case']} FAILED: {st['error'].splitlines()[0]}")
            continue
        pre, dec = st["prefill"], st["decode"]
        lines.append(f"stream {st['requests']} x {fmt_bytes(st['bytes'])}, {st['concurrency']} in flight"
                     + (f", paced {st['rate']:g}/s" if st["rate"] else "")
                     + (f", switch interval {st['switch_interval_s'] * 1e3:g} ms" if st.get("switch_interval_s")
                        else "")
                     + (f", engine progress every {st['engine_progress_s'] * 1e3:g} ms"
                        if st.get("engine_progress_s") is not None else "")
                     + f": {st['gbps']:.2f} GB/s ({st['requests_per_s']:.0f} requests/s; raw NIXL, "
                     f"{st['concurrency']} descriptors: {_f(st['raw_nixl_gbps'])} GB/s, kvb/raw "
                     f"{_f(st.get('vs_raw_nixl'), '.3f')}); latency p50 {_f(st['p50_ms'], '.3f')} ms, p99 "
                     f"{_f(st['p99_ms'], '.3f')} ms; {'verified' if st.get('verified') else 'NOT verified'}")
        lines.append(f"  engine loop ({st['engine_step_us']:.0f} us steps) loses "
                     f"{pre['engine_steps_lost'] * 100:.1f} % of its steps on the prefill, "
                     f"{dec['engine_steps_lost'] * 100:.1f} % on the decode; kvbridge CPU "
                     f"{pre['cpu_ms_per_request']:.3f} / {dec['cpu_ms_per_request']:.3f} ms per request "
                     f"(prefill / decode; of it in the engine's thread {pre['engine_thread_ms_per_request']:.3f} / "
                     f"{dec['engine_thread_ms_per_request']:.3f} ms)")
    lw = result.get("layerwise")
    if lw:
        if lw.get("error"):
            lines.append(f"layer-wise FAILED: {lw['error'].splitlines()[0]}")
        else:
            if not lw["available"]:
                lines.append(lw["reason"])
            lines.append(f"layer-wise ({lw['case']}, groups of {lw['group']} of {lw['layers']} layers; compute "
                         f"{lw['compute_per_layer_s'] * 1e3:.2f} ms per layer: {lw['compute']})")
            at_end = lw["modes"]["at_end"]
            lines.append(f"  send at the end: tail after the last layer's compute "
                         f"{at_end['median_tail_s'] * 1e3:.3f} ms "
                         f"(all layers' transfer {lw['all_layers_transfer_s'] * 1e3:.3f} ms)")
            if "layerwise" in lw["modes"]:
                lines.append(f"  layer-wise: tail {lw['modes']['layerwise']['median_tail_s'] * 1e3:.3f} ms = "
                             f"{lw['tail_over_one_group']:.2f} x one group's transfer "
                             f"({lw['one_group_transfer_s'] * 1e3:.3f} ms, estimated)")
    hs = result.get("host_staging")
    if hs and "error" not in hs:
        lines.append(f"host staging ({hs['what']}): gather {hs['gather_gbps']:.1f} GB/s, scatter "
                     f"{hs['scatter_gbps']:.1f} GB/s vs memcpy {hs['memcpy_gbps']:.1f} GB/s "
                     f"({hs['gather_vs_memcpy']:.2f}x / {hs['scatter_vs_memcpy']:.2f}x)")
    elif hs:
        lines.append(f"host staging: {hs['error']}")
    ck = result.get("checksums")
    if ck:
        lines.append(f"checksums ({ck['what']}): digest {ck['digest_gbps']:.1f} GB/s vs memcpy "
                     f"{ck['memcpy_gbps']:.1f} GB/s ({ck['digest_vs_memcpy']:.2f}x), paid once on each side")
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], opts: Options, out: TextIO = sys.stdout) -> None:
    """Plots (when asked and matplotlib is there), then the JSON (always, when asked)."""
    if opts.plots:
        from kvbridge_bench.plots import write_plots

        prefix = "gpu-" if result["machine"]["device"] == "cuda" else "cpu-"
        written, problem = write_plots(result, opts.plots, prefix)
        result["plots"] = written
        if problem:
            result["notes"].append(problem)
            print(problem, file=out)
        for written_path in written:
            print(f"plot: {written_path}", file=out)
    if opts.json_path:
        import json

        path = Path(opts.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
        print(f"json: {path}", file=out)


def _jsonable(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


# ----------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvbridge bench transfer`` (defaults are None: filled per device, see --help)."""
    g = parser.add_argument_group("transfer options (kvbridge bench transfer)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="cuda: prefill ranks on GPU 0, decode ranks on GPU 1 (default auto: cuda when present)")
    g.add_argument("--sizes", default=None, help="request sizes, all ranks together (GPU 1GiB, host 64MiB)")
    g.add_argument("--page-tokens", default=None, help="page sizes in tokens (default 16,64)")
    g.add_argument("--tp-pairs", default=None, help="prefill-decode TP pairs (default 1-1,2-1,1-2,4-2)")
    g.add_argument("--layouts", default=None, help="token-major,head-major (default both)")
    g.add_argument("--placements", default=None,
                   help="scattered,contiguous (default both; contiguous only for equal TP sizes)")
    g.add_argument("--layers", type=int, default=None, help="model layers (default GPU 32, host 8)")
    g.add_argument("--pool-tokens", type=int, default=None, help="tokens the pool holds (GPU default max(32k, 1.25x))")
    g.add_argument("--repeats", type=int, default=None, help="timed rounds per case (after one verified warm-up)")
    g.add_argument("--staging-mib", type=int, default=None, help="staging area per rank (default: the agent's)")
    g.add_argument("--staging-mode", default=None, choices=("auto", "always", "never"),
                   help="AgentConfig.staging, where the build has it (default: the agent's)")
    g.add_argument("--piece-mib", type=int, default=None,
                   help="staged pieces of at most this many MiB (staging_piece_bytes; default: the agent's)")
    g.add_argument("--layerwise", action="store_true", default=None,
                   help="also the layer-wise streaming case (simulated per-layer compute)")
    g.add_argument("--layer-group", type=int, default=None, help="layers per layer-wise post (default 1)")
    g.add_argument("--latency-requests", type=int, default=None, help="128-token requests (default GPU 200, host 100)")
    g.add_argument("--concurrency", default=None, metavar="N[,N...]",
                   help="request streams with N requests in flight per rank pair (each N a run), under an engine-loop "
                        "probe on each rank: aggregate GB/s vs raw NIXL, p50/p99, engine steps lost, CPU per request")
    g.add_argument("--rate", type=float, default=None, help="streams start at most this many requests per second")
    g.add_argument("--stream-requests", type=int, default=None, help="requests per stream (default GPU 400, host 100)")
    g.add_argument("--stream-size", default=None, help="bytes per stream request (default GPU 64MiB, host 4MiB)")
    g.add_argument("--switch-interval-ms", type=float, default=None,
                   help="streams: set the rank processes' sys.setswitchinterval (what an engine could do; Python's "
                        "default is 5 ms, the longest a thread back from a GIL-releasing call waits for the GIL)")
    g.add_argument("--engine-progress-ms", type=float, default=None,
                   help="AgentConfig.engine_progress_s of every rank, in ms: the engine's own calls run a progress "
                        "step at most this often beside the progress thread (default: unset)")
    g.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the result as JSON")
    g.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots (needs matplotlib)")
    g.add_argument("--quick", action="store_true", default=None, help="small sizes and few cases (the CI smoke run)")
    g.add_argument("--timeout", type=float, default=None, help="seconds any one step may take (default 300)")
    g.add_argument("--plugin", action="append", default=None, metavar="MODULE",
                   help="load this plugin module too (a source tree without installed entry points)")


TRANSFER_ARGS = ("device", "sizes", "page_tokens", "tp_pairs", "layouts", "placements", "layers", "pool_tokens",
                 "repeats", "staging_mib", "staging_mode", "piece_mib", "layerwise", "layer_group", "latency_requests",
                 "concurrency", "rate", "stream_requests", "stream_size", "switch_interval_ms", "engine_progress_ms",
                 "json_path", "plots", "quick", "timeout", "plugin")


def options_from_args(args: argparse.Namespace) -> Options:
    opts = Options(device=args.device or "auto", backend=args.backend, layers=args.layers,
                   pool_tokens=args.pool_tokens, repeats=args.repeats, staging_mib=args.staging_mib,
                   staging_mode=args.staging_mode, piece_mib=args.piece_mib,
                   engine_progress_ms=args.engine_progress_ms, layerwise=bool(args.layerwise),
                   layer_group=args.layer_group or 1,
                   latency_requests=args.latency_requests, json_path=args.json_path, plots=args.plots,
                   quick=bool(args.quick), timeout_s=args.timeout or 300.0, plugins=tuple(args.plugin or ()),
                   command=getattr(args, "command_line", "") or "")
    if args.sizes:
        opts.sizes = tuple(parse_size(s) for s in args.sizes.split(","))
    if args.concurrency:
        opts.concurrency = tuple(int(n) for n in str(args.concurrency).split(","))
        if any(n < 1 for n in opts.concurrency):
            raise ValueError("--concurrency: at least one request in flight")
    if args.rate is not None:
        if not args.rate >= 0:
            raise ValueError(f"--rate {args.rate}: requests per second, 0 or more")
        opts.rate = args.rate
    opts.stream_requests = args.stream_requests
    if args.switch_interval_ms is not None:
        if not 0 < args.switch_interval_ms <= 1000:
            raise ValueError(f"--switch-interval-ms {args.switch_interval_ms}: between 0 and 1000 ms")
        opts.switch_interval_ms = args.switch_interval_ms
    if args.stream_size:
        opts.stream_size = parse_size(args.stream_size)
    if args.page_tokens:
        opts.page_tokens = tuple(int(p) for p in args.page_tokens.split(","))
        if any(p < 1 for p in opts.page_tokens):
            raise ValueError("--page-tokens: pages hold at least one token")
    if args.tp_pairs:
        opts.tp_pairs = parse_tp_pairs(args.tp_pairs)
    if args.piece_mib is not None and args.piece_mib < 1:
        raise ValueError(f"--piece-mib {args.piece_mib}: a staged piece holds at least 1 MiB")
    if args.layouts:
        opts.layouts = _csv(args.layouts, LAYOUTS, "--layouts")
    if args.placements:
        opts.placements = _csv(args.placements, PLACEMENTS, "--placements")
    return opts


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"kvbridge bench transfer: {exc}", file=sys.stderr)
        return 2
    result = run(opts, out)
    print(format_report(result), file=out)
    write_outputs(result, opts, out)
    failed = [c for c in result["cases"] if not (c["error"] or "").startswith("skipped")
              and (c["error"] or not c.get("verified"))]
    others = [x for x in (result["latency"], result["layerwise"], *result.get("streams", []))
              if x and (x.get("error") or x.get("failed") or x.get("verified") is False)]
    return 1 if failed or others else 0

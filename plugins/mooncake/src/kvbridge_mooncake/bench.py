"""Benchmark: kvbridge over Mooncake vs raw Mooncake batch writes vs memcpy, in one run, two processes.

This process is the prefill side; a spawned process is the decode side (its own engine, its own pool).
For each scenario the same planner descriptors are moved four ways, interleaved round by round, medians
reported:

* ``kvbridge``      - ``MooncakeBackend.send_component`` + ``poll`` every 50 us until DONE (worker thread,
  windowed batches); ``kvbridge_handle`` is the same transfer timed by the handle itself (post to DONE as
  the transfer thread saw it, without the caller's polling delay);
* ``raw_sync``      - ``batch_transfer_sync_write`` in chunks of 1024 from the calling thread (the plain way;
  one call cannot take more than ~2048 descriptors);
* ``raw_window``    - the backend's own strategy (async batches, same chunk and window) without kvbridge;
* ``memcpy``        - numpy ``copyto`` of the same number of bytes, one contiguous block, in this process;
* ``memcpy_scattered`` - the same descriptors copied locally (kvbridge's loopback copier).

Before timing, the decode side zeroes its pool, kvbridge moves the request once, and the decode side's
digest must equal a numpy reference reshard (so the figures are for a verified transfer).

    python -m kvbridge_mooncake.bench [--layers 8] [--pages 256] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    BufferPair,
    Component,
    ComponentTransfer,
    HandleState,
    PeerInfo,
    Rank,
    RemoteBuffers,
    TransferPlan,
    buffer_segments,
    copy_descriptors,
    plan_transfer,
    region_of,
)
from kvbridge_mooncake.testing import KVShape, heads_of, spawn_peer

_PIPE_WAIT_S = 60.0
_RAW_SYNC_CHUNK = 1024
_POLL_S = 50e-6   # how often the bench polls a kvbridge handle (an engine would poll once per step)


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    """One request shape: a token-major bf16 KV pool, ``pages`` of it scattered, prefill rank 0 of ``pt``."""

    name: str
    layers: int
    pool_pages: int
    pages: int
    page: int = 16
    heads: int = 8
    head_dim: int = 128
    pt: int = 1
    dt: int = 1

    @property
    def pool(self) -> KVShape:
        return KVShape(heads=self.heads, layers=self.layers, pages=self.pool_pages, page=self.page,
                       head_dim=self.head_dim)

    def local_heads(self, tp: int) -> int:
        return self.pool.local_heads(tp)

    def component(self, tp: int) -> Component:
        return self.pool.component(tp)

    def heads_of(self, rank: int, tp: int) -> list[int]:
        return heads_of(rank, tp, self.heads)


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    scenario: str
    nbytes: int
    descriptors: int
    planner_ms: float
    send_call_us: float
    gbps: dict[str, float]
    ratios: dict[str, float]
    seconds: dict[str, float]


# ---------------------------------------------------------------- decode side (child process)
def _decode_side(conn: Any) -> None:
    from kvbridge_mooncake.backend import MooncakeBackend

    backend = MooncakeBackend(name="bench-decode")
    arrays: list[np.ndarray] = []
    registered = None
    try:
        while conn.poll(_PIPE_WAIT_S):
            cmd, arg = conn.recv()
            if cmd == "setup":
                if registered is not None:
                    backend.deregister_buffers(registered)
                sc = msgspec.msgpack.decode(arg, type=Scenario)
                comp = sc.component(sc.dt)
                arrays = [np.zeros((sc.pool_pages, *b.item_shape), dtype=np.uint16) for b in comp.buffers]
                registered = backend.register_buffers("kv", [region_of(a) for a in arrays])
                info = PeerInfo("bench-decode", backend.endpoint, (registered.remote(),))
                conn.send(msgspec.msgpack.encode(info))
            elif cmd == "zero":
                for a in arrays:
                    a.fill(0)
                conn.send(True)
            elif cmd == "digest":
                conn.send(_digest(arrays))
            else:
                break
    finally:
        backend.close()


def _digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- prefill side
def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _plan(sc: Scenario, src_arrays: Sequence[np.ndarray], remote: RemoteBuffers, src_idx: np.ndarray,
          dst_idx: np.ndarray) -> TransferPlan:
    src_comp, dst_comp = sc.component(sc.pt), sc.component(sc.dt)
    buffers = zip(src_comp.buffers, dst_comp.buffers, src_arrays, remote.regions, strict=True)
    pairs = [BufferPair(src_base=region_of(a).addr, src_item_nbytes=sb.item_nbytes,
                        src_num_items=sb.num_items, dst_base=r.addr, dst_item_nbytes=db.item_nbytes,
                        dst_num_items=db.num_items,
                        segments=buffer_segments(sb, db, Rank(0, sc.pt), Rank(0, sc.dt)))
             for sb, db, a, r in buffers]
    return plan_transfer(pairs, src_idx, dst_idx)


def _expected(sc: Scenario, full: Sequence[np.ndarray], src_idx: np.ndarray, dst_idx: np.ndarray) -> str:
    """Digest of the decode pool after prefill rank 0 wrote its heads (plain numpy head slicing)."""
    mine, theirs = sc.heads_of(0, sc.pt), sc.heads_of(0, sc.dt)
    out = []
    for f in full:
        dst = np.zeros((sc.pool_pages, sc.page, len(theirs), sc.head_dim), dtype=np.uint16)
        for h in mine:
            if h in theirs:
                dst[dst_idx, :, theirs.index(h)] = f[src_idx][:, :, h]
        out.append(dst)
    return _digest(out)


def _ask(conn: Any, cmd: str, arg: Any = None) -> Any:
    conn.send((cmd, arg))
    if not conn.poll(_PIPE_WAIT_S):
        raise RuntimeError(f"the decode process did not answer {cmd!r} within {_PIPE_WAIT_S} s")
    return conn.recv()


def _run_scenario(sc: Scenario, backend: Any, conn: Any, repeats: int, seed: int) -> Result:
    from kvbridge_mooncake.backend import MooncakeEndpoint
    from kvbridge_mooncake.engine import DEFAULT_CHUNK, DEFAULT_WINDOW

    info = msgspec.msgpack.decode(_ask(conn, "setup", msgspec.msgpack.encode(sc)), type=PeerInfo)
    peer = backend.add_peer(info)
    remote = info.component("kv")
    rng = np.random.default_rng(seed)
    full = [rng.integers(1, 2**16, (sc.pool_pages, sc.page, sc.heads, sc.head_dim), dtype=np.uint16)
            for _ in range(2 * sc.layers)]
    src_arrays = [np.ascontiguousarray(f[:, :, sc.heads_of(0, sc.pt)]) for f in full]
    src_idx = np.sort(rng.choice(sc.pool_pages, sc.pages, replace=False))
    dst_idx = rng.choice(sc.pool_pages, sc.pages, replace=False)
    registered = backend.register_buffers("kv", [region_of(a) for a in src_arrays])
    try:
        plan_times = []
        for _ in range(max(3, repeats)):
            t = time.perf_counter()
            plan = _plan(sc, src_arrays, remote, src_idx, dst_idx)
            plan_times.append(time.perf_counter() - t)
        ct = ComponentTransfer(room=1, component="kv", peer=peer, chunk=0, last=True, src=registered,
                               dst=remote, plan=plan)
        engine = backend._engine  # the raw baselines drive the very same engine directly
        session = msgspec.msgpack.decode(info.endpoint, type=MooncakeEndpoint).session
        src_l, dst_l, len_l = plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()
        nbytes, n = plan.total_nbytes, len(plan)
        call_times: list[float] = []
        handle_times: list[float] = []

        def kvbridge() -> None:
            t = time.perf_counter()
            handle = backend.send_component(ct)
            call_times.append(time.perf_counter() - t)
            while (poll := backend.poll(handle)).state is HandleState.PENDING:
                time.sleep(_POLL_S)
            if poll.state is not HandleState.DONE:
                raise RuntimeError(f"kvbridge transfer failed: {poll.reason}")
            handle_times.append(handle.elapsed)

        def raw_sync() -> None:
            for i in range(0, n, _RAW_SYNC_CHUNK):
                j = i + _RAW_SYNC_CHUNK
                rc = engine.batch_transfer_sync_write(session, src_l[i:j], dst_l[i:j], len_l[i:j])
                if rc != 0:
                    raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")

        def raw_window() -> None:
            pending: list[int] = []
            for i in range(0, n, DEFAULT_CHUNK):
                if len(pending) == DEFAULT_WINDOW and engine.get_batch_transfer_status([pending.pop(0)]) != 0:
                    raise RuntimeError("raw async batch failed")
                j = i + DEFAULT_CHUNK
                pending.append(engine.batch_transfer_async_write(session, src_l[i:j], dst_l[i:j], len_l[i:j]))
            for batch in pending:
                if engine.get_batch_transfer_status([batch]) != 0:
                    raise RuntimeError("raw async batch failed")

        block_src = np.ones(nbytes, dtype=np.uint8)
        block_dst = np.zeros(nbytes, dtype=np.uint8)
        local_pool = [np.zeros((sc.pool_pages, *b.item_shape), dtype=np.uint16)
                      for b in sc.component(sc.dt).buffers]
        remote_base = np.array([r.addr for r in remote.regions], dtype=np.uint64)
        local_base = np.array([region_of(a).addr for a in local_pool], dtype=np.uint64)
        local_dst = plan.dst_addr - remote_base[plan.buffer] + local_base[plan.buffer]

        def memcpy() -> None:
            np.copyto(block_dst, block_src)

        def memcpy_scattered() -> None:
            copy_descriptors(plan.src_addr, local_dst, plan.nbytes)

        _ask(conn, "zero")
        kvbridge()
        if _ask(conn, "digest") != _expected(sc, full, src_idx, dst_idx):
            raise RuntimeError(f"{sc.name}: the decode pool does not match the reference reshard")
        call_times.clear()
        handle_times.clear()

        methods: dict[str, Callable[[], None]] = {
            "kvbridge": kvbridge, "raw_sync": raw_sync, "raw_window": raw_window, "memcpy": memcpy,
            "memcpy_scattered": memcpy_scattered}
        times: dict[str, list[float]] = {k: [] for k in methods}
        for fn in methods.values():  # warm-up: connections, page faults
            fn()
        for _ in range(repeats):
            for name, fn in methods.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        seconds = {k: _median(v) for k, v in times.items()}
        seconds["kvbridge_handle"] = _median(handle_times[-repeats:])
        gbps = {k: nbytes / v / 1e9 for k, v in seconds.items()}
        ratios = {"kvbridge/raw_sync": seconds["raw_sync"] / seconds["kvbridge"],
                  "kvbridge/raw_window": seconds["raw_window"] / seconds["kvbridge"],
                  "kvbridge_handle/raw_window": seconds["raw_window"] / seconds["kvbridge_handle"],
                  "kvbridge/memcpy": seconds["memcpy"] / seconds["kvbridge"],
                  "kvbridge/memcpy_scattered": seconds["memcpy_scattered"] / seconds["kvbridge"]}
        return Result(scenario=sc.name, nbytes=nbytes, descriptors=n, planner_ms=_median(plan_times) * 1e3,
                      send_call_us=_median(call_times) * 1e6, gbps=gbps, ratios=ratios,
                      seconds=seconds)
    finally:
        backend.deregister_buffers(registered)
        backend.remove_peer(peer)


def default_scenarios(layers: int = 8, pages: int = 256) -> list[Scenario]:
    return [
        Scenario(name="same-tp scattered pages", layers=layers, pool_pages=2 * pages, pages=pages),
        Scenario(name="tp 2->1 per-token rows", layers=layers, pool_pages=max(8, pages // 4), pages=max(4, pages // 8),
                 pt=2),
        Scenario(name="small request (1 page)", layers=layers, pool_pages=64, pages=1),
    ]


def run_bench(scenarios: Sequence[Scenario] | None = None, *, repeats: int = 5,
              seed: int = 0) -> dict[str, Any]:
    """Run every scenario between this process and a spawned decode process; return the figures."""
    from kvbridge_mooncake.backend import MooncakeBackend

    scenarios = list(scenarios or default_scenarios())
    parent, _child, proc = spawn_peer(_decode_side)
    try:
        with MooncakeBackend(name="bench-prefill") as backend:
            results = [_run_scenario(sc, backend, parent, repeats, seed + i)
                       for i, sc in enumerate(scenarios)]
            parent.send(("exit", None))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    return {"setup": "2 processes, Mooncake TCP over 127.0.0.1, P2PHANDSHAKE", "repeats": repeats,
            "results": [asdict(r) for r in results]}


def _print(report: dict[str, Any]) -> None:
    print(f"# {report['setup']}; medians of {report['repeats']} interleaved rounds")
    for r in report["results"]:
        g, q = r["gbps"], r["ratios"]
        print(f"\n{r['scenario']}: {r['nbytes'] / 2**20:.1f} MiB in {r['descriptors']} descriptors; "
              f"planner {r['planner_ms']:.2f} ms; send_component call {r['send_call_us']:.0f} us")
        for name in ("kvbridge", "kvbridge_handle", "raw_sync", "raw_window", "memcpy", "memcpy_scattered"):
            print(f"  {name:17s} {g[name]:8.3f} GB/s  {r['seconds'][name] * 1e3:9.2f} ms")
        print("  ratios (time of baseline / time of kvbridge; 1.0 = as fast): "
              + ", ".join(f"{k} {v:.2f}" for k, v in q.items()))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; with ``argv`` None (as ``kvbridge bench --backend mooncake`` calls it) the defaults."""
    parser = argparse.ArgumentParser(prog="python -m kvbridge_mooncake.bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args([] if argv is None else argv)
    report = run_bench(default_scenarios(args.layers, args.pages), repeats=args.repeats)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``kvbridge bench planner|control`` and ``--backend NAME``: measurements printed as ratios against a baseline
measured in the same run.

* ``planner``: the DESIGN anchor request (32k tokens, 64 layers, 8 KV heads, 16-token pages scattered
  over the pool) planned at equal TP and from prefill TP 4 to decode TP 2, token-major and head-major:
  plan time and descriptors per request, against SGLang 0.5.12's figures on a 2-core host (107 ms /
  262,016 descriptors and 143 ms / 4,194,304 descriptors, shared/DESIGN.md section 10).
* ``control``: control-plane overhead of a 128-token request end to end (two agents over real ZMQ
  sockets, loopback backend), p50/p99, against a ZMQ PUSH/PULL round trip and a memcpy of the bytes.
* ``transfer``: kvbridge end to end through the agent (GPU when CUDA is present, host otherwise) against
  raw NIXL and a plain copy of the same bytes, per page size, TP pair, page layout and placement; 128-token
  latency; layer-wise streaming with simulated compute; JSON and PNG plots (``kvbridge_bench.transfer``).
* ``--backend NAME``: the backend plugin's own benchmark, the entry its spec names (``BackendSpec.bench``),
  else the one this package ships for it (``nixl``: :mod:`kvbridge_bench.nixl_backend`, kvbridge over NIXL
  against raw NIXL and memcpy).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kvbridge import BackendSpec, BufferGeometry, Component, DType, PoolLayout, Rank, ShardAxis
from kvbridge.plugin import BufferPair, buffer_segments, plan_transfer, target_ranks
from kvbridge_bench._internals import PluginKind, Registry, gather, regular_rows, resolve, scatter

_T = TypeVar("_T")
SGLANG_ANCHOR = {"equal": (107.0, 262_016), "4->2": (143.0, 4_194_304)}


def _best_ms(fn: Callable[[], _T], repeat: int = 5) -> tuple[float, _T]:
    """Best of ``repeat`` (at least one) timed calls of ``fn``, in ms, and its last result."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best, out


def bench_planner(tokens: int = 32768, layers: int = 64, heads: int = 8, head_dim: int = 128, page: int = 16,
                  pool_pages: int = 40960, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    n_pages = tokens // page
    src_pages = rng.choice(np.arange(1, pool_pages), n_pages, replace=False)
    dst_pages = rng.choice(np.arange(1, pool_pages), n_pages, replace=False)
    rows: list[dict[str, Any]] = []
    for layout in ("token-major", "head-major"):
        for label, (pt, dt) in (("equal", (4, 4)), ("4->2", (4, 2))):
            def geom(tp: int, layout: str = layout) -> BufferGeometry:
                local = heads // tp
                shape = (page, local, head_dim) if layout == "token-major" else (local, page, head_dim)
                return BufferGeometry(name="k", num_items=pool_pages, item_shape=shape, dtype=DType.BFLOAT16,
                                      shard=ShardAxis(1 if layout == "token-major" else 0, heads))
            src_g, dst_g = geom(pt), geom(dt)
            p = target_ranks(pt, dt, 0)[-1]
            seg = buffer_segments(src_g, dst_g, Rank(p, pt), Rank(0, dt))
            base_s, base_d = 1 << 40, 1 << 41
            pairs = [BufferPair(src_base=base_s + b * src_g.nbytes, src_item_nbytes=src_g.item_nbytes,
                                src_num_items=pool_pages,
                                dst_base=base_d + b * dst_g.nbytes, dst_item_nbytes=dst_g.item_nbytes,
                                dst_num_items=pool_pages, segments=seg)
                     for b in range(2 * layers)]
            ms, plan = _best_ms(functools.partial(plan_transfer, pairs, src_pages, dst_pages), repeat=3)
            sg_ms, sg_desc = SGLANG_ANCHOR[label]
            rows.append({"layout": layout, "tp": label, "plan_ms": ms, "descriptors": len(plan),
                         "sglang_ms": sg_ms, "sglang_descriptors": sg_desc, "speedup": sg_ms / ms})
    rows.append(staged_row(heads, head_dim, page, rng))
    return rows


def staged_row(heads: int, head_dim: int, page: int, rng: np.random.Generator) -> dict[str, object]:
    """Token-major 4->2 through the staging path: one descriptor per chunk; the cost moves to a host gather
    (and a scatter on arrival), measured here on a sample against a memcpy of the same bytes."""
    src_g = BufferGeometry(name="k", num_items=1024, item_shape=(page, heads // 4, head_dim),
                           dtype=DType.BFLOAT16, shard=ShardAxis(1, heads))
    dst_g = BufferGeometry(name="k", num_items=1024, item_shape=(page, heads // 2, head_dim),
                           dtype=DType.BFLOAT16, shard=ShardAxis(1, heads))
    seg = buffer_segments(src_g, dst_g, Rank(3, 4), Rank(1, 2))
    r = regular_rows(seg, src_g.item_nbytes, dst_g.item_nbytes)
    assert r is not None
    bufs = [rng.integers(0, 255, (1024, src_g.item_nbytes), dtype=np.uint8) for _ in range(8)]
    dsts = [np.zeros((1024, dst_g.item_nbytes), np.uint8) for _ in range(8)]
    items = rng.permutation(1024)[:512]
    staged = np.empty((512, 8 * r.nbytes), np.uint8)
    gather_ms, _ = _best_ms(lambda: gather(bufs, [r] * 8, items, staged))
    scatter_ms, _ = _best_ms(lambda: scatter(dsts, [r] * 8, items, staged))
    flat_src, flat_dst = staged.copy(), np.empty_like(staged)
    copy_ms, _ = _best_ms(lambda: np.copyto(flat_dst, flat_src))
    return {"layout": "token-major", "tp": "4->2 staged", "plan_ms": 0.0, "descriptors": 1,
            "sglang_ms": SGLANG_ANCHOR["4->2"][0], "sglang_descriptors": SGLANG_ANCHOR["4->2"][1],
            "speedup": float("nan"),
            "gather_gbps": staged.nbytes / gather_ms / 1e6, "scatter_gbps": staged.nbytes / scatter_ms / 1e6,
            "memcpy_gbps": staged.nbytes / copy_ms / 1e6}


_PAGE, _LAYERS, _HEADS, _HEAD_DIM = 16, 4, 8, 128


def control_layout() -> PoolLayout:
    bufs = tuple(BufferGeometry(name=f"{t}.{i}", num_items=64, item_shape=(_PAGE, _HEADS, _HEAD_DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, _HEADS))
                 for t in "kv" for i in range(_LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1, tp_rank=0,
                      page_size=_PAGE, model="bench")


def send_request(agent: Any, room: int, pages: np.ndarray, poll_s: float = 0.001) -> Any:
    """Send ``pages`` as the one chunk of ``room`` through the prefill ``agent`` once the decode side asked
    for it; returns the room's sender when its buffers are safe to reuse (not yet cleared)."""
    from kvbridge.agent import KVPoll

    sender = agent.sender(room)
    while sender.poll() < KVPoll.WaitingForInput:
        agent.link_wait(poll_s)
    sender.send(pages, last=True)
    while not sender.safe_to_reuse:
        agent.link_wait(poll_s)
    return sender


def _serve_prefill(bootstrap: str, requests: int, n_pages: int) -> None:
    """The prefill engine of the control benchmark (a separate process): answer each room when ready."""
    from kvbridge.agent import Role, TransferAgent, ZmqLink

    layout = control_layout()
    geoms = layout.components[0].buffers
    arrays = [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in geoms]
    pages = np.arange(1, 1 + n_pages)
    with TransferAgent(layout=layout, buffers={"kv": arrays}, role=Role.PREFILL,
                       link=ZmqLink(bootstrap=bootstrap), instance="bench") as pre:
        for room in range(1, requests + 1):
            send_request(pre, room, pages).clear()
        time.sleep(0.5)   # let the last notices drain before saying goodbye


def bench_control(requests: int = 300, tokens: int = 128) -> dict[str, float]:
    """Decode here, prefill in another process, real ZMQ sockets; latency of send_metadata -> Success."""
    import multiprocessing as mp

    import zmq

    from kvbridge.agent import BootstrapServer, KVPoll, Role, TransferAgent, ZmqLink
    from kvbridge_bench._internals import HostPool

    n_pages = tokens // _PAGE
    layout = control_layout()
    geoms = layout.components[0].buffers
    server = BootstrapServer().start()
    child = mp.get_context("spawn").Process(target=_serve_prefill, args=(server.address, requests, n_pages),
                                            daemon=True)
    child.start()
    pool = HostPool(layout, shared=True)      # loopback reaches another process's memory through /dev/shm
    dec = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, role=Role.DECODE,
                        link=ZmqLink(bootstrap=server.address))
    pages = np.arange(1, 1 + n_pages)
    latencies = []
    try:
        dec.connect("bench", timeout_s=30)
        for room in range(1, requests + 1):
            t0 = time.perf_counter()
            receiver = dec.receiver(room, "bench")
            receiver.send_metadata({"kv": pages})
            while (status := receiver.poll()) < KVPoll.Success:
                if status == KVPoll.Failed:
                    raise RuntimeError(receiver.failure_reason)
                dec.link_wait(0.001)
            latencies.append(time.perf_counter() - t0)
            receiver.clear()
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        dec.close()
        pool.close()
        server.close()
    nbytes = sum(g.item_nbytes for g in geoms) * n_pages
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    copy_ms, _ = _best_ms(lambda: np.copyto(dst, src), repeat=20)
    rtt_ms = zmq_rtt_ms(zmq)
    lat = np.array(latencies[10:]) * 1000           # the first rooms pay connection set-up
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "zmq_rtt_ms": rtt_ms, "memcpy_ms": copy_ms, "bytes": float(nbytes)}


def bench_poll(rooms: int = 1600, rounds: int = 5) -> dict[str, float]:
    """Cost of polling ``rooms`` in-flight decode rooms once each, as an engine's scheduler step does:
    with the progress thread running (poll reads kept state) and without it (poll runs one progress step);
    and of one ``events()`` call instead, which learns the same per step (the rooms that changed)."""
    from kvbridge.agent import LocalHub, Role, TransferAgent

    layout = control_layout()
    geoms = layout.components[0].buffers
    arrays = [[np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in geoms] for _ in range(2)]
    hub = LocalHub()
    result: dict[str, float] = {"rooms": float(rooms)}
    with TransferAgent(layout=layout, buffers={"kv": arrays[0]}, role=Role.PREFILL, link=hub.link("p"),
                       instance="bench") as pre, \
         TransferAgent(layout=layout, buffers={"kv": arrays[1]}, role=Role.DECODE, link=hub.link("d")) as dec:
        pre.start(0.001)
        dec.connect("bench", timeout_s=10)
        receivers = []
        for room in range(1, rooms + 1):
            receiver = dec.receiver(room, "bench")
            receiver.send_metadata({"kv": np.array([1 + room % 8])})
            receivers.append(receiver)
        for mode in ("no_thread", "thread"):
            if mode == "thread":
                dec.start(0.001)
            best = min(_timed(lambda: [r.poll() for r in receivers]) for _ in range(rounds))
            result[f"poll_all_ms_{mode}"] = best
            result[f"events_ms_{mode}"] = min(_timed(dec.events) for _ in range(rounds))
        for receiver in receivers:
            receiver.abort("benchmark over")
    return result


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def zmq_rtt_ms(zmq: object, rounds: int = 200) -> float:
    """Median PUSH/PULL ping-pong between two threads of this process (64-byte frames)."""
    ctx = zmq.Context.instance()  # type: ignore[attr-defined]
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)  # type: ignore[attr-defined]
    a.bind("tcp://127.0.0.1:0")
    b.bind("tcp://127.0.0.1:0")
    to_a, to_b = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)  # type: ignore[attr-defined]
    to_a.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))  # type: ignore[attr-defined]
    to_b.connect(b.getsockopt_string(zmq.LAST_ENDPOINT))  # type: ignore[attr-defined]

    def echo() -> None:
        for _ in range(rounds):
            to_a.send(b.recv())

    thread = threading.Thread(target=echo)
    thread.start()
    rtts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        to_b.send(b"x" * 64)
        a.recv()
        rtts.append(time.perf_counter() - t0)
    thread.join()
    for sock in (a, b, to_a, to_b):
        sock.close(0)
    return statistics.median(rtts) * 1000


def main_planner() -> int:
    print("planner: 32k tokens, 64 layers (K+V), 8 KV heads x 128 bf16, 16-token pages scattered (one prefill rank)")
    print(f"{'layout':<12} {'TP':<6} {'plan ms':>9} {'descriptors':>12} {'SGLang ms':>10} {'SGLang desc':>12} "
          f"{'speedup':>8}")
    for r in bench_planner():
        if "gather_gbps" in r:
            print(f"{r['layout']:<12} {r['tp']:<6}: 1 descriptor per chunk; host gather {r['gather_gbps']:.1f} GB/s, "
                  f"scatter {r['scatter_gbps']:.1f} GB/s vs memcpy {r['memcpy_gbps']:.1f} GB/s "
                  f"(ratios {r['gather_gbps'] / r['memcpy_gbps']:.2f}, {r['scatter_gbps'] / r['memcpy_gbps']:.2f})")
            continue
        print(f"{r['layout']:<12} {r['tp']:<6} {r['plan_ms']:>9.2f} {r['descriptors']:>12,} {r['sglang_ms']:>10.0f} "
              f"{r['sglang_descriptors']:>12,} {r['speedup']:>7.1f}x")
    return 0


def main_control() -> int:
    r = bench_control()
    print(f"control plane: 128-token request (4 layers K+V, {r['bytes'] / 1024:.0f} KiB), prefill and decode in two "
          "processes over ZMQ, loopback backend (in-process copy on the prefill side)")
    print(f"  kvbridge request p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms")
    print(f"  baselines: ZMQ round trip {r['zmq_rtt_ms']:.3f} ms, memcpy of the bytes {r['memcpy_ms']:.3f} ms")
    print(f"  p50 / (ZMQ RTT + memcpy) = {r['p50_ms'] / (r['zmq_rtt_ms'] + r['memcpy_ms']):.2f}x")
    p = bench_poll()
    print(f"polling {p['rooms']:.0f} in-flight decode rooms once each: {p['poll_all_ms_thread']:.2f} ms with the "
          f"progress thread (poll reads kept state), {p['poll_all_ms_no_thread']:.2f} ms without it (each poll "
          "runs one progress step)")
    print(f"  one events() call instead (the rooms that changed): {p['events_ms_thread']:.3f} ms with the progress "
          f"thread, {p['events_ms_no_thread']:.3f} ms without it")
    return 0


#: Benchmarks this package ships for backends whose spec names none (``BackendSpec.bench`` wins when set).
BACKEND_BENCHMARKS = {"nixl": "kvbridge_bench.nixl_backend:main"}


def main_backend(name: str, registry: Registry | None = None) -> int:
    """Run the benchmark the backend's spec names (``BackendSpec.bench``), else the one this package ships for
    it (:data:`BACKEND_BENCHMARKS`), also when the backend cannot run here (its benchmark then says why)."""
    registry = Registry.build() if registry is None else registry
    specs = {r.name: r.spec for r in registry.records() if r.kind is PluginKind.BACKEND}
    spec = specs.get(name)
    if not isinstance(spec, BackendSpec):
        print(f"no backend named {name!r} is installed (known: {', '.join(sorted(specs)) or 'none'})")
        return 2
    target = spec.bench if spec.bench is not None else BACKEND_BENCHMARKS.get(name)
    if target is None:
        print(f"backend {name!r} ships no benchmark (its BackendSpec names no bench)")
        return 2
    try:
        entry = resolve(target)
    except (ImportError, AttributeError) as exc:
        print(f"backend {name!r}: cannot load its benchmark ({target}): {exc}")
        return 2
    result = entry()
    return int(result) if isinstance(result, int) else 0

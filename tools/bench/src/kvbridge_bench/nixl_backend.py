"""``kvbridge bench --backend nixl`` (``python -m kvbridge_bench.nixl_backend``): what kvbridge's NIXL backend
adds on top of NIXL, and what NIXL costs against memcpy.

One run, the same bytes and descriptors for every method; the prefill side and the decode side (in this process
or, with ``--two-process``, another) each hold a kvbridge ``nixl`` backend and a raw NIXL agent
(:mod:`kvbridge_bench.raw_nixl`, NIXL's own API) over the same memory:

* ``kvbridge``: the backend's ``send_component`` with a real ``plan_transfer`` plan, polled to DONE;
* ``raw_prepped``: NIXL alone, per-page dlists prepped once (outside the timing), ``make_prepped_xfer``;
* ``raw_initialize``: NIXL alone, ``initialize_xfer`` from the plan's descriptor rows on every request;
* ``memcpy``: one plain copy of the same number of bytes (numpy on the host, ``Tensor.copy_`` on a GPU).

kvbridge's own cost per ``send_component`` is estimated as the whole call minus the raw post of the same
descriptors (``make_prepped_xfer`` + ``transfer``).

Cases: ``paged`` (same-TP KV: ``layers`` x 2 buffers, ``pages`` scattered pages of ``page_kib`` each) and
``contiguous`` (one region of the same total size, one descriptor). Each method runs ``repeats`` times,
interleaved, after one warm-up; figures are medians. Timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    BufferPair,
    ComponentTransfer,
    DeviceKind,
    HandleState,
    MemoryRegion,
    PeerInfo,
    Segments,
    TransferBackend,
    plan_transfer,
)
from kvbridge_bench._internals import Registry
from kvbridge_bench.raw_nixl import RawNixl, rows

_PEER_S = 120.0   # how long the decode process may take to answer


def _backend(name: str, options: dict[str, str] | None) -> TransferBackend:
    """kvbridge's ``nixl`` backend, built by name through the registry (this package imports no plugin)."""
    return Registry.build().create_backend("nixl", name=name, options=options)


def _raw(name: str, options: dict[str, str] | None) -> RawNixl:
    return RawNixl(name, ucx_tls=(options or {}).get("ucx_tls", ""))


def _say(*parts: object) -> None:
    """Progress on stderr, so a run cut short still tells where it was."""
    print("[bench]", *parts, file=sys.stderr, flush=True)


def _timed(fn: Callable[[], object], runs: list[float]) -> None:
    start = time.perf_counter()
    fn()
    runs.append(time.perf_counter() - start)


class _Pool:
    """``nbuf`` buffers of ``pool`` items in one allocation, host (numpy) or CUDA (torch)."""

    def __init__(self, nbuf: int, pool: int, item: int, fill: int, device: str, stamp: bool) -> None:
        host = np.empty((nbuf, pool, item), dtype=np.uint8)
        host.fill(fill)                     # written once: pages are touched before registration
        if stamp:                           # (buffer, page) in the first 8 bytes of every page
            ids = host[:, :, :8].view(np.uint64)
            ids[:, :, 0] = ((np.arange(nbuf, dtype=np.uint64)[:, None] << np.uint64(32))
                            | np.arange(pool, dtype=np.uint64))
        self.device = device
        if device == "cpu":
            self.data: Any = host
            base, kind, dev = host.ctypes.data, DeviceKind.CPU, 0
        else:
            import torch

            self.data = torch.from_numpy(host).to(device)
            torch.cuda.synchronize()
            base, kind, dev = self.data.data_ptr(), DeviceKind.CUDA, self.data.device.index or 0
        size = pool * item
        self.regions = [MemoryRegion(base + b * size, size, kind, dev) for b in range(nbuf)]
        self.mem, self.devid = ("DRAM", 0) if device == "cpu" else ("VRAM", dev)

    def stamps(self, pages: np.ndarray) -> np.ndarray:
        part = self.data[:, pages, :8]
        part = part if self.device == "cpu" else part.cpu().numpy()
        return np.ascontiguousarray(part).view(np.uint64)[:, :, 0]

    def copier(self, other: _Pool, nbytes: int) -> Callable[[], None]:
        """A plain copy of ``nbytes`` from this pool into ``other`` (memcpy, or a device copy)."""
        src, dst = self.data.reshape(-1)[:nbytes], other.data.reshape(-1)[:nbytes]
        if self.device == "cpu":
            return lambda: np.copyto(dst, src)
        import torch

        def copy() -> None:
            dst.copy_(src)
            torch.cuda.synchronize()
        return copy


class _LocalDecode:
    """The decode side in this process: its own backend, raw agent and pool."""

    def __init__(self, db: TransferBackend, raw: RawNixl, nbuf: int, pool: int, item: int, device: str) -> None:
        self.db, self.raw, self.pool = db, raw, _Pool(nbuf, pool, item, 0, device, stamp=False)
        self.reg = db.register_buffers("bench", self.pool.regions)
        self.info = PeerInfo("bench-decode", db.endpoint, (self.reg.remote(),))
        raw.register(self.pool.regions)
        self.raw_metadata = raw.metadata()

    def stamps(self, pages: np.ndarray) -> np.ndarray:
        return self.pool.stamps(pages)

    def drain(self) -> None:
        self.db.drain_notifications()
        self.raw.notices()

    def close(self) -> None:
        self.db.deregister_buffers(self.reg)
        self.raw.close()


class _RemoteDecode:
    """The decode side in a spawned process (``decode_process``), driven through a pipe."""

    def __init__(self, nbuf: int, pool: int, item: int, device: str, options: dict[str, str] | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_process, args=(child, nbuf, pool, item, device, options), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(_PEER_S):
            self.close()
            raise TimeoutError("the decode process did not start")
        self.info = msgspec.msgpack.decode(self.conn.recv_bytes(), type=PeerInfo)
        self.raw_metadata = self.conn.recv_bytes()

    def _ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(_PEER_S):
            raise TimeoutError(f"the decode process did not answer {msg[0]!r}")
        return self.conn.recv()

    def stamps(self, pages: np.ndarray) -> np.ndarray:
        return self._ask("stamps", pages)

    def drain(self) -> None:
        pass   # the decode process drains on its own

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
            self.proc.join(_PEER_S)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.conn.close()


def decode_process(conn: Any, nbuf: int, pool: int, item: int, device: str, options: dict[str, str] | None) -> None:
    """Body of the decode process: register a pool, publish PeerInfo, answer stamp queries, drain notices."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    db, raw = _backend("bench-decode", options), _raw("bench-decode", options)
    try:
        side = _LocalDecode(db, raw, nbuf, pool, item, device)
        conn.send_bytes(msgspec.msgpack.encode(side.info))
        conn.send_bytes(side.raw_metadata)
        while True:
            if not conn.poll(0.001):
                side.drain()
                continue
            msg = conn.recv()
            if msg[0] == "stamps":
                conn.send(side.stamps(msg[1]))
            else:
                break
        side.close()
    finally:
        db.close()


class _Case:
    """One layout: a source pool registered here, a destination pool registered by the decode side."""

    def __init__(self, pb: TransferBackend, raw: RawNixl, decode: _LocalDecode | _RemoteDecode, nbuf: int,
                 pool: int, item: int, fill: int, device: str, dst_device: str) -> None:
        self.pb, self.raw, self.decode, self.nbuf, self.pool, self.item = pb, raw, decode, nbuf, pool, item
        self.src = _Pool(nbuf, pool, item, fill, device, stamp=True)
        self.scratch = _Pool(nbuf, pool, item, 0, dst_device, stamp=False)   # the memcpy baseline's target
        self.src_reg = pb.register_buffers("bench", self.src.regions)
        self.info = decode.info
        self.dst_reg = self.info.component("bench")
        first = self.dst_reg.regions[0]
        self.dst_mem, self.dst_devid = ("DRAM", 0) if first.device is DeviceKind.CPU else ("VRAM", first.device_id)
        pb.add_peer(self.info)
        raw.register(self.src.regions)
        self.peer_agent = raw.add_peer(decode.raw_metadata)

    def close(self) -> None:
        self.pb.remove_peer("bench-decode")
        self.pb.deregister_buffers(self.src_reg)
        self.raw.close()

    def measure(self, src_idx: np.ndarray, dst_idx: np.ndarray, repeats: int) -> dict[str, Any]:
        seg = Segments.whole(self.item)
        pairs = [BufferPair(src_base=s.addr, src_item_nbytes=self.item, src_num_items=self.pool,
                            dst_base=d.addr, dst_item_nbytes=self.item, dst_num_items=self.pool, segments=seg)
                 for s, d in zip(self.src_reg.regions, self.dst_reg.regions)]
        plan_runs: list[float] = []
        for _ in range(repeats):
            _timed(lambda: plan_transfer(pairs, src_idx, dst_idx), plan_runs)
        plan = plan_transfer(pairs, src_idx, dst_idx)
        order = np.argsort(src_idx, kind="stable")
        s_sorted, d_sorted = src_idx[order], dst_idx[order]
        transfer = ComponentTransfer(room=1, component="bench", peer="bench-decode", chunk=0, last=True,
                                     src=self.src_reg, dst=self.info.component("bench"),
                                     plan=plan, notice=b"bench", src_items=s_sorted, dst_items=d_sorted,
                                     segments=(seg,) * self.nbuf)
        nbytes = plan.total_nbytes
        raw, peer_agent = self.raw, self.peer_agent

        # raw NIXL, prepped: one descriptor per (buffer, page), prepped once, indexed per request
        base_s = np.array([r.addr for r in self.src_reg.regions], dtype=np.uint64)
        base_d = np.array([r.addr for r in self.dst_reg.regions], dtype=np.uint64)
        pages = np.arange(self.pool, dtype=np.uint64) * np.uint64(self.item)

        def page_rows(bases: np.ndarray, devid: int) -> np.ndarray:
            return rows((bases[:, None] + pages[None, :]).ravel(), self.item, devid)

        local = raw.prep(page_rows(base_s, self.src.devid), self.src.mem)
        remote = raw.prep(page_rows(base_d, self.dst_devid), self.dst_mem, peer_agent)
        buf_off = (np.arange(self.nbuf, dtype=np.int64) * self.pool)[:, None]
        l_idx = (buf_off + s_sorted[None, :]).ravel().astype(np.int32)
        r_idx = (buf_off + d_sorted[None, :]).ravel().astype(np.int32)
        plan_rows_s = rows(plan.src_addr, plan.nbytes, self.src.devid)
        plan_rows_d = rows(plan.dst_addr, plan.nbytes, self.dst_devid)
        send_us: list[float] = []   # send_component: kvbridge's checks and indexing + NIXL's post
        post_us: list[float] = []   # make_prepped_xfer + transfer alone, same descriptors
        make_us: list[float] = []       # make_prepped_xfer alone (prepped: the per-request CPU cost)
        init_us: list[float] = []       # get_xfer_descs x2 + initialize_xfer (its per-request CPU cost)

        def kvbridge() -> None:
            t0 = time.perf_counter()
            handle = self.pb.send_component(transfer)
            send_us.append((time.perf_counter() - t0) * 1e6)
            while (poll := self.pb.poll(handle)).state is HandleState.PENDING:
                pass
            self.pb.release(handle)
            if poll.state is HandleState.FAILED:
                raise RuntimeError(poll.reason)
            self.decode.drain()

        def raw_prepped() -> None:
            t0 = time.perf_counter()
            xfer = raw.prepped(local, l_idx, remote, r_idx, b"bench")
            make_us.append((time.perf_counter() - t0) * 1e6)
            state = raw.post(xfer)
            post_us.append((time.perf_counter() - t0) * 1e6)
            raw.finish(xfer, state)
            self.decode.drain()

        def raw_initialize() -> None:
            t0 = time.perf_counter()
            xfer = raw.initialize(plan_rows_s, self.src.mem, plan_rows_d, self.dst_mem, peer_agent, b"bench")
            init_us.append((time.perf_counter() - t0) * 1e6)
            raw.finish(xfer, raw.post(xfer))
            self.decode.drain()

        memcpy = self.src.copier(self.scratch, nbytes)

        methods = {"kvbridge": kvbridge, "raw_prepped": raw_prepped, "raw_initialize": raw_initialize}
        runs: dict[str, list[float]] = {name: [] for name in (*methods, "memcpy")}
        _say(f"{len(plan)} descriptors, {nbytes / 2**20:.0f} MiB: warm-up")
        kvbridge()                                      # warm-up, then verify what it wrote
        verified = self._verify(s_sorted, d_sorted)
        for fn in methods.values():
            fn()
        for r in range(repeats):
            for name, fn in methods.items():
                _timed(fn, runs[name])
            _say(f"round {r}: " + ", ".join(f"{n} {runs[n][-1] * 1e3:.1f} ms" for n in methods))
        memcpy()
        for _ in range(repeats):
            _timed(memcpy, runs["memcpy"])
        secs = {name: statistics.median(r) for name, r in runs.items()}
        gbps = {name: nbytes / t / 1e9 for name, t in secs.items()}
        return {
            "bytes": nbytes, "descriptors": len(plan), "verified": verified,
            "plan_ms": statistics.median(plan_runs) * 1e3,
            "send_component_us": statistics.median(send_us), "raw_post_us": statistics.median(post_us),
            "kvbridge_overhead_us": statistics.median(send_us) - statistics.median(post_us),
            "make_prepped_xfer_us": statistics.median(make_us), "initialize_xfer_us": statistics.median(init_us),
            "ms": {k: v * 1e3 for k, v in secs.items()}, "gbps": gbps,
            "kvbridge_over_raw": gbps["kvbridge"] / gbps["raw_prepped"],
            "raw_over_memcpy": gbps["raw_prepped"] / gbps["memcpy"],
            "initialize_over_prepped": gbps["raw_initialize"] / gbps["raw_prepped"],
        }

    def _verify(self, s_sorted: np.ndarray, d_sorted: np.ndarray) -> bool:
        """Every moved page carries its source's (buffer, page) stamp (the body is a constant fill)."""
        return bool(np.array_equal(self.decode.stamps(d_sorted), self.src.stamps(s_sorted)))


def run_bench(*, layers: int = 64, pages: int = 256, page_kib: int = 32, pool_pages: int = 320,
              repeats: int = 5, seed: int = 0, device: str = "cpu", dst_device: str | None = None,
              two_process: bool = False, options: dict[str, str] | None = None) -> dict[str, Any]:
    """Measure both cases; return a JSON-able dict (see the module docstring). ``dst_device`` (default:
    ``device``) places the decode pools elsewhere, e.g. ``cuda:1``; ``two_process`` puts the decode side
    in a spawned process (the deployment shape; UCX then uses CMA or CUDA IPC between the two)."""
    dst_device = dst_device or device
    rng = np.random.default_rng(seed)
    pb = _backend("bench-prefill", options)
    db = None if two_process else _backend("bench-decode", options)
    out: dict[str, Any] = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                    "python": platform.python_version()},
                           "params": {"layers": layers, "pages": pages, "page_kib": page_kib,
                                      "pool_pages": pool_pages, "repeats": repeats, "device": device,
                                      "dst_device": dst_device, "two_process": two_process,
                                      "options": options or {}},
                           "cases": {}}

    def decode_side(nbuf: int, pool: int, item: int) -> _LocalDecode | _RemoteDecode:
        if db is not None:
            return _LocalDecode(db, _raw("bench-decode", options), nbuf, pool, item, dst_device)
        return _RemoteDecode(nbuf, pool, item, dst_device, options)

    total = 2 * layers * pages * page_kib * 1024
    shapes = {"paged": (2 * layers, pool_pages, page_kib * 1024, 1), "contiguous": (1, 1, total, 2)}
    try:
        for name, (nbuf, pool, item, fill) in shapes.items():
            _say(f"{name} case: {2 * nbuf * pool * item / 2**30:.2f} GiB on {device} -> {dst_device}")
            decode = decode_side(nbuf, pool, item)
            try:
                case = _Case(pb, _raw("bench-prefill", options), decode, nbuf, pool, item, fill, device,
                             dst_device)
                try:
                    if name == "paged":
                        src = rng.choice(pool_pages, size=pages, replace=False).astype(np.int64)
                        dst = rng.choice(pool_pages, size=pages, replace=False).astype(np.int64)
                    else:
                        src = dst = np.zeros(1, dtype=np.int64)
                    out["cases"][name] = case.measure(src, dst, repeats)
                finally:
                    case.close()
            finally:
                decode.close()
    finally:
        pb.close()
        if db is not None:
            db.close()
    return out


def format_report(result: dict[str, Any]) -> str:
    lines = [f"kvbridge bench --backend nixl  {result['params']}  host {result['host']}"]
    for name, c in result["cases"].items():
        g = c["gbps"]
        lines.append(
            f"{name:>10}: {c['bytes'] / 2**20:.0f} MiB in {c['descriptors']} descriptors (verified={c['verified']}); "
            f"plan {c['plan_ms']:.2f} ms; kvbridge's own cost per send_component {c['kvbridge_overhead_us']:.0f} us "
            f"(whole call {c['send_component_us']:.0f} us minus raw post {c['raw_post_us']:.0f} us; UCX may copy "
            f"inside the post)\n"
            f"{'':>12}per-request engine CPU: make_prepped_xfer {c['make_prepped_xfer_us']:.0f} us vs "
            f"get_xfer_descs+initialize_xfer {c['initialize_xfer_us']:.0f} us\n"
            f"{'':>12}GB/s  kvbridge {g['kvbridge']:.2f} | raw prepped {g['raw_prepped']:.2f} | "
            f"raw initialize_xfer {g['raw_initialize']:.2f} | memcpy {g['memcpy']:.2f}\n"
            f"{'':>12}ratios kvbridge/raw {c['kvbridge_over_raw']:.3f} | raw/memcpy {c['raw_over_memcpy']:.3f} | "
            f"initialize/prepped {c['initialize_over_prepped']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; with ``argv`` None (as ``kvbridge bench --backend nixl`` calls it) the defaults."""
    parser = argparse.ArgumentParser(prog="python -m kvbridge_bench.nixl_backend",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-kib", type=int, default=32)
    parser.add_argument("--pool-pages", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N (torch tensors in VRAM)")
    parser.add_argument("--dst-device", default=None, help="where the decode pools live (default: --device)")
    parser.add_argument("--two-process", action="store_true", help="run the decode side in another process")
    parser.add_argument("--ucx-tls", default="", help="pin UCX transports (e.g. tcp)")
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = parser.parse_args([] if argv is None else argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")   # NIXL logs INFO lines on stdout otherwise
    result = run_bench(layers=args.layers, pages=args.pages, page_kib=args.page_kib, pool_pages=args.pool_pages,
                       repeats=args.repeats, device=args.device, dst_device=args.dst_device,
                       two_process=args.two_process,
                       options={"ucx_tls": args.ucx_tls} if args.ucx_tls else None)
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

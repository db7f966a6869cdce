"""GPU check of the NIXL backend: prefill process on GPU 0, decode process on GPU 1, CUDA tensors (VRAM).

Runs kvbridge end to end (TransferAgent over ZMQ, NIXL backend, VRAM registration) for a dense GQA pool,
verifies every transferred byte on the decode GPU against a copy regenerated from the same seed, and
times the same bytes through a plain torch GPU0 -> GPU1 copy. Needs two CUDA devices, torch, nixl_cu13.

    PYTHONPATH=core:plugins/nixl/src python3 scripts/gpu_nixl_check.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import os

LAYERS, HEADS, HEAD_DIM, PAGE, POOL = 32, 8, 128, 16, 2304
CASES = (("contiguous", 2048), ("scattered", 2048))
CPU = os.environ.get("KVBRIDGE_GPU_CHECK_ON_CPU") == "1"     # a dry run of this script's logic on host memory
if CPU:
    LAYERS, POOL, CASES = 2, 64, (("contiguous", 32), ("scattered", 32))


def _dev(index: int) -> str:
    return "cpu" if CPU else f"cuda:{index}"


def _sync(index: int) -> None:
    import torch

    if not CPU:
        torch.cuda.synchronize(index)


def _layout(rank_layout: object = None):  # noqa: ANN202
    from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis

    bufs = tuple(BufferGeometry(f"{t}.{l}", POOL, (PAGE, HEADS, HEAD_DIM), DType.BFLOAT16, ShardAxis(1, HEADS))
                 for t in "kv" for l in range(LAYERS))
    return PoolLayout((Component("kv", "kv", bufs),), 1, 0, PAGE, "gpu-check")


def _tensors(device: int, seed: int | None):  # noqa: ANN202
    import torch

    out = []
    for b in range(2 * LAYERS):
        t = torch.zeros((POOL, PAGE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=_dev(device))
        if seed is not None:
            g = torch.Generator(device=_dev(device)).manual_seed(seed * 1000 + b)
            t.view(torch.int16).random_(-32768, 32767, generator=g)
        out.append(t)
    _sync(device)
    return out


def _registry():  # noqa: ANN202
    import kvbridge_nixl

    from kvbridge.registry import Registry

    return Registry.build(plugins=[kvbridge_nixl])


def _pages(case: str, n: int):  # noqa: ANN202
    import numpy as np

    rng = np.random.default_rng(7)
    if case == "contiguous":
        return np.arange(1, 1 + n), np.arange(1, 1 + n)
    return rng.permutation(np.arange(1, POOL))[:n], rng.permutation(np.arange(1, POOL))[:n]


def prefill(bootstrap: str, results: mp.Queue) -> None:
    import torch

    from kvbridge.agent import TransferAgent
    from kvbridge.wire import KVPoll, Role
    from kvbridge.zmq_link import ZmqLink

    if not CPU:
        torch.cuda.set_device(0)
    bufs = _tensors(0, seed=11)
    agent = TransferAgent(layout=_layout(), buffers={"kv": bufs}, role=Role.PREFILL, backend="nixl",
                          registry=_registry(), link=ZmqLink(bootstrap=bootstrap), instance="gpu")
    agent.start()
    try:
        for room, (case, n) in enumerate(CASES * 3, start=1):
            src, _ = _pages(case, n)
            sender = agent.sender(room)
            while sender.poll() < KVPoll.WaitingForInput:
                agent.link_wait(0.001)
            sender.send(src, last=True)
            while not sender.safe_to_reuse:
                agent.link_wait(0.0005)
            results.put(("sent", room, case, sender.poll().name, *sender.stats))
            sender.clear()
        time.sleep(2)
    finally:
        agent.close()


def decode(bootstrap: str, results: mp.Queue) -> None:
    import torch

    from kvbridge.agent import TransferAgent
    from kvbridge.wire import KVPoll, Role
    from kvbridge.zmq_link import ZmqLink

    if not CPU:
        torch.cuda.set_device(1)
    bufs = _tensors(1, seed=None)
    agent = TransferAgent(layout=_layout(), buffers={"kv": bufs}, role=Role.DECODE, backend="nixl",
                          registry=_registry(), link=ZmqLink(bootstrap=bootstrap))
    agent.start()
    try:
        agent.connect("gpu", timeout_s=120)
        expected = _tensors(1, seed=11)          # the prefill's data, regenerated from the seed on GPU 1
        for room, (case, n) in enumerate(CASES * 3, start=1):
            src, dst = _pages(case, n)
            for t in bufs:
                t.zero_()
            _sync(1)
            t0 = time.perf_counter()
            receiver = agent.receiver(room, "gpu")
            receiver.send_metadata({"kv": dst})
            while (status := receiver.poll()) < KVPoll.Success:
                if status == KVPoll.Failed:
                    break
                agent.link_wait(0.0002)
            seconds = time.perf_counter() - t0
            si, di = torch.as_tensor(src, device=_dev(1)), torch.as_tensor(dst, device=_dev(1))
            exact = status == KVPoll.Success and all(                      # bit patterns: random bf16 has NaNs
                torch.equal(b.view(torch.int16)[di], e.view(torch.int16)[si]) for b, e in zip(bufs, expected))
            untouched = torch.ones(POOL, dtype=torch.bool, device=_dev(1))
            untouched[di] = False
            clean = all(int(b[untouched].count_nonzero()) == 0 for b in bufs)
            results.put(("received", room, case, status.name, receiver.failure_reason, seconds, receiver.nbytes,
                         bool(exact), bool(clean)))
            receiver.clear()
    finally:
        agent.close()


def torch_baseline(nbytes: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=_dev(0))
    b = torch.empty(nbytes, dtype=torch.uint8, device=_dev(1))
    b.copy_(a)
    _sync(0), _sync(1)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(0), _sync(1)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_nixl_check.json")
    args = parser.parse_args()
    from kvbridge.zmq_link import BootstrapServer

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    server = BootstrapServer().start()
    procs = [ctx.Process(target=f, args=(server.address, results)) for f in (prefill, decode)]
    for p in procs:
        p.start()
    rows = []
    deadline = time.monotonic() + 400
    while sum(r[0] == "received" for r in rows) < len(CASES) * 3 and time.monotonic() < deadline:
        try:
            rows.append(results.get(timeout=5))
        except Exception:  # noqa: BLE001
            if not all(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    server.close()
    received = [r for r in rows if r[0] == "received"]
    report = {"rows": rows}
    if received:
        nbytes = max(r[6] for r in received)
        report["torch_gpu0_to_gpu1_GBps"] = torch_baseline(nbytes)
        for case, _ in CASES:
            best = min((r[5] for r in received if r[2] == case and r[3] == "Success"), default=None)
            if best:
                report[f"kvbridge_{case}_GBps"] = nbytes / best / 1e9
        report["all_exact"] = all(r[7] and r[8] for r in received) and len(received) == len(CASES) * 3
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

"""GPU check of the NIXL backend: prefill rank processes on GPU 0, a decode process on GPU 1, CUDA tensors.

Runs kvbridge end to end (TransferAgent over ZMQ, NIXL backend, VRAM registration) for a dense GQA pool
(token-major pages, 8 KV heads): same TP with contiguous and scattered pages, and prefill TP 2 -> decode
TP 1 with scattered pages, each through the path the cost model picks (``AgentConfig.staging="auto"``:
contiguous pages as few large descriptors, scattered ones staged: gathered on the prefill GPU on the agent's
own stream in pieces, written, scattered on the decode GPU) and with the descriptor path forced
(``"never"``: one descriptor per page, or per token row across TP sizes); and a layer-wise send (the same
pages posted once per group of layers). Every transferred byte is verified on the decode GPU against data
regenerated from the same seeds; the bytes' throughput is compared with a torch GPU0 -> GPU1 copy.

    PYTHONPATH=core:plugins/nixl/src:tools/bench/src python3 scripts/gpu_nixl_check.py --out result.json
    ... --only "tp2->1"                    (configs whose label contains the text)
    KVBRIDGE_GPU_CHECK_ON_CPU=1 ... (a small dry run of the same logic on host memory)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

LAYERS, HEADS, HEAD_DIM, PAGE, POOL, N = 32, 8, 128, 16, 2304, 2048
CPU = os.environ.get("KVBRIDGE_GPU_CHECK_ON_CPU") == "1"
if CPU:
    LAYERS, POOL, N = 2, 64, 32
#: (label, prefill TP, page placement, staging bytes per rank, AgentConfig.staging, layer groups or 0)
CONFIGS = (("same-tp contiguous auto", 1, "contiguous", 5 << 30, "auto", 0),
           ("same-tp scattered auto", 1, "scattered", 5 << 30, "auto", 0),
           ("same-tp scattered per-page", 1, "scattered", 0, "never", 0),
           ("tp2->1 scattered auto", 2, "scattered", 5 << 30, "auto", 0),
           ("tp2->1 scattered per-token", 2, "scattered", 0, "never", 0),
           ("same-tp scattered auto layer-wise x4", 1, "scattered", 5 << 30, "auto", 4))
REPEAT = 3
PIECE = 256 << 20
#: the agents' progress loop interval: staged pieces are posted (and counted) when the loop sees their
#: CUDA events complete, so a coarse interval would add its length to every pipeline stage it waits for
POLL_S = 0.0002


def _dev(index: int) -> str:
    return "cpu" if CPU else f"cuda:{index}"


def _sync(index: int) -> None:
    import torch

    if not CPU:
        torch.cuda.synchronize(index)


def _layout(tp: int, rank: int):
    from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis

    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=POOL, item_shape=(PAGE, HEADS // tp, HEAD_DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, HEADS))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp,
                      tp_rank=rank, page_size=PAGE, model="gpu-check")


def _tensors(device: int, heads: int, seed: int | None):
    import torch

    out = []
    for b in range(2 * LAYERS):
        t = torch.zeros((POOL, PAGE, heads, HEAD_DIM), dtype=torch.bfloat16, device=_dev(device))
        if seed is not None:
            g = torch.Generator(device=_dev(device)).manual_seed(seed * 1000 + b)
            t.view(torch.int16).random_(-32768, 32767, generator=g)
        out.append(t)
    _sync(device)
    return out


def _registry():
    import kvbridge_nixl
    from kvbridge.registry import Registry

    return Registry.build(plugins=[kvbridge_nixl])


def _pages(placement: str):
    import numpy as np

    if placement == "contiguous":
        return np.arange(1, 1 + N), np.arange(1, 1 + N)
    rng = np.random.default_rng(7)
    return rng.permutation(np.arange(1, POOL))[:N], rng.permutation(np.arange(1, POOL))[:N]


def _send_layerwise(agent, room: int, pages, groups: int):
    from kvbridge.protocol.wire import KVPoll

    sender = agent.sender(room)
    while sender.poll() < KVPoll.WaitingForInput:
        agent.link_wait(0.0005)
    groups = min(groups, LAYERS)
    per = LAYERS // groups
    for g in range(groups):
        stop = LAYERS if g == groups - 1 else (g + 1) * per
        sender.send(pages, last=g == groups - 1, layers=range(g * per, stop))
    while not sender.safe_to_reuse:
        agent.link_wait(0.0005)
    return sender


def prefill(bootstrap: str, results: mp.Queue, tp: int, rank: int, placement: str, staging: int, mode: str,
            groups: int) -> None:
    import torch

    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import Role
    from kvbridge.zmq_link import ZmqLink
    from kvbridge_bench.micro import send_request

    if not CPU:
        torch.cuda.set_device(0)
    bufs = _tensors(0, HEADS // tp, seed=11 + rank)
    staging = min(staging, 64 << 20) if CPU else min(staging, 1 << 30)   # the prefill stages piece by piece
    piece = min(PIECE, 4 << 20) if CPU else PIECE
    agent = TransferAgent(layout=_layout(tp, rank), buffers={"kv": bufs}, role=Role.PREFILL, backend="nixl",
                          registry=_registry(), link=ZmqLink(bootstrap=bootstrap), instance="gpu",
                          config=AgentConfig(staging_bytes=staging, staging=mode, staging_piece_bytes=piece))
    agent.start(POLL_S)
    try:
        src, _ = _pages(placement)
        for room in range(1, REPEAT + 1):
            sender = (_send_layerwise(agent, room, src, groups) if groups
                      else send_request(agent, room, src, poll_s=0.0005))
            results.put(("sent", rank, room, sender.poll().name, *sender.stats))
            sender.clear()
        time.sleep(2)
    finally:
        agent.close()


def decode(bootstrap: str, results: mp.Queue, tp: int, placement: str, staging: int, mode: str,
           groups: int) -> None:
    import torch

    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import KVPoll, Role
    from kvbridge.zmq_link import ZmqLink

    if not CPU:
        torch.cuda.set_device(1)
    bufs = _tensors(1, HEADS, seed=None)
    staging = min(staging, 64 << 20) if CPU else staging
    agent = TransferAgent(layout=_layout(1, 0), buffers={"kv": bufs}, role=Role.DECODE, backend="nixl",
                          registry=_registry(), link=ZmqLink(bootstrap=bootstrap),
                          config=AgentConfig(staging_bytes=staging, staging=mode))
    agent.start(POLL_S)
    try:
        agent.connect("gpu", timeout_s=120)
        expected = [_tensors(1, HEADS // tp, seed=11 + r) for r in range(tp)]   # regenerated on GPU 1
        src, dst = _pages(placement)
        si, di = torch.as_tensor(src, device=_dev(1)), torch.as_tensor(dst, device=_dev(1))
        for room in range(1, REPEAT + 1):
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
            h = HEADS // tp
            exact = status == KVPoll.Success and all(   # compare bit patterns: random bf16 has NaNs
                torch.equal(b.view(torch.int16)[di][:, :, r * h:(r + 1) * h], e[i].view(torch.int16)[si])
                for i, b in enumerate(bufs) for r, e in enumerate(expected))
            untouched = torch.ones(POOL, dtype=torch.bool, device=_dev(1))
            untouched[di] = False
            clean = all(int(b[untouched].count_nonzero()) == 0 for b in bufs)
            staged = bool(agent.decode.rooms[room].staged) if agent.decode is not None else False
            results.put(("received", room, status.name, receiver.failure_reason, seconds, receiver.nbytes,
                         bool(exact), bool(clean), staged))
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


def run_config(label: str, tp: int, placement: str, staging: int, mode: str, groups: int) -> dict[str, object]:
    from kvbridge.zmq_link import BootstrapServer

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    server = BootstrapServer().start()
    procs = [ctx.Process(target=prefill, args=(server.address, results, tp, r, placement, staging, mode, groups))
             for r in range(tp)]
    procs.append(ctx.Process(target=decode, args=(server.address, results, tp, placement, staging, mode, groups)))
    for p in procs:
        p.start()
    rows: list[tuple] = []
    deadline = time.monotonic() + 240
    while sum(r[0] == "received" for r in rows) < REPEAT and time.monotonic() < deadline:
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
    sent = [r for r in rows if r[0] == "sent"]
    ok = [r for r in received if r[2] == "Success"]
    nbytes = max((r[5] for r in received), default=0)
    return {"config": label, "prefill_tp": tp, "pages": placement, "staging": mode, "layer_groups": groups,
            "staged": any(r[8] for r in received),
            "requests": len(received), "byte_exact": len(received) == REPEAT and all(r[6] and r[7] for r in received),
            "bytes_per_request": nbytes, "descriptors_per_request": sum(r[5] for r in sent) // max(1, REPEAT),
            "best_s": min((r[4] for r in ok), default=None),
            "GBps": (nbytes / min(r[4] for r in ok) / 1e9) if ok else None,
            "failures": [r[3] for r in received if r[2] != "Success"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_nixl_check.json")
    parser.add_argument("--only", default="", help="run the configs whose label contains this text")
    args = parser.parse_args()
    report = {"configs": [run_config(*c) for c in CONFIGS if args.only in c[0]]}
    nbytes = max(c["bytes_per_request"] for c in report["configs"])  # type: ignore[type-var]
    report["torch_gpu0_to_gpu1_GBps"] = torch_baseline(int(nbytes)) if nbytes else None
    for c in report["configs"]:
        if c["GBps"] and report["torch_gpu0_to_gpu1_GBps"]:
            c["vs_torch_copy"] = c["GBps"] / report["torch_gpu0_to_gpu1_GBps"]
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

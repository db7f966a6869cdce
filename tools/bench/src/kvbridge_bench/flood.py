"""``kvbridge bench flood``: healthy requests' latency while a flood of forged (bad-MAC) frames hits both agents.

A prefill (another process) and a decode (this process) share a secret and talk over real ZMQ sockets on
127.0.0.1; each request moves 128 tokens (the control benchmark's pool). First a baseline: requests one after
another for ``baseline_s``. Then a flooder process sends frames whose MAC is wrong to both agents' control
sockets, at most ``rate`` per second for at most ``seconds`` (bounded in count and time), while the decode keeps
issuing requests. Printed: p50/p99 of each phase and their ratio (flood / baseline), frames sent and rejected.
Nothing is asserted here (``tools/bench/tests/test_bench_flood.py`` runs a short one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from kvbridge_bench.micro import control_layout

_SECRET = b"kvbridge bench flood: the cluster's secret"
_PAGES = 8                          # 128 tokens of 16-token pages


def _serve(bootstrap: str, stop: Any, report: Any) -> None:
    """The prefill engine: answer rooms 1, 2, ... as the decode asks for them, until ``stop`` is set."""
    from kvbridge.agent import AgentConfig, KVPoll, Role, TransferAgent, ZmqLink

    layout = control_layout()
    arrays = [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]
    pages = np.arange(1, 1 + _PAGES)
    pre = TransferAgent(layout=layout, buffers={"kv": arrays}, role=Role.PREFILL, instance="flood",
                        link=ZmqLink(bootstrap=bootstrap, secret=_SECRET), config=AgentConfig(secret=_SECRET))
    report.put(("address", pre.link.address))
    room = 0
    try:
        while not stop.is_set():
            room += 1
            sender = pre.sender(room)
            while sender.poll() < KVPoll.WaitingForInput and not stop.is_set():
                pre.link_wait(0.001)
            if stop.is_set():
                break
            sender.send(pages, last=True)
            while not sender.safe_to_reuse and not stop.is_set():
                pre.link_wait(0.001)
            sender.clear()
    finally:
        report.put(("rejected", pre.rejected_frames))
        pre.close()


def _flood(addresses: list[str], rate: int, seconds: float, report: Any) -> None:
    """Send forged frames (a real envelope under a wrong MAC) to ``addresses`` (127.0.0.1 only): at most
    ``rate`` per second and ``rate * seconds`` in all, for at most ``seconds``."""
    import zmq

    from kvbridge_bench._internals import Codec, Heartbeat

    ctx = zmq.Context()
    socks = []
    for address in addresses:
        if not address.startswith("tcp://127.0.0.1:"):
            raise ValueError(f"the flood goes to 127.0.0.1 only, not {address}")
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(address)
        socks.append((address, sock))
    forger = Codec(b"a guessed secret", sender="mallory", address="tcp://127.0.0.1:1")
    frames = {a: [forger.encode(Heartbeat(agent="mallory", address="tcp://127.0.0.1:1", seq=i), to=a)
                  for i in range(64)] for a in addresses}
    limit, sent, refused = int(rate * seconds), 0, 0
    started = time.monotonic()
    tick = 0.01
    while sent + refused < limit and time.monotonic() - started < seconds:
        due = min(limit, int((time.monotonic() - started + tick) * rate)) - sent - refused
        for i in range(max(0, due)):
            address, sock = socks[i % len(socks)]
            try:
                sock.send(frames[address][i % 64], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                refused += 1
        time.sleep(tick)
    report.put(("flood", sent, refused, time.monotonic() - started))
    for _, sock in socks:
        sock.close(0)
    ctx.term()


def _request(dec: Any, room: int, pages: np.ndarray) -> float:
    from kvbridge.agent import KVPoll

    started = time.perf_counter()
    receiver = dec.receiver(room, "flood")
    receiver.send_metadata({"kv": pages})
    while (status := receiver.poll()) < KVPoll.Success:
        if status == KVPoll.Failed:
            raise RuntimeError(f"room {room} failed: {receiver.failure_reason}")
        dec.link_wait(0.001)
    took = time.perf_counter() - started
    receiver.clear()
    return took


def bench_flood(seconds: float = 10.0, rate: int = 10_000, baseline_s: float = 3.0) -> dict[str, float]:
    """Latency of healthy requests before and during a bounded flood of bad-MAC frames (see the module doc)."""
    from kvbridge.agent import AgentConfig, BootstrapServer, Role, TransferAgent, ZmqLink
    from kvbridge_bench._internals import HostPool

    spawn = mp.get_context("spawn")
    server = BootstrapServer(secret=_SECRET).start()
    stop, report = spawn.Event(), spawn.Queue()
    child = spawn.Process(target=_serve, args=(server.address, stop, report), daemon=True)
    child.start()
    layout = control_layout()
    pool = HostPool(layout, shared=True)
    dec = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, role=Role.DECODE,
                        link=ZmqLink(bootstrap=server.address, secret=_SECRET), config=AgentConfig(secret=_SECRET))
    pages = np.arange(1, 1 + _PAGES)
    baseline: list[float] = []
    flooded: list[float] = []
    flooder = None
    room = 0
    try:
        kind, prefill_address = report.get(timeout=60)
        dec.connect("flood", timeout_s=30)
        for _ in range(10):                        # connection set-up, not measured
            room += 1
            _request(dec, room, pages)
        started = time.monotonic()
        while time.monotonic() - started < baseline_s:
            room += 1
            baseline.append(_request(dec, room, pages))
        flooder = spawn.Process(target=_flood, args=([dec.link.address, prefill_address], rate, seconds, report),
                                daemon=True)
        flooder.start()
        time.sleep(0.2)                            # the flood is under way before the first measured request
        while flooder.is_alive():
            room += 1
            flooded.append(_request(dec, room, pages))
        flooder.join(timeout=5)
        stop.set()
        results: dict[str, Any] = {}
        for _ in range(2):
            item = report.get(timeout=30)
            results[item[0]] = item[1:]
    finally:
        stop.set()
        for proc in (flooder, child):
            if proc is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
        dec.close()
        pool.close()
        server.close()
    sent, refused, flood_s = results.get("flood", (0, 0, 0.0))
    base, during = np.array(baseline) * 1000, np.array(flooded or [float("nan")]) * 1000
    out = {"baseline_p50_ms": float(np.percentile(base, 50)), "baseline_p99_ms": float(np.percentile(base, 99)),
           "flood_p50_ms": float(np.percentile(during, 50)), "flood_p99_ms": float(np.percentile(during, 99)),
           "baseline_requests": float(len(baseline)), "flood_requests": float(len(flooded)),
           "frames_sent": float(sent), "frames_refused_by_zmq": float(refused), "flood_s": float(flood_s),
           "rejected_decode": float(dec.rejected_frames), "rejected_prefill": float(results.get("rejected", (0,))[0])}
    out["p50_ratio"] = out["flood_p50_ms"] / out["baseline_p50_ms"]
    out["p99_ratio"] = out["flood_p99_ms"] / out["baseline_p99_ms"]
    return out


def main(seconds: float = 10.0, rate: int = 10_000) -> int:
    r = bench_flood(seconds, rate)
    print(f"flood: bad-MAC frames to both agents (127.0.0.1, real ZMQ, secret set), at most {rate}/s for "
          f"{seconds} s; {os.cpu_count()} CPUs")
    per_s = r["frames_sent"] / max(r["flood_s"], 1e-9)
    print(f"  sent {r['frames_sent']:.0f} frames in {r['flood_s']:.1f} s ({per_s:.0f}/s; "
          f"{r['frames_refused_by_zmq']:.0f} not taken by ZMQ), rejected: decode {r['rejected_decode']:.0f}, "
          f"prefill {r['rejected_prefill']:.0f}")
    print(f"  healthy 128-token requests: baseline p50 {r['baseline_p50_ms']:.2f} ms, p99 "
          f"{r['baseline_p99_ms']:.2f} ms ({r['baseline_requests']:.0f}); under the flood p50 "
          f"{r['flood_p50_ms']:.2f} ms, p99 {r['flood_p99_ms']:.2f} ms ({r['flood_requests']:.0f})")
    print(f"  ratio flood / baseline: p50 {r['p50_ratio']:.2f}x, p99 {r['p99_ratio']:.2f}x")
    return 0

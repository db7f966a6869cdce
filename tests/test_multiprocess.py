"""Prefill and decode ranks in separate processes: the demo matrix, rank kills, and resource hygiene."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _tpmatrix import pair_cases

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.demo.model import RequestShape
from kvbridge.demo.presets import get_preset
from kvbridge.demo.ranks import rank_context
from kvbridge.demo.run import run_demo
from kvbridge.demo.worker import (
    INSTANCE,
    SEGMENT_PREFIX,
    WorkerConfig,
    allocate_items,
    make_requests,
    reap_segments,
    run_worker,
)
from kvbridge.geometry import PoolLayout
from kvbridge.hostpool import HostPool
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.zmq_link import BootstrapServer, ZmqLink

pytestmark = pytest.mark.kvbridge_multiprocess


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _orphans(names: set[str]) -> set[str]:
    """Demo segments whose owning process is gone (other test sessions on this host may be running)."""
    out = set()
    for name in names:
        if name.startswith(SEGMENT_PREFIX):
            pid = int(name[len(SEGMENT_PREFIX):].split("-")[0])
            if not os.path.exists(f"/proc/{pid}"):
                out.add(name)
    return out


@pytest.fixture(scope="module", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = _shm()
    yield
    leaked = _orphans(_shm() - before)
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.mark.parametrize("preset, pt, dt", pair_cases(("dense-gqa", "mla")))
def test_demo_across_processes_is_byte_exact(preset: str, pt: int, dt: int) -> None:
    out = io.StringIO()
    summary = run_demo(backend="loopback", preset=preset, prefill_tp=pt, decode_tp=dt, requests=6, seed=pt * 10 + dt,
                       window=3, region_pages=6, timeout_s=60, out=out)
    assert summary.ok, out.getvalue()
    assert "verified: 6/6 byte-exact" in out.getvalue()
    assert not mp.active_children()


def _layout(role: Role, rank: int, tp: int, window: int, region_pages: int) -> PoolLayout:
    preset = get_preset("dense-gqa")
    items = 1 + window * region_pages
    return PoolLayout(components=tuple(m.component(tp, items) for m in preset.components), tp_size=tp,
                      tp_rank=rank, page_size=preset.page_size, model=preset.model)


def _one_rank(role: Role, bootstrap: str, seed: int, region_pages: int, **extra: float) -> WorkerConfig:
    """A 1-rank dense-gqa loopback worker of one request (window 1)."""
    return WorkerConfig(role=role, rank=0, prefill_tp=1, decode_tp=1, preset="dense-gqa", backend="loopback",
                        bootstrap=bootstrap, requests=1, seed=seed, window=1, region_pages=region_pages,
                        timeout_s=60, **extra)


def _this_side(child: WorkerConfig) -> tuple[RequestShape, PoolLayout, HostPool]:
    """The child's request, and the layout and shared pool of the rank this process plays against it."""
    request = make_requests(child.seed, 1, 16, child.region_pages)[0]
    role = Role.DECODE if child.role is Role.PREFILL else Role.PREFILL
    layout = _layout(role, 0, 1, 1, child.region_pages)
    return request, layout, HostPool(layout, shared=True)


_QUEUES: list[object] = []


def _child(cfg: WorkerConfig) -> mp.Process:
    ctx = rank_context(cfg.backend)
    results = ctx.Queue()
    _QUEUES.append(results)          # the queue must outlive the child's start-up
    proc = ctx.Process(target=run_worker, args=(cfg, results), daemon=True)
    proc.start()
    return proc


def _kill(proc: mp.Process) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
    proc.join(timeout=10)
    reap_segments(proc.pid)  # type: ignore[arg-type]


def _wait(predicate, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.005)
    return time.monotonic() - started


def test_kill_decode_rank_mid_transfer_fails_prefill_rooms_within_bound() -> None:
    server = BootstrapServer().start()
    cfg = _one_rank(Role.DECODE, server.address, seed=3, region_pages=8)
    request, layout, pool = _this_side(cfg)
    agent = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, role=Role.PREFILL,
                          link=ZmqLink(bootstrap=server.address),
                          instance=INSTANCE, config=AgentConfig(peer_timeout_s=1.0, heartbeat_interval_s=0.1))
    agent.start()
    child = _child(cfg)
    try:
        sender = agent.sender(request.room)
        _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, 30)
        items = allocate_items(_one_rank(Role.PREFILL, "", seed=3, region_pages=8), request)
        if len(items) > 1:
            sender.send(items[:1])
        _kill(child)
        took = _wait(lambda: sender.poll() == KVPoll.Failed, 5)
        assert took < 1.0 + 1.5, f"took {took:.2f} s to notice the dead decode rank"
        assert "dead" in sender.failure_reason or "gone" in sender.failure_reason
        assert sender.safe_to_reuse
        sender.clear()
    finally:
        _kill(child)
        agent.close()
        pool.close()
        server.close()


def test_kill_prefill_rank_mid_transfer_fails_decode_rooms_within_bound() -> None:
    server = BootstrapServer().start()
    cfg = _one_rank(Role.PREFILL, server.address, seed=5, region_pages=8, pace_s=30.0)
    request, layout, pool = _this_side(cfg)
    child = _child(cfg)
    agent = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, role=Role.DECODE,
                          link=ZmqLink(bootstrap=server.address),
                          config=AgentConfig(peer_timeout_s=1.0, heartbeat_interval_s=0.1))
    agent.start()
    try:
        agent.connect(INSTANCE, timeout_s=30)
        receiver = agent.receiver(request.room, INSTANCE)
        items = np.arange(1, 1 + max(1, len(request.positions)))
        receiver.send_metadata({"kv": items[: len(request.positions)]})
        _wait(lambda: receiver.poll() >= KVPoll.Transferring, 30)   # the child sent its first chunk and pauses
        _kill(child)
        took = _wait(lambda: receiver.poll() == KVPoll.Failed, 5)
        assert took < 1.0 + 1.5, f"took {took:.2f} s to notice the dead prefill rank"
        assert receiver.safe_to_reuse      # a dead sender writes nothing more
        receiver.clear()
    finally:
        _kill(child)
        agent.close()
        pool.close()
        server.close()


def test_unsupported_topology_is_refused_before_starting() -> None:
    from kvbridge.errors import UnsupportedTopology

    with pytest.raises(UnsupportedTopology, match="prefill TP 3 and decode TP 2"):
        run_demo(backend="loopback", preset="dense-gqa", prefill_tp=3, decode_tp=2, requests=1, seed=0)


def test_garbage_frames_do_not_kill_a_peer_process() -> None:
    server = BootstrapServer().start()
    cfg = _one_rank(Role.PREFILL, server.address, seed=9, region_pages=4)
    request, layout, pool = _this_side(cfg)
    child = _child(cfg)
    link = ZmqLink(bootstrap=server.address)
    agent = TransferAgent(layout=layout, buffers=pool.buffers, staging=pool.staging, role=Role.DECODE, link=link)
    try:
        _wait(lambda: (info := link.lookup(INSTANCE)) is not None and info.complete, 30)
        target = link.lookup(INSTANCE).addresses[0]  # type: ignore[union-attr]
        rng = np.random.default_rng(0)
        for size in (0, 1, 7, 64, 4096):
            link.send(target, rng.bytes(size))
        link.send(target, b"\x92\x01\x81\xa4type\xa5hello")           # a Hello with no fields
        link.send(target, b"\x92\x09\x81\xa4type\xa6notice")          # an unknown protocol version
        agent.start()
        agent.connect(INSTANCE, timeout_s=30)
        items = np.arange(1, 1 + len(request.positions))
        receiver = agent.receiver(request.room, INSTANCE)
        receiver.send_metadata({"kv": items}, prefix_len=request.prefix_pages * 16)
        _wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 30)
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        model = get_preset("dense-gqa").components[0]
        assert model.verify(pool.buffers["kv"], 1, 0, request, items) == 0
        assert child.is_alive() or child.exitcode == 0
    finally:
        agent.close()
        child.join(timeout=20)
        _kill(child)
        pool.close()
        server.close()

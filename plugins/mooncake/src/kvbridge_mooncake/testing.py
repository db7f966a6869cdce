"""Test helpers of the mooncake plugin: KV pools, an independent reference reshard, planning, polling,
and the decode-side peer process of the two-process test (importable from a spawned process).

The reference reshard uses only numpy head slicing of a full (all-heads) tensor; it never calls
kvbridge.slicing, which the tests use only to *build* plans.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    BufferGeometry,
    BufferPair,
    Component,
    ComponentTransfer,
    DType,
    HandleState,
    PeerInfo,
    Poll,
    Rank,
    RegisteredBuffers,
    RemoteBuffers,
    ShardAxis,
    TransferPlan,
    buffer_segments,
    plan_transfer,
    region_of,
)
from kvbridge_mooncake.availability import probe


def spawn_peer(target: Callable[[Any], None]) -> tuple[Any, Any, Any]:
    """Start ``target(conn)`` in a spawned daemon process; returns (this end of the pipe, the child's end,
    the process). The caller joins (or kills) the process and closes its end."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    return parent, child, proc


def unavailable_reason() -> str | None:
    """Why the real engine cannot run here (for a skip marker), or None when it can."""
    result = probe()
    return None if result.available else f"mooncake unavailable: {result.reason} ({result.hint})"


@dataclass(frozen=True, slots=True, kw_only=True)
class KVShape:
    """A token-major KV pool: ``layers`` K and V buffers of ``[pages, page, heads/TP, head_dim]`` bf16."""

    heads: int = 4
    layers: int = 2
    pages: int = 12
    page: int = 4
    head_dim: int = 8

    def local_heads(self, tp: int) -> int:
        return self.heads // tp if self.heads >= tp else 1

    def component(self, tp: int) -> Component:
        shape = (self.page, self.local_heads(tp), self.head_dim)
        return Component(name="kv", state_type="kv", buffers=tuple(
            BufferGeometry(name=f"{t}.{layer}", num_items=self.pages, item_shape=shape, dtype=DType.BFLOAT16,
                           shard=ShardAxis(axis=1, total=self.heads))
            for t in "kv" for layer in range(self.layers)))

    def full(self, seed: int) -> list[np.ndarray]:
        """The un-sharded pool, one ``[pages, page, heads, head_dim]`` uint16 array per buffer."""
        rng = np.random.default_rng(seed)
        return [rng.integers(1, 2**16, (self.pages, self.page, self.heads, self.head_dim), dtype=np.uint16)
                for _ in range(2 * self.layers)]


def heads_of(rank: int, tp: int, total: int) -> list[int]:
    """The global heads TP rank ``rank`` holds (one replicated head when there are fewer heads than ranks)."""
    if total >= tp:
        n = total // tp
        return list(range(rank * n, rank * n + n))
    return [rank // (tp // total)]


def shard(full: list[np.ndarray], rank: int, tp: int, total: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(f[:, :, heads_of(rank, tp, total), :]) for f in full]


def reference_reshard(full: list[np.ndarray], src_idx: np.ndarray, dst_idx: np.ndarray, rank: int, tp: int,
                      total: int, pages: int) -> list[np.ndarray]:
    """What decode rank ``rank`` holds after the transfer: request pages at ``dst_idx``, zeros elsewhere."""
    out = []
    for f in full:
        expected = np.zeros((pages, f.shape[1], len(heads_of(rank, tp, total)), f.shape[3]), dtype=f.dtype)
        expected[dst_idx] = f[src_idx][:, :, heads_of(rank, tp, total), :]
        out.append(expected)
    return out


def plan_between(src_comp: Component, dst_comp: Component, src_arrays: Sequence[np.ndarray],
                 dst_regions: Sequence[Any], src: Rank, dst: Rank, src_idx: np.ndarray,
                 dst_idx: np.ndarray) -> TransferPlan:
    """The real planner's plan of what ``src`` writes into ``dst`` (empty when it writes nothing)."""
    pairs = []
    for sb, db, arr, dreg in zip(src_comp.buffers, dst_comp.buffers, src_arrays, dst_regions, strict=True):
        segments = buffer_segments(sb, db, src, dst)
        pairs.append(BufferPair(src_base=region_of(arr).addr, src_item_nbytes=sb.item_nbytes,
                                src_num_items=sb.num_items, dst_base=dreg.addr, dst_item_nbytes=db.item_nbytes,
                                dst_num_items=db.num_items, segments=segments))
    return plan_transfer(pairs, src_idx, dst_idx)


def transfer(plan: TransferPlan, src: RegisteredBuffers, dst: RemoteBuffers, peer: str, room: int = 1,
             component: str = "kv") -> ComponentTransfer:
    return ComponentTransfer(room=room, component=component, peer=peer, chunk=0, last=True, src=src, dst=dst,
                             plan=plan)


def raw_plan(src: np.ndarray, dst: np.ndarray, dst_addr: np.ndarray | None = None,
             nbytes: int = 0) -> TransferPlan:
    """A plan copying all of ``src`` into ``dst`` as one descriptor (or to explicit addresses)."""
    n = nbytes or src.nbytes
    d = np.array([dst.ctypes.data], dtype=np.uint64) if dst_addr is None else dst_addr
    return TransferPlan(np.array([src.ctypes.data], dtype=np.uint64), d, np.array([n], dtype=np.uint64),
                        np.zeros(1, dtype=np.int32))


def wait_all(backend: Any, handles: Sequence[Any], timeout: float = 30.0) -> list[Poll]:
    """Poll every handle until it is terminal; fail the test past ``timeout``."""
    deadline = time.monotonic() + timeout
    results: list[Poll | None] = [None] * len(handles)
    while True:
        for i, handle in enumerate(handles):
            if results[i] is None:
                poll = backend.poll(handle)
                if poll.state is not HandleState.PENDING:
                    results[i] = poll
        if all(r is not None for r in results):
            return [r for r in results if r is not None]
        if time.monotonic() > deadline:
            pending = sum(r is None for r in results)
            raise AssertionError(f"{pending} of {len(handles)} transfers still pending after {timeout} s")
        time.sleep(0.001)


def drain_until(backend: Any, count: int, timeout: float = 20.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(backend.drain_notifications())
        time.sleep(0.001)
    return got


# ---------------------------------------------------------------- the decode peer of the 2-process test
class PeerSetup(msgspec.Struct, frozen=True, kw_only=True):
    shape_heads: int
    layers: int
    pages: int
    page: int
    head_dim: int
    tp: int


def sink_peer(conn: Any, nbytes: int = 1 << 20) -> None:
    """Child process: registers one zeroed buffer as component "sink", sends PeerInfo, waits to be told."""
    from kvbridge_mooncake.backend import MooncakeBackend

    buffer = np.zeros(nbytes, dtype=np.uint8)
    with MooncakeBackend(name="sink") as backend:
        registered = backend.register_buffers("sink", [region_of(buffer)])
        conn.send_bytes(msgspec.msgpack.encode(PeerInfo("sink", backend.endpoint, (registered.remote(),))))
        if conn.poll(120.0):
            conn.recv()
        conn.send(buffer.tobytes())


def decode_peer(conn: Any) -> None:
    """Child process, a decode rank: registers its pool, sends PeerInfo, checks bytes as the notice lands."""
    from kvbridge_mooncake.backend import MooncakeBackend

    setup = msgspec.msgpack.decode(conn.recv_bytes(), type=PeerSetup)
    shape = KVShape(heads=setup.shape_heads, layers=setup.layers, pages=setup.pages, page=setup.page,
                    head_dim=setup.head_dim)
    comp = shape.component(setup.tp)
    arrays = [np.zeros((shape.pages, *b.item_shape), dtype=np.uint16) for b in comp.buffers]
    backend = MooncakeBackend(name="decode-child")
    try:
        registered = backend.register_buffers("kv", [region_of(a) for a in arrays])
        info = PeerInfo(name="decode-child", endpoint=backend.endpoint, buffers=(registered.remote(),))
        conn.send_bytes(msgspec.msgpack.encode(info))
        expected = [np.frombuffer(conn.recv_bytes(), dtype=np.uint16).reshape(a.shape) for a in arrays]
        notices = drain_until(backend, 1, timeout=30.0)
        # checked the moment the notice lands
        ok_at_notice = all(np.array_equal(a, e) for a, e in zip(arrays, expected, strict=True))
        conn.send(("notice", notices, ok_at_notice))
        if conn.poll(30.0):
            conn.recv()
        conn.send(("final", all(np.array_equal(a, e) for a, e in zip(arrays, expected, strict=True))))
    finally:
        backend.close()

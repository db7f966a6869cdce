"""Independent byte-exact reference for TP resharding (plain numpy; kvbridge.slicing is never consulted).

A component is described at TP 1 (its logical, un-sharded form). The reference fills it with random bytes,
shards it per rank itself, then runs kvbridge for every (prefill rank, decode rank) pair -- slice through the
state type, plan with ``plan_transfer``, move the bytes into the decode rank's buffers -- and compares each
decode buffer, byte for byte, with its own reshard for the decode TP. It also counts how many times each
destination byte was written.

The bytes move with ``copy_descriptors`` (state-type tests: kvbridge-mamba, -swa, -nsa), or through one
backend per rank, driven by the backend protocol directly (no agent), when ``backend`` is given (backend
tests; :func:`kvbridge.testkit.rig.run_backend_reshard` is the paged-KV shorthand)::

    run_reshard(STATE, make, pt=4, dt=2, src_items=s, dst_items=d).assert_exact()
    run_reshard(KVState(), make, 4, 2, s, d, backend=lambda name: MyBackend(name=name)).assert_exact()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.base import ComponentTransfer, HandleState, Poll, RegisteredBuffers
from kvbridge.backends.copying import copy_descriptors
from kvbridge.geometry import BufferGeometry, Component, Rank, region_of
from kvbridge.planner import BufferPair, TransferPlan, plan_transfer
from kvbridge.protocol.records import PeerInfo
from kvbridge.slicing import ComponentSlice
from kvbridge.state.base import StateType

TP_SIZES = (1, 2, 4, 8)


def units_held(total: int, tp: int, rank: int) -> np.ndarray | None:
    """Global units of a sharded axis that ``rank`` of ``tp`` holds; None when they cannot be split."""
    if total >= tp:
        if total % tp:
            return None
        n = total // tp
        return np.arange(rank * n, rank * n + n)
    if tp % total:
        return None
    return np.array([rank * total // tp])


def shardable(totals: tuple[int, ...], tp: int) -> bool:
    return all(units_held(t, tp, 0) is not None for t in totals)


def logical_bytes(buf: BufferGeometry, rng: np.random.Generator) -> np.ndarray:
    """Random content of a TP-1 buffer as ``[items, *item_shape, itemsize]`` uint8."""
    return rng.integers(0, 256, (buf.num_items, *buf.item_shape, buf.dtype.itemsize), dtype=np.uint8)


def reshard(logical: np.ndarray, buf: BufferGeometry, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank`` of ``tp``'s copy of a logical buffer, flattened to ``[items, item_nbytes]``."""
    if buf.shard is None:
        local = logical
    else:
        picks, base = [], 0
        for total in buf.shard.group_totals:
            held = units_held(total, tp, rank)
            assert held is not None, f"{buf.name}: {total} units do not split over TP {tp}"
            picks.append(base + held)
            base += total
        local = np.take(logical, np.concatenate(picks), axis=buf.shard.axis + 1)
    return np.ascontiguousarray(local).reshape(logical.shape[0], -1)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """Per decode rank and buffer: what kvbridge produced, what the reference expects, write counts."""

    got: list[list[np.ndarray]]
    expected: list[list[np.ndarray]]
    writes: list[list[np.ndarray]]
    expected_writes: list[list[np.ndarray]]
    descriptors: np.ndarray  # [pt, dt] descriptor count of each pair

    def assert_exact(self) -> None:
        """Bytes equal the reference; each destination byte of the request's items was written exactly
        once, and nothing outside them was touched."""
        for d, (got, exp) in enumerate(zip(self.got, self.expected)):
            for b, (g, e) in enumerate(zip(got, exp)):
                if not np.array_equal(g, e):
                    bad = np.argwhere(g != e)[:3].tolist()
                    raise AssertionError(f"decode rank {d} buffer {b}: bytes differ at (item, byte) {bad}")
        for d, (w, ew) in enumerate(zip(self.writes, self.expected_writes)):
            for b, (wb, eb) in enumerate(zip(w, ew)):
                wrong = wb != eb
                if wrong.any():
                    bad = np.flatnonzero(wrong)[:3].tolist()
                    raise AssertionError(f"decode rank {d} buffer {b}: bytes {bad} written "
                                         f"{wb[bad].tolist()} times, expected {eb[bad].tolist()}")


def run_reshard(state: StateType, make: Callable[[int], Component], pt: int, dt: int,
                src_items: np.ndarray, dst_items: np.ndarray, seed: int = 0, *,
                backend: Callable[[str], Any] | None = None,
                make_dst: Callable[[int], Component] | None = None) -> Outcome:
    """Move ``src_items`` of every prefill rank to ``dst_items`` of every decode rank and compare.

    ``make(tp)`` builds the component of one rank at TP ``tp`` (``make_dst``, if given, the decode side's).
    With ``backend`` (a factory called with an endpoint name), each rank gets its own backend and every
    pair's plan is posted with ``send_component`` and polled to DONE; the backends are closed at the end.
    """
    rng = np.random.default_rng(seed)
    logical_comp, src_comp, dst_comp = make(1), make(pt), (make_dst or make)(dt)
    logical = [logical_bytes(b, rng) for b in logical_comp.buffers]
    src = [[reshard(x, b, pt, p) for x, b in zip(logical, logical_comp.buffers)] for p in range(pt)]
    initial = [[rng.integers(0, 256, (b.num_items, b.item_nbytes), dtype=np.uint8) for b in dst_comp.buffers]
               for _ in range(dt)]
    got = [[a.copy() for a in bufs] for bufs in initial]
    diffs = [[np.zeros(a.size + 1, dtype=np.int64) for a in bufs] for bufs in got]
    descriptors = np.zeros((pt, dt), dtype=np.int64)
    movers = _Movers(backend, src, got) if backend is not None else None
    try:
        for p in range(pt):
            for d in range(dt):
                sl = state.slice(src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                assert len(sl.buffers) == len(dst_comp.buffers)
                pairs = [BufferPair(src_base=s.ctypes.data, src_item_nbytes=sb.item_nbytes,
                                    src_num_items=sb.num_items, dst_base=g.ctypes.data, dst_item_nbytes=db.item_nbytes,
                                    dst_num_items=db.num_items, segments=seg)
                         for s, g, sb, db, seg in zip(src[p], got[d], src_comp.buffers, dst_comp.buffers,
                                                      sl.buffers)]
                plan = plan_transfer(pairs, src_items, dst_items)
                descriptors[p, d] = len(plan)
                _check_bounds(plan.src_addr, plan.nbytes, plan.buffer, src[p])
                starts = _check_bounds(plan.dst_addr, plan.nbytes, plan.buffer, got[d])
                if movers is None:
                    copy_descriptors(plan.src_addr, plan.dst_addr, plan.nbytes)
                elif len(plan):
                    movers.send(p, d, plan, sl, src_items, dst_items)
                for b in np.unique(plan.buffer):
                    sel = plan.buffer == b
                    np.add.at(diffs[d][b], starts[sel], 1)
                    np.add.at(diffs[d][b], starts[sel] + plan.nbytes[sel].astype(np.int64), -1)
        if movers is not None:
            movers.finish()
    finally:
        if movers is not None:
            movers.close()
    expected, expected_writes = [], []
    for d in range(dt):
        exp, ew = [], []
        for x, b, init in zip(logical, logical_comp.buffers, initial[d]):
            e = init.copy()
            e[dst_items] = reshard(x, b, dt, d)[src_items]
            exp.append(e)
            w = np.zeros(init.shape, dtype=np.int64)
            w[dst_items] = 1
            ew.append(w.ravel())
        expected.append(exp)
        expected_writes.append(ew)
    writes = [[np.cumsum(diff)[:-1] for diff in bufs] for bufs in diffs]
    return Outcome(got=got, expected=expected, writes=writes, expected_writes=expected_writes, descriptors=descriptors)


class _Movers:
    """One backend per rank: prefill rank ``p`` is ``prefill-<p>``, decode rank ``d`` is ``decode-<d>``."""

    def __init__(self, factory: Callable[[str], Any], src: list[list[np.ndarray]],
                 dst: list[list[np.ndarray]]) -> None:
        self.prefill: list[tuple[Any, RegisteredBuffers]] = []
        self.decode: list[tuple[Any, RegisteredBuffers]] = []
        self.pending: list[tuple[Any, Any]] = []
        for side, name, pools in ((self.prefill, "prefill", src), (self.decode, "decode", dst)):
            for rank, arrays in enumerate(pools):
                backend = factory(f"{name}-{rank}")
                side.append((backend, backend.register_buffers(COMPONENT, [region_of(a) for a in arrays])))

    def send(self, p: int, d: int, plan: TransferPlan, sl: ComponentSlice, src_items: np.ndarray,
             dst_items: np.ndarray) -> None:
        sender, registered = self.prefill[p]
        receiver, dst = self.decode[d]
        peer = sender.add_peer(PeerInfo(f"decode-{d}", receiver.endpoint, (dst.remote(),)))
        order = np.argsort(src_items, kind="stable")
        transfer = ComponentTransfer(room=1, component=COMPONENT, peer=peer, chunk=0, last=True, src=registered,
                                     dst=dst.remote(), plan=plan, src_items=np.asarray(src_items, np.int64)[order],
                                     dst_items=np.asarray(dst_items, np.int64)[order], segments=tuple(sl.buffers))
        self.pending.append((sender, sender.send_component(transfer)))

    def finish(self, timeout: float = 10.0) -> None:
        for sender, handle in self.pending:
            result = wait(sender, handle, timeout)
            assert result == Poll.done(), result
            sender.release(handle)

    def close(self) -> None:
        for backend, _ in self.prefill + self.decode:
            backend.close()


COMPONENT = "kv"


def assert_identity_at_equal_tp(state: StateType, component: Component, tp: int) -> None:
    """At TP ratio 1, prefill rank r writes whole items to decode rank r only."""
    for p in range(tp):
        for d in range(tp):
            sl = state.slice(component, component, Rank(p, tp), Rank(d, tp))
            if p != d:
                assert sl.is_empty, f"prefill {p} of {tp} has a slice for decode {d}"
                continue
            for seg, buf in zip(sl.buffers, component.buffers):
                got = (seg.src_off.tolist(), seg.dst_off.tolist(), seg.nbytes.tolist())
                assert got == ([0], [0], [buf.item_nbytes]), f"{buf.name}: {got} is not the whole item"


def wait(backend: Any, handle: Any, timeout: float = 10.0) -> Poll:
    """Poll ``handle`` until it leaves PENDING (or ``timeout`` seconds passed); the last poll."""
    deadline = time.monotonic() + timeout
    while True:
        result: Poll = backend.poll(handle)
        if result.state is not HandleState.PENDING or time.monotonic() > deadline:
            return result
        time.sleep(0.001)


def _check_bounds(addr: np.ndarray, nbytes: np.ndarray, buffer: np.ndarray, arrays: list[np.ndarray]) -> np.ndarray:
    """Offsets of each descriptor inside its buffer; fail (before any copy) if one leaves its buffer."""
    base = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)[buffer]
    size = np.array([a.nbytes for a in arrays], dtype=np.int64)[buffer]
    off = (addr - base).astype(np.int64)
    assert np.all((addr >= base) & (off + nbytes.astype(np.int64) <= size)), "descriptor outside its buffer"
    return off

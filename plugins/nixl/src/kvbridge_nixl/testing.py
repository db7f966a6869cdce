"""Test support (importable by spawned peers): a token-major paged KV case, an independent reference
reshard, and the body of a prefill peer process.

The expected destination bytes are computed here with plain numpy head slicing of the full (unsharded)
KV; ``kvbridge.slicing`` is used only to build the plans under test, never the expectation.
"""

from __future__ import annotations

import ctypes
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvbridge.plugin import (
    BufferGeometry,
    BufferPair,
    ComponentTransfer,
    DType,
    HandleState,
    MemoryRegion,
    PeerInfo,
    Rank,
    RegisteredBuffers,
    RemoteBuffers,
    ShardAxis,
    buffer_segments,
    plan_transfer,
    region_of,
)

PAGE = 4            # tokens per page
HEAD_DIM = 8        # fp16 -> 16 B per head per token
LAYERS = 2          # K and V per layer -> 4 buffers
SRC_PAGES = 24
DST_PAGES = 20
SENTINEL = 0xA5


def heads_of(total: int, tp: int, rank: int) -> tuple[int, int]:
    """Head range a TP rank holds (one head replicated over tp/total ranks when total < tp)."""
    if total >= tp:
        per = total // tp
        return rank * per, rank * per + per
    unit = rank // (tp // total)
    return unit, unit + 1


def full_kv(seed: int, heads: int) -> list[np.ndarray]:
    """Unsharded K/V of every layer: ``[page, token, head, dim]`` fp16 with random bit patterns."""
    rng = np.random.default_rng(seed)
    shape = (SRC_PAGES, PAGE, heads, HEAD_DIM)
    return [rng.integers(0, 256, size=(*shape[:-1], HEAD_DIM * 2), dtype=np.uint8).view(np.float16)
            for _ in range(2 * LAYERS)]


def prefill_pool(full: list[np.ndarray], tp: int, rank: int) -> list[np.ndarray]:
    lo, hi = heads_of(full[0].shape[2], tp, rank)
    return [np.ascontiguousarray(buf[:, :, lo:hi, :]) for buf in full]   # written -> pages are touched


def decode_pool(heads: int, tp: int, rank: int) -> list[np.ndarray]:
    lo, hi = heads_of(heads, tp, rank)
    shape = (DST_PAGES, PAGE, hi - lo, HEAD_DIM)
    return [np.full((*shape[:-1], HEAD_DIM * 2), SENTINEL, dtype=np.uint8).view(np.float16)
            for _ in range(2 * LAYERS)]


def expected_decode(full: list[np.ndarray], tp: int, rank: int, src_idx: np.ndarray,
                    dst_idx: np.ndarray) -> list[np.ndarray]:
    """Reference reshard: decode rank ``rank``'s pool after pages ``src_idx -> dst_idx`` landed."""
    heads = full[0].shape[2]
    lo, hi = heads_of(heads, tp, rank)
    out = decode_pool(heads, tp, rank)
    for dst, src in zip(out, full):
        dst[dst_idx] = src[src_idx][:, :, lo:hi, :]
    return out


def geometry(pool: list[np.ndarray], heads: int) -> list[BufferGeometry]:
    return [BufferGeometry(name=f"{'kv'[i % 2]}.{i // 2}", num_items=b.shape[0], item_shape=b.shape[1:],
                           dtype=DType.FLOAT16, shard=ShardAxis(axis=1, total=heads)) for i, b in enumerate(pool)]


def regions(pool: list[np.ndarray]) -> list[MemoryRegion]:
    return [region_of(b) for b in pool]


@dataclass(frozen=True)
class Side:
    """One rank's pool as the planner needs it."""

    rank: Rank
    pool: list[np.ndarray]
    heads: int

    @property
    def geometry(self) -> list[BufferGeometry]:
        return geometry(self.pool, self.heads)


def make_transfer(src: Side, dst: Side, src_reg: RegisteredBuffers, dst_remote: RemoteBuffers, peer: str,
                  src_idx: np.ndarray, dst_idx: np.ndarray, room: int, notice: bytes) -> ComponentTransfer | None:
    """The ComponentTransfer ``src`` posts to ``dst`` for these pages (None when it writes nothing)."""
    segs = tuple(buffer_segments(s, d, src.rank, dst.rank) for s, d in zip(src.geometry, dst.geometry))
    if all(len(s) == 0 for s in segs):
        return None
    pairs = [BufferPair(src_base=sr.addr, src_item_nbytes=sg.item_nbytes, src_num_items=sg.num_items,
                        dst_base=dr.addr, dst_item_nbytes=dg.item_nbytes, dst_num_items=dg.num_items, segments=seg)
             for sr, dr, sg, dg, seg in zip(src_reg.regions, dst_remote.regions, src.geometry, dst.geometry, segs)]
    plan = plan_transfer(pairs, src_idx, dst_idx)
    order = np.argsort(src_idx, kind="stable")
    return ComponentTransfer(room=room, component="kv", peer=peer, chunk=0, last=True, src=src_reg,
                             dst=dst_remote, plan=plan, notice=notice,
                             src_items=np.asarray(src_idx, np.int64)[order],
                             dst_items=np.asarray(dst_idx, np.int64)[order], segments=segs)


def request_pages(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Scattered, unsorted source and destination pages, with one adjacent run so merging is exercised."""
    rng = np.random.default_rng(seed)
    run_src, run_dst = np.array([5, 6, 7]), np.array([10, 11, 12])
    src = np.concatenate((run_src, rng.choice(np.setdiff1d(np.arange(SRC_PAGES), run_src), n - 3, replace=False)))
    dst = np.concatenate((run_dst, rng.choice(np.setdiff1d(np.arange(DST_PAGES), run_dst), n - 3, replace=False)))
    perm = rng.permutation(n)
    return src[perm].astype(np.int64), dst[perm].astype(np.int64)


def same_bytes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))


# -- device placement --------------------------------------------------------------------------------

def place(pool: list[np.ndarray], device: str) -> tuple[list[Any], list[MemoryRegion]]:
    """The pool's buffers on ``device`` (``cpu``: the arrays themselves; ``cuda[:N]``: torch copies, as
    bytes) and their memory regions."""
    if device == "cpu":
        return list(pool), regions(pool)
    import torch

    tensors = [torch.from_numpy(np.ascontiguousarray(b).view(np.uint8)).to(device) for b in pool]
    torch.cuda.synchronize()
    return tensors, [region_of(t) for t in tensors]


def fetch(buffers: list[Any], like: list[np.ndarray]) -> list[np.ndarray]:
    """Host copies of ``buffers`` with the dtype and shape of ``like``."""
    if all(isinstance(b, np.ndarray) for b in buffers):
        return buffers
    return [b.cpu().numpy().view(ref.dtype).reshape(ref.shape) for b, ref in zip(buffers, like)]


def rearm(buffers: list[Any]) -> None:
    """Refill destination buffers with the sentinel."""
    for buf in buffers:
        if isinstance(buf, np.ndarray):
            buf.view(np.uint8)[:] = SENTINEL
        else:
            buf.fill_(SENTINEL)


# -- driving backends ----------------------------------------------------------------------------------

DEADLINE_S = 60.0


def wait_done(backend: Any, handles: list[object]) -> None:
    end = time.monotonic() + DEADLINE_S
    pending = list(handles)
    while pending:
        polls = [(h, backend.poll(h)) for h in pending]
        failed = [p.reason for _, p in polls if p.state is HandleState.FAILED]
        assert not failed, failed
        pending = [h for h, p in polls if p.state is HandleState.PENDING]
        assert time.monotonic() < end, f"{len(pending)} transfers still pending"
        time.sleep(0.0005)


def wait_notices(backend: Any, expected: set[tuple[str, bytes]],
                 senders: Sequence[tuple[Any, object]] = ()) -> list[tuple[str, bytes]]:
    """Drain ``backend`` until ``expected`` arrived, polling the senders' handles meanwhile (NIXL sends a
    WRITE's notice when the initiator observes its completion, so the sender must keep polling)."""
    got: list[tuple[str, bytes]] = []
    end = time.monotonic() + DEADLINE_S
    while not expected <= set(got):
        for sender, handle in senders:
            assert sender.poll(handle).state is not HandleState.FAILED, sender.poll(handle).reason
        got += backend.drain_notifications()
        assert time.monotonic() < end, f"notices missing: {expected - set(got)}"
        time.sleep(0.0005)
    return got


def run_reshard(backends: Callable[[str], Any], pt: int, dt: int, heads: int, seed: int,
                device: str = "cpu") -> None:
    """Pt prefill backends write two requests into Dt decode backends (pools on ``device``); check every
    byte of every decode pool against the reference reshard the moment its notices are in, then leaks."""
    full = full_kv(seed, heads)
    pre = [Side(Rank(p, pt), prefill_pool(full, pt, p), heads) for p in range(pt)]
    dec = [Side(Rank(d, dt), decode_pool(heads, dt, d), heads) for d in range(dt)]
    pb = [backends(f"prefill-{p}") for p in range(pt)]
    db = [backends(f"decode-{d}") for d in range(dt)]
    pre_mem = [place(s.pool, device) for s in pre]
    dec_mem = [place(s.pool, device) for s in dec]
    preg = [b.register_buffers("kv", m[1]) for b, m in zip(pb, pre_mem)]
    dreg = [b.register_buffers("kv", m[1]) for b, m in zip(db, dec_mem)]
    infos = [PeerInfo(f"decode-{d}", db[d].endpoint, (dreg[d].remote(),)) for d in range(dt)]
    try:
        for b in pb:
            for info in infos:
                b.add_peer(info)
        for room, n in ((7, 9), (8, 6)):   # the second request reuses the prepped dlists
            src_idx, dst_idx = request_pages(seed + room, n)
            sent: dict[int, list[object]] = {}
            expected: dict[int, set[tuple[str, bytes]]] = {d: set() for d in range(dt)}
            for p in range(pt):
                for d in range(dt):
                    notice = f"room{room}:{p}->{d}".encode()
                    xfer = make_transfer(pre[p], dec[d], preg[p], infos[d].component("kv"), f"decode-{d}",
                                         src_idx, dst_idx, room, notice)
                    if xfer is not None:
                        sent.setdefault(p, []).append(pb[p].send_component(xfer))
                        expected[d].add((f"prefill-{p}", notice))
            dlists = sum(b.resources()["dlists"] for b in pb)
            for d in range(dt):
                assert expected[d], f"nobody writes decode rank {d}"
                wait_notices(db[d], expected[d], [(pb[p], h) for p, hs in sent.items() for h in hs])
                # the notice rides on the data: once it is here, every byte must be too
                landed = fetch(dec_mem[d][0], dec[d].pool)
                assert same_bytes(landed, expected_decode(full, dt, d, src_idx, dst_idx)), (pt, dt, d, room, device)
            for p, handles in sent.items():
                wait_done(pb[p], handles)
                for h in handles:
                    pb[p].release(h)
                assert pb[p].resources()["handles"] == 0
            for d in range(dt):   # re-arm the sentinel for the next request
                rearm(dec_mem[d][0])
        assert sum(b.resources()["dlists"] for b in pb) == dlists, "second request rebuilt dlists"
    finally:
        for b, reg in zip(pb, preg):
            for d in range(dt):
                b.remove_peer(f"decode-{d}")
            b.deregister_buffers(reg)
        for b, reg in zip(db, dreg):
            b.deregister_buffers(reg)
    for b in pb + db:
        assert b.resources() == {"handles": 0, "peers": 0, "registrations": 0, "dlists": 0}


# -- a prefill peer in another process ---------------------------------------------------------------

PEER_DEADLINE_S = 90.0


class PeerOrder(msgspec.Struct, frozen=True, kw_only=True):
    """What the parent (decode side) tells a prefill peer process to do."""

    decode: list[bytes]          # msgpack-encoded PeerInfo per decode rank
    pt: int
    heads: int
    seed: int
    src_idx: list[int]
    dst_idx: list[int]
    room: int
    device: str = "cpu"


def block_cma_with_seccomp() -> None:
    """Make ``process_vm_readv/writev`` fail with EPERM in this process (as Docker's default seccomp
    profile does without CAP_SYS_PTRACE). x86-64 Linux only; threads created afterwards inherit it."""
    if platform.machine() != "x86_64":
        raise OSError("the CMA seccomp filter is written for x86-64")

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    load_nr, jeq, ret = 0x20, 0x15, 0x06                      # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    readv, writev, allow, eperm = 310, 311, 0x7FFF0000, 0x00050001
    rules = (Filter * 5)(Filter(load_nr, 0, 0, 0), Filter(jeq, 2, 0, readv), Filter(jeq, 1, 0, writev),
                         Filter(ret, 0, 0, allow), Filter(ret, 0, 0, eperm))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(Program(5, rules)), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def prefill_peer(conn: Connection, options: dict[str, str], block_cma: bool) -> None:
    """Body of a prefill process: ``pt`` ranks write one request into the parent's decode ranks."""
    from kvbridge_nixl.backend import NixlBackend

    backends: list[Any] = []
    keep: list[Any] = []          # device copies of the pools stay alive while registered
    try:
        if block_cma:
            block_cma_with_seccomp()
        if not conn.poll(PEER_DEADLINE_S):
            raise TimeoutError("no order from the parent")
        order = msgspec.msgpack.decode(conn.recv_bytes(), type=PeerOrder)
        infos = [msgspec.msgpack.decode(blob, type=PeerInfo) for blob in order.decode]
        full, dt = full_kv(order.seed, order.heads), len(infos)
        src_idx, dst_idx = np.array(order.src_idx), np.array(order.dst_idx)
        handles = []
        for p in range(order.pt):
            backend = NixlBackend(name=f"prefill-{p}", options=options)
            backends.append(backend)
            side = Side(Rank(p, order.pt), prefill_pool(full, order.pt, p), order.heads)
            memory, where = place(side.pool, order.device)
            keep.append(memory)
            reg = backend.register_buffers("kv", where)
            for d, info in enumerate(infos):
                backend.add_peer(info)
                dst = Side(Rank(d, dt), decode_pool(order.heads, dt, d), order.heads)   # geometry only
                xfer = make_transfer(side, dst, reg, info.component("kv"), info.name, src_idx, dst_idx,
                                     order.room, f"room{order.room}:{p}->{d}".encode())
                if xfer is not None:
                    handles.append((backend, backend.send_component(xfer)))
        end = time.monotonic() + PEER_DEADLINE_S
        states = [b.poll(h) for b, h in handles]
        while any(s.state is HandleState.PENDING for s in states) and time.monotonic() < end:
            time.sleep(0.0005)
            states = [b.poll(h) for b, h in handles]
        for b, h in handles:
            b.release(h)
        conn.send(("sent", [f"{s.state.name} {s.reason}".strip() for s in states]))
        conn.poll(PEER_DEADLINE_S)          # stay alive until the parent has checked the bytes
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        start = time.monotonic()
        for backend in backends:
            backend.close()
        conn.send(("closed", time.monotonic() - start))


def run_two_process(backends: Callable[[str], Any], pt: int, dt: int, options: dict[str, str], block_cma: bool,
                    seed: int, device: str = "cpu", peer_device: str | None = None) -> None:
    """Dt decode backends here; a spawned process runs Pt prefill backends (``options``, CMA optionally
    blocked) that write one request. PeerInfo travels as bytes through a pipe; every byte is checked
    once the notices are in; the child is always reaped (killed if need be)."""
    import multiprocessing as mp

    heads, room = 4, 77
    full = full_kv(seed, heads)
    dec = [Side(Rank(d, dt), decode_pool(heads, dt, d), heads) for d in range(dt)]
    db = [backends(f"decode-{d}") for d in range(dt)]
    mem = [place(s.pool, device) for s in dec]
    regs = [b.register_buffers("kv", m[1]) for b, m in zip(db, mem)]
    src_idx, dst_idx = request_pages(seed, 8)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_peer, args=(child, options, block_cma), daemon=True)
    try:
        proc.start()
        infos = [msgspec.msgpack.encode(PeerInfo(f"decode-{d}", db[d].endpoint, (regs[d].remote(),)))
                 for d in range(dt)]
        parent.send_bytes(msgspec.msgpack.encode(PeerOrder(decode=infos, pt=pt, heads=heads, seed=seed,
                                                           src_idx=src_idx.tolist(),
                                                           dst_idx=dst_idx.tolist(), room=room,
                                                           device=peer_device or device)))
        expected = {d: {(f"prefill-{p}", f"room{room}:{p}->{d}".encode()) for p in writers(pt, dt, d)}
                    for d in range(dt)}
        got: dict[int, set[tuple[str, bytes]]] = {d: set() for d in range(dt)}
        report = None
        end = time.monotonic() + PEER_DEADLINE_S
        while any(not expected[d] <= got[d] for d in range(dt)):
            assert time.monotonic() < end, f"notices missing: {expected} vs {got}; child: {report}"
            if report is None and parent.poll(0):
                report = parent.recv()
                assert report[0] == "sent", report[1]
            for d in range(dt):
                got[d] |= set(db[d].drain_notifications())
            time.sleep(0.001)
        for d in range(dt):   # every notice is in: every byte must be too
            landed = fetch(mem[d][0], dec[d].pool)
            assert same_bytes(landed, expected_decode(full, dt, d, src_idx, dst_idx)), (pt, dt, d, device)
        if report is None:
            assert parent.poll(PEER_DEADLINE_S), "the prefill process never reported"
            report = parent.recv()
        assert report == ("sent", ["DONE"] * sum(len(e) for e in expected.values())), report
        parent.send("bye")
        assert parent.poll(PEER_DEADLINE_S), "the prefill process did not close its backends"
        status, close_s = parent.recv()
        assert status == "closed", (status, close_s)
    finally:
        proc.join(PEER_DEADLINE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()
        child.close()
        for b, reg in zip(db, regs):
            b.deregister_buffers(reg)
    assert proc.exitcode == 0


def writers(pt: int, dt: int, d: int) -> set[int]:
    """Prefill ranks that write decode rank ``d`` (heads >= both TP sizes, so no replica election)."""
    if pt >= dt:
        return {p for p in range(pt) if p // (pt // dt) == d}
    return {d // (dt // pt)}

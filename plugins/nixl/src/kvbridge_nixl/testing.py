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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvbridge.backends.base import ComponentTransfer, HandleState, PeerInfo, RegisteredBuffers, RemoteBuffers
from kvbridge.geometry import BufferGeometry, DType, MemoryRegion, Rank, ShardAxis, region_of
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.slicing import buffer_segments

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
    pairs = [BufferPair(sr.addr, sg.item_nbytes, sg.num_items, dr.addr, dg.item_nbytes, dg.num_items, seg)
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


# -- a prefill peer in another process ---------------------------------------------------------------

PEER_DEADLINE_S = 90.0


class PeerOrder(msgspec.Struct, frozen=True):
    """What the parent (decode side) tells a prefill peer process to do."""

    decode: list[bytes]          # msgpack-encoded PeerInfo per decode rank
    pt: int
    heads: int
    seed: int
    src_idx: list[int]
    dst_idx: list[int]
    room: int


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
            reg = backend.register_buffers("kv", regions(side.pool))
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

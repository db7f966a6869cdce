"""Host-memory copies of planned descriptors, for backends that move bytes with the CPU (stand-ins,
benchmarks, the reference reshard). Callers bounds-check first (``check_within``)."""

from __future__ import annotations

import ctypes

import numpy as np

from kvbridge.planner import TransferPlan

__all__ = ["copy_descriptors", "copy_plan"]

_SMALL_GROUP = 64  # below this many same-length descriptors, memmove each directly (~0.5 us each; the
#                   vectorized path costs ~100 us whatever the count: measured crossover ~100)
_LARGE_DESCRIPTOR = 16384  # and from this size on too: the per-call cost is lost in the copy itself


def _bytes_at(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def copy_descriptors(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
    """Copy ``lens[i]`` bytes from address ``src[i]`` to ``dst[i]`` for all i, vectorized per length.

    Same-length descriptors are copied with one gather and one scatter over sliding-window views of the
    spanned memory; a handful, or large ones, go through memmove directly.
    """
    if lens.size == 0:
        return
    if lens.size < _SMALL_GROUP:          # a handful: no grouping work at all
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        return
    for length in np.unique(lens):
        sel = np.flatnonzero(lens == length)
        n = int(length)
        if sel.size < _SMALL_GROUP or n >= _LARGE_DESCRIPTOR:
            for i in sel:
                ctypes.memmove(int(dst[i]), int(src[i]), n)
            continue
        s, d = src[sel], dst[sel]
        s_lo, d_lo = int(s.min()), int(d.min())
        s_view = np.lib.stride_tricks.sliding_window_view(_bytes_at(s_lo, int(s.max()) - s_lo + n), n)
        d_view = np.lib.stride_tricks.sliding_window_view(_bytes_at(d_lo, int(d.max()) - d_lo + n), n,
                                                          writeable=True)
        d_view[(d - np.uint64(d_lo)).astype(np.int64)] = s_view[(s - np.uint64(s_lo)).astype(np.int64)]


def copy_plan(plan: TransferPlan, dst_addr: np.ndarray | None = None) -> None:
    """Copy every descriptor of ``plan``; ``dst_addr`` replaces ``plan.dst_addr`` (a peer's addresses as
    mapped into this process)."""
    copy_descriptors(plan.src_addr, plan.dst_addr if dst_addr is None else dst_addr, plan.nbytes)

"""Per-destination digests of pages in GPU memory, many buffers at once, with one wait for the host.

The same digests as :func:`kvbridge.digests.digest_items` (bit for bit): a position-weighted sum of 32-bit words mod
2^64. Where Triton is importable and the runs are 8-byte aligned and regular (a page, a head slice, a head slice per
token row: the common cases), one kernel launch per group of buffers reads each run byte once, straight from the
pages: no gathered copy, no temporaries the size of the request. Otherwise the torch path of ``digest_items`` runs
per buffer, its results kept on the device. Either way only the digests cross to the host, once per call.

    digest_buffers(views, items, runs)     # uint64 [len(views) * len(items)], buffer-major

``views`` are ``[num_items, item_nbytes]`` uint8 arrays (numpy: digested on the host) or tensors on one device,
``runs[k]`` the runs of ``views[k]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.digests import Runs, _digest_tensor_on_device, _tensor_weights, digest_items

BLOCK_WORDS = 1024              # 8 KiB of a run per program
MAX_BLOCKS = 65535              # the kernel's second grid axis
WARPS = 4                       # warps per program


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; None where Triton is not importable (CPU hosts, CI)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def digest_runs(table, row_strides, items, lo, hi, partial, n_items, words, run_words,  # type: ignore[no-untyped-def]
                    run_stride, start, BLOCK: tl.constexpr):
        pid = tl.program_id(0)                 # buffer * n_items + item
        block = tl.program_id(1)
        buffer = pid // n_items
        base = tl.load(table + buffer).to(tl.pointer_type(tl.int64))
        row = tl.load(items + pid % n_items) * tl.load(row_strides + buffer)
        w = block * BLOCK + tl.arange(0, BLOCK)
        inside = w < words
        offsets = row + start + (w // run_words).to(tl.int64) * run_stride + (w % run_words)
        x = tl.load(base + offsets, mask=inside, other=0)
        weight_lo = tl.load(lo + w, mask=inside, other=0)
        weight_hi = tl.load(hi + w, mask=inside, other=0)
        terms = x * weight_lo + ((x >> 32) & 0xFFFFFFFF) * weight_hi      # int64 wraps mod 2^64
        tl.store(partial + pid * tl.num_programs(1) + block, tl.sum(terms, axis=0))

    return digest_runs


def fused(view: Any, runs: Runs) -> bool:
    """Can the kernel read ``runs`` of ``view`` as 8-byte words: regular runs, everything a multiple of 8 bytes."""
    return (_kernel() is not None and view.is_cuda and view.element_size() == 1 and runs.regular and view.stride(1) == 1
            and view.data_ptr() % 8 == 0 and view.stride(0) % 8 == 0 and runs.start % 8 == 0
            and runs.length % 8 == 0 and runs.stride % 8 == 0 and runs.length > 0
            and -(-runs.nbytes // 8 // BLOCK_WORDS) <= MAX_BLOCKS)


def _launch(views: Sequence[Any], items: np.ndarray, runs: Runs) -> Any:
    """int64 ``[len(views), len(items)]`` digests of buffers that share ``runs``, by one kernel launch (the views'
    addresses, row strides and the items cross to the device in one copy)."""
    import torch

    device = views[0].device
    words = runs.nbytes // 8
    lo, hi = _tensor_weights(words, device)
    n, b = len(items), len(views)
    table = np.empty(2 * b + n, np.int64)
    table[:b] = [v.data_ptr() for v in views]
    table[b: 2 * b] = [v.stride(0) // 8 for v in views]
    table[2 * b:] = items
    on_device = torch.from_numpy(table).to(device, non_blocking=True)
    blocks = -(-words // BLOCK_WORDS)
    partial = torch.empty(b * n, blocks, dtype=torch.int64, device=device)
    with torch.cuda.device(device):         # launched on the views' GPU, whichever is current
        _kernel()[(b * n, blocks)](on_device[:b], on_device[b: 2 * b], on_device[2 * b:], lo, hi, partial, n, words,
                                   runs.length // 8, runs.stride // 8, runs.start // 8, BLOCK=BLOCK_WORDS,
                                   num_warps=WARPS)
    return partial.sum(1).view(b, n)


def digest_buffers(views: Sequence[Any], items: np.ndarray, runs: Sequence[Runs]) -> np.ndarray:
    """uint64 digests of ``runs[k]`` of ``views[k][item]`` for every view and item, buffer-major: what
    ``np.concatenate([digest_items(v, items, r) for v, r in zip(views, runs)])`` gives; for tensors computed on
    their device, the host waiting once (on the caller's current stream, after the work queued on it)."""
    import sys

    if len(views) != len(runs):
        raise ValueError(f"digest_buffers: {len(views)} views but {len(runs)} runs (one each)")
    n = len(items)
    if n == 0 or not views:
        return np.zeros(n * len(views), np.uint64)
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(v, torch.Tensor) for v in views):
        return np.concatenate([digest_items(v, items, r) for v, r in zip(views, runs)])
    groups: dict[tuple[int, int, int, int], list[int]] = {}      # regular runs: (start, length, stride, count)
    rest = []
    for k, (view, r) in enumerate(zip(views, runs)):
        if r.nbytes and fused(view, r):
            groups.setdefault((r.start, r.length, r.stride, r.count), []).append(k)
        else:
            rest.append(k)
    if not rest and len(groups) == 1:                            # the common case: one launch gives it all
        return _launch(views, items, runs[0]).cpu().numpy().view(np.uint64).reshape(-1)
    device = views[0].device
    out = torch.zeros(len(views), n, dtype=torch.int64, device=device)
    if rest:
        index = torch.as_tensor(np.ascontiguousarray(items, dtype=np.int64)).to(device, non_blocking=True)
        for k in rest:
            if runs[k].nbytes:
                out[k] = _digest_tensor_on_device(views[k], index, runs[k])
    for ks in groups.values():
        out[ks] = _launch([views[k] for k in ks], items, runs[ks[0]])
    return out.cpu().numpy().view(np.uint64).reshape(-1)

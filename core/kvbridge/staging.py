"""The staging fast path: gather a request's slices into one contiguous region, one write, scatter on arrival.

With different TP sizes, a token-major page contributes one small run per token row (``page_size``
descriptors per page per layer) and engines pay ~6 us per descriptor. When a slice is *regular* (the same
column range of every row of an item, which is exactly the token-major head slice), the sender gathers
``[pages, buffers, rows, cols]`` into its registered staging area with numpy, posts one descriptor per
chunk into the receiver's staging area, and the receiver scatters into its pages when the chunk's
notice arrives, before the chunk counts as delivered. Works on numpy arrays (host memory) and on torch
tensors (CUDA memory: the gather and scatter run as device kernels, then the stream is synchronised
before the write is posted or the chunk is counted).

    rows = regular_rows(segments, src_item_nbytes, dst_item_nbytes)   # None -> use plain descriptors
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.geometry import MemoryRegion, region_of
from kvbridge.slicing import Segments

STAGING = "__staging__"      # the component name staging regions are registered under
MIN_ROWS = 4                 # below this many runs per item, descriptors are cheaper than a gather


@dataclass(frozen=True, slots=True, kw_only=True)
class Rows:
    """A regular slice: ``rows`` runs of ``cols`` bytes at ``src_col + r*src_stride`` -> ``dst_col + r*dst_stride``."""

    rows: int
    cols: int
    src_stride: int
    dst_stride: int
    src_col: int
    dst_col: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols


def regular_rows(seg: Segments, src_item: int, dst_item: int) -> Rows | None:
    """Recognise the token-row pattern; None when the slice is not regular or too short to be worth it."""
    n = len(seg)
    if n < MIN_ROWS or np.any(seg.nbytes != seg.nbytes[0]):
        return None
    s_stride, d_stride = src_item // n, dst_item // n
    if s_stride * n != src_item or d_stride * n != dst_item:
        return None
    r = np.arange(n, dtype=np.int64)
    s0, d0, cols = int(seg.src_off[0]), int(seg.dst_off[0]), int(seg.nbytes[0])
    if not (np.array_equal(seg.src_off, s0 + r * s_stride) and np.array_equal(seg.dst_off, d0 + r * d_stride)):
        return None
    if s0 + cols > s_stride or d0 + cols > d_stride:
        return None
    return Rows(rows=n, cols=cols, src_stride=s_stride, dst_stride=d_stride, src_col=s0, dst_col=d0)


def host_view(region: MemoryRegion) -> np.ndarray:
    """A writable uint8 numpy view of a registered host region."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))


def page_layout(rows: Sequence[Rows]) -> tuple[list[int], int]:
    """Byte offset of each buffer's slice inside one staged page, and the staged bytes per page."""
    offsets, total = [], 0
    for r in rows:
        offsets.append(total)
        total += r.nbytes
    return offsets, total


def _split(x: Any, *shape: int) -> Any:
    """Reshape without ever copying (numpy or torch): staged slices must stay views of the area."""
    if isinstance(x, np.ndarray):
        out = x.view()
        out.shape = shape          # raises instead of silently copying
        return out
    return x.view(*shape)


def _index(items: np.ndarray, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return items
    import torch

    return torch.as_tensor(items, dtype=torch.int64, device=like.device)


def gather(buffers: Sequence[Any], rows: Sequence[Rows], items: np.ndarray, out: Any) -> None:
    """Pack the slice of ``buffers[b][items[k]]`` into ``out[k]`` (``[n, staged bytes per page]``), buffer by
    buffer. ``buffers`` are ``[num_items, item_nbytes]`` uint8 numpy arrays or torch tensors."""
    offsets, _ = page_layout(rows)
    idx = _index(items, out)
    for buf, r, off in zip(buffers, rows, offsets):
        src = _split(buf, buf.shape[0], r.rows, r.src_stride)[idx, :, r.src_col: r.src_col + r.cols]
        _split(out[:, off: off + r.nbytes], len(items), r.rows, r.cols)[...] = src


def scatter(buffers: Sequence[Any], rows: Sequence[Rows], items: np.ndarray, staged: Any) -> None:
    """The inverse on the receiving side: unpack ``staged[k]`` into the slice of ``buffers[b][items[k]]``."""
    offsets, _ = page_layout(rows)
    idx = _index(items, staged)
    for buf, r, off in zip(buffers, rows, offsets):
        dst = _split(buf, buf.shape[0], r.rows, r.dst_stride)
        dst[idx, :, r.dst_col: r.dst_col + r.cols] = _split(staged[:, off: off + r.nbytes], len(items), r.rows, r.cols)


def synchronize(array: Any) -> None:
    """Wait for device kernels that touched ``array`` (no-op for host memory)."""
    device = getattr(array, "device", None)
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)


def device_view(array: Any, num_items: int, item_nbytes: int) -> Any | None:
    """A ``[num_items, item_nbytes]`` uint8 view of a registered CUDA tensor (None for anything else)."""
    device = getattr(array, "device", None)
    if device is None or getattr(device, "type", "") != "cuda":
        return None
    import torch

    return array.view(torch.uint8).view(num_items, item_nbytes)


class StagingArea:
    """A registered host region with a first-fit allocator (offsets in bytes, 64-byte aligned)."""

    def __init__(self, array: Any) -> None:
        """``array``: a one-dimensional uint8 numpy array (host) or torch tensor (CUDA)."""
        if isinstance(array, np.ndarray):
            if array.dtype != np.uint8 or array.ndim != 1:
                raise ValueError("a staging area is a one-dimensional uint8 array")
            self.region = MemoryRegion(array.ctypes.data, array.nbytes)
        else:
            self.region = region_of(array)
            if array.dim() != 1 or array.element_size() != 1:
                raise ValueError("a staging area is a one-dimensional uint8 tensor")
        self.array = array
        self._free: list[tuple[int, int]] = [(0, array.nbytes)]
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        size = -(-max(1, nbytes) // 64) * 64
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        self._free.pop(i)
                    else:
                        self._free[i] = (start + size, length - size)
                    return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-max(1, nbytes) // 64) * 64
        with self._lock:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

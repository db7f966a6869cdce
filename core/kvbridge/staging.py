"""The staging path: gather a request's slices into one contiguous region, write it, scatter on arrival.

Engines pay a fixed cost per descriptor (~6 us for UCX-like engines), so a request whose slices are many
small runs (scattered pages at equal TP, one run per token row with different TP sizes) moves far below
the link's speed as plain descriptors. When a slice is *regular* -- every item contributes ``rows`` runs
of ``cols`` bytes at a constant stride on both sides (one run per item is the common case: a whole page at
equal TP, a head slice of a head-major page; a token-major head slice has one run per token row) -- the
sender gathers the runs into its registered staging area, posts one descriptor per piece into the
receiver's staging area, and the receiver scatters them into its pages when the piece's notice arrives,
before the piece counts as delivered.

Which path a (peer, component) takes is a cost model (:func:`should_stage`): staging wins when the average
descriptor the plan would post is smaller than ``descriptor cost x staging throughput`` (the bytes the
gather and the scatter move in the time one descriptor costs). The receiver decides when it sends its
request (it reserves the staging space there); the sender follows the reservation or falls back.

Copies work on numpy arrays (host memory) and torch tensors (CUDA: device kernels on the caller's stream,
see :class:`CudaStager`). Host copies use ``torch.index_select`` when torch is already imported in the
process (one pass), numpy otherwise; :func:`gather_rows` / :func:`scatter_rows` are the primitives.

    rows = regular_rows(segments, src_item_nbytes, dst_item_nbytes)   # None -> plain descriptors
    gather_rows(src_view, rows, items, out)          # out: [len(items), rows.nbytes]
    scatter_rows(dst_view, rows, items, staged)
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.geometry import DeviceKind, MemoryRegion, region_of
from kvbridge.slicing import Segments

STAGING = "__staging__"      # the component name staging regions are registered under

#: Bytes per second the staging path moves through a gather *and* a scatter (1 / (1/gather + 1/scatter)),
#: measured: host (one core, numpy/torch, 2026-11 2-core EPYC host: gather ~6-9 GB/s, scatter ~5-9 GB/s
#: for >= 1 KiB runs) and CUDA (H200 index_select ~1.8 TB/s, index_copy_ ~0.7 TB/s, issue 14).
STAGE_BPS = {DeviceKind.CPU: 3.0e9, DeviceKind.CUDA: 5.0e11}
#: per-descriptor cost assumed for a backend whose spec does not say (UCX-like engines, measured ~6 us)
DEFAULT_DESCRIPTOR_COST_US = 6.0
MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rows:
    """A regular slice: ``rows`` runs of ``cols`` bytes at ``src_col + r*src_stride`` -> ``dst_col + r*dst_stride``
    inside one source / destination item (``rows * stride`` is the item size on each side)."""

    rows: int
    cols: int
    src_stride: int
    dst_stride: int
    src_col: int
    dst_col: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols

    @property
    def src_contiguous(self) -> bool:
        """The item's runs are adjacent in the source item (one run of ``nbytes`` at ``src_col``)."""
        return self.rows == 1 or self.cols == self.src_stride

    @property
    def dst_contiguous(self) -> bool:
        return self.rows == 1 or self.cols == self.dst_stride


_ROWS: dict[tuple[Segments, int, int], Rows | None] = {}
_ROWS_KEPT = 1024


def regular_rows(seg: Segments, src_item: int, dst_item: int) -> Rows | None:
    """Recognise a regular slice (one run per item, or ``n`` equal runs at a constant stride that tiles the
    item on both sides); None when the slice is empty or not regular. Remembered per ``Segments`` object
    (immutable, hashed by identity: the registry shares one per slice plan among every agent)."""
    key = (seg, src_item, dst_item)
    if key in _ROWS:
        return _ROWS[key]
    found = _regular_rows(seg, src_item, dst_item)
    if len(_ROWS) >= _ROWS_KEPT:
        _ROWS.clear()
    _ROWS[key] = found
    return found


def _regular_rows(seg: Segments, src_item: int, dst_item: int) -> Rows | None:
    n = len(seg)
    if n == 0:
        return None
    s0, d0, cols = int(seg.src_off[0]), int(seg.dst_off[0]), int(seg.nbytes[0])
    if n == 1:
        if cols <= 0 or s0 + cols > src_item or d0 + cols > dst_item:
            return None
        return Rows(rows=1, cols=cols, src_stride=src_item, dst_stride=dst_item, src_col=s0, dst_col=d0)
    if np.any(seg.nbytes != seg.nbytes[0]):
        return None
    s_stride, d_stride = src_item // n, dst_item // n
    if s_stride * n != src_item or d_stride * n != dst_item:
        return None
    r = np.arange(n, dtype=np.int64)
    if not (np.array_equal(seg.src_off, s0 + r * s_stride) and np.array_equal(seg.dst_off, d0 + r * d_stride)):
        return None
    if s0 + cols > s_stride or d0 + cols > d_stride:
        return None
    return Rows(rows=n, cols=cols, src_stride=s_stride, dst_stride=d_stride, src_col=s0, dst_col=d0)


def page_layout(rows: Sequence[Rows]) -> tuple[list[int], int]:
    """Byte offset of each buffer's slice inside one item-major staged item, and the staged bytes per item."""
    offsets, total = [], 0
    for r in rows:
        offsets.append(total)
        total += r.nbytes
    return offsets, total


# ---------------------------------------------------------------------------------------------- cost model
def stage_threshold(descriptor_cost_us: float, device: DeviceKind) -> float:
    """The average descriptor size (bytes) below which staging beats plain descriptors: the bytes a gather
    and a scatter move in the time one descriptor costs."""
    return descriptor_cost_us * 1e-6 * STAGE_BPS.get(device, STAGE_BPS[DeviceKind.CPU])


def estimated_descriptors(rows: Sequence[Rows], dst_items: np.ndarray) -> int:
    """Descriptors a plain plan of these items would post, as the receiver can tell (from its own items):
    whole-item runs merge along runs of consecutive destination items, anything else is one per run."""
    n = int(dst_items.size)
    if n == 0:
        return 0
    runs = 1 + int(np.count_nonzero(np.diff(dst_items) != 1)) if n > 1 else 1
    total = 0
    for r in rows:
        whole = r.rows == 1 and r.cols == r.src_stride == r.dst_stride
        total += runs if whole else n * r.rows
    return total


def should_stage(rows: Sequence[Rows], dst_items: np.ndarray, *, mode: str, below_bytes: float) -> bool:
    """Pure: stage when ``mode`` says so, or (``auto``) when the average descriptor would be smaller than
    ``below_bytes`` (see :func:`stage_threshold`)."""
    if mode == "never" or not rows or dst_items.size == 0:
        return False
    if mode == "always":
        return True
    descriptors = estimated_descriptors(rows, dst_items)
    nbytes = sum(r.nbytes for r in rows) * int(dst_items.size)
    return descriptors > 0 and nbytes / descriptors < below_bytes


# ---------------------------------------------------------------------------------------------- copies
def host_view(region: MemoryRegion) -> np.ndarray:
    """A writable uint8 numpy view of a registered host region."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))


def _loaded_torch() -> Any | None:
    """torch when this process already imported it (never imported here: it costs seconds and memory)."""
    return sys.modules.get("torch")


def _is_cuda(x: Any) -> bool:
    device = getattr(x, "device", None)
    return device is not None and getattr(device, "type", "") == "cuda"


def _rows_index(items: np.ndarray, rows: int) -> np.ndarray:
    """Index of every (item, row) pair in a ``[num_items * rows, stride]`` view."""
    return (items[:, None] * rows + np.arange(rows, dtype=np.int64)).ravel()


def _source_view(buf: Any, r: Rows) -> Any:
    """A 2-D view whose rows are the runs to copy (indexed by :func:`source_index`)."""
    if r.src_contiguous:
        return buf[:, r.src_col: r.src_col + r.nbytes]
    return _reshape(buf, buf.shape[0] * r.rows, r.src_stride)[:, r.src_col: r.src_col + r.cols]


def _dest_view(buf: Any, r: Rows) -> Any:
    if r.dst_contiguous:
        return buf[:, r.dst_col: r.dst_col + r.nbytes]
    return _reshape(buf, buf.shape[0] * r.rows, r.dst_stride)[:, r.dst_col: r.dst_col + r.cols]


def _reshape(x: Any, *shape: int) -> Any:
    """Reshape without ever copying (numpy or torch): staged slices must stay views."""
    if isinstance(x, np.ndarray):
        if _NUMPY_COPY_KW:
            return x.reshape(shape, copy=False)      # raises instead of silently copying
        out = x.view()
        out.shape = shape          # the same, before NumPy 2.1 (deprecated from 2.5)
        return out
    return x.view(*shape)


_NUMPY_COPY_KW = tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 1)


def _void(a: np.ndarray) -> np.ndarray:
    """A 2-D uint8 array with contiguous rows as a 1-D array of ``V<row bytes>`` (one element per run)."""
    return a.view(np.dtype((np.void, a.shape[1])))[:, 0]


def _elements(buf: np.ndarray, r: Rows, items: np.ndarray, side: str) -> tuple[np.ndarray, int] | None:
    """When every run of a side starts at a multiple of its length (TP head slices do), the buffer is a flat
    array of ``V<run>`` elements and each run is one element: their indices and the run length, else None.
    Runs adjacent in the item count as one."""
    if side == "src":
        stride, col, contiguous = r.src_stride, r.src_col, r.src_contiguous
    else:
        stride, col, contiguous = r.dst_stride, r.dst_col, r.dst_contiguous
    item = buf.shape[1]
    rows, cols = (1, r.nbytes) if contiguous else (r.rows, r.cols)
    stride = item if contiguous else stride
    if col % cols or stride % cols or item % cols or not buf.flags.c_contiguous:
        return None
    per_item, first = item // cols, col // cols
    if rows == 1:
        return (items * per_item + first if first or per_item != 1 else items), cols
    per_row = stride // cols
    return ((items * per_item)[:, None] + (np.arange(rows, dtype=np.int64) * per_row + first)[None, :]).ravel(), cols


def _flat_void(a: np.ndarray, cols: int) -> np.ndarray:
    return _reshape(a, a.size).view(np.dtype((np.void, cols)))


def gather_rows(buf: Any, r: Rows, items: np.ndarray, out: Any, *, index: Any = None) -> None:
    """Pack the slice of ``buf[items[k]]`` into ``out[k]``. ``buf``: ``[num_items, item_nbytes]`` uint8 (numpy,
    or torch on any device); ``out``: a C-contiguous ``[len(items), r.nbytes]`` uint8 view of the same kind.
    ``index`` (CUDA only): :func:`source_index` of ``items`` already on the device. Host: one pass
    (``np.take`` of run-sized elements, or ``torch.index_select`` when torch is loaded)."""
    if isinstance(buf, np.ndarray):
        found = _elements(buf, r, items, "src")
        if found is not None:
            elements, run = found
            np.take(_flat_void(buf, run), elements, out=_flat_void(out, run), mode="clip")  # items were validated
            return
        src, idx = _source_view(buf, r), source_index(r, items)
        out2 = _reshape(out, idx.size, src.shape[1])
        tm = _loaded_torch()
        if tm is not None:
            tm.index_select(tm.from_numpy(src), 0, tm.from_numpy(idx), out=tm.from_numpy(out2))
        else:
            _void(out2)[...] = _void(src)[idx]                # two passes: numpy has no strided take
        return
    import torch

    src = _source_view(buf, r)
    where = index if index is not None else torch.as_tensor(source_index(r, items), device=buf.device)
    torch.index_select(src, 0, where, out=out.view(where.numel(), src.shape[1]))


def scatter_rows(buf: Any, r: Rows, items: np.ndarray, staged: Any, *, index: Any = None) -> None:
    """The inverse on the receiving side: unpack ``staged[k]`` (``[len(items), r.nbytes]``) into the slice of
    ``buf[items[k]]``. Host: one pass (``np.put`` of run-sized elements, or a fancy assignment)."""
    if isinstance(buf, np.ndarray):
        found = _elements(buf, r, items, "dst")
        if found is not None and staged.flags.c_contiguous:
            elements, run = found
            np.put(_flat_void(buf, run), elements, _flat_void(staged, run), mode="clip")
            return
        dst, idx = _dest_view(buf, r), dest_index(r, items)
        _void(dst)[idx] = _void(_reshape(staged, idx.size, dst.shape[1]))   # a memcpy per run
        return
    import torch

    dst = _dest_view(buf, r)
    where = index if index is not None else torch.as_tensor(dest_index(r, items), device=buf.device)
    dst.index_copy_(0, where, staged.view(where.numel(), dst.shape[1]))


def source_index(r: Rows, items: np.ndarray) -> np.ndarray:
    """The row index :func:`gather_rows` uses for ``items`` (to move it to a device ahead of time)."""
    return items if r.src_contiguous else _rows_index(items, r.rows)


def dest_index(r: Rows, items: np.ndarray) -> np.ndarray:
    return items if r.dst_contiguous else _rows_index(items, r.rows)


def _parts(buffers: Sequence[Any], rows: Sequence[Rows], n: int, area: Any) -> list[tuple[Any, Rows, Any]]:
    """Buffer-major views of a C-contiguous staged area: buffer ``b``'s ``[n, rows[b].nbytes]`` block follows
    the blocks of the buffers before it."""
    flat = _reshape(area, n * sum(r.nbytes for r in rows))
    parts, cursor = [], 0
    for buf, r in zip(buffers, rows):
        parts.append((buf, r, _reshape(flat[cursor: cursor + n * r.nbytes], n, r.nbytes)))
        cursor += n * r.nbytes
    return parts


def gather(buffers: Sequence[Any], rows: Sequence[Rows], items: np.ndarray, out: Any) -> None:
    """Pack the slices of ``items`` of every buffer into the C-contiguous ``out`` (``len(items) *`` the sum of
    ``rows[b].nbytes`` bytes, any shape), buffer-major: buffer ``b``'s ``[len(items), rows[b].nbytes]`` block
    after those of the buffers before it, as the agent stages a layer. One pass per buffer."""
    for buf, r, part in _parts(buffers, rows, len(items), out):
        gather_rows(buf, r, items, part)


def scatter(buffers: Sequence[Any], rows: Sequence[Rows], items: np.ndarray, staged: Any) -> None:
    """The inverse of :func:`gather`."""
    for buf, r, part in _parts(buffers, rows, len(items), staged):
        scatter_rows(buf, r, items, part)


def device_view(array: Any, num_items: int, item_nbytes: int) -> Any | None:
    """A ``[num_items, item_nbytes]`` uint8 view of a registered CUDA tensor (None for anything else)."""
    if not _is_cuda(array):
        return None
    import torch

    return array.view(torch.uint8).view(num_items, item_nbytes)


def is_cuda(array: Any) -> bool:
    return _is_cuda(array)


class CudaStager:
    """This agent's CUDA stream for gathers and scatters: work is queued on it, ordered after an engine
    event when given, and an event recorded after it says when it is done (``event.query()``, never a
    synchronize). One per agent and device."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def engine_event(self) -> Any:
        """An event after the work queued so far on the caller's current stream (the engine's forward pass)."""
        torch = self._torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_device(self, index: np.ndarray) -> tuple[Any, Any]:
        """An index array on the device, copied on our stream from pinned memory without waiting (a
        pageable copy would wait for everything queued on the stream, the engine's event included): the
        device tensor and the pinned one, both to keep alive until the work that reads them is done."""
        torch = self._torch
        host = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(self.stream):          # (the stream's context sets its device too)
            return host.to(self.stream.device, non_blocking=True), host

    def run(self, work: Any, after: Any = None) -> Any:
        """Queue ``work()`` on our stream after ``after`` (an event, or None); return the event that ends it."""
        torch = self._torch
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            work()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


class StagingArea:
    """A registered region (host or CUDA) with a first-fit allocator (offsets in bytes, 64-byte aligned)."""

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
        self.nbytes = int(array.nbytes)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]
        self._lock = threading.Lock()

    @property
    def device(self) -> DeviceKind:
        return self.region.device

    def view(self, offset: int, rows: int, cols: int) -> Any:
        """``[rows, cols]`` uint8 view of the area at ``offset`` (C-contiguous)."""
        part = self.array[offset: offset + rows * cols]
        return part.reshape(rows, cols) if isinstance(part, np.ndarray) else part.view(rows, cols)

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

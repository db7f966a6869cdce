"""One index kernel per staged piece, whatever the number of buffers it spans.

An engine keeps its KV cache in one tensor per layer and K/V (64 buffers for 32 layers). Gathering a
piece buffer by buffer costs a kernel launch and a few Python views per buffer: ~1.5 ms for a 128-token
request on an H100, ten times the transfer itself. A :class:`BufferSpan` views the address range that all
buffers of a component occupy as rows of one tensor (``word`` bytes per row, the largest unit every buffer
offset, item size and run is a multiple of); a :class:`RunIndex` turns a piece's items into the row index
of every run of every buffer, on the device, in the staged order (buffer by buffer, item by item, run by
run), so the gather is one ``index_select`` and the scatter one ``index_copy_``. Only the rows of
registered buffers are ever indexed: the gaps between buffers inside the span are never touched.

    span = BufferSpan.over(views)                      # views: [num_items, item_nbytes] uint8 tensors
    index = span.run_index(buffers=[0, 1], rows=rows, side="src")   # None: not batchable
    index.gather(items_on_device, staged_bytes)        # staged_bytes: C-contiguous uint8, piece-sized
    index.scatter(items_on_device, staged_bytes)       # the receiving side's inverse (side="dst")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.staging import Rows

#: below this row size an index would hold more entries than it saves launches (fall back to per buffer)
MIN_WORD_BYTES = 128


class _Interface:
    """``__cuda_array_interface__`` of a raw address range (no stream: nothing is synchronised)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 2}


def _element(word: int, addr: int) -> tuple[Any, int]:
    """The widest torch integer type whose size divides ``word`` and the base address (and its size)."""
    import torch

    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if word % size == 0 and addr % size == 0:
            return dtype, size
    return torch.uint8, 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RunIndex:
    """The runs of some buffers of a span, as span rows: ``starts[b] + item * item_rows + runs``."""

    span: Any            # [rows, word / element] tensor over the whole address range
    word: int            # bytes per span row
    element: int         # bytes per tensor element
    starts: Any          # int64 [B, 1, 1] on the device
    item_rows: int       # span rows per item (every buffer of the index has the same item size)
    runs: Any            # int64 [1, 1, R] on the device: rows of one item's runs, in order
    offsets: Any         # int64 [B, 1, R]: starts + runs (the index of item 0)

    @property
    def nbytes_per_item(self) -> int:
        """Staged bytes one item contributes over all buffers of the index."""
        return int(self.starts.shape[0]) * int(self.runs.shape[-1]) * self.word

    def rows_of(self, items: Any) -> Any:
        """The span rows of every run (buffer-major, then item, then run) of ``items`` (int64, on the device)."""
        import torch

        return torch.add(self.offsets, items.view(1, -1, 1), alpha=self.item_rows).view(-1)   # one kernel

    def _staged(self, staged: Any, count: int) -> Any:
        if staged.numel() != count * self.word or not staged.is_contiguous() \
                or staged.data_ptr() % self.element:
            raise ValueError(f"staged bytes: {staged.numel()} B contiguous at {staged.data_ptr():#x} do not hold "
                             f"{count} rows of {self.word} B")
        return staged.view(-1).view(self.span.dtype).view(count, self.word // self.element)

    def gather(self, items: Any, staged: Any) -> None:
        """Pack the runs of ``items`` into ``staged`` (uint8, C-contiguous, exactly the piece's bytes)."""
        import torch

        where = self.rows_of(items)
        torch.index_select(self.span, 0, where, out=self._staged(staged, int(where.numel())))

    def scatter(self, items: Any, staged: Any) -> None:
        """The inverse: write ``staged`` into the runs of ``items``."""
        where = self.rows_of(items)
        self.span.index_copy_(0, where, self._staged(staged, int(where.numel())))


class BufferSpan:
    """Every buffer of one component (``[num_items, item_nbytes]`` uint8 tensors on one device) seen as rows of
    one tensor over the address range they occupy; :meth:`run_index` builds the index of a piece's runs."""

    def __init__(self, views: Sequence[Any], span_of: Any = None) -> None:
        """``span_of(addr, nbytes)``: a uint8 tensor over that range (default: a CUDA array interface view);
        tests over host memory pass one that slices a parent tensor."""
        if not views:
            raise ValueError("a span needs at least one buffer")
        self.views = list(views)
        self.device = views[0].device
        self.bases = [int(v.data_ptr()) for v in self.views]
        self.item_nbytes = [int(v.shape[1]) for v in self.views]
        self.lo = min(self.bases)
        self.hi = max(b + int(v.numel()) for b, v in zip(self.bases, self.views))
        self._span_of = span_of or _cuda_range
        self._spans: dict[int, Any] = {}
        self._index: dict[tuple[Any, ...], RunIndex | None] = {}

    @classmethod
    def over(cls, views: Sequence[Any]) -> BufferSpan:
        return cls(views)

    def _span(self, word: int) -> tuple[Any, int]:
        found = self._spans.get(word)
        dtype, size = _element(word, self.lo)
        if found is None:
            nbytes = -(-(self.hi - self.lo) // word) * word
            raw = self._span_of(self.lo, nbytes)
            found = self._spans[word] = raw.view(dtype).view(nbytes // word, word // size)
        return found, size

    def run_index(self, *, buffers: Sequence[int], rows: Rows, side: str) -> RunIndex | None:
        """The index of ``buffers``' runs, each buffer's as ``rows`` describes them on ``side`` ("src": the
        gathering side, "dst": the scattering side); None when the buffers differ in item size or the common
        row would be smaller than ``MIN_WORD_BYTES``. Cached."""
        key = (tuple(buffers), rows, side)
        if key not in self._index:
            self._index[key] = self._build(list(buffers), rows, side)
        return self._index[key]

    def _build(self, buffers: list[int], r: Rows, side: str) -> RunIndex | None:
        import torch

        if not buffers or len({self.item_nbytes[b] for b in buffers}) != 1:
            return None
        item = self.item_nbytes[buffers[0]]
        src = side == "src"
        contiguous = r.src_contiguous if src else r.dst_contiguous
        col, stride = (r.src_col, r.src_stride) if src else (r.dst_col, r.dst_stride)
        n_runs, run = (1, r.nbytes) if contiguous else (r.rows, r.cols)
        stride = item if contiguous else stride
        word = 0
        for value in [self.bases[b] - self.lo for b in buffers] + [item, col, run, stride]:
            word = math.gcd(word, value)
        word = math.gcd(word, 1 << 20)              # a row of at most 1 MiB: long runs are several rows
        if word < MIN_WORD_BYTES:
            return None
        span, element = self._span(word)
        per_run = run // word
        runs = (np.arange(n_runs, dtype=np.int64)[:, None] * (stride // word) + col // word
                + np.arange(per_run, dtype=np.int64)[None, :]).reshape(1, 1, -1)
        starts = np.array([(self.bases[b] - self.lo) // word for b in buffers], np.int64).reshape(-1, 1, 1)
        return RunIndex(span=span, word=word, element=element,
                        starts=torch.from_numpy(starts).to(self.device), item_rows=item // word,
                        runs=torch.from_numpy(runs).to(self.device),
                        offsets=torch.from_numpy(starts + runs).to(self.device))


def _cuda_range(addr: int, nbytes: int) -> Any:
    """A uint8 tensor over ``[addr, addr + nbytes)`` on the device that owns ``addr`` (never a copy)."""
    import torch

    found = torch.as_tensor(_Interface(addr, nbytes))
    if found.data_ptr() != addr or found.device.type != "cuda":
        raise RuntimeError(f"torch copied the range at {addr:#x} instead of viewing it")
    return found

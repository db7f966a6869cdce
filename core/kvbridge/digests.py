"""Per-destination checksums: a digest of exactly the bytes one decode rank receives of each (buffer, item).

SGLang's own KV checksum covers a prefill rank's whole pages, so it can only be compared when both sides
have the same TP size. Here the prefill digests, for every buffer and item of a notice, the runs it writes to
that decode rank (the slice's segments, in segment order), and the decode digests the same runs where they
landed in its own items: with any TP ratio the two agree byte for byte, or the room fails naming the
component, the buffer (its layer) and the destination page.

The digest is a position-weighted sum of the 32-bit words of the runs, mod 2^64, with 64-bit weights
``random * 2^33 + 2 * position + 1``: odd, and for any two positions their sum and difference have a 2-adic
valuation below 33. So a change confined to one word (any single changed bit or byte), any swap of two different
words, and the same bit flipped in any two words always change it: such a change is a nonzero multiple of 2^64
only if its valuation reached 64, and it stays below. (A sum over 64-bit words cannot promise this: two flipped
top bits add ``2^63 * (odd + odd)``, which vanishes.) It guards against corruption, not against an adversary (the
control channel's HMAC does that). Host memory, vectorized with numpy: computed on 64-bit words as
``X @ lo_weights + (X >> 32) @ hi_correction``, which is the same sum, in bounded temporary memory. Device memory
(torch tensors, CUDA or not): the same sum by torch's int64 arithmetic (which wraps mod 2^64) where the pages
live, one gather and two multiply-sums per batch; only the digests cross to the host.

    runs = run_bytes(segments, "src")                  # the runs inside one item (cache it)
    d = digest_items(buffer_view, items, runs)         # uint64 per item
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.slicing import Segments

BATCH_BYTES = 16 << 20          # items are digested in batches of about this many bytes
SHIFT_BYTES = 1 << 20           # the high halves are formed in pieces of about this many bytes (cache-sized)
_WEIGHTS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _weights(words: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``words`` 64-bit words: ``lo`` and ``hi`` such that ``X @ lo + (X >> 32) @ hi`` (mod 2^64) is the
    sum over 32-bit words ``p`` of ``e_p * word_p`` with ``e_p = random * 2^33 + 2p + 1`` (fixed: both sides
    must agree). Word ``2j`` is the low half of ``X[j]`` (weight ``lo[j]``), word ``2j + 1`` the high half,
    whose weight ``2^32 * lo[j] + hi[j]`` is made ``= 4j + 3`` modulo 2^33 by ``hi[j]``."""
    found = _WEIGHTS.get(words)
    if found is None:
        rng = np.random.Generator(np.random.PCG64(0x6B76627269646765))     # 'kvbridge'
        j = np.arange(words, dtype=np.uint64)
        mask = np.uint64((1 << 33) - 1)
        high = rng.integers(0, 2**31, (2, words), dtype=np.int64).view(np.uint64) << np.uint64(33)
        lo = high[0] | (j * np.uint64(4) + np.uint64(1))
        hi = high[1] | ((j * np.uint64(4) + np.uint64(3) - np.uint64(1 << 32)) & mask)
        found = _WEIGHTS[words] = (lo, hi)
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class Runs:
    """The runs of one buffer's slice inside an item, on one side: ``count`` runs of ``length`` bytes from
    ``start`` every ``stride`` bytes when regular (the common case: a page, a head slice, a head slice per token
    row), else the byte offsets of every run byte (``index``), run after run."""

    index: np.ndarray
    start: int
    length: int
    stride: int
    count: int
    regular: bool

    @property
    def nbytes(self) -> int:
        return int(self.index.size)


def run_bytes(segments: Segments, side: str) -> Runs:
    """The runs of ``segments`` on ``side`` ("src"/"dst"), in segment order: the order both sides digest in."""
    offsets = segments.src_off if side == "src" else segments.dst_off
    lengths = segments.nbytes
    if len(segments) == 0:
        return Runs(index=np.zeros(0, np.int64), start=0, length=0, stride=0, count=0, regular=True)
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    index = starts + np.arange(int(lengths.sum()), dtype=np.int64)
    count, length, first = len(segments), int(lengths[0]), int(offsets[0])
    stride = int(offsets[1] - offsets[0]) if count > 1 else length
    regular = bool(np.all(lengths == length)) and stride >= length and bool(
        np.array_equal(offsets, first + stride * np.arange(count, dtype=np.int64)))
    return Runs(index=index, start=first, length=length, stride=stride, count=count, regular=regular)


def _slices(view: np.ndarray, batch: np.ndarray, runs: Runs) -> np.ndarray:
    """``[len(batch), runs.nbytes]`` uint8: the runs of those items, contiguous (one gather of those bytes)."""
    n, item = len(batch), view.shape[1]
    if runs.regular:
        if runs.count == 1 or runs.stride == runs.length:
            return view[batch, runs.start: runs.start + runs.nbytes]
        row, col = divmod(runs.start, runs.stride)
        if item % runs.stride == 0 and col + runs.length <= runs.stride and row + runs.count <= item // runs.stride:
            grid = view.reshape(view.shape[0], item // runs.stride, runs.stride)
            return grid[batch, row: row + runs.count, col: col + runs.length].reshape(n, -1)
    return view[batch[:, None], runs.index[None, :]]


def readable(view: Any) -> bool:
    """Can :func:`digest_items` read ``view``: a numpy array, or a torch tensor on any device."""
    if isinstance(view, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(view, torch.Tensor)


def digest_items(view: Any, items: np.ndarray, runs: Runs) -> np.ndarray:
    """uint64 digest of the runs of ``view[item]`` for every item (``view``: ``[num_items, item_nbytes]`` uint8,
    a numpy array or a torch tensor on any device: the same digests either way)."""
    if not isinstance(view, np.ndarray):
        return _digest_tensor(view, items, runs)
    n, size = len(items), runs.nbytes
    out = np.zeros(n, np.uint64)
    if n == 0 or size == 0:
        return out
    words = -(-size // 8)
    lo, hi = _weights(words)
    per = max(1, BATCH_BYTES // max(1, view.shape[1]))
    rows = max(1, SHIFT_BYTES // (8 * words))
    high = np.empty((min(rows, per, n), words), np.uint64)
    for a in range(0, n, per):
        batch = np.asarray(items[a: a + per])
        data = _slices(view, batch, runs)
        if size % 8:
            data = np.concatenate([data, np.zeros((len(batch), words * 8 - size), np.uint8)], axis=1)
        x = np.ascontiguousarray(data).view(np.uint64)
        total = x @ lo                                                   # mod 2^64
        for r in range(0, len(batch), rows):
            part = high[: min(rows, len(batch) - r)]
            np.right_shift(x[r: r + len(part)], np.uint64(32), out=part)
            total[r: r + len(part)] += part @ hi
        out[a: a + per] = total
    return out


_DEVICE_WEIGHTS: dict[tuple[int, str], tuple[Any, Any]] = {}


def _tensor_weights(words: int, device: Any) -> tuple[Any, Any]:
    import torch

    key = (words, str(device))
    found = _DEVICE_WEIGHTS.get(key)
    if found is None:
        lo, hi = _weights(words)
        found = _DEVICE_WEIGHTS[key] = (torch.from_numpy(lo.view(np.int64)).to(device),
                                        torch.from_numpy(hi.view(np.int64)).to(device))
    return found


def _digest_tensor(view: Any, items: np.ndarray, runs: Runs) -> np.ndarray:
    """:func:`digest_items` where a torch ``view`` lives (see :func:`_digest_tensor_on_device`); returns once the
    digests are on the host."""
    import torch

    if len(items) == 0 or runs.nbytes == 0:
        return np.zeros(len(items), np.uint64)
    index = torch.as_tensor(np.ascontiguousarray(items, dtype=np.int64)).to(view.device, non_blocking=True)
    return _digest_tensor_on_device(view, index, runs).cpu().numpy().view(np.uint64)


def _digest_tensor_on_device(view: Any, index: Any, runs: Runs) -> Any:
    """int64 digests (a tensor on ``view``'s device) of the runs of ``view[index]``: int64 products and sums wrap
    mod 2^64 as uint64 ones do; the high halves are shifted logically (``>> 32`` then masked: torch's shift of a
    signed word is arithmetic). Queued on the caller's current stream, after the work queued on it."""
    import torch

    n, size = int(index.shape[0]), runs.nbytes
    device = view.device
    words = -(-size // 8)
    lo, hi = _tensor_weights(words, device)
    item = int(view.shape[1])
    per = max(1, BATCH_BYTES // max(1, item))
    out = torch.empty(n, dtype=torch.int64, device=device)
    columns = None if runs.regular else torch.as_tensor(runs.index).to(device)
    for a in range(0, n, per):
        rows = view.index_select(0, index[a: a + per])
        b = rows.shape[0]
        if columns is not None:
            data = rows[:, columns]
        elif runs.count == 1 or runs.stride == runs.length:
            data = rows[:, runs.start: runs.start + size]
        else:
            row, col = divmod(runs.start, runs.stride)
            if item % runs.stride == 0 and col + runs.length <= runs.stride and row + runs.count <= item // runs.stride:
                grid = rows.reshape(b, item // runs.stride, runs.stride)
                data = grid[:, row: row + runs.count, col: col + runs.length].reshape(b, -1)
            else:
                data = rows[:, torch.as_tensor(runs.index).to(device)]
        if size % 8:
            data = torch.nn.functional.pad(data, (0, words * 8 - size))
        x = data.contiguous().view(torch.int64)
        out[a: a + per] = (x * lo).sum(1) + (((x >> 32) & 0xFFFFFFFF) * hi).sum(1)
    return out

"""Per-destination checksums: a digest of exactly the bytes one decode rank receives of each (buffer, item).

SGLang's own KV checksum covers a prefill rank's whole pages, so it can only be compared when both sides
have the same TP size. Here the prefill digests, for every buffer and item of a notice, the runs it writes to
that decode rank (the slice's segments, in segment order), and the decode digests the same runs where they
landed in its own items: with any TP ratio the two agree byte for byte, or the room fails naming the
component, the buffer (its layer) and the destination page.

The digest is a position-weighted sum of the 64-bit words of the runs, mod 2^64, folded to 32 bits: any single
changed byte, and any swap of two different words, changes it (the weights are odd). It guards against
corruption, not against an adversary (the control channel's HMAC does that). Host memory, vectorized with
numpy, bounded temporary memory.

    runs = run_bytes(segments, "src")                  # the runs inside one item (cache it)
    d = digest_items(buffer_view, items, runs)         # uint32 per item
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.slicing import Segments

BATCH_BYTES = 16 << 20          # items are digested in batches of about this many bytes
_WEIGHTS: dict[int, np.ndarray] = {}


def _weights(words: int) -> np.ndarray:
    """Odd 64-bit weights per word position (fixed: both sides must agree)."""
    found = _WEIGHTS.get(words)
    if found is None:
        rng = np.random.Generator(np.random.PCG64(0x6B76627269646765))     # 'kvbridge'
        found = rng.integers(0, 2**63 - 1, words, dtype=np.int64).view(np.uint64) | np.uint64(1)
        _WEIGHTS[words] = found
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


def digest_items(view: np.ndarray, items: np.ndarray, runs: Runs) -> np.ndarray:
    """uint32 digest of the runs of ``view[item]`` for every item (``view``: ``[num_items, item_nbytes]``)."""
    n, size = len(items), runs.nbytes
    out = np.zeros(n, np.uint32)
    if n == 0 or size == 0:
        return out
    words = -(-size // 8)
    weights = _weights(words)
    per = max(1, BATCH_BYTES // max(1, view.shape[1]))
    for a in range(0, n, per):
        batch = np.asarray(items[a: a + per])
        data = _slices(view, batch, runs)
        if size % 8:
            data = np.concatenate([data, np.zeros((len(batch), words * 8 - size), np.uint8)], axis=1)
        total = np.ascontiguousarray(data).view(np.uint64) @ weights     # mod 2^64
        out[a: a + per] = ((total >> np.uint64(32)) ^ total).astype(np.uint32)
    return out

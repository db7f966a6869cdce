"""Per-destination checksums: a digest of exactly the bytes one decode rank receives of each (buffer, item).

SGLang's own KV checksum covers a prefill rank's whole pages, so it can only be compared when both sides
have the same TP size. Here the prefill digests, for every buffer and item of a notice, the runs it writes to
that decode rank (the slice's segments, in segment order), and the decode digests the same runs where they
landed in its own items: with any TP ratio the two agree byte for byte, or the room fails naming the
component, the buffer (its layer) and the destination page.

The digest is a position-weighted sum of the 32-bit words of a run, mod 2^64, folded to 32 bits: any single
changed byte, and any swap of two different words, changes it (the weights are odd). It guards against
corruption, not against an adversary (the control channel's HMAC does that). Host memory, vectorized with
numpy, bounded temporary memory.

    index = run_bytes(segments, "src")                 # byte offsets of the runs inside one item, cached
    d = digest_items(buffer_view, items, index)        # uint32 per item
"""

from __future__ import annotations

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


def run_bytes(segments: Segments, side: str) -> np.ndarray:
    """The byte offsets (int64) inside one item of every run of ``segments`` on ``side`` ("src"/"dst"),
    run after run: the order both sides digest in."""
    offsets = segments.src_off if side == "src" else segments.dst_off
    if len(segments) == 0:
        return np.zeros(0, np.int64)
    lengths = segments.nbytes
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def digest_items(view: np.ndarray, items: np.ndarray, index: np.ndarray) -> np.ndarray:
    """uint32 digest of ``view[item][index]`` for every item (``view``: ``[num_items, item_nbytes]`` uint8)."""
    n, size = len(items), int(index.size)
    out = np.zeros(n, np.uint32)
    if n == 0 or size == 0:
        return out
    contiguous = bool(index[-1] - index[0] == size - 1)        # one run (a whole page, a head-major slice)
    words = -(-size // 4)
    weights = _weights(words)
    per = max(1, BATCH_BYTES // max(1, size))
    for a in range(0, n, per):
        batch = np.asarray(items[a: a + per])
        if contiguous:
            data = view[batch, int(index[0]): int(index[0]) + size]
        else:
            data = view[batch[:, None], index[None, :]]
        if size % 4:
            data = np.concatenate([data, np.zeros((len(batch), words * 4 - size), np.uint8)], axis=1)
        else:
            data = np.ascontiguousarray(data)
        word = data.view(np.uint32).astype(np.uint64)
        with np.errstate(over="ignore"):
            total = (word * weights[None, :]).sum(axis=1, dtype=np.uint64)
        out[a: a + per] = ((total >> np.uint64(32)) ^ total).astype(np.uint32)
    return out

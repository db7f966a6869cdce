"""Batched staging over a span of buffers (kvbridge.spans), checked against the per-buffer reference
(``gather_rows`` / ``scatter_rows``) on host tensors: buffers carved out of one parent allocation with gaps
between them stand in for an engine's separately allocated layers (the GPU test runs the real CUDA view)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvbridge.spans import BufferSpan
from kvbridge.staging import Rows, gather_rows, scatter_rows

torch = pytest.importorskip("torch")

ITEMS, ITEM = 40, 4096


def _world(gaps: list[int], seed: int = 0) -> tuple[Any, list[Any], Any]:
    """A parent tensor with one ``[ITEMS, ITEM]`` buffer after each gap (bytes), random contents."""
    total = sum(gaps) + len(gaps) * ITEMS * ITEM
    parent = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8))
    views, cursor = [], 0
    for gap in gaps:
        cursor += gap
        views.append(parent[cursor: cursor + ITEMS * ITEM].view(ITEMS, ITEM))
        cursor += ITEMS * ITEM
    base = parent.data_ptr()

    def span_of(addr: int, nbytes: int) -> Any:
        return parent[addr - base: addr - base + nbytes]

    return parent, views, span_of


CASES = {
    "whole item": Rows(rows=1, cols=ITEM, src_stride=ITEM, dst_stride=ITEM, src_col=0, dst_col=0),
    "head-major half": Rows(rows=1, cols=ITEM // 2, src_stride=ITEM, dst_stride=ITEM, src_col=ITEM // 2, dst_col=0),
    "token-major slice": Rows(rows=16, cols=128, src_stride=ITEM // 16, dst_stride=ITEM // 16, src_col=128,
                              dst_col=128),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("side", ["src", "dst"])
def test_batched_gather_and_scatter_match_the_per_buffer_reference(name: str, side: str) -> None:
    rows = CASES[name]
    _, views, span_of = _world([0, 4096, 256 * 3, 1 << 16])
    span = BufferSpan(views, span_of=span_of)
    buffers = [0, 2, 3, 1]                        # any order: the staged layout follows the list
    index = span.run_index(buffers=buffers, rows=rows, side=side)
    assert index is not None
    items = np.array([7, 3, 39, 0, 12], np.int64)
    nb = rows.nbytes
    if side == "src":
        staged = torch.zeros(len(buffers) * len(items) * nb, dtype=torch.uint8)
        index.gather(torch.from_numpy(items), staged)
        for k, b in enumerate(buffers):
            want = np.zeros((len(items), nb), np.uint8)
            gather_rows(views[b].numpy(), rows, items, want)
            got = staged[k * len(items) * nb: (k + 1) * len(items) * nb].numpy().reshape(len(items), nb)
            np.testing.assert_array_equal(got, want, err_msg=f"buffer {b}")
    else:
        before = [v.numpy().copy() for v in views]
        staged = torch.from_numpy(np.random.default_rng(5).integers(0, 256, len(buffers) * len(items) * nb,
                                                                    dtype=np.uint8))
        index.scatter(torch.from_numpy(items), staged)
        for k, b in enumerate(buffers):
            want = before[b]
            part = staged[k * len(items) * nb: (k + 1) * len(items) * nb].numpy().reshape(len(items), nb)
            scatter_rows(want, rows, items, part)
            np.testing.assert_array_equal(views[b].numpy(), want, err_msg=f"buffer {b}")
        untouched = [v for v in range(4) if v not in buffers]
        for b in untouched:
            np.testing.assert_array_equal(views[b].numpy(), before[b])


def test_gaps_between_buffers_are_never_written() -> None:
    parent, views, span_of = _world([512, 8192, 512])
    index = BufferSpan(views, span_of=span_of).run_index(buffers=[0, 1, 2], rows=CASES["whole item"], side="dst")
    assert index is not None
    before = parent.clone()
    inside = torch.zeros_like(parent, dtype=torch.bool)
    for v in views:
        start = v.data_ptr() - parent.data_ptr()
        inside[start: start + v.numel()] = True
    items = torch.arange(ITEMS, dtype=torch.int64)
    index.scatter(items, torch.full((3 * ITEMS * ITEM,), 7, dtype=torch.uint8))
    assert torch.equal(parent[~inside], before[~inside])
    assert bool((parent[inside] == 7).all())


def test_not_batched_when_item_sizes_differ_or_runs_are_tiny() -> None:
    _, views, span_of = _world([0, 0])
    other = torch.zeros(ITEMS * ITEM, dtype=torch.uint8).view(ITEMS * 2, ITEM // 2)
    mixed = BufferSpan([views[0], other], span_of=lambda addr, n: torch.zeros(n, dtype=torch.uint8))
    assert mixed.run_index(buffers=[0, 1], rows=CASES["head-major half"], side="src") is None
    tiny = Rows(rows=64, cols=32, src_stride=64, dst_stride=64, src_col=0, dst_col=0)
    assert BufferSpan(views, span_of=span_of).run_index(buffers=[0, 1], rows=tiny, side="src") is None


def test_a_staged_region_of_the_wrong_size_is_refused() -> None:
    _, views, span_of = _world([0])
    index = BufferSpan(views, span_of=span_of).run_index(buffers=[0], rows=CASES["whole item"], side="src")
    assert index is not None
    with pytest.raises(ValueError, match="do not hold"):
        index.gather(torch.arange(3, dtype=torch.int64), torch.zeros(2 * ITEM, dtype=torch.uint8))

"""The staging fast path: pattern recognition, gather/scatter against the reference, the allocator, fallback."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.geometry import BufferGeometry, DType, Rank, ShardAxis
from kvbridge.slicing import buffer_segments
from kvbridge.staging import StagingArea, gather, page_layout, regular_rows, scatter
from kvbridge.testkit import reference as ref


def _geom(heads_total: int, tp: int, page: int = 8, dim: int = 4, layout: str = "token-major") -> BufferGeometry:
    local = len(ref.units_held(heads_total, tp, 0))
    shape = (page, local, dim) if layout == "token-major" else (local, page, dim)
    return BufferGeometry(name="k", num_items=6, item_shape=shape, dtype=DType.FLOAT16,
                          shard=ShardAxis(1 if layout == "token-major" else 0, heads_total))


@pytest.mark.parametrize("pt, dt", [(4, 2), (2, 4), (1, 8), (8, 1), (2, 8)])
def test_gather_scatter_equals_the_reference_reshard(pt: int, dt: int) -> None:
    heads, page, dim = 8, 8, 4
    spec = ref.KVSpec(ref.TOKEN_MAJOR, total_heads=heads, page_size=page, head_bytes=dim * 2)
    src_items, dst_items = np.array([4, 1, 3]), np.array([2, 5, 0])
    positions = np.arange(3)
    for d in range(dt):
        dst = np.zeros((6, spec.local_page_nbytes(dt)), np.uint8)
        for p in range(pt):
            seg = buffer_segments(_geom(heads, pt), _geom(heads, dt), Rank(p, pt), Rank(d, dt))
            if len(seg) == 0:
                continue
            rows = regular_rows(seg, spec.local_page_nbytes(pt), spec.local_page_nbytes(dt))
            assert rows is not None and rows.rows == page
            src = ref.source_buffer(spec, 3, 0, 0, pt, p, 6, src_items, positions, 1, 0).reshape(6, -1)
            staged = np.zeros((3, page_layout([rows])[1]), np.uint8)
            gather([src], [rows], src_items, staged)
            scatter([dst], [rows], dst_items, staged)
        want = ref.expected_pages(spec, 3, 0, 0, dt, d, positions).reshape(3, -1)
        assert np.array_equal(dst[dst_items], want)


def test_equal_tp_and_head_major_slices_are_not_staged() -> None:
    whole = buffer_segments(_geom(8, 2), _geom(8, 2), Rank(0, 2), Rank(0, 2))
    assert regular_rows(whole, 1, 1) is None                  # one run per page: descriptors are cheaper
    hm = buffer_segments(_geom(8, 4, layout="head-major"), _geom(8, 2, layout="head-major"), Rank(1, 4), Rank(0, 2))
    assert len(hm) == 1 and regular_rows(hm, 1, 1) is None


def test_allocator_first_fit_and_coalescing() -> None:
    area = StagingArea(np.zeros(1024, np.uint8))
    a, b, c = area.alloc(100), area.alloc(200), area.alloc(600)
    assert (a, b, c) == (0, 128, 384)
    assert area.alloc(100) is None
    area.free(b, 200)
    assert area.alloc(150) == 128
    area.free(a, 100), area.free(128, 150), area.free(c, 600)
    assert area.free_bytes == 1024 and area.alloc(1024) == 0

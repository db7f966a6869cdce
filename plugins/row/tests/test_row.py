"""The row state type: pairing, refusals, and the conformance kit's geometry rules."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge import Rank
from kvbridge.plugin import GeometryError, IndexKind
from kvbridge.registry import Registry
from kvbridge.slicing import sharded_component_slice
from kvbridge_row import RowState, row_component


def test_row_zero_is_a_row() -> None:
    comp = row_component("aux", rows=[(8, 64)])
    src, dst = RowState().pair_indices(comp, np.array([0]), 0, np.array([7]), 0)
    assert src.tolist() == [0] and dst.tolist() == [7]


@pytest.mark.parametrize("src,dst", [([], [1]), ([1, 2], [3]), ([1], [-1])])
def test_one_row_each_side(src: list[int], dst: list[int]) -> None:
    comp = row_component("aux", rows=[(8, 64)])
    with pytest.raises(GeometryError):
        RowState().pair_indices(comp, np.array(src, dtype=np.int64), 0, np.array(dst, dtype=np.int64), 0)


def test_page_indexed_refused() -> None:
    comp = row_component("aux", rows=[(8, 64)])
    bad = type(comp)(name=comp.name, state_type="row", buffers=comp.buffers, index_kind=IndexKind.PAGE)
    with pytest.raises(GeometryError, match="indexed by slot"):
        RowState().check_component(bad, Rank(0, 1))


@pytest.mark.parametrize("pt,dt", [(1, 1), (4, 2), (1, 4), (2, 8)])
def test_replicated_rows_written_once(pt: int, dt: int) -> None:
    comp = row_component("aux", rows=[(8, 64), (8, 512)])
    for d in range(dt):
        writers = [p for p in range(pt)
                   if not sharded_component_slice(comp, comp, Rank(p, pt), Rank(d, dt)).is_empty]
        assert len(writers) == 1, (pt, dt, d, writers)


def test_registered() -> None:
    registry = Registry.build()
    assert registry.state_type("row").name == "row"

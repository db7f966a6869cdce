"""Byte-exact head-sliced resharding of window pages against the independent numpy reference."""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbridge.errors import UnsupportedTopology
from kvbridge.geometry import Component, Rank
from kvbridge.testkit.reshard import TP_SIZES, assert_identity_at_equal_tp, run_reshard, shardable
from kvbridge_swa import SWAState, swa_component, window_pages

STATE = SWAState()
PAIRS = list(itertools.product(TP_SIZES, TP_SIZES))
PAGE, WINDOW, NUM_PAGES = 4, 10, 24


def make(heads: int, head_major: bool, tp: int, *, head_dim: int = 3, v_head_dim: int | None = None,
         dtype: str = "bfloat16", page: int = PAGE, window: int = WINDOW, num_pages: int = NUM_PAGES,
         layers: int = 2) -> Component:
    return swa_component("swa", layers=layers, page_size=page, kv_heads=heads, head_dim=head_dim, tp=tp,
                         dtype=dtype, num_pages=num_pages, window=window, v_head_dim=v_head_dim,
                         head_major=head_major)


def window_lists(seq_len: int, rng: np.random.Generator, page: int = PAGE, window: int = WINDOW,
                 num_pages: int = NUM_PAGES) -> tuple[np.ndarray, int]:
    """Scattered SWA-pool pages for a request's window (never page 0, the padding page), and its first position."""
    first, count = window_pages(seq_len, window, page)
    return rng.permutation(np.arange(1, num_pages))[:count], first


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
@pytest.mark.parametrize("heads", [8, 2, 6])
@pytest.mark.parametrize(("pt", "dt"), PAIRS)
def test_byte_exact_matrix(layout: str, heads: int, pt: int, dt: int) -> None:
    """8 heads split everywhere; 2 heads replicate from TP 4 on; 6 heads only split over TP 1 and 2."""
    build = partial(make, heads, layout == "head-major")
    if not (shardable((heads,), pt) and shardable((heads,), dt)):
        with pytest.raises(UnsupportedTopology):
            build(pt if not shardable((heads,), pt) else dt)
        return
    rng = np.random.default_rng(pt * 100 + dt * 10 + heads)
    src, sf = window_lists(37, rng)   # tokens 27..36 -> pages 6..9 (4 pages)
    dst, df = window_lists(37, rng)
    s, d = STATE.pair_indices(build(pt), src, sf, dst, df)
    assert len(d) == 4
    run_reshard(STATE, build, pt, dt, s, d, seed=pt + dt).assert_exact()


def test_different_tp_head_major_slices_whole_page_runs() -> None:
    """Head-major pages reshard with one segment per page (per buffer); token-major with one per token."""
    hm = STATE.slice(make(8, True, 4), make(8, True, 2), Rank(3, 4), Rank(1, 2)).buffers[0]
    tm = STATE.slice(make(8, False, 4), make(8, False, 2), Rank(3, 4), Rank(1, 2)).buffers[0]
    assert len(hm) == 1 and len(tm) == PAGE


def test_window_end_to_end_with_margin_and_different_tp() -> None:
    """Prefill (TP 1) sends its window plus one page of margin; decode (TP 4) lists only its window."""
    rng = np.random.default_rng(5)
    first, count = window_pages(37, WINDOW, PAGE)
    src = rng.permutation(np.arange(1, NUM_PAGES))[:count + 1]
    dst = rng.permutation(np.arange(1, NUM_PAGES))[:count]
    s, d = STATE.pair_indices(make(8, False, 1), src, first - 1, dst, first)
    assert s.tolist() == src[1:].tolist()
    run_reshard(STATE, partial(make, 8, False), 1, 4, s, d).assert_exact()


def test_v_head_dim_differs_from_k() -> None:
    build = partial(make, 4, False, head_dim=4, v_head_dim=2)
    assert build(1).buffers[0].item_shape == (PAGE, 4, 4) and build(1).buffers[2].item_shape == (PAGE, 4, 2)
    for pt, dt in [(4, 1), (1, 4), (2, 2)]:
        run_reshard(STATE, build, pt, dt, np.array([3, 7]), np.array([9, 2])).assert_exact()


# ----------------------------------------------------------------------------- properties
@st.composite
def geometries(draw: st.DrawFn) -> dict:
    return {
        "heads": draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16])),
        "head_major": draw(st.booleans()),
        "head_dim": draw(st.integers(1, 4)),
        "v_head_dim": draw(st.one_of(st.none(), st.integers(1, 4))),
        "dtype": draw(st.sampled_from(["uint8", "float16", "float32"])),
        "page": draw(st.integers(1, 5)),
        "window": draw(st.integers(1, 12)),
        "layers": draw(st.integers(1, 2)),
    }


def build(g: dict, tp: int) -> Component:
    return make(g["heads"], g["head_major"], tp, head_dim=g["head_dim"], v_head_dim=g["v_head_dim"],
                dtype=g["dtype"], page=g["page"], window=g["window"], num_pages=NUM_PAGES, layers=g["layers"])


@settings(max_examples=250, deadline=None)
@given(g=geometries(), pt=st.sampled_from(TP_SIZES), dt=st.sampled_from(TP_SIZES), seq_len=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_property_exactly_once_and_equal_to_reference(g: dict, pt: int, dt: int, seq_len: int, seed: int) -> None:
    """Window pages of a random request: every destination byte written exactly once, union = reference."""
    for tp in (pt, dt):
        if not shardable((g["heads"],), tp):
            with pytest.raises(UnsupportedTopology):
                build(g, tp)
            event("refused: not shardable")
            return
    event("resharded")
    rng = np.random.default_rng(seed)
    first, count = window_pages(seq_len, g["window"], g["page"])
    src = rng.permutation(np.arange(1, NUM_PAGES))[:count]
    dst = rng.permutation(np.arange(1, NUM_PAGES))[:count]
    s, d = STATE.pair_indices(build(g, pt), src, first, dst, first)
    run_reshard(STATE, partial(build, g), pt, dt, s, d, seed=seed).assert_exact()


@settings(max_examples=100, deadline=None)
@given(g=geometries(), tp=st.sampled_from(TP_SIZES))
def test_property_equal_tp_is_identity(g: dict, tp: int) -> None:
    if not shardable((g["heads"],), tp):
        return
    assert_identity_at_equal_tp(STATE, build(g, tp), tp)

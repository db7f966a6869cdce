"""Window page selection and pairing of page lists by absolute position."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import GeometryError
from kvbridge_swa import PageRange, SWAState, align_by_position, max_window_pages, swa_component, window_pages


# ----------------------------------------------------------------------------- window_pages
def test_window_pages_sglang_example() -> None:
    # window 4096, seq_len 10000, P=64: start 5904 floored to 5888 -> 4112 tokens -> 65 pages
    assert window_pages(10_000, 4096, 64) == PageRange(92, 65) == (92, 65)
    assert window_pages(10_000, 4096, 64).stop == 157


@pytest.mark.parametrize(("seq_len", "window", "page", "expected"), [
    (0, 128, 16, (0, 0)),          # empty request
    (1, 128, 16, (0, 1)),
    (100, 4096, 64, (0, 2)),       # shorter than the window: the whole request
    (128, 128, 16, (0, 8)),        # exactly one window, page-aligned
    (129, 128, 16, (0, 9)),        # start 1 floors to 0
    (144, 128, 16, (1, 8)),        # start 16 is aligned
    (145, 128, 16, (1, 9)),        # start 17 floors to 16; the partial last page counts
    (10, 1, 1, (9, 1)),
])
def test_window_pages_cases(seq_len: int, window: int, page: int, expected: tuple[int, int]) -> None:
    assert window_pages(seq_len, window, page) == expected


@pytest.mark.parametrize("args", [(-1, 128, 16), (10, 0, 16), (10, 128, 0)])
def test_window_pages_rejects_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(GeometryError):
        window_pages(*args)


@settings(max_examples=300, deadline=None)
@given(seq_len=st.integers(0, 3000), window=st.integers(1, 700), page=st.integers(1, 80))
def test_window_pages_is_the_set_of_pages_holding_window_tokens(seq_len: int, window: int, page: int) -> None:
    """Brute force: the pages that hold tokens [max(0, L-W), L), as a contiguous run of positions."""
    tokens = np.arange(max(0, seq_len - window), seq_len)
    pages = np.unique(tokens // page)
    got = window_pages(seq_len, window, page)
    assert got.count == pages.size
    if pages.size:
        assert got.first == pages[0] and got.stop == pages[-1] + 1
    assert got.count <= max_window_pages(window, page)


@settings(max_examples=100, deadline=None)
@given(window=st.integers(1, 300), page=st.integers(1, 40))
def test_max_window_pages_is_attained(window: int, page: int) -> None:
    longest = max(window_pages(n, window, page).count for n in range(window, window + 2 * page))
    assert longest == max_window_pages(window, page)


# ----------------------------------------------------------------------------- align_by_position
def test_align_trims_source_pages_before_the_decode_window() -> None:
    s, d = align_by_position(np.array([10, 11, 12, 13]), 91, np.array([40, 41, 42]), 92)
    assert s.tolist() == [11, 12, 13] and d.tolist() == [40, 41, 42]


def test_align_trims_source_pages_after_the_decode_window() -> None:
    s, d = align_by_position(np.array([10, 11, 12, 13]), 92, np.array([40, 41]), 92)
    assert s.tolist() == [10, 11] and d.tolist() == [40, 41]


def test_align_same_window_is_identity() -> None:
    src, dst = np.array([5, 9, 2]), np.array([7, 1, 3])
    s, d = align_by_position(src, 4, dst, 4)
    assert s.tolist() == [5, 9, 2] and d.tolist() == [7, 1, 3]


def test_shifted_window_of_equal_length_is_refused_not_misaligned() -> None:
    """The prefix-truncation pitfall: equal lengths, starts one page apart. Pairing positionally would
    silently put page 91's KV where decode expects page 92's; aligned by position, one decode page is
    uncovered, which is a real conflict."""
    with pytest.raises(GeometryError, match=r"not covered.*\[91, 94\).*\[92, 95\)"):
        align_by_position(np.array([10, 11, 12]), 91, np.array([40, 41, 42]), 92)


def test_no_overlap_is_refused() -> None:
    with pytest.raises(GeometryError, match="do not overlap"):
        align_by_position(np.array([1, 2]), 10, np.array([3, 4]), 20)


def test_empty_decode_list_pairs_nothing() -> None:
    s, d = align_by_position(np.array([1, 2]), 0, np.array([], dtype=np.int64), 0)
    assert s.size == 0 and d.size == 0


def test_empty_source_for_a_nonempty_window_is_refused() -> None:
    with pytest.raises(GeometryError, match="do not overlap"):
        align_by_position(np.array([], dtype=np.int64), 3, np.array([1]), 3)


@pytest.mark.parametrize(("src", "src_first", "dst", "match"), [
    (np.array([[1, 2]]), 0, np.array([1, 2]), "one-dimensional"),
    (np.array([1.0, 2.0]), 0, np.array([1, 2]), "integers"),
    (np.array([1, 2]), -1, np.array([1, 2]), ">= 0"),
])
def test_align_rejects_malformed_input(src: np.ndarray, src_first: int, dst: np.ndarray, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        align_by_position(src, src_first, dst, 0)


@settings(max_examples=400, deadline=None)
@given(sf=st.integers(0, 30), ns=st.integers(0, 12), df=st.integers(0, 30), nd=st.integers(0, 12))
def test_align_pairs_by_position_or_refuses(sf: int, ns: int, df: int, nd: int) -> None:
    """Source page ids encode their position (1000 + pos), decode ids theirs (2000 + pos): every returned
    pair must hold the same position, and a refusal happens exactly when the decode range is uncovered."""
    src, dst = 1000 + np.arange(sf, sf + ns), 2000 + np.arange(df, df + nd)
    covered = nd == 0 or (sf <= df and df + nd <= sf + ns)
    if not covered:
        with pytest.raises(GeometryError):
            align_by_position(src, sf, dst, df)
        return
    s, d = align_by_position(src, sf, dst, df)
    assert np.array_equal(s - 1000, d - 2000)
    assert np.array_equal(d, dst)  # every decode page is written, in its order


# ----------------------------------------------------------------------------- through the state type
def comp(window: int = 4096, page: int = 64) -> object:
    return swa_component("swa", layers=2, page_size=page, kv_heads=4, head_dim=8, tp=1, dtype="float16",
                         num_pages=1024, window=window)


def test_state_pages_uses_the_component_options() -> None:
    assert SWAState().pages(comp(), 10_000) == (92, 65)
    assert SWAState().pages(comp(), 10_000, page_size=16) == window_pages(10_000, 4096, 16)


def test_length_drift_within_the_same_pages_pairs_identically() -> None:
    """Prefill saw 10000 tokens, decode counts 10010: both windows are pages [92, 157)."""
    st_ = SWAState()
    a, b = st_.pages(comp(), 10_000), st_.pages(comp(), 10_010)
    assert a == b == (92, 65)
    s, d = st_.pair_indices(comp(), 500 + np.arange(a.count), a.first, np.arange(b.count), b.first)
    assert s.tolist() == list(range(500, 565)) and d.tolist() == list(range(65))


@pytest.mark.parametrize(("prefill_len", "decode_len"), [(10_000, 10_050), (10_050, 10_000)])
def test_length_drift_across_a_page_boundary_is_a_conflict(prefill_len: int, decode_len: int) -> None:
    """10050 tokens give pages [93, 158), 10000 give [92, 157): whichever side is longer, one decode page
    was never sent, so pairing refuses (truncating a list would shift every page by one instead)."""
    st_ = SWAState()
    a, b = st_.pages(comp(), prefill_len), st_.pages(comp(), decode_len)
    assert {a, b} == {(92, 65), (93, 65)}
    with pytest.raises(GeometryError, match="not covered"):
        st_.pair_indices(comp(), np.arange(a.count), a.first, np.arange(b.count), b.first)


def test_prefill_sending_a_margin_is_trimmed_by_position() -> None:
    """A sender that adds one page of margin at each end: decode's window lies inside and pairs exactly."""
    st_ = SWAState()
    w = st_.pages(comp(), 10_000)
    src = 300 + np.arange(w.first - 1, w.stop + 1)          # page id 300 + position
    s, d = st_.pair_indices(comp(), src, w.first - 1, np.arange(w.count), w.first)
    assert s.tolist() == (300 + np.arange(w.first, w.stop)).tolist() and d.size == w.count


def test_state_refuses_a_decode_list_longer_than_any_window() -> None:
    with pytest.raises(GeometryError, match="spans at most 65 pages"):
        SWAState().pair_indices(comp(), np.arange(157), 0, np.arange(157), 0)

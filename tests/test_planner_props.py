"""Properties of TP slicing + planning, checked byte for byte against the independent reference.

For generated KV geometries (token-major, head-major, MLA; H in {1,2,4,8,16}; Pt, Dt in {1,2,4,8};
random page permutations), every (prefill rank, decode rank) pair is planned and copied into real numpy
buffers with the loopback backend's copy routine; a separate counter records how often each destination
byte is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from _kvcase import KVModel, count_writes, mergeable_pairs, page_runs, plan_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.backends.copying import copy_descriptors
from kvbridge.geometry import DType, Rank, region_of
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.slicing import Segments, target_ranks
from kvbridge.state.kv import KVState
from kvbridge.testkit import reference as ref

TP_SIZES = (1, 2, 4, 8)
HEAD_COUNTS = (1, 2, 4, 8, 16)
PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Scenario:
    model: KVModel
    pt: int
    dt: int
    src_pool: int
    dst_pool: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    positions: np.ndarray

    def __repr__(self) -> str:  # readable hypothesis falsifying examples
        return (f"Scenario({self.model}, Pt={self.pt}, Dt={self.dt}, pools={self.src_pool}/{self.dst_pool}, "
                f"src={self.src_pages.tolist()}, dst={self.dst_pages.tolist()}, "
                f"pos0={self.positions[:1].tolist()})")


@st.composite
def scenarios(draw: st.DrawFn, *, same_tp: bool = False) -> Scenario:
    layout = draw(st.sampled_from(ref.LAYOUTS))
    heads = 1 if layout == ref.MLA else draw(st.sampled_from(HEAD_COUNTS))
    dim = st.integers(1, 3)
    dims = (draw(dim),) if layout == ref.MLA else (draw(dim), draw(dim))  # V may differ from K
    model = KVModel(layout, heads, page_size=draw(st.integers(1, 4)), head_dims=dims,
                    num_layers=draw(st.integers(1, 2)),
                    dtype=draw(st.sampled_from([DType.UINT8, DType.BFLOAT16, DType.FLOAT32])))
    pt = draw(st.sampled_from(TP_SIZES))
    dt = pt if same_tp else draw(st.sampled_from(TP_SIZES))
    src_pool, dst_pool = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = draw(st.integers(0, min(src_pool, dst_pool)))
    src = np.array(draw(st.permutations(range(src_pool)))[:n], dtype=np.int64)
    dst = np.array(draw(st.permutations(range(dst_pool)))[:n], dtype=np.int64)
    if draw(st.booleans()):  # ascending lists have long runs on both sides: exercise merging
        src, dst = np.sort(src), np.sort(dst)
    first = draw(st.integers(0, 6))
    return Scenario(model, pt, dt, src_pool, dst_pool, src, dst, np.arange(first, first + n))


def _run(sc: Scenario) -> tuple[dict, dict, dict, dict]:
    """Plan and copy every (p, d) pair; return prefill buffers, decode buffers, write counts and plans."""
    kv = KVState()
    m = sc.model
    src_comp, dst_comp = m.component(sc.pt, sc.src_pool), m.component(sc.dt, sc.dst_pool)
    src = {p: m.source_buffers(sc.pt, p, sc.src_pool, sc.src_pages, sc.positions) for p in range(sc.pt)}
    dst = {d: m.empty_destination(sc.dt, d, sc.dst_pool) for d in range(sc.dt)}
    counters = {d: [np.zeros(b.nbytes + 1, np.int64) for b in dst[d]] for d in range(sc.dt)}
    plans = {}
    for d in range(sc.dt):
        targets = target_ranks(sc.pt, sc.dt, d)
        for p in range(sc.pt):
            cut = kv.slice(src_comp, dst_comp, Rank(p, sc.pt), Rank(d, sc.dt))
            if p not in targets:
                assert cut.is_empty, f"prefill {p} is not a target of decode {d} but has a slice"
            plan = plan_pair(src_comp, dst_comp, src[p], dst[d], cut.buffers, sc.src_pages, sc.dst_pages)
            count_writes(plan, dst[d], counters[d])
            copy_descriptors(plan.src_addr, plan.dst_addr, plan.nbytes)
            plans[p, d] = plan
    writes = {d: [np.cumsum(c)[:-1] for c in counters[d]] for d in range(sc.dt)}
    return src, dst, writes, plans


@PROPS
@given(scenarios())
def test_each_destination_byte_written_exactly_once_and_matches_reference(sc: Scenario) -> None:
    _, dst, writes, _ = _run(sc)
    m = sc.model
    untouched = np.setdiff1d(np.arange(sc.dst_pool), sc.dst_pages)
    for d in range(sc.dt):
        expected = m.expected_destination(sc.dt, d, sc.dst_pool, sc.dst_pages, sc.positions)
        for b, (got, want) in enumerate(zip(dst[d], expected)):
            per_page = writes[d][b].reshape(sc.dst_pool, -1)
            where = f"decode {d} buffer {b}"
            assert (per_page[sc.dst_pages] == 1).all(), f"{where}: a byte written {per_page.max()}x or 0x"
            assert (per_page[untouched] == 0).all(), f"{where}: a page outside the request was written"
            np.testing.assert_array_equal(got, want, err_msg=f"decode rank {d} buffer {b}")


@PROPS
@given(scenarios())
def test_descriptors_are_maximal_runs_and_bounded(sc: Scenario) -> None:
    _, _, _, plans = _run(sc)
    n = sc.src_pages.size
    for (p, d), plan in plans.items():
        assert mergeable_pairs(plan) == [], f"({p}->{d}): descriptors contiguous on both sides"
        assert (plan.nbytes > 0).all()
        per_buffer = np.bincount(plan.buffer, minlength=sc.model.num_buffers)
        if sc.model.layout == ref.TOKEN_MAJOR:  # at worst one per token row of a page
            assert per_buffer.max(initial=0) <= n * sc.model.page_size
        else:  # head-major and MLA slice per page: at most one descriptor per page
            assert per_buffer.max(initial=0) <= n


@PROPS
@given(scenarios(same_tp=True))
def test_equal_tp_is_the_identity_with_merged_page_runs(sc: Scenario) -> None:
    src, dst, _, plans = _run(sc)
    runs = page_runs(sc.src_pages, sc.dst_pages)
    comp = sc.model.component(sc.pt, sc.src_pool)
    for (p, d), plan in plans.items():
        if p != d:
            assert len(plan) == 0, f"equal TP: prefill {p} must not write to decode {d}"
            continue
        for b, geo in enumerate(comp.buffers):
            sel = plan.buffer == b
            sb, db = region_of(src[p][b]).addr, region_of(dst[d][b]).addr
            got = sorted(zip((plan.src_addr[sel] - np.uint64(sb)).tolist(),
                             (plan.dst_addr[sel] - np.uint64(db)).tolist(), plan.nbytes[sel].tolist()))
            item = geo.item_nbytes
            assert got == [(s * item, t * item, k * item) for s, t, k in runs], f"buffer {geo.name}"


def test_contiguous_page_run_is_one_descriptor_per_buffer() -> None:
    m = KVModel(ref.TOKEN_MAJOR, total_heads=4, page_size=4, head_dims=(8, 8), num_layers=3)
    comp = m.component(2, 16)
    src_pages, dst_pages = np.arange(3, 9), np.arange(10, 16)
    src = m.source_buffers(2, 1, 16, src_pages, np.arange(6))
    dst = m.empty_destination(2, 1, 16)
    cut = KVState().slice(comp, comp, Rank(1, 2), Rank(1, 2))
    plan = plan_pair(comp, comp, src, dst, cut.buffers, src_pages, dst_pages)
    item = comp.buffers[0].item_nbytes
    assert len(plan) == m.num_buffers
    assert sorted(plan.buffer.tolist()) == list(range(m.num_buffers))
    for b in range(m.num_buffers):
        row = plan.buffer.tolist().index(b)
        assert int(plan.src_addr[row]) == region_of(src[b]).addr + 3 * item
        assert int(plan.dst_addr[row]) == region_of(dst[b]).addr + 10 * item
        assert int(plan.nbytes[row]) == 6 * item
    # a break on either side splits the run: [3,4,5]->[10,11,13] is two descriptors per buffer
    plan = plan_pair(comp, comp, src, dst, cut.buffers, np.array([3, 4, 5]), np.array([10, 11, 13]))
    assert len(plan) == 2 * m.num_buffers


def test_unsorted_source_pages_are_sorted_before_merging() -> None:
    pair = BufferPair(src_base=0x1000, src_item_nbytes=64, src_num_items=32, dst_base=0x100000,
                      dst_item_nbytes=64, dst_num_items=32, segments=Segments.whole(64))
    plan = plan_transfer([pair], np.array([6, 4, 5]), np.array([2, 0, 1]))
    assert (plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.nbytes.tolist()) == (
        [0x1000 + 4 * 64], [0x100000], [3 * 64])


@pytest.mark.parametrize("src_base, dst_base", [
    (2**63, 2**63 + 2**40),
    (2**64 - 2**23, 2**63 + 7 * 4096),       # the last MiBs of the address space
    (0xFFFF_8000_0000_0000, 0x8000_0000_0000_1000),
])
def test_uint64_addresses_above_2_63_plan_exactly(src_base: int, dst_base: int) -> None:
    item, n_items = 512, 4096
    segs = Segments(np.array([0, 256], dtype=np.int64), np.array([128, 384], dtype=np.int64),
                    np.array([64, 64], dtype=np.int64))
    span = item * n_items
    pairs = [BufferPair(src_base=src_base, src_item_nbytes=item, src_num_items=n_items, dst_base=dst_base,
                        dst_item_nbytes=item, dst_num_items=n_items, segments=segs),
             BufferPair(src_base=src_base + span, src_item_nbytes=item, src_num_items=n_items,
                        dst_base=dst_base + span, dst_item_nbytes=item, dst_num_items=n_items,
                        segments=Segments.whole(item))]
    src_idx, dst_idx = np.array([3, 1, 4000, 4001]), np.array([7, 9, 11, 12])
    plan = plan_transfer(pairs, src_idx, dst_idx)  # fake addresses: planned, never copied
    assert plan.src_addr.dtype == np.uint64 and plan.dst_addr.dtype == np.uint64
    want = {(0, src_base + s * item + so, dst_base + t * item + do, n)
            for s, t in zip(src_idx.tolist(), dst_idx.tolist())
            for so, do, n in zip(segs.src_off.tolist(), segs.dst_off.tolist(), segs.nbytes.tolist())}
    want |= {(1, src_base + span + s * item, dst_base + span + t * item, k * item)
             for s, t, k in [(1, 9, 1), (3, 7, 1), (4000, 11, 2)]}
    got = {(int(b), int(s), int(d), int(n))
           for b, s, d, n in zip(plan.buffer, plan.src_addr, plan.dst_addr, plan.nbytes)}
    assert got == want
    assert len(plan) == len(want)

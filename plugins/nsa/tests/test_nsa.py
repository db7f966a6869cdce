"""NSA indexer pages: selection from position 0, replicated delivery (one writer each), checks, registry."""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge.state.kv
import kvbridge_nsa
from kvbridge.errors import GeometryError, IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, Rank, ShardAxis
from kvbridge.state.kv import KVState
from kvbridge.testkit import TP_SIZES, assert_state_type_installed, composed_types, run_reshard
from kvbridge_nsa import NSAState, PageRange, indexer_pages, nsa_component

STATE = NSAState()
NUM_PAGES = 12


def make(tp: int, *, layers: int = 3, page_size: int = 64, bytes_per_token: int = 132,
         num_pages: int = NUM_PAGES) -> Component:
    """The indexer component does not depend on TP (it is replicated); ``tp`` is accepted for the harness."""
    return nsa_component("indexer", layers=layers, page_size=page_size, bytes_per_token=bytes_per_token,
                         num_pages=num_pages)


def with_options(c: Component, options: dict) -> Component:
    return Component(name=c.name, state_type=c.state_type, buffers=c.buffers, index_kind=c.index_kind,
                     options=options)


# ----------------------------------------------------------------------------- page selection
@pytest.mark.parametrize(("seq_len", "page", "count"), [(0, 64, 0), (1, 64, 1), (64, 64, 1), (65, 64, 2),
                                                         (10_000, 64, 157), (7, 1, 7)])
def test_indexer_pages(seq_len: int, page: int, count: int) -> None:
    assert indexer_pages(seq_len, page) == PageRange(0, count)


@settings(max_examples=200, deadline=None)
@given(seq_len=st.integers(0, 5000), page=st.integers(1, 128))
def test_indexer_pages_brute_force(seq_len: int, page: int) -> None:
    assert indexer_pages(seq_len, page).count == np.unique(np.arange(seq_len) // page).size


@pytest.mark.parametrize("args", [(-1, 64), (10, 0)])
def test_indexer_pages_rejects(args: tuple[int, int]) -> None:
    with pytest.raises(GeometryError):
        indexer_pages(*args)


def test_state_pages_from_options() -> None:
    assert STATE.pages(make(1), 130) == (0, 3)
    assert STATE.pages(make(1, page_size=16, bytes_per_token=8), 130) == (0, 9)


# ----------------------------------------------------------------------------- geometry
def test_deepseek_v32_geometry() -> None:
    comp = nsa_component("indexer", layers=[0, 1, 61], num_pages=100)
    assert [b.name for b in comp.buffers] == ["indexer.indexer.0", "indexer.indexer.1", "indexer.indexer.61"]
    assert all(b.item_shape == (8448,) and b.dtype is DType.UINT8 and b.shard is None for b in comp.buffers)
    assert comp.options == {"page_size": 64, "bytes_per_token": 132} and comp.index_kind is IndexKind.PAGE
    STATE.check_component(comp, Rank(3, 8))


@pytest.mark.parametrize("bad", [{"page_size": 0}, {"bytes_per_token": -1}, {"layers": []}, {"layers": [2, 2]}])
def test_builder_rejects(bad: dict) -> None:
    args: dict = {"layers": 2, "num_pages": 8}
    args.update(bad)
    with pytest.raises(GeometryError):
        nsa_component("indexer", **args)


def test_check_component_refuses_slots_and_sharding() -> None:
    comp = make(1)
    slots = Component(name=comp.name, state_type="nsa", buffers=comp.buffers, index_kind=IndexKind.SLOT,
                      options=comp.options)
    with pytest.raises(GeometryError, match="indexed by page"):
        STATE.check_component(slots, Rank(0, 1))
    sharded = BufferGeometry(name="indexer.indexer.0", num_items=8, item_shape=(4, 64), dtype=DType.UINT8,
                             shard=ShardAxis(axis=0, total=8))
    with pytest.raises(GeometryError, match="replicated on every TP rank"):
        STATE.check_component(Component(name="indexer", state_type="nsa", buffers=(sharded,)), Rank(0, 2))


@pytest.mark.parametrize(("options", "match"), [
    ({"page_size": 0}, "positive int"), ({"page_size": 64, "bytes_per_token": "132"}, "positive int"),
    ({"page_size": 64, "bytes_per_token": 131}, "expected 64 tokens x 131 B"), ({"page_size": 5}, "evenly"),
])
def test_check_component_options(options: dict, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        STATE.check_component(with_options(make(1), options), Rank(0, 1))


def test_slice_refuses_peers_that_disagree() -> None:
    with pytest.raises(IncompatiblePeer, match="page_size 64 on prefill, 32 on decode"):
        STATE.slice(make(1), with_options(make(1), {"page_size": 32, "bytes_per_token": 264}), Rank(0, 1), Rank(0, 1))
    sharded = BufferGeometry(name="indexer.indexer.0", num_items=8, item_shape=(4, 64), dtype=DType.UINT8,
                             shard=ShardAxis(axis=0, total=8))
    comp = Component(name="indexer", state_type="nsa", buffers=(sharded,))
    with pytest.raises(IncompatiblePeer, match="must be replicated"):
        STATE.slice(comp, comp, Rank(0, 2), Rank(0, 2))


# ----------------------------------------------------------------------------- pairing
def test_pair_indices_from_position_zero() -> None:
    s, d = STATE.pair_indices(make(1), np.array([9, 4, 7]), 0, np.array([1, 2, 3]), 0)
    assert s.tolist() == [9, 4, 7] and d.tolist() == [1, 2, 3]


@pytest.mark.parametrize(("src_first", "dst_first"), [(3, 0), (0, 3), (3, 3)])
def test_pair_indices_refuses_lists_that_do_not_start_at_zero(src_first: int, dst_first: int) -> None:
    """A decode with a prefix hit must still list the indexer pages of its prefix (from position 0)."""
    with pytest.raises(GeometryError, match="from position 0, prefix hits included"):
        STATE.pair_indices(make(1), np.array([1, 2]), src_first, np.array([1, 2]), dst_first)


def test_pair_indices_source_too_short_is_a_conflict() -> None:
    with pytest.raises(GeometryError, match="decode expects 3 indexer pages, prefill sent 2"):
        STATE.pair_indices(make(1), np.array([1, 2]), 0, np.array([1, 2, 3]), 0)


def test_pair_indices_extra_source_pages_are_left_out() -> None:
    s, d = STATE.pair_indices(make(1), np.array([5, 6, 7, 8]), 0, np.array([1, 2]), 0)
    assert s.tolist() == [5, 6] and d.tolist() == [1, 2]


def test_pair_indices_malformed() -> None:
    with pytest.raises(GeometryError, match="integers"):
        STATE.pair_indices(make(1), np.array([1.5]), 0, np.array([1]), 0)
    with pytest.raises(GeometryError, match="one-dimensional"):
        STATE.pair_indices(make(1), np.array([1]), 0, np.array([[1]]), 0)


# ----------------------------------------------------------------------------- delivery
@pytest.mark.parametrize(("pt", "dt"), list(itertools.product(TP_SIZES, TP_SIZES)))
def test_byte_exact_matrix(pt: int, dt: int) -> None:
    rng = np.random.default_rng(pt * 10 + dt)
    first, count = indexer_pages(300, 64)                     # 5 pages of 8448 B per layer
    src = rng.permutation(np.arange(1, NUM_PAGES))[:count]
    dst = rng.permutation(np.arange(1, NUM_PAGES))[:count]
    s, d = STATE.pair_indices(make(pt), src, first, dst, first)
    run_reshard(STATE, make, pt, dt, s, d, seed=pt + dt).assert_exact()


@pytest.mark.parametrize(("pt", "dt"), [(2, 3), (3, 2), (4, 6), (6, 4), (8, 3)])
def test_sizes_that_do_not_divide_raise(pt: int, dt: int) -> None:
    with pytest.raises(UnsupportedTopology, match="do not divide"):
        STATE.slice(make(pt), make(dt), Rank(0, pt), Rank(0, dt))


@pytest.mark.parametrize(("pt", "dt"), [(3, 6), (6, 3), (3, 1)])
def test_multiples_beyond_powers_of_two(pt: int, dt: int) -> None:
    run_reshard(STATE, make, pt, dt, np.array([1, 2, 3]), np.array([4, 5, 6])).assert_exact()


def test_one_elected_writer_per_destination() -> None:
    comp = make(1)
    writers = {d: [p for p in range(8) if not STATE.slice(comp, comp, Rank(p, 8), Rank(d, 2)).is_empty]
               for d in range(2)}
    assert writers == {0: [0], 1: [4]}
    feeds = {d: [p for p in range(2) if not STATE.slice(comp, comp, Rank(p, 2), Rank(d, 8)).is_empty]
             for d in range(8)}
    assert feeds == {d: [d // 4] for d in range(8)}
    seg = STATE.slice(comp, comp, Rank(4, 8), Rank(1, 2)).buffers[0]
    assert (seg.src_off.tolist(), seg.dst_off.tolist(), seg.nbytes.tolist()) == ([0], [0], [8448])


def test_decode_prefix_hit_still_receives_the_whole_sequence() -> None:
    """Decode already holds 3 pages of KV (radix prefix), yet lists all 5 indexer pages from position 0:
    every one of them, prefix included, is written."""
    first, count = indexer_pages(300, 64)
    src, dst = np.array([3, 9, 1, 4, 11]), np.array([2, 5, 6, 7, 8])
    s, d = STATE.pair_indices(make(1), src, first, dst, first)
    assert len(d) == count == 5
    outcome = run_reshard(STATE, make, 2, 4, s, d)
    outcome.assert_exact()


def test_contiguous_pages_merge_into_one_descriptor_per_layer() -> None:
    outcome = run_reshard(STATE, make, 1, 1, np.arange(2, 7), np.arange(5, 10))
    outcome.assert_exact()
    assert outcome.descriptors.tolist() == [[3]]  # 3 layers, 5 pages each merged into one run


@st.composite
def geometries(draw: st.DrawFn) -> dict:
    return {"layers": draw(st.integers(1, 3)), "page_size": draw(st.integers(1, 8)),
                "bytes_per_token": draw(st.integers(1, 20))}


@settings(max_examples=150, deadline=None)
@given(g=geometries(), pt=st.sampled_from(TP_SIZES), dt=st.sampled_from(TP_SIZES), seq_len=st.integers(0, 60),
       seed=st.integers(0, 2**16))
def test_property_exactly_once_and_equal_to_reference(g: dict, pt: int, dt: int, seq_len: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    first, count = indexer_pages(seq_len, g["page_size"])
    pool = count + 1 + int(rng.integers(0, 4))
    src, dst = rng.permutation(np.arange(1, pool))[:count], rng.permutation(np.arange(1, pool))[:count]
    build = partial(make, num_pages=pool, **g)
    s, d = STATE.pair_indices(build(pt), src, first, dst, first)
    run_reshard(STATE, build, pt, dt, s, d, seed=seed).assert_exact()


@settings(max_examples=50, deadline=None)
@given(g=geometries(), tp=st.sampled_from(TP_SIZES))
def test_property_equal_tp_is_identity(g: dict, tp: int) -> None:
    comp = make(tp, **g)
    for p, d in itertools.product(range(tp), range(tp)):
        sl = STATE.slice(comp, comp, Rank(p, tp), Rank(d, tp))
        whole = [([0], [0], [b.item_nbytes]) for b in comp.buffers]
        got = [(s.src_off.tolist(), s.dst_off.tolist(), s.nbytes.tolist()) for s in sl.buffers]
        assert got == whole if p == d else sl.is_empty


# ----------------------------------------------------------------------------- registry
def mla_kv() -> Component:
    latent = BufferGeometry(name="kv.latent.0", num_items=32, item_shape=(64, 576), dtype=DType.BFLOAT16, shard=None)
    return Component(name="kv", state_type="kv", buffers=(latent,))


def test_entry_point_discovery() -> None:
    assert_state_type_installed("nsa", "kvbridge-nsa", NSAState)


def test_compose_mla_kv_then_indexer_in_declared_order() -> None:
    plugins = [kvbridge.state.kv, kvbridge_nsa]
    assert composed_types(plugins, (mla_kv(), make(1)), tp_size=4, tp_rank=2, page_size=64) == [KVState, NSAState]
    assert composed_types(plugins, (make(1), mla_kv()), tp_size=4, tp_rank=2, page_size=64) == [NSAState, KVState]

"""SWA component checks, peer agreement, builder, and registry discovery/composition."""

from __future__ import annotations

import numpy as np
import pytest

import kvbridge.state.kv
import kvbridge_swa
from kvbridge.errors import GeometryError, IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, PoolLayout, Rank, ShardAxis
from kvbridge.registry import Registry
from kvbridge.state.kv import KVState, kv_component
from kvbridge.testkit import assert_state_type_installed, composed_types
from kvbridge_swa import SWAState, swa_component

STATE = SWAState()


def comp(tp: int = 2, **overrides: object) -> Component:
    args: dict = {"layers": [0, 2], "page_size": 16, "kv_heads": 8, "head_dim": 8, "tp": tp, "dtype": "bfloat16",
                  "num_pages": 64, "window": 128}
    args.update(overrides)
    return swa_component("swa", **args)


def with_options(c: Component, options: dict) -> Component:
    return Component(name=c.name, state_type=c.state_type, buffers=c.buffers, index_kind=c.index_kind,
                     options=options)


# ----------------------------------------------------------------------------- builder
def test_builder_k_then_v_named_by_layer() -> None:
    c = comp(tp=4, v_head_dim=4)
    assert [b.name for b in c.buffers] == ["swa.k.0", "swa.k.2", "swa.v.0", "swa.v.2"]
    assert c.buffers[0].item_shape == (16, 2, 8) and c.buffers[2].item_shape == (16, 2, 4)
    assert c.buffers[0].shard == ShardAxis(axis=1, total=8)
    assert c.options == {"window": 128, "page_size": 16} and c.index_kind is IndexKind.PAGE


def test_builder_head_major_and_replicated_heads() -> None:
    c = comp(tp=8, kv_heads=2, head_major=True)
    assert c.buffers[0].item_shape == (1, 16, 8) and c.buffers[0].shard == ShardAxis(axis=0, total=2)


def test_builder_refuses_indivisible_heads() -> None:
    with pytest.raises(UnsupportedTopology):
        comp(tp=4, kv_heads=6)


@pytest.mark.parametrize("bad", [{"window": 0}, {"page_size": 0}, {"tp": 0}, {"layers": []}, {"layers": [1, 1]}])
def test_builder_rejects(bad: dict) -> None:
    with pytest.raises(GeometryError):
        comp(**bad)


# ----------------------------------------------------------------------------- check_component
def test_check_component_accepts_builder_output() -> None:
    STATE.check_component(comp(tp=4), Rank(3, 4))


@pytest.mark.parametrize("options", [{}, {"window": 0}, {"window": -5}, {"window": "128"}, {"window": True},
                                     {"window": 128.0}, {"window": 128, "page_size": 0}])
def test_check_component_requires_a_positive_window(options: dict) -> None:
    with pytest.raises(GeometryError, match="must be a positive int"):
        STATE.check_component(with_options(comp(), options), Rank(0, 2))


def test_check_component_window_alone_is_enough() -> None:
    STATE.check_component(with_options(comp(), {"window": 64}), Rank(0, 2))


def test_check_component_requires_pages() -> None:
    c = comp()
    slots = Component(name=c.name, state_type="swa", buffers=c.buffers, index_kind=IndexKind.SLOT, options=c.options)
    with pytest.raises(GeometryError, match="indexed by page"):
        STATE.check_component(slots, Rank(0, 2))


def test_check_component_refuses_shard_groups_and_wrong_tp() -> None:
    grouped = BufferGeometry(name="swa.k.0", num_items=8, item_shape=(16, 4, 8), dtype=DType.BFLOAT16,
                             shard=ShardAxis(axis=1, total=8, groups=(4, 4)))
    c = Component(name="swa", state_type="swa", buffers=(grouped,), options={"window": 64})
    with pytest.raises(GeometryError, match="no shard groups"):
        STATE.check_component(c, Rank(0, 2))
    with pytest.raises(GeometryError, match="holds 4 units but TP 4"):
        STATE.check_component(comp(tp=2), Rank(0, 4))


# ----------------------------------------------------------------------------- peer agreement
def test_slice_refuses_different_windows() -> None:
    with pytest.raises(IncompatiblePeer, match="window 128 on prefill, 256 on decode"):
        STATE.slice(comp(), comp(window=256), Rank(0, 2), Rank(0, 2))


def test_slice_refuses_different_page_sizes() -> None:
    with pytest.raises(IncompatiblePeer, match="page_size"):
        STATE.slice(comp(), with_options(comp(), {"window": 128, "page_size": 32}), Rank(0, 2), Rank(0, 2))


def test_different_tp_is_supported() -> None:
    """SGLang refuses non-MLA SWA across TP sizes; here prefill TP 1 feeds decode TP 8 by head ranges."""
    src, dst = comp(tp=1), comp(tp=8)
    for d in range(8):
        seg = STATE.slice(src, dst, Rank(0, 1), Rank(d, 8)).buffers[0]
        assert seg.src_off[:2].tolist() == [d * 16, 8 * 16 + d * 16] and seg.nbytes[0] == 16


def test_pair_indices_validates_integer_lists() -> None:
    with pytest.raises(GeometryError, match="integers"):
        STATE.pair_indices(comp(), np.array([1.0]), 0, np.array([1]), 0)


# ----------------------------------------------------------------------------- registry
def kv() -> Component:
    return kv_component(layers=[1], page_size=16, kv_heads=8, head_dim=8, tp=2, dtype="bfloat16", num_pages=32)


def test_entry_point_discovery() -> None:
    assert_state_type_installed("swa", "kvbridge-swa", SWAState)


def test_compose_kv_swa_mamba_in_declared_order() -> None:
    kvbridge_mamba = pytest.importorskip("kvbridge_mamba")
    mamba = kvbridge_mamba.mamba_component("linear", layers=[3], conv_groups=(8, 8, 16), kernel=4, heads=4,
                                           head_dim=2, state=2, tp=2, dtype="bfloat16", num_slots=9)
    assert composed_types([kvbridge.state.kv, kvbridge_mamba, kvbridge_swa], (kv(), comp(), mamba), tp_size=2,
                          tp_rank=1, page_size=16) == [KVState, SWAState, kvbridge_mamba.MambaState]


def test_compose_refuses_a_window_less_component() -> None:
    registry = Registry.build(entry_points=False, plugins=[kvbridge.state.kv, kvbridge_swa])
    layout = PoolLayout(components=(kv(), with_options(comp(), {})), tp_size=2, tp_rank=0, page_size=16)
    with pytest.raises(GeometryError, match="window"):
        registry.compose(layout)

"""Discovery through the ``kvbridge`` entry point group, and multi-state composition in declared order."""

from __future__ import annotations

import pytest

import kvbridge.state.kv
import kvbridge_mamba
from kvbridge.errors import GeometryError
from kvbridge.geometry import Component, IndexKind, PoolLayout
from kvbridge.registry import Registry
from kvbridge.state.kv import KVState, kv_component
from kvbridge.testkit import assert_state_type_installed, composed_types
from kvbridge_mamba import MambaState, mamba_component

TP = 2


def kv() -> Component:
    return kv_component(layers=[0], page_size=16, kv_heads=8, head_dim=8, tp=TP, dtype="bfloat16", num_pages=32)


def mamba() -> Component:
    return mamba_component("linear", layers=[1, 2], conv_groups=(8, 8, 16), kernel=4, heads=4, head_dim=2,
                           state=2, tp=TP, dtype="bfloat16", num_slots=9)


def test_entry_point_discovery() -> None:
    assert_state_type_installed("mamba", "kvbridge-mamba", MambaState)


def test_compose_kv_then_mamba_in_declared_order() -> None:
    plugins = [kvbridge.state.kv, kvbridge_mamba]
    assert composed_types(plugins, (kv(), mamba()), tp_size=TP, tp_rank=1, page_size=16) == [KVState, MambaState]
    assert composed_types(plugins, (mamba(), kv()), tp_size=TP, tp_rank=1, page_size=16) == [MambaState, KVState]


def test_compose_kv_swa_mamba_nsa_in_declared_order() -> None:
    kvbridge_swa = pytest.importorskip("kvbridge_swa")
    kvbridge_nsa = pytest.importorskip("kvbridge_nsa")
    registry = Registry.build(entry_points=False,
                              plugins=[kvbridge.state.kv, kvbridge_mamba, kvbridge_swa, kvbridge_nsa])
    swa = kvbridge_swa.swa_component("swa", layers=[0, 3], page_size=16, kv_heads=8, head_dim=8, tp=TP,
                                     dtype="bfloat16", num_pages=32, window=128)
    nsa = kvbridge_nsa.nsa_component("indexer", layers=2, num_pages=32)
    layout = PoolLayout(components=(kv(), swa, mamba(), nsa), tp_size=TP, tp_rank=0, page_size=16)
    types = registry.compose(layout)
    assert [t.name for t in types] == ["kv", "swa", "mamba", "nsa"]
    assert [type(t) for t in types] == [KVState, kvbridge_swa.SWAState, MambaState, kvbridge_nsa.NSAState]
    layout = PoolLayout(components=(mamba(), nsa, kv(), swa), tp_size=TP, tp_rank=0, page_size=16)
    assert [t.name for t in registry.compose(layout)] == ["mamba", "nsa", "kv", "swa"]


def test_compose_checks_the_component() -> None:
    registry = Registry.build(entry_points=False, plugins=[kvbridge.state.kv, kvbridge_mamba])
    paged = Component(name="linear", state_type="mamba", buffers=mamba().buffers, index_kind=IndexKind.PAGE)
    layout = PoolLayout(components=(kv(), paged), tp_size=TP, tp_rank=0, page_size=16)
    with pytest.raises(GeometryError, match="indexed by slot"):
        registry.compose(layout)

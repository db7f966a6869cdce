"""Discovery through the ``kvbridge`` entry point group, and multi-state composition in declared order."""

from __future__ import annotations

import kvbridge.state.kv
import kvbridge_mamba
import pytest
from kvbridge.errors import GeometryError
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, PoolLayout, ShardAxis
from kvbridge.registry import Registry
from kvbridge.specs import PluginStatus
from kvbridge.state.kv import KVState
from kvbridge_mamba import MambaState, mamba_component

TP = 2


def kv_component() -> Component:
    def buf(name: str) -> BufferGeometry:
        return BufferGeometry(name=name, num_items=32, item_shape=(16, 4, 8), dtype=DType.BFLOAT16,
                              shard=ShardAxis(axis=1, total=8))

    return Component(name="kv", state_type="kv", buffers=(buf("kv.k.0"), buf("kv.v.0")))


def mamba() -> Component:
    return mamba_component("linear", layers=[1, 2], conv_groups=(8, 8, 16), kernel=4, heads=4, head_dim=2,
                           state=2, tp=TP, dtype="bfloat16", num_slots=9)


def test_entry_point_discovery() -> None:
    registry = Registry.build(env={})
    record = next(r for r in registry.records() if r.name == "mamba")
    assert record.distribution == "kvbridge-mamba" and record.status is PluginStatus.AVAILABLE
    assert isinstance(registry.state_type("mamba"), MambaState)


def test_compose_kv_then_mamba_in_declared_order() -> None:
    registry = Registry.build(entry_points=False, plugins=[kvbridge.state.kv, kvbridge_mamba])
    layout = PoolLayout(components=(kv_component(), mamba()), tp_size=TP, tp_rank=1, page_size=16)
    assert [type(t) for t in registry.compose(layout)] == [KVState, MambaState]
    reverse = PoolLayout(components=(mamba(), kv_component()), tp_size=TP, tp_rank=1, page_size=16)
    assert [type(t) for t in registry.compose(reverse)] == [MambaState, KVState]


def test_compose_kv_swa_mamba_nsa_in_declared_order() -> None:
    kvbridge_swa = pytest.importorskip("kvbridge_swa")
    kvbridge_nsa = pytest.importorskip("kvbridge_nsa")
    registry = Registry.build(entry_points=False,
                              plugins=[kvbridge.state.kv, kvbridge_mamba, kvbridge_swa, kvbridge_nsa])
    swa = kvbridge_swa.swa_component("swa", layers=[0, 3], page_size=16, kv_heads=8, head_dim=8, tp=TP,
                                     dtype="bfloat16", num_pages=32, window=128)
    nsa = kvbridge_nsa.nsa_component("indexer", layers=2, num_pages=32)
    layout = PoolLayout(components=(kv_component(), swa, mamba(), nsa), tp_size=TP, tp_rank=0, page_size=16)
    types = registry.compose(layout)
    assert [t.name for t in types] == ["kv", "swa", "mamba", "nsa"]
    assert [type(t) for t in types] == [KVState, kvbridge_swa.SWAState, MambaState, kvbridge_nsa.NSAState]
    layout = PoolLayout(components=(mamba(), nsa, kv_component(), swa), tp_size=TP, tp_rank=0, page_size=16)
    assert [t.name for t in registry.compose(layout)] == ["mamba", "nsa", "kv", "swa"]


def test_compose_checks_the_component() -> None:
    registry = Registry.build(entry_points=False, plugins=[kvbridge.state.kv, kvbridge_mamba])
    paged = Component(name="linear", state_type="mamba", buffers=mamba().buffers, index_kind=IndexKind.PAGE)
    layout = PoolLayout(components=(kv_component(), paged), tp_size=TP, tp_rank=0, page_size=16)
    with pytest.raises(GeometryError, match="indexed by slot"):
        registry.compose(layout)

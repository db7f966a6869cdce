"""Registry checks every state-type plugin's tests make: the ``kvbridge`` entry point is found and the
state type is available, and several state types compose over a pool layout in its declared order.

    assert_state_type_installed("mamba", "kvbridge-mamba", MambaState)
    assert composed_types([kvbridge.state.kv, kvbridge_mamba], (kv, mamba), tp_size=2, tp_rank=1,
                          page_size=16) == [KVState, MambaState]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbridge.geometry import Component, PoolLayout
from kvbridge.registry import Registry
from kvbridge.specs import PluginStatus

__all__ = ["assert_state_type_installed", "composed_types"]


def assert_state_type_installed(name: str, distribution: str, state_class: type) -> None:
    """The installed entry points offer the state type ``name``, from ``distribution``, available here,
    and the registry builds it as a ``state_class``."""
    registry = Registry.build(env={})
    record = next((r for r in registry.records() if r.name == name), None)
    assert record is not None, f"no installed plugin is called {name!r}"
    assert record.distribution == distribution, f"{name!r} comes from {record.distribution!r}, not {distribution!r}"
    assert record.status is PluginStatus.AVAILABLE, f"{name!r} is {record.status}: {record.reason}"
    assert isinstance(registry.state_type(name), state_class)


def composed_types(plugins: Sequence[Any], components: Sequence[Component], *, tp_size: int, tp_rank: int,
                   page_size: int) -> list[type]:
    """The types of the state types a registry of only ``plugins`` composes for a layout of ``components``
    (one per component, in the layout's order)."""
    registry = Registry.build(entry_points=False, plugins=list(plugins))
    layout = PoolLayout(components=tuple(components), tp_size=tp_size, tp_rank=tp_rank, page_size=page_size)
    return [type(t) for t in registry.compose(layout)]

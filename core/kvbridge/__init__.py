"""kvbridge: move KV cache and hybrid-model state between disaggregated prefill and decode workers.

Public modules (stable names; everything else under ``kvbridge`` is internal and may move):

* ``kvbridge``: the records and errors below;
* ``kvbridge.agent``: ``TransferAgent``, ``Sender``, ``Receiver`` and ``AgentConfig``, what an engine drives;
* ``kvbridge.plugin``: the plugin-author surface, the one module a backend or state-type plugin imports;
* ``kvbridge.testkit``: the conformance kit and test helpers for plugins (its package root only).
"""

from __future__ import annotations

from kvbridge._markers import hookimpl
from kvbridge.errors import (
    Draining,
    GeometryError,
    IncompatiblePeer,
    KVBridgeError,
    PluginConflictError,
    PluginError,
    PluginUnavailableError,
    ProtocolError,
    RegionError,
    TransferError,
    UnknownPluginError,
    UnsupportedTopology,
)
from kvbridge.geometry import (
    BufferGeometry,
    Component,
    DeviceKind,
    DType,
    IndexKind,
    MemoryRegion,
    PoolLayout,
    Rank,
    ShardAxis,
    geometry_of,
    region_of,
)
from kvbridge.logs import configure_logging
from kvbridge.specs import Availability, BackendSpec, Capability, StateTypeSpec

configure_logging()    # KVBRIDGE_LOG=INFO|DEBUG|...: kvbridge's records on stderr in any process that imports it

__all__ = [
    "Availability", "BackendSpec", "BufferGeometry", "Capability", "Component", "DType", "DeviceKind", "Draining",
    "GeometryError", "IncompatiblePeer", "IndexKind", "KVBridgeError", "MemoryRegion", "PluginConflictError",
    "PluginError", "PluginUnavailableError", "PoolLayout", "ProtocolError", "Rank", "RegionError", "ShardAxis",
    "StateTypeSpec", "TransferError", "UnknownPluginError", "UnsupportedTopology", "geometry_of", "hookimpl",
    "region_of",
]


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("kvbridge")
        except PackageNotFoundError:
            return "0+source"
    raise AttributeError(name)

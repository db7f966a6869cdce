"""kvbridge: move KV cache and hybrid-model state between disaggregated prefill and decode workers."""

from __future__ import annotations

from kvbridge.errors import (
    GeometryError, IncompatiblePeer, KVBridgeError, PluginConflictError, PluginError, PluginUnavailableError,
    ProtocolError, RegionError, TransferError, UnknownPluginError, UnsupportedTopology,
)
from kvbridge.geometry import (
    BufferGeometry, Component, DeviceKind, DType, IndexKind, MemoryRegion, PoolLayout, Rank, ShardAxis,
    geometry_of, region_of,
)
from kvbridge.plugin import hookimpl
from kvbridge.specs import Availability, BackendSpec, Capability, StateTypeSpec

__all__ = [
    "Availability", "BackendSpec", "BufferGeometry", "Capability", "Component", "DType", "DeviceKind",
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

"""The plugin-author surface: everything a transfer backend or a state type imports from kvbridge.

A plugin imports from this module only (its tests may also use :mod:`kvbridge.testkit`); the modules
these names come from are internal and may be reorganized. A backend plugin, in full::

    from kvbridge.plugin import (BackendSpec, Capability, ComponentTransfer, EngineTables, NoNotifications,
                                 PeerInfo, Poll, RegisteredBuffers, check_within, copy_plan, hookimpl)

    class EchoBackend(NoNotifications):
        def __init__(self, *, name, options=None):
            self.name, self.endpoint = "echo", name.encode()
            self._tables = EngineTables("echo")
        def register_buffers(self, component, regions):
            return self._tables.register(component, regions, [r.addr for r in regions])
        def deregister_buffers(self, registered): self._tables.deregister(registered)
        def add_peer(self, peer: PeerInfo): return self._tables.add_peer(peer.name, peer)
        def remove_peer(self, peer_id): self._tables.pop_peer(peer_id)
        def send_component(self, transfer: ComponentTransfer):
            peer, local = self._tables.for_send(transfer)
            check_within(transfer.plan.src_addr, transfer.plan.nbytes, local.regions, "source")
            check_within(transfer.plan.dst_addr, transfer.plan.nbytes, transfer.dst.regions, "destination")
            copy_plan(transfer.plan)
            return Poll.done()
        def poll(self, handle): return handle
        def release(self, handle): pass
        def close(self): self._tables.close()

    @hookimpl
    def kvbridge_transfer_backends():
        return [BackendSpec(name="echo", factory=EchoBackend, capabilities=frozenset({Capability.HOST_MEMORY}))]

A discovery service plugin returns a :class:`DiscoverySpec` (the URL schemes it opens) from
``kvbridge_discovery_services``; its client implements :class:`Discovery` and keeps records that others read
as :func:`seal_record` bytes, checked with :func:`open_record` (``plugins/etcd`` is the worked example).

A state type subclasses :class:`StateType` and returns a :class:`StateTypeSpec` from
``kvbridge_state_types``; components are built with :class:`Component` / :class:`BufferGeometry` (see
:func:`kv_component` for the built-in paged KV). Its demo model (``StateTypeSpec.demo_model``) subclasses
:class:`StateModel` and fills items with :func:`pattern`.
"""

from __future__ import annotations

# The markers come first: core modules that mark hook implementations import them from here too.
from kvbridge._markers import ENTRY_POINT_GROUP, PROJECT, hookimpl, hookspec
from kvbridge.addresses import endpoint_host_port
from kvbridge.backends.base import (
    ComponentTransfer,
    HandleState,
    Poll,
    RegisteredBuffers,
    TransferBackend,
    check_within,
    check_within_buffers,
)
from kvbridge.backends.calls import BackendCall, CallKind, CallOutcome, Proceed
from kvbridge.backends.copying import copy_descriptors, copy_plan
from kvbridge.backends.scaffold import (
    EngineTables,
    NoNotifications,
    PendingHandle,
    Registration,
    default_host,
    import_engine,
    load_api,
    settled,
)
from kvbridge.demo.model import ComponentModel, RequestShape, StateModel, item_rows
from kvbridge.discovery import (
    Change,
    Discovery,
    DiscoveryError,
    RankRecord,
    Watch,
    check_address,
    check_rank,
    instances_from,
    open_record,
    seal_record,
)
from kvbridge.errors import (
    GeometryError,
    IncompatiblePeer,
    KVBridgeError,
    PluginError,
    PluginUnavailableError,
    ProtocolError,
    RegionError,
    TransferError,
    UnsupportedTopology,
)
from kvbridge.findings import Finding, Severity
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
    local_units,
    owned_range,
    region_of,
)
from kvbridge.links import InstanceInfo
from kvbridge.pages import PageRange, as_index
from kvbridge.pattern import byte_view, pattern, shard_axis
from kvbridge.planner import BufferPair, TransferPlan, plan_transfer
from kvbridge.protocol.records import PeerInfo, RegionWire, RemoteBuffers
from kvbridge.settings import SettingsError, env_defaults, parse_options
from kvbridge.slicing import ComponentSlice, Segments, buffer_segments, sharded_component_slice, target_ranks
from kvbridge.specs import Availability, BackendSpec, Capability, DiscoverySpec, StateTypeSpec, probe_import
from kvbridge.state.base import StateType
from kvbridge.state.kv import KVLayout, kv_component

__all__ = [
    # hooks
    "ENTRY_POINT_GROUP", "PROJECT", "hookimpl", "hookspec",
    # discovery records
    "Availability", "BackendSpec", "Capability", "DiscoverySpec", "StateTypeSpec", "probe_import",
    # a backend's own host checks (``BackendSpec.diagnose``, run by ``kvbridge doctor``)
    "Finding", "Severity",
    # errors
    "GeometryError", "IncompatiblePeer", "KVBridgeError", "PluginError", "PluginUnavailableError", "ProtocolError",
    "RegionError", "TransferError", "UnsupportedTopology",
    # geometry
    "BufferGeometry", "Component", "DType", "DeviceKind", "IndexKind", "KVLayout", "MemoryRegion", "PoolLayout",
    "Rank", "ShardAxis", "geometry_of", "kv_component", "local_units", "owned_range", "region_of",
    # state types: pages named by absolute position, index arrays
    "PageRange", "as_index",
    # state types: slicing and planning
    "BufferPair", "ComponentSlice", "Segments", "StateType", "TransferPlan", "buffer_segments", "plan_transfer",
    "sharded_component_slice", "target_ranks",
    # backends: the protocol and its records
    "ComponentTransfer", "HandleState", "PeerInfo", "Poll", "RegionWire", "RegisteredBuffers", "RemoteBuffers",
    "TransferBackend", "check_within", "check_within_buffers",
    # backends: what a call monitor or interceptor (``Registry.add_call_monitoring`` / ``add_call_interceptor``:
    # metrics, fault injection) is given
    "BackendCall", "CallKind", "CallOutcome", "Proceed",
    # backends: helpers
    "EngineTables", "NoNotifications", "PendingHandle", "Registration", "copy_descriptors", "copy_plan",
    "default_host", "import_engine", "load_api", "settled",
    # backends: options (a msgspec schema as the factory's ``options_schema``) and engines' environment
    "SettingsError", "env_defaults", "parse_options",
    # state types: the demo's model of a component (``StateTypeSpec.demo_model``) and its fill pattern
    "ComponentModel", "RequestShape", "StateModel", "byte_view", "item_rows", "pattern", "shard_axis",
    # discovery services: the protocol, its records, authenticated store records
    "Change", "Discovery", "DiscoveryError", "InstanceInfo", "RankRecord", "Watch", "check_address", "check_rank",
    "endpoint_host_port", "instances_from", "open_record", "seal_record",
]

"""The kvbridge conformance kit: a pytest plugin (entry point ``pytest11: kvbridge``) plus test classes a
plugin subclasses in its ``tests/test_conformance.py``.

    from kvbridge.testkit import BackendTests, StateTypeTests

Plugins (their ``testing`` helpers and tests) use only this package root and ``kvbridge.testkit.reference`` (the
independent reference reshard, for checks of your own); the other modules are internal.

Importing this package is cheap: the names below load their modules on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "BackendTests": "kvbridge.testkit.backends",
    "BasicBackendTests": "kvbridge.testkit.backends",
    "MultiProcessBackendTests": "kvbridge.testkit.backends",
    "HardwareBackendTests": "kvbridge.testkit.backends",
    "FenceBackendTests": "kvbridge.testkit.backends",
    "requires": "kvbridge.testkit.backends",
    "StateTypeTests": "kvbridge.testkit.states",
    "DiscoveryTests": "kvbridge.testkit.discovery_kit",
    "ComponentFactory": "kvbridge.testkit.states",
    "RequestItems": "kvbridge.testkit.states",
    "shard_buffer": "kvbridge.testkit.states",
    "prefix_request": "kvbridge.testkit.states",
    "DECODE_PREFIXES": "kvbridge.testkit.states",
    "BufferMeaning": "kvbridge.testkit.logical",
    "Fault": "kvbridge.testkit.faults",
    # registry checks of a state-type plugin
    "assert_state_type_installed": "kvbridge.testkit.discovery",
    "composed_types": "kvbridge.testkit.discovery",
    "FaultInjector": "kvbridge.testkit.faults",
    "InjectedFault": "kvbridge.testkit.faults",
    "CallKind": "kvbridge.backends.calls",
    "CheckedBackend": "kvbridge.testkit.checked",
    "kit_registry": "kvbridge.testkit.checked",
    "Tracker": "kvbridge.testkit.checked",
    # the reshard rig: byte-exact TP resharding through a state type, by copy or through backends
    "Outcome": "kvbridge.testkit.reshard",
    "TP_SIZES": "kvbridge.testkit.reshard",
    "assert_identity_at_equal_tp": "kvbridge.testkit.reshard",
    "run_reshard": "kvbridge.testkit.reshard",
    "shardable": "kvbridge.testkit.reshard",
    "units_held": "kvbridge.testkit.reshard",
    "wait": "kvbridge.testkit.reshard",
    # paged KV ranks for backend tests
    "Model": "kvbridge.testkit.rig",
    "Rig": "kvbridge.testkit.rig",
    "connected_backends": "kvbridge.testkit.rig",
    "connected_ranks": "kvbridge.testkit.rig",
    "page_plan": "kvbridge.testkit.rig",
    "make_rank": "kvbridge.testkit.rig",
    "peer_info": "kvbridge.testkit.rig",
    "plan_for": "kvbridge.testkit.rig",
    "reference_heads": "kvbridge.testkit.rig",
    "run_backend_reshard": "kvbridge.testkit.rig",
    "transfer": "kvbridge.testkit.rig",
}

__all__ = ["BackendTests", "BasicBackendTests", "BufferMeaning", "CallKind", "CheckedBackend", "ComponentFactory",
           "DECODE_PREFIXES", "DiscoveryTests", "Fault", "FaultInjector", "FenceBackendTests", "HardwareBackendTests",
           "InjectedFault", "Model", "MultiProcessBackendTests", "Outcome", "RequestItems", "Rig", "StateTypeTests",
           "TP_SIZES", "Tracker", "assert_identity_at_equal_tp", "assert_state_type_installed", "composed_types",
           "connected_backends", "connected_ranks", "kit_registry", "make_rank", "page_plan", "peer_info", "plan_for",
           "prefix_request", "reference_heads", "requires", "run_backend_reshard", "run_reshard", "shard_buffer",
           "shardable", "transfer", "units_held", "wait"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge.testkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

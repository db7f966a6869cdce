"""The kvbridge conformance kit: a pytest plugin (entry point ``pytest11: kvbridge``) plus test classes a
plugin subclasses in its ``tests/test_conformance.py``.

    from kvbridge.testkit import BackendTests, StateTypeTests

Importing this package is cheap: the names below load their modules on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "BackendTests": "kvbridge.testkit.backends",
    "BasicBackendTests": "kvbridge.testkit.backends",
    "MultiProcessBackendTests": "kvbridge.testkit.backends",
    "HardwareBackendTests": "kvbridge.testkit.backends",
    "requires": "kvbridge.testkit.backends",
    "StateTypeTests": "kvbridge.testkit.states",
    "ComponentFactory": "kvbridge.testkit.states",
    "RequestItems": "kvbridge.testkit.states",
    "shard_buffer": "kvbridge.testkit.states",
    "Fault": "kvbridge.testkit.faults",
    "FaultInjector": "kvbridge.testkit.faults",
    "CheckedBackend": "kvbridge.testkit.checked",
    "kit_registry": "kvbridge.testkit.checked",
}

__all__ = ["BackendTests", "BasicBackendTests", "CheckedBackend", "ComponentFactory", "Fault", "FaultInjector",
           "HardwareBackendTests", "MultiProcessBackendTests", "RequestItems", "StateTypeTests", "kit_registry",
           "requires", "shard_buffer"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge.testkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

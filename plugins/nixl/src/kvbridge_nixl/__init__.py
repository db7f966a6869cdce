"""kvbridge-nixl: the NIXL transfer backend (UCX; host DRAM and GPU VRAM).

This module is the entry point (group ``kvbridge``, name ``nixl``). It must stay cheap: it declares the
backend and probes for NIXL with ``importlib.util.find_spec`` only; ``nixl`` itself is imported when a
backend is built (``kvbridge_nixl.backend``).

    registry = Registry.build()
    backend = registry.create_backend("nixl", name="prefill-0", options={"ucx_tls": "tcp"})
"""

from __future__ import annotations

import importlib.util

from kvbridge.plugin import Availability, BackendSpec, Capability, hookimpl

__all__ = ["INSTALL_HINT", "SPEC", "kvbridge_transfer_backends", "probe"]

INSTALL_HINT = "pip install torch==2.13.0 && pip install nixl"
#: The wheel that carries the native library, in the order nixl's own loader tries them.
_NATIVE = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def probe() -> Availability:
    """Available when the ``nixl`` package and one of its native wheels are installed (no import)."""
    if not _findable("nixl"):
        return Availability.missing("the nixl package is not installed", INSTALL_HINT)
    if not any(_findable(m) for m in _NATIVE):
        return Availability.missing(f"nixl is installed but none of its native wheels ({', '.join(_NATIVE)}) is",
                                    INSTALL_HINT)
    return Availability.ok()


SPEC = BackendSpec(
    name="nixl",
    factory="kvbridge_nixl.backend:NixlBackend",
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.CUDA_MEMORY, Capability.MULTI_PROCESS,
                            Capability.NOTIFICATIONS, Capability.ASYNC}),
    probe=probe,
    description="NIXL over UCX: one-sided WRITE from prepped descriptor lists, notices ride on the data",
    diagnose="kvbridge_nixl.routes:diagnose",     # kvbridge doctor: the UCX transports picked on this host
    serve_probe="kvbridge_nixl.routes:serve",     # ... and, from another host's doctor, to this one
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

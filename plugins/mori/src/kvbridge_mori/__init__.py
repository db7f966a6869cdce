"""kvbridge-mori: the ``mori`` transfer backend (AMD MoRI-IO, ``mori.io``).

Importing this package is cheap: ``mori`` itself is imported only when a backend is built, so
``kvbridge plugins`` can say why MoRI is unavailable instead of failing. See README.md for what is
hardware-verified (nothing yet) and how it was checked.
"""

from __future__ import annotations

import importlib.util
import sys

from kvbridge.plugin import Availability, BackendSpec, Capability, hookimpl, probe_import

__all__ = ["INSTALL_HINT", "SPEC", "kvbridge_transfer_backends", "probe"]

INSTALL_HINT = ("MoRI needs a ROCm 7 host and an amd-mori wheel for CPython 3.10 or 3.12: "
                "`pip install amd-mori` on a ROCm host")
_WHEEL_PYTHONS = ((3, 10), (3, 12))


def probe() -> Availability:
    """Available when ``mori.io`` imports (it loads the HIP runtime, so this also checks ROCm)."""
    if importlib.util.find_spec("mori") is None:
        reason = "amd-mori is not installed"
        if sys.version_info[:2] not in _WHEEL_PYTHONS:
            reason += f" (it publishes no wheel for CPython {sys.version_info[0]}.{sys.version_info[1]})"
        return Availability.missing(reason, INSTALL_HINT)
    return probe_import("mori.io", INSTALL_HINT)


SPEC = BackendSpec(
    name="mori", factory="kvbridge_mori.backend:MoriBackend",
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.CUDA_MEMORY, Capability.MULTI_PROCESS,
                            Capability.ASYNC}),
    probe=probe,
    description="AMD MoRI-IO one-sided RDMA writes (ROCm); not hardware-verified",
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

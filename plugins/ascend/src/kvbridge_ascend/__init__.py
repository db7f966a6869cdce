"""kvbridge-ascend: the ``ascend`` transfer backend (Huawei Ascend NPU, ``memfabric_hybrid``).

Importing this package is cheap: memfabric is imported by the probe and when a backend is built. See
README.md for what is hardware-verified (nothing yet) and how it was checked.
"""

from __future__ import annotations

from pathlib import Path

from kvbridge.plugin import Availability, BackendSpec, Capability, hookimpl, probe_import

__all__ = ["DRIVER_DIR", "INSTALL_HINT", "NPU_HINT", "SPEC", "kvbridge_transfer_backends", "probe"]

INSTALL_HINT = "pip install memfabric-hybrid"
NPU_HINT = ("run on an Ascend NPU host with the Ascend driver and CANN installed (memfabric's "
            "TransferEngine.initialize() fails without them)")
#: Where the Ascend NPU driver lives; memfabric reads <DRIVER_DIR>/version.info during initialize().
DRIVER_DIR = Path("/usr/local/Ascend/driver")


def probe() -> Availability:
    """Available when memfabric_hybrid imports and the NPU driver is installed."""
    imported = probe_import("memfabric_hybrid", INSTALL_HINT)
    if not imported.available:
        return imported
    if not DRIVER_DIR.is_dir():
        return Availability.missing(f"memfabric_hybrid imports, but the Ascend NPU driver is missing ({DRIVER_DIR} "
                                    "not found), and TransferEngine.initialize() returns -1 without it", NPU_HINT)
    return Availability.ok()


SPEC = BackendSpec(
    name="ascend", factory="kvbridge_ascend.backend:AscendBackend",
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.MULTI_PROCESS, Capability.ASYNC}),
    probe=probe,
    description="Ascend NPU transfers through memfabric_hybrid (SDMA / device RDMA); not hardware-verified",
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

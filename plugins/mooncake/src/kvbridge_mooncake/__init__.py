"""kvbridge-mooncake: the ``mooncake`` transfer backend (Mooncake transfer engine, P2P handshake).

Importing this package is cheap: ``mooncake`` itself is imported only when a backend is built (and by
the availability probe, after the cheap checks pass), so ``kvbridge plugins`` can say why Mooncake is
unavailable instead of failing. See README.md for what is verified (TCP) and what is not (RDMA).
"""

from __future__ import annotations

from kvbridge.plugin import BackendSpec, Capability, hookimpl
from kvbridge_mooncake.availability import APT_HINT, PIP_HINT, probe

__all__ = ["APT_HINT", "PIP_HINT", "SPEC", "kvbridge_transfer_backends", "probe"]

SPEC = BackendSpec(
    name="mooncake", factory="kvbridge_mooncake.backend:MooncakeBackend",
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.MULTI_PROCESS, Capability.NOTIFICATIONS,
                            Capability.ASYNC, Capability.NOTIFY_FAILURES}),
    probe=probe,
    description="Mooncake transfer engine, P2P handshake; TCP verified, RDMA untested",
    bench="kvbridge_mooncake.bench:main",
)


@hookimpl
def kvbridge_transfer_backends() -> list[BackendSpec]:
    return [SPEC]

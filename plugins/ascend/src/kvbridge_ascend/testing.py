"""A backend spec bound to the in-process stand-in, for the conformance kit's basic tier and tests.

Not registered through entry points (it must never look like a usable Ascend engine). Every instance
joins the stand-in config store ``tcp://standin:1`` unless ``store_url`` is given::

    from kvbridge_ascend.testing import STANDIN_SPEC

The reshard rig the plugin's tests use comes from :mod:`kvbridge.testkit` and is re-exported here.
"""

from __future__ import annotations

from typing import Any

from kvbridge.plugin import Availability, BackendSpec, Capability
from kvbridge.testkit import Model, Rig, make_rank, peer_info, plan_for, reference_heads, transfer, wait
from kvbridge.testkit import run_backend_reshard as run_reshard
from kvbridge_ascend import standin
from kvbridge_ascend.backend import AscendBackend

__all__ = ["STANDIN_SPEC", "STANDIN_STORE", "Model", "Rig", "make_rank", "peer_info", "plan_for",
           "reference_heads", "run_reshard", "standin_backend", "transfer", "wait"]

STANDIN_STORE = "tcp://standin:1"


def standin_backend(*, name: str, options: dict[str, str] | None = None) -> AscendBackend:
    """An AscendBackend over the stand-in. The first engine of a store hosts it: store_server_role is set
    to Prefill, the default role, so no separate create_config_store call is needed."""
    opts: dict[str, Any] = {"store_url": STANDIN_STORE, "host": "127.0.0.1", "store_server_role": "Prefill",
                            **(options or {})}
    return AscendBackend(name=name, options=opts, api=standin)


STANDIN_SPEC = BackendSpec(
    name="ascend-standin", factory=standin_backend,
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.ASYNC}),
    probe=Availability.ok,
    description="the ascend backend over kvbridge_ascend.standin (one process, host memory)",
)

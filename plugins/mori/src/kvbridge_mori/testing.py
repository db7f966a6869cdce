"""A backend spec bound to the in-process stand-in, for the conformance kit's basic tier and tests.

It is not registered through entry points (it must never look like a usable MoRI); point the kit at it
explicitly::

    from kvbridge_mori.testing import STANDIN_SPEC

The reshard rig the plugin's tests use comes from :mod:`kvbridge.testkit` and is re-exported here.
"""

from __future__ import annotations

import functools

from kvbridge.plugin import Availability, BackendSpec, Capability
from kvbridge.testkit import Model, Rig, make_rank, peer_info, plan_for, reference_heads, transfer, wait
from kvbridge.testkit import run_backend_reshard as run_reshard
from kvbridge_mori import standin
from kvbridge_mori.backend import MoriBackend

__all__ = ["STANDIN_SPEC", "Model", "Rig", "make_rank", "peer_info", "plan_for", "reference_heads",
           "run_reshard", "transfer", "wait"]

STANDIN_SPEC = BackendSpec(
    name="mori-standin", factory=functools.partial(MoriBackend, api=standin),
    capabilities=frozenset({Capability.HOST_MEMORY, Capability.ASYNC}),
    probe=Availability.ok,
    description="the mori backend over kvbridge_mori.standin (one process, host memory)",
)

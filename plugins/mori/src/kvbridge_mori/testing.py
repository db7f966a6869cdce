"""A backend spec bound to the in-process stand-in, for the conformance kit's basic tier and tests.

It is not registered through entry points (it must never look like a usable MoRI); point the kit at it
explicitly::

    from kvbridge_mori.testing import STANDIN_SPEC

The reshard rig the plugin's tests use lives in ``kvbridge.testkit.rig`` and is re-exported here.
"""

from __future__ import annotations

import functools

from kvbridge.specs import Availability, BackendSpec, Capability
from kvbridge.testkit.rig import (  # noqa: F401 - the plugin's tests import the rig from here
    COMPONENT, Model, Rig, make_rank, peer_info, plan_for, reference_heads, run_reshard, transfer, wait,
)

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

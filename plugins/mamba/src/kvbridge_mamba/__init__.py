"""kvbridge-mamba: the ``mamba`` state type (per-request conv + SSM slot state, TP-resharded).

    >>> import kvbridge_mamba
    >>> [spec.name for spec in kvbridge_mamba.kvbridge_state_types()]
    ['mamba']
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_mamba.geometry import mamba_component
from kvbridge_mamba.state import MambaState

__all__ = ["MambaState", "mamba_component"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="mamba", factory=MambaState,
                          description="Mamba/GDN slot state: conv sharded on channels (shard groups), SSM on heads",
                          demo_model="kvbridge_mamba.demo:MambaModel")]

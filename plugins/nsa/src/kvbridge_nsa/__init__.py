"""kvbridge-nsa: the ``nsa`` state type (sparse-attention indexer pages, whole sequence, replicated).

    >>> import kvbridge_nsa
    >>> [spec.name for spec in kvbridge_nsa.kvbridge_state_types()]
    ['nsa']
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_nsa.geometry import nsa_component
from kvbridge_nsa.pages import PageRange, indexer_pages
from kvbridge_nsa.state import NSAState

__all__ = ["NSAState", "PageRange", "indexer_pages", "nsa_component"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="nsa", factory=NSAState,
                          description="sparse-attention indexer pages from position 0, replicated across TP",
                          demo_model="kvbridge_nsa.demo:NSAModel")]

"""kvbridge-row: the ``row`` state type (one item per request, sent once with the last chunk).

    >>> import kvbridge_row
    >>> [spec.name for spec in kvbridge_row.kvbridge_state_types()]
    ['row']
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_row.state import RowState, row_component

__all__ = ["RowState", "row_component"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="row", factory=RowState,
                          description="one row per request (metadata, request rows): whole, replicated, last chunk")]

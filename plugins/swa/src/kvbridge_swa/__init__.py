"""kvbridge-swa: the ``swa`` state type (sliding-window KV, window pages only, aligned by position).

    >>> import kvbridge_swa
    >>> [spec.name for spec in kvbridge_swa.kvbridge_state_types()]
    ['swa']
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_swa.geometry import swa_component
from kvbridge_swa.state import SWAState
from kvbridge_swa.window import PageRange, align_by_position, max_window_pages, window_pages

__all__ = ["PageRange", "SWAState", "align_by_position", "max_window_pages", "swa_component", "window_pages"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="swa", factory=SWAState,
                          description="sliding-window KV: window pages only, aligned by position, head-sliced",
                          demo_model="kvbridge_swa.demo:SWAModel")]

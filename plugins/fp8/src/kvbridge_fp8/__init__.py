"""kvbridge-fp8: FP8 KV block scales (``block_scale``, ``block_scale_swa``), resliced by KV head.

    >>> import kvbridge_fp8
    >>> [spec.name for spec in kvbridge_fp8.kvbridge_state_types()]
    ['block_scale', 'block_scale_swa']
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_fp8.geometry import SCALE_BLOCK, block_scale_component, scale_shape
from kvbridge_fp8.state import BlockScaleState, SWABlockScaleState

__all__ = ["SCALE_BLOCK", "BlockScaleState", "SWABlockScaleState", "block_scale_component", "scale_shape"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="block_scale", factory=BlockScaleState,
                          description="FP8 KV block scales, in chunks with the pages they scale, by KV head"),
            StateTypeSpec(name="block_scale_swa", factory=SWABlockScaleState,
                          description="FP8 block scales of an SWA pool's window pages, by KV head")]

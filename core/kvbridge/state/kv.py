"""The built-in ``kv`` state type: paged KV cache, MHA/GQA head-sliced, MLA replicated.

Buffers are one per layer and tensor (K layers, then V layers), each item a page. Token-major pages are
``[page_size, heads, head_dim]`` with ``ShardAxis(axis=1, total=H)``; head-major pages are
``[heads, page_size, head_dim]`` with ``ShardAxis(axis=0, total=H)``; MLA pages have no shard axis.
Head ranges are computed from the model's total KV heads, never ``local * TP``; with fewer heads than
ranks, one replica per destination is elected to write.
"""

from __future__ import annotations

from typing import ClassVar

from kvbridge.errors import GeometryError
from kvbridge.geometry import Component, IndexKind, Rank
from kvbridge.plugin import hookimpl
from kvbridge.specs import StateTypeSpec
from kvbridge.state.base import StateType


class KVState(StateType):
    name: ClassVar[str] = "kv"
    chunked: ClassVar[bool] = True

    def check_component(self, component: Component, tp: Rank) -> None:
        if component.index_kind is not IndexKind.PAGE:
            raise GeometryError(f"component {component.name!r}: kv is indexed by page, not {component.index_kind.value}")
        for buf in component.buffers:
            if buf.shard is not None and buf.shard.groups:
                raise GeometryError(f"buffer {buf.name!r}: kv heads have no shard groups")


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    return [StateTypeSpec(name="kv", factory=KVState, description="paged KV cache (MHA/GQA/MLA), built in")]

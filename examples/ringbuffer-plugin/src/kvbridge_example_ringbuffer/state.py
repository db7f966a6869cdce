"""The ``ringbuffer`` state type: one ring of ``capacity`` entries per request, indexed by slot.

Geometry rules (checked by :meth:`RingBufferState.check_component`):

* the component is indexed by slot and declares ``options["capacity"]`` (a positive int);
* a ring tensor has ``item_shape = (capacity, *entry_shape)``; it is replicated (``shard=None``) or
  sharded on an entry axis (``shard.axis >= 1``) - the ring axis 0 is never split across ranks, because
  every rank must see every position of its own ring;
* an optional cursor tensor - the one named ``*.cursor`` or ``cursor`` - is ``int64`` with item shape
  ``(1,)`` and replicated: the number of entries written so far.

TP slicing is kvbridge's generic shard-axis slicing (inherited): with Pt > Dt one elected prefill rank
writes each replicated ring, the others write nothing; sharded entries move as head/channel ranges.
A request has exactly one slot on each side.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvbridge.plugin import (
    Component,
    ComponentSlice,
    DType,
    GeometryError,
    IncompatiblePeer,
    IndexKind,
    Rank,
    StateType,
)


def capacity_of(component: Component) -> int:
    """The ring capacity a component declares in its options."""
    capacity = component.options.get("capacity")
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise GeometryError(f"component {component.name!r}: ringbuffer needs options['capacity'] = a "
                            f"positive int, got {capacity!r}")
    return capacity


def is_cursor(name: str) -> bool:
    return name == "cursor" or name.endswith(".cursor")


class RingBufferState(StateType):
    """A small per-request ring buffer (see the module docstring for the geometry rules)."""

    name: ClassVar[str] = "ringbuffer"
    chunked: ClassVar[bool] = False  # the ring is final only after the last chunk: it travels once

    def check_component(self, component: Component, tp: Rank) -> None:
        if component.index_kind is not IndexKind.SLOT:
            raise GeometryError(f"component {component.name!r}: a ring buffer is indexed by slot, "
                                f"not {component.index_kind.value}")
        capacity = capacity_of(component)
        cursors = [b for b in component.buffers if is_cursor(b.name)]
        if len(cursors) > 1:
            raise GeometryError(f"component {component.name!r}: more than one cursor buffer "
                                f"{[b.name for b in cursors]}")
        for buf in component.buffers:
            if is_cursor(buf.name):
                if buf.item_shape != (1,) or buf.dtype is not DType.INT64 or buf.shard is not None:
                    raise GeometryError(f"buffer {buf.name!r}: a ring cursor is one replicated int64 per "
                                        f"slot, got item shape {buf.item_shape} {buf.dtype.value} "
                                        f"shard={buf.shard}")
                continue
            if buf.item_shape[0] != capacity:
                raise GeometryError(f"buffer {buf.name!r}: ring axis holds {buf.item_shape[0]} entries, the "
                                    f"component's capacity is {capacity}")
            if buf.shard is not None and buf.shard.axis == 0:
                raise GeometryError(f"buffer {buf.name!r}: the ring axis cannot be sharded across TP ranks; "
                                    "shard an entry axis (axis >= 1) instead")

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        if capacity_of(src) != capacity_of(dst):
            raise IncompatiblePeer(f"component {src.name!r}: ring capacity {capacity_of(src)} on prefill, "
                                   f"{capacity_of(dst)} on decode")
        return super().slice(src, dst, src_rank, dst_rank)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        if len(src_items) != 1 or len(dst_items) != 1:
            raise GeometryError(f"component {component.name!r}: a request has exactly one ring slot per "
                                f"side, got {len(src_items)} source and {len(dst_items)} destination slots")
        return src_items, dst_items

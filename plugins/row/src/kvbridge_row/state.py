"""The ``row`` state type and the component builder.

A row component is indexed by slot: a request owns exactly one row of every buffer (a metadata slot, a
request-pool row). Each side names its own row; they are paired one to one. Row 0 is an ordinary row.

    >>> import numpy as np
    >>> comp = row_component("aux", rows=[(4, 64), (4, 512)])
    >>> [b.name for b in comp.buffers], comp.buffers[1].item_nbytes
    (['aux.0', 'aux.1'], 512)
    >>> RowState().pair_indices(comp, np.array([0]), 0, np.array([3]), 0)
    (array([0]), array([3]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from kvbridge.plugin import (
    BufferGeometry,
    Component,
    DType,
    GeometryError,
    IndexKind,
    Rank,
    StateType,
    as_index,
)


class RowState(StateType):
    """One whole row per request; travels once, with the last chunk."""

    name: ClassVar[str] = "row"
    chunked: ClassVar[bool] = False

    def check_component(self, component: Component, tp: Rank) -> None:
        if component.index_kind is not IndexKind.SLOT:
            raise GeometryError(f"component {component.name!r}: a row is indexed by slot (one per request), "
                                f"not by {component.index_kind.value}")
        for buf in component.buffers:
            buf.check_tp(tp.size)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        """Exactly one row on each side; positions play no part."""
        where = f"component {component.name!r}"
        src, dst = as_index(src_items, f"{where}: prefill"), as_index(dst_items, f"{where}: decode")
        for side, rows in (("prefill", src), ("decode", dst)):
            if rows.size != 1:
                raise GeometryError(f"{where}: a request owns exactly one {side} row, got {rows.size}")
            if int(rows[0]) < 0:
                raise GeometryError(f"{where}: {side} row {int(rows[0])} is negative")
        return src, dst


def row_component(name: str, *, rows: Sequence[tuple[int, int]], names: Sequence[str] | None = None,
                  state_type: str = "row") -> Component:
    """A replicated row component: ``rows`` gives ``(num_rows, row_bytes)`` per buffer (uint8 rows)."""
    if not rows:
        raise GeometryError(f"{name}: a row component needs at least one buffer")
    labels = list(names) if names is not None else [str(i) for i in range(len(rows))]
    if len(labels) != len(rows):
        raise GeometryError(f"{name}: {len(labels)} names for {len(rows)} buffers")
    counts = {int(n) for n, _ in rows}
    if len(counts) != 1:
        raise GeometryError(f"{name}: buffers disagree on the number of rows {sorted(counts)}")
    buffers = tuple(BufferGeometry(name=f"{name}.{label}", num_items=int(n), item_shape=(int(nbytes),),
                                   dtype=DType.UINT8) for label, (n, nbytes) in zip(labels, rows))
    return Component(name=name, state_type=state_type, buffers=buffers, index_kind=IndexKind.SLOT)

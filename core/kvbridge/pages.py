"""Page positions shared by state types that name pages by their absolute position in a request.

Internal: plugins import these names from :mod:`kvbridge.plugin`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvbridge.errors import GeometryError

__all__ = ["PageRange", "as_index"]


class PageRange(NamedTuple):
    """``count`` pages starting at absolute page position ``first``."""

    first: int
    count: int  # type: ignore[assignment]  # a field named like tuple.count, which it shadows

    @property
    def stop(self) -> int:
        return self.first + self.count


def as_index(items: np.ndarray, what: str) -> np.ndarray:
    """``items`` as a one-dimensional int64 index array; GeometryError naming ``what`` otherwise."""
    arr = np.asarray(items)
    if arr.ndim != 1:
        raise GeometryError(f"{what} indices must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise GeometryError(f"{what} indices must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)

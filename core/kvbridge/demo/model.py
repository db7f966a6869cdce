"""What a component model of the demo is: the contract presets and state-type plugins share.

A model describes one component of a preset's pool: its kvbridge ``Component`` for a (TP size, rank),
which logical items a request moves (:meth:`ComponentModel.span`), how many items a request region of
its pool holds, how prefill fills a request's source items and what decode's destination items must
hold, computed from logical coordinates with :mod:`kvbridge.pattern` -- never through
``kvbridge.slicing`` or the planner. The paged KV model is built in (``kvbridge.demo.presets.KVModel``);
a state type's plugin provides its own through ``StateTypeSpec.demo_model``, usually a
:class:`StateModel` subclass that only gives the geometry and the expected bytes::

    @dataclass(frozen=True)
    class RingModel(StateModel):
        name: str
        slots: int = 2

        def component(self, tp_size, num_items): return ring_component(self.name, num_slots=num_items)
        def region_items(self, region_pages): return self.slots
        def span(self, request): return 0, 1
        def expected(self, tp_size, rank, request):
            return [pattern(request.seed, TAG_RING, 0, np.arange(64)).reshape(1, -1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvbridge.geometry import Component
from kvbridge.pattern import byte_view

__all__ = ["ComponentModel", "RequestShape", "StateModel", "item_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestShape:
    """One request as both sides see it (page positions are absolute, in pages of the sequence)."""

    index: int
    room: int
    seed: int
    seq_len: int            # tokens
    prefix_pages: int       # pages decode already holds (prefix hit); not sent
    num_pages: int          # pages of the whole sequence

    @property
    def positions(self) -> np.ndarray:
        """Page positions that travel (the delta after the decode prefix)."""
        return np.arange(self.prefix_pages, self.num_pages, dtype=np.int64)


class ComponentModel(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def chunked(self) -> bool: ...  # True: sent chunk by chunk (KV pages); False: once, with the last chunk

    def component(self, tp_size: int, num_items: int) -> Component: ...
    def region_items(self, region_pages: int) -> int: ...
    def span(self, request: RequestShape) -> tuple[int, int]: ...
    def fill(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None: ...
    def verify(self, buffers: Sequence[np.ndarray], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int: ...


def item_rows(buffer: Any) -> np.ndarray:
    """A writable uint8 view ``[num_items, item bytes]`` of a rank buffer (first axis = items)."""
    view = byte_view(buffer)
    return view.reshape(view.shape[0], -1)


class StateModel:
    """Shared fill / verify over :meth:`expected`; subclasses give the geometry and the logical bytes."""

    name: str
    chunked = False

    def expected(self, tp_size: int, rank: int, request: RequestShape) -> list[np.ndarray]:
        """What ``rank`` holds of the request's items, per buffer (wire order): uint8 ``[count, item bytes]``."""
        raise NotImplementedError

    def span(self, request: RequestShape) -> tuple[int, int]:
        """(first position, count) of the logical items the request moves."""
        raise NotImplementedError

    def fill(self, buffers: Sequence[Any], tp_size: int, rank: int, request: RequestShape,
             items: np.ndarray) -> None:
        for buf, want in zip(buffers, self.expected(tp_size, rank, request), strict=True):
            item_rows(buf)[items] = want

    def verify(self, buffers: Sequence[Any], tp_size: int, rank: int, request: RequestShape,
               items: np.ndarray) -> int:
        """Bytes that differ from the reference in the request's items, plus any byte written into item 0
        (the padding item no request owns; the demo pool starts zeroed)."""
        bad = 0
        for buf, want in zip(buffers, self.expected(tp_size, rank, request), strict=True):
            rows = item_rows(buf)
            bad += int(np.count_nonzero(rows[items] != want)) + int(np.count_nonzero(rows[0]))
        return bad

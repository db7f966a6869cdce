"""What a state type provides: geometry checks, TP slicing (pure) and index pairing.

A state type plugin subclasses :class:`StateType` and overrides only what differs from the generic
shard-axis rules. Example, a per-request ring buffer replicated on every rank::

    class RingState(StateType):
        name = "ring"
        chunked = False                       # travels with the last chunk only
        def check_component(self, component, tp):
            if component.index_kind is not IndexKind.SLOT:
                raise GeometryError(f"{component.name}: ring state is indexed by slot")
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvbridge.errors import GeometryError
from kvbridge.geometry import BufferGeometry, Component, Rank
from kvbridge.repaging import Planes, default_planes
from kvbridge.slicing import ComponentSlice, sharded_component_slice


class StateType:
    """Base state type: generic shard-axis slicing, equal-length index pairing."""

    name: ClassVar[str] = ""
    #: True when the component's items are sent with every prefill chunk (KV pages); False when it
    #: travels once, with the last chunk (Mamba slots, SWA window, NSA indexer).
    chunked: ClassVar[bool] = False
    #: True when its pages may differ in size between prefill and decode: the agent then pairs them as pages of
    #: ``gcd(P, D)`` tokens (:mod:`kvbridge.repaging`); the page's first axis must be its tokens.
    repageable: ClassVar[bool] = False

    def token_planes(self, component: Component, buffer: BufferGeometry, page_size: int) -> Planes | None:
        """Bytes per token of each plane of one page of ``buffer``, in page order (:data:`kvbridge.repaging.Planes`),
        or None when its pages cannot be cut into sub-pages. Asked only of a ``repageable`` state type whose pages
        differ in size from the peer's. The default knows token-major pages ``[page, ...]`` (one plane) and
        head-major ones ``[heads, page, ...]`` sharded on heads (one plane per head)."""
        return default_planes(buffer, page_size)

    def check_component(self, component: Component, tp: Rank) -> None:
        """Raise GeometryError when ``component`` is not a valid instance of this state type."""

    def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
        """Which bytes of each source item ``src_rank`` writes where in ``dst_rank``'s items. Pure."""
        return sharded_component_slice(src, dst, src_rank, dst_rank)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        """Pair source and destination items. ``*_first`` is the absolute position (in items) of the
        first index, for state types whose lists can start at different places (SWA)."""
        if len(src_items) != len(dst_items):
            raise GeometryError(f"component {component.name!r}: {len(src_items)} source items but "
                                f"{len(dst_items)} destination items")
        return src_items, dst_items

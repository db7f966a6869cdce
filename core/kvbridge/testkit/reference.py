"""The kit's reference: the fill pattern and the independent TP reshard of :mod:`kvbridge.pattern`.

Kept under this name for the kit and its users; the code lives in core (the demo fills and verifies
with it too, without depending on the kit). See :mod:`kvbridge.pattern` for the pattern's definition.

    from kvbridge.testkit import reference as ref
    want = ref.expected_pages(ref.KVSpec("mla", total_heads=1, page_size=16, head_bytes=64), seed=1,
                              layer=0, tensor=0, tp_size=2, rank=1, positions=[0, 1])
"""

from __future__ import annotations

from kvbridge.pattern import (
    HEAD_MAJOR,
    LAYOUTS,
    MLA,
    TOKEN_MAJOR,
    KVSpec,
    ReferenceTopologyError,
    background,
    byte_view,
    expected_buffer,
    expected_pages,
    fill_source,
    heads_held,
    logical_pages,
    pattern,
    shard_axis,
    shard_pages,
    source_buffer,
    units_held,
)

__all__ = [
    "HEAD_MAJOR", "LAYOUTS", "MLA", "TOKEN_MAJOR", "KVSpec", "ReferenceTopologyError", "background", "byte_view",
    "expected_buffer", "expected_pages", "fill_source", "heads_held", "logical_pages", "pattern", "shard_axis",
    "shard_pages", "source_buffer", "units_held",
]

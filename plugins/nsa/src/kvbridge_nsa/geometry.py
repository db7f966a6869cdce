"""Build the ``Component`` of an NSA indexer pool (identical on every TP rank).

One buffer per layer, ``<name>.indexer.<layer>``, each item one page of ``page_size * bytes_per_token``
raw bytes (uint8). DeepSeek-V3.2 defaults: 64-token pages of 132 bytes per token (128 fp8 key bytes and a
4-byte fp32 scale), 8448 bytes per page, stored as all keys of the page then all scales. A draft model's
indexer layers are appended as further layer ids.

    >>> comp = nsa_component("indexer", layers=61, num_pages=4096)
    >>> len(comp.buffers), comp.buffers[60].name, comp.buffers[0].item_shape, comp.buffers[0].shard is None
    (61, 'indexer.indexer.60', (8448,), True)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.plugin import BufferGeometry, Component, DType, GeometryError, IndexKind


def nsa_component(name: str, *, layers: int | Sequence[int], page_size: int = 64, bytes_per_token: int = 132,
                  num_pages: int) -> Component:
    """The paged, replicated indexer component (``num_pages`` counts the padding page 0)."""
    if page_size <= 0 or bytes_per_token <= 0:
        raise GeometryError(f"{name}: page size {page_size} and bytes per token {bytes_per_token} must be positive")
    ids = tuple(range(layers)) if isinstance(layers, int) else tuple(int(i) for i in layers)
    if not ids or len(set(ids)) != len(ids):
        raise GeometryError(f"{name}: layer ids {ids} must be non-empty and distinct")
    item = (page_size * bytes_per_token,)
    buffers = tuple(BufferGeometry(name=f"{name}.indexer.{i}", num_items=num_pages, item_shape=item,
                                   dtype=DType.UINT8, shard=None) for i in ids)
    return Component(name=name, state_type="nsa", buffers=buffers, index_kind=IndexKind.PAGE,
                     options={"page_size": page_size, "bytes_per_token": bytes_per_token})

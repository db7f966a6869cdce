"""Which indexer pages a request has: all of them, from position 0.

The sparse-attention indexer scores every earlier token, so decode needs the indexer cache of the whole
sequence -- including a prefix decode already holds in its radix cache. Both sides therefore list the
pages of positions ``0 .. ceil(seq_len / page_size)``, never the KV delta.

    >>> indexer_pages(10_000, 64)
    PageRange(first=0, count=157)
"""

from __future__ import annotations

from kvbridge.plugin import GeometryError, PageRange

__all__ = ["PageRange", "indexer_pages"]


def indexer_pages(seq_len: int, page_size: int) -> PageRange:
    """Pages holding tokens ``[0, seq_len)``.

    >>> indexer_pages(0, 64), indexer_pages(64, 64), indexer_pages(65, 64)
    (PageRange(first=0, count=0), PageRange(first=0, count=1), PageRange(first=0, count=2))
    """
    if seq_len < 0 or page_size <= 0:
        raise GeometryError(f"indexer_pages needs seq_len >= 0 and page_size > 0; got {seq_len}, {page_size}")
    return PageRange(0, -(-seq_len // page_size))

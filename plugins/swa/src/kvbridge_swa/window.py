"""Which pages of a request the attention window covers, and pairing two page lists by position.

Pages are named by their *absolute position* in the request (page ``k`` holds tokens ``[k*P, (k+1)*P)``).
Each side computes its window from its own sequence length, so the two lists may start at different
positions; they are paired by position, never by truncating the longer list.

    >>> window_pages(10_000, 4096, 64)         # tokens 5904.. floored to 5888 = page 92; 65 pages
    PageRange(first=92, count=65)
    >>> align_by_position(np.array([10, 11, 12]), 91, np.array([40, 41]), 92)
    (array([11, 12]), array([40, 41]))
"""

from __future__ import annotations

import numpy as np

from kvbridge.plugin import GeometryError, PageRange, as_index

__all__ = ["PageRange", "align_by_position", "max_window_pages", "window_pages"]


def window_pages(seq_len: int, window: int, page_size: int) -> PageRange:
    """The pages holding the last ``window`` tokens of a ``seq_len``-token request.

    The window starts at ``max(0, seq_len - window)``, floored to a page boundary.

    >>> window_pages(100, 4096, 64), window_pages(0, 128, 16), window_pages(129, 64, 64)
    (PageRange(first=0, count=2), PageRange(first=0, count=0), PageRange(first=1, count=2))
    """
    if seq_len < 0 or window <= 0 or page_size <= 0:
        raise GeometryError(f"window_pages needs seq_len >= 0, window > 0 and page_size > 0; got "
                            f"{seq_len}, {window}, {page_size}")
    first = max(0, seq_len - window) // page_size
    return PageRange(first, -(-seq_len // page_size) - first)


def max_window_pages(window: int, page_size: int) -> int:
    """The most pages a window of ``window`` tokens can span (when its start is not page-aligned).

    >>> max_window_pages(4096, 64), max_window_pages(64, 64), max_window_pages(1, 16)
    (65, 2, 1)
    """
    return (window + 2 * page_size - 2) // page_size


def align_by_position(src_items: np.ndarray, src_first: int, dst_items: np.ndarray, dst_first: int,
                      what: str = "pages") -> tuple[np.ndarray, np.ndarray]:
    """Pair ``src_items`` (positions ``src_first..``) with ``dst_items`` (positions ``dst_first..``).

    Every destination position must be covered by the source; source pages outside the destination's
    range are left out. Raises GeometryError naming both ranges otherwise.
    """
    src, dst = as_index(src_items, f"{what}: prefill"), as_index(dst_items, f"{what}: decode")
    if src_first < 0 or dst_first < 0:
        raise GeometryError(f"{what}: first page positions must be >= 0, got prefill {src_first}, "
                            f"decode {dst_first}")
    if dst.size == 0:
        return src[:0], dst
    s, d = PageRange(int(src_first), src.size), PageRange(int(dst_first), dst.size)
    ranges = f"prefill sent positions [{s.first}, {s.stop}), decode expects [{d.first}, {d.stop})"
    if d.first >= s.stop or s.first >= d.stop:
        raise GeometryError(f"{what}: page lists do not overlap: {ranges}")
    if d.first < s.first or d.stop > s.stop:
        raise GeometryError(f"{what}: the decode window is not covered by the prefill window ({ranges}); "
                            "did the two sides compute the window from different sequence lengths?")
    lo = d.first - s.first
    return src[lo: lo + d.count], dst

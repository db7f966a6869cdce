"""kvbridge's state-type conformance kit against ``swa``: properties, then end to end with window page
lists that start at different positions on the two sides (paired by position)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.testkit import RequestItems, StateTypeTests
from kvbridge_swa import swa_component


class TestSWAConformance(StateTypeTests):
    state_type = "swa"
    num_items = 8

    def component_factory(self, draw):
        heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        head_major = draw(st.booleans())
        v_dim = draw(st.sampled_from([None, 6]))
        return lambda tp, pages: swa_component("swa", layers=2, page_size=4, kv_heads=heads, head_dim=4, tp=tp,
                                               dtype="bfloat16", num_pages=pages, window=64, v_head_dim=v_dim,
                                               head_major=head_major)

    def request_items(self, component, rng):
        # prefill lists the pages of positions 3..6, decode those of 4..6: position p pairs with position p
        src = 1 + rng.permutation(component.num_items - 1)[:4]
        dst = 1 + rng.permutation(component.num_items - 1)[:3]
        return RequestItems(src=src, src_first=3, dst=dst, dst_first=4, pairs=(src[1:], dst))

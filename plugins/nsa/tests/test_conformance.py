"""kvbridge's state-type conformance kit against ``nsa``: the replicated indexer pages, whole sequence
from position 0 (prefill may list more pages than decode needs)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.testkit import RequestItems, StateTypeTests
from kvbridge_nsa import nsa_component


class TestNSAConformance(StateTypeTests):
    state_type = "nsa"

    def component_factory(self, draw):
        page_size = draw(st.sampled_from([1, 4, 8]))
        per_token = draw(st.sampled_from([3, 132]))
        layers = draw(st.integers(1, 3))
        return lambda tp, pages: nsa_component("indexer", layers=layers, page_size=page_size,
                                               bytes_per_token=per_token, num_pages=pages)

    def request_items(self, component, rng):
        src = 1 + rng.permutation(component.num_items - 1)[:4]
        dst = 1 + rng.permutation(component.num_items - 1)[:3]
        return RequestItems(src=src, src_first=0, dst=dst, dst_first=0, pairs=(src[:3], dst))

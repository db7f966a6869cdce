"""kvbridge's state-type conformance kit against ``block_scale`` (chunked with the pages it scales, token and
interleaved layouts, 1 to 8 KV heads so fewer heads than ranks replicate) and ``block_scale_swa`` (window pages
paired by position): every byte against the kit's independent reshard, at every TP pair it sweeps."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.testkit import RequestItems, StateTypeTests
from kvbridge_fp8 import block_scale_component


class TestBlockScaleConformance(StateTypeTests):
    state_type = "block_scale"

    def component_factory(self, draw):
        heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        layout = draw(st.sampled_from(["token", "interleaved"]))
        page = 64 if layout == "interleaved" else draw(st.sampled_from([1, 4]))
        v_dim = draw(st.sampled_from([None, 64]))
        return lambda tp, pages: block_scale_component("block_scale", layers=2, page_size=page, kv_heads=heads,
                                                       head_dim=32, v_head_dim=v_dim, tp=tp, num_pages=pages,
                                                       layout=layout, scale_block=16)


class TestSWABlockScaleConformance(StateTypeTests):
    state_type = "block_scale_swa"
    num_items = 8

    def component_factory(self, draw):
        heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        layout = draw(st.sampled_from(["token", "interleaved"]))
        return lambda tp, pages: block_scale_component("block_scale_swa", layers=1, page_size=32, kv_heads=heads,
                                                       head_dim=64, tp=tp, num_pages=pages, layout=layout,
                                                       state_type="block_scale_swa", window=128)

    def request_items(self, component, rng):
        # prefill lists the pages of positions 3..6, decode those of 4..6: position p pairs with position p
        src = 1 + rng.permutation(component.num_items - 1)[:4]
        dst = 1 + rng.permutation(component.num_items - 1)[:3]
        return RequestItems(src=src, src_first=3, dst=dst, dst_first=4, pairs=(src[1:], dst))

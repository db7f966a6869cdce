"""The kvbridge conformance kit, run against this plugin's ``ringbuffer`` state type.

Needs the plugin installed (``pip install .``): the kit finds ``ringbuffer`` by its entry point, the way
kvbridge itself will. Run with ``pytest tests/`` (the kit's pytest plugin loads automatically).
"""

from __future__ import annotations

from hypothesis import strategies as st
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, ShardAxis, local_units
from kvbridge.testkit import StateTypeTests


class TestRingBufferConformance(StateTypeTests):
    state_type = "ringbuffer"
    items_per_request = 1            # one ring slot per request

    def component_factory(self, draw):
        capacity = draw(st.sampled_from([1, 3, 4]))
        heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
        dim = draw(st.sampled_from([2, 5]))

        def build(tp: int, slots: int) -> Component:
            return Component("recent", "ringbuffer", (
                BufferGeometry("recent.hidden", slots, (capacity, local_units(heads, tp), dim), DType.BFLOAT16,
                               ShardAxis(axis=1, total=heads)),
                BufferGeometry("recent.tokens", slots, (capacity,), DType.INT32),
                BufferGeometry("recent.cursor", slots, (1,), DType.INT64),
            ), IndexKind.SLOT, options={"capacity": capacity})

        return build

"""The kvbridge conformance kit, run against this plugin's ``ringbuffer`` state type.

Needs the plugin installed (``pip install .``): the kit finds ``ringbuffer`` by its entry point, the way
kvbridge itself will. Run with ``pytest tests/`` (the kit's pytest plugin loads automatically).
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.plugin import BufferGeometry, Component, DType, IndexKind, ShardAxis, local_units
from kvbridge.testkit import BufferMeaning, StateTypeTests


class TestRingBufferConformance(StateTypeTests):
    state_type = "ringbuffer"
    items_per_request = 1            # one ring slot per request

    def component_factory(self, draw):
        capacity = draw(st.sampled_from([1, 3, 4]))
        heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
        dim = draw(st.sampled_from([2, 5]))

        def build(tp: int, slots: int) -> Component:
            return Component(name="recent", state_type="ringbuffer", buffers=(
                BufferGeometry(name="recent.hidden", num_items=slots,
                               item_shape=(capacity, local_units(heads, tp), dim), dtype=DType.BFLOAT16,
                               shard=ShardAxis(axis=1, total=heads)),
                BufferGeometry(name="recent.tokens", num_items=slots, item_shape=(capacity,), dtype=DType.INT32),
                BufferGeometry(name="recent.cursor", num_items=slots, item_shape=(1,), dtype=DType.INT64),
            ), index_kind=IndexKind.SLOT, options={"capacity": capacity})

        return build

    def logical_model(self, logical):
        # what each buffer holds, written from the model (the kit reshards by this, not by the ShardAxis)
        return (BufferMeaning(units="heads", axis=1),          # hidden [capacity, heads, dim]
                BufferMeaning(units="replicated"),             # token ids: every rank holds them whole
                BufferMeaning(units="replicated"))             # cursor

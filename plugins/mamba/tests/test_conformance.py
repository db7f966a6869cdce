"""kvbridge's state-type conformance kit against ``mamba`` (hypothesis properties, then end to end)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.testkit import StateTypeTests
from kvbridge_mamba import mamba_component


class TestMambaConformance(StateTypeTests):
    state_type = "mamba"
    items_per_request = 1            # one slot per request (slot 0 is padding)

    def component_factory(self, draw):
        groups = draw(st.sampled_from([(8,), (2,), (4, 4, 8), (6, 6, 12)]))    # GDN [q | k | v] blocks too
        heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        channels_last = draw(st.booleans())
        ssm_dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        return lambda tp, slots: mamba_component(
            "m", layers=2, conv_groups=groups, kernel=4, heads=heads, head_dim=2, state=3, tp=tp,
            dtype="bfloat16", ssm_dtype=ssm_dtype, num_slots=slots, conv_channels_last=channels_last)

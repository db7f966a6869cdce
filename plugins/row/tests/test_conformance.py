"""kvbridge's state-type conformance kit against ``row``: one replicated row per request."""

from __future__ import annotations

from hypothesis import strategies as st

from kvbridge.testkit import StateTypeTests
from kvbridge_row import row_component


class TestRowConformance(StateTypeTests):
    state_type = "row"
    items_per_request = 1            # one row per request

    def component_factory(self, draw):
        sizes = draw(st.sampled_from([(8,), (4, 64), (1, 3, 16)]))
        return lambda tp, rows: row_component("aux", rows=[(rows, n) for n in sizes])

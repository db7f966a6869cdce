"""The benchmark runs end to end on a tiny request (its transfers are digest-checked); no timing asserted."""

from __future__ import annotations

import pytest

from kvbridge_mooncake.bench import Scenario, run_bench
from kvbridge_mooncake.testing import unavailable_reason

NEEDS_MOONCAKE = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
pytestmark = [NEEDS_MOONCAKE, pytest.mark.kvbridge_multiprocess]


def test_bench_smoke() -> None:
    scenarios = [Scenario(name="same tp", layers=1, pool_pages=8, pages=3, page=4, heads=2, head_dim=16),
                 Scenario(name="tp 2->1", layers=1, pool_pages=8, pages=3, page=4, heads=2, head_dim=16, pt=2)]
    report = run_bench(scenarios, repeats=1)
    assert [r["scenario"] for r in report["results"]] == ["same tp", "tp 2->1"]
    for result in report["results"]:
        assert result["descriptors"] > 0 and result["nbytes"] > 0
        assert set(result["gbps"]) == {"kvbridge", "kvbridge_handle", "raw_sync", "raw_window", "memcpy",
                                       "memcpy_scattered"}
        assert all(v > 0 for v in result["gbps"].values())

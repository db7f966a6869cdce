"""Root conftest: the order of test modules, for a parallel run (``pytest -n N --dist loadfile``, as ``.ci/run``
does) as much as for a serial one.

``--dist loadfile`` keeps every test of a module in one worker, in file order: modules share processes through
module- and class-scoped fixtures (vLLM engines, fault-matrix scenarios), and some run their probes in order.
(``--dist loadgroup`` would let independent tests of one module spread over workers, but pytest-xdist 3.8 cannot
apply its groups under pytest 9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads.)

The slowest modules come first (``SLOW``, measured on the 2-core CI host), so that no worker starts a long
module when the others are about to finish. The order within a module is kept, and every worker sorts the same
way (xdist checks that all workers collected the same list).
"""

from __future__ import annotations

import pytest

# Slowest first (whole-module times on the 2-core host; .ci/run prints the slowest tests).
SLOW = (
    "adapters/vllm/tests/test_vllm_e2e.py",
    "tests/test_demo_engines.py",
    "tests/test_churn.py",
    "tests/test_rolling_restart.py",
    "tests/test_soak.py",
    "adapters/vllm/tests/test_vllm_serve_proxy.py",
    "adapters/vllm/tests/test_vllm_hetero.py",
    "adapters/vllm/tests/test_vllm_e2e_adversary.py",
    "tests/test_fault_matrix.py",
    "adapters/sglang/tests/test_sglang_ranks.py",
    "tests/test_multiprocess.py",
    "tests/test_seed_scenarios.py",
    "tests/test_netns.py",
    "tests/test_adversary.py",
    "tools/bench/tests/test_bench_transfer.py",
    "tests/test_cli_demo.py",
    "tests/test_demo_hybrid.py",
    "tests/test_sim.py",
    "tests/test_version_skew.py",
    "tests/test_adversary_wave3.py",
)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW)}
    items.sort(key=lambda item: rank.get(_module(item), len(SLOW)))        # stable: file order kept otherwise

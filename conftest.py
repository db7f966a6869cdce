"""Root conftest: the order and grouping of tests for a parallel run (``pytest -n N --dist loadgroup``, as
``.ci/run`` does); without pytest-xdist it only reorders modules.

* Grouping: every test of a module runs in one worker, in file order, as with ``--dist loadfile``: modules
  share processes through module- and class-scoped fixtures (vLLM engines, fault-matrix scenarios) and some
  run their probes in order. The modules in ``INDEPENDENT`` start their own processes in every test and
  share nothing, so their tests are spread over the workers one by one.
* Order: the slowest modules first (``SLOW``, measured on the 2-core CI host), so that no worker starts a
  long module when the others are about to finish. The order within a module is kept.

The hook runs before xdist's (tryfirst): xdist reads the ``xdist_group`` marks when it builds the node ids
it schedules by, and every worker must see the same order.
"""

from __future__ import annotations

import pytest

# Modules whose tests each start and stop their own processes, with no shared fixture or ordering.
INDEPENDENT = (
    "tests/test_demo_engines.py",
    "adapters/sglang/tests/test_sglang_ranks.py",
    "tests/test_churn.py",
)

# Slowest first (whole-module times in a serial run on the 2-core host; see .ci/run's --durations).
SLOW = (
    "tests/test_soak.py",
    "tests/test_churn.py",
    "adapters/vllm/tests/test_vllm_e2e.py",
    "tests/test_demo_engines.py",
    "adapters/vllm/tests/test_vllm_serve_proxy.py",
    "adapters/vllm/tests/test_vllm_hetero.py",
    "adapters/vllm/tests/test_vllm_e2e_adversary.py",
    "tests/test_fault_matrix.py",
    "adapters/sglang/tests/test_sglang_ranks.py",
    "tests/test_seed_scenarios.py",
    "tests/test_netns.py",
    "tests/test_cli_demo.py",
    "tests/test_bench_transfer.py",
    "tests/test_multiprocess.py",
    "tests/test_demo_hybrid.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it too; without xdist the mark is inert, and --strict-markers needs it known
    config.addinivalue_line("markers", "xdist_group(name): run these tests in one xdist worker")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW)}
    items.sort(key=lambda item: rank.get(_module(item), len(SLOW)))        # stable: file order kept otherwise
    for item in items:
        module = _module(item)
        if module not in INDEPENDENT:
            item.add_marker(pytest.mark.xdist_group(module))

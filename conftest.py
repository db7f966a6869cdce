"""Root conftest: the order of test modules, for a parallel run (``pytest -n N --dist loadfile``, as ``.ci/run``
does) as much as for a serial one.

``--dist loadfile`` keeps every test of a module in one worker, in file order: modules share processes through
module- and class-scoped fixtures (vLLM engines, fault-matrix scenarios), and some run their probes in order.
(``--dist loadgroup`` would let independent tests of one module spread over workers, but pytest-xdist 3.8 cannot
apply its groups under pytest 9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads.)

The slowest modules come first (``SLOW``, measured on the 2-core CI host), so that no worker starts a long
module when the others are about to finish; xdist is told to keep that order (by default it sorts modules by
their number of tests). The order within a module is kept, and every worker sorts the same
way (xdist checks that all workers collected the same list).
"""

from __future__ import annotations

import pytest

# Slowest first (whole-module worker-seconds of a clean-clone run on the 2-core host, 2026-11-27; .ci/run prints
# the slowest tests). The vLLM modules (CPU engines whose OpenMP threads spin) are spread between CPU-light ones so
# that the three workers rarely run two of them at once.
SLOW = (
    "tests/test_churn.py",                                  # 565 s before its rig started decodes ahead (~150 s now)
    "tests/test_sim.py",                                    # 481 s (10,000 schedules, CPU-bound)
    "adapters/vllm/tests/test_vllm_serve_proxy.py",         # 202 s
    "tests/test_fault_matrix.py",                           # 204 s
    "tests/test_testkit.py",                                # 188 s
    "adapters/vllm/tests/test_vllm_e2e.py",                 # 178 s
    "plugins/nixl/tests/test_conformance.py",               # 188 s
    "tools/bench/tests/test_bench_transfer.py",             # 158 s
    "adapters/vllm/tests/test_vllm_hetero.py",              # 129 s
    "tests/test_adversary.py",                              # 156 s
    "adapters/sglang/tests/test_sglang_ranks.py",           # 154 s
    "tests/test_netns.py",                                  # 153 s
    "adapters/vllm/tests/test_connector_adversary.py",      # 115 s
    "adapters/sglang/tests/test_restart.py",                # 75-128 s on a loaded host
    "tests/test_trace_probe.py",                            # 140 s
    "tests/test_demo_engines.py",                           # 121 s
    "adapters/vllm/tests/test_vllm_e2e_adversary.py",       # 85 s
    "tests/test_rolling_restart.py",                        # 115 s
    "tests/test_goodbye_race.py",                           # ~40 s (3 cases, 10 rooms each, real processes)
    "plugins/mooncake/tests/test_conformance.py",           # 82 s
    "adapters/vllm/tests/test_worker_adversary.py",         # 79 s
    "tests/test_soak.py",                                   # 80 s
    "adapters/sglang/tests/test_adversary_abort.py",        # 78 s
    "tests/test_cli_demo.py",
    "tests/test_metrics.py",
    "tests/test_staging_ring_lifecycle.py",
    "tests/test_seed_scenarios.py",
    "tests/test_matrix.py",
    "tests/test_layerwise.py",
    "adapters/sglang/tests/test_adversary_input.py",
    "plugins/nixl/tests/test_two_process.py",
    "tests/test_wire_fuzz.py",
    "tests/test_staging_paths.py",
    "tests/test_settings_adversary.py",
    "tests/test_multiprocess.py",
    "adapters/sglang/tests/test_adversary_faults.py",
    "tests/test_version_skew.py",
    "tests/test_demo_hybrid.py",
    "tests/test_adversary_wave3.py",
)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engines: starts real inference engines (vLLM CPU instances); scripts/test.sh "
                                       "runs these modules after the others, one at a time")
    # pytest-xdist's loadfile scheduler sorts modules by their number of tests (most first) unless told not to:
    # that order put a one-test module of two minutes (the vLLM serve test) last, alone, in a clean-clone run
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW)}
    items.sort(key=lambda item: rank.get(_module(item), len(SLOW)))        # stable: file order kept otherwise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """With ``KVBRIDGE_CPU_LOG=path``: append each test's CPU seconds (this process and the children it reaped
    meanwhile), wall seconds and start (the host's monotonic clock, shared by the workers: which tests overlapped)
    to ``path``, to find where a CI run's CPU goes (the 2-core host is CPU-bound)."""
    import os
    import time

    path = os.environ.get("KVBRIDGE_CPU_LOG")
    if not path:
        return (yield)
    before, start = os.times(), time.monotonic()
    try:
        return (yield)
    finally:
        after = os.times()
        cpu = sum(after[:4]) - sum(before[:4])
        with open(path, "a") as log:
            log.write(f"{cpu:.2f}\t{time.monotonic() - start:.2f}\t{start:.1f}\t{item.nodeid}\n")

"""A prefill process writes into decode ranks of this process over NIXL/UCX (127.0.0.1 only).

The parent registers decode pools, ships their ``PeerInfo`` bytes through a pipe, and checks every byte
against the reference reshard as soon as each rank's notices arrived. The child is always killed.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import pytest

from kvbridge_nixl.backend import NixlBackend
from kvbridge_nixl.testing import run_two_process

pytestmark = pytest.mark.kvbridge_multiprocess
Factory = Callable[[str], NixlBackend]
_SECCOMP = platform.system() == "Linux" and platform.machine() == "x86_64"

SCENARIOS = {
    # name: (prefill TP, decode TP, options of the writer, block CMA in the writer)
    "default-ucx": (2, 1, {}, False),
    "cma-blocked": (1, 2, {}, True),                  # UCX 1.23 self-tests CMA and falls back to TCP
    "tcp-pinned": (2, 2, {"ucx_tls": "tcp"}, True),   # the documented fallback
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prefill_process_writes_decode_ranks(backends: Factory, scenario: str) -> None:
    pt, dt, options, block = SCENARIOS[scenario]
    if block and not _SECCOMP:
        pytest.skip("the CMA-blocking seccomp filter needs x86-64 Linux")
    run_two_process(backends, pt, dt, options, block, seed=40 + pt * 4 + dt)

"""kvbridge's conformance kit against the real NIXL backend (UCX): the basic tier in this process, the
multi-process tier with a child process on 127.0.0.1, the hardware tier where a CUDA device is present."""

from __future__ import annotations

from kvbridge.testkit import BackendTests


class TestNixlConformance(BackendTests):
    backend = "nixl"
    # UCX over TCP between loaded processes: a 3 s wait for data failed a 2 -> 4 room once on the 2-core CI host
    # with other work beside it (the data was late, not lost)
    waiting_timeout_s = 8.0
    stateful_examples = 3        # every example starts two NIXL agents (~0.6 s each) and re-adds its peer
    stateful_steps = 12          # after each registration (new NIXL metadata)

"""kvbridge's conformance kit against the real NIXL backend (UCX): the basic tier in this process, the
multi-process tier with a child process on 127.0.0.1, the hardware tier where a CUDA device is present."""

from __future__ import annotations

from kvbridge.testkit import BackendTests


class TestNixlConformance(BackendTests):
    backend = "nixl"
    # UCX over TCP between loaded processes: a 3 s wait for data failed a 2 -> 4 room once on the 2-core CI host
    # with other work beside it (the data was late, not lost)
    waiting_timeout_s = 8.0
    # NIXL's Python API starts each agent's progress thread with no pause between polls (~0.19 of a core each,
    # idle, here): the in-process worlds hold up to 16 agents, which starved their own process on the 2-core CI
    # host until a room stalled for 80-120 s (a faulthandler dump: every Python thread waiting for the GIL). One
    # agent a process, as in production, keeps the thread: the multi-process tier runs with it.
    world_options = {"progress_thread": "false"}
    stateful_examples = 3        # every example starts two NIXL agents (~0.6 s each) and re-adds its peer
    stateful_steps = 12          # after each registration (new NIXL metadata)

"""kvbridge's conformance kit against the real Mooncake backend (TCP transport, P2P handshake): the
basic tier in this process and the multi-process tier with a child process on 127.0.0.1."""

from __future__ import annotations

from kvbridge.testkit import BackendTests


class TestMooncakeConformance(BackendTests):
    backend = "mooncake"
    stateful_examples = 3        # every example starts two transfer engines (~1 s each)

"""A flood of bad frames is counted, not logged line by line (80k forged frames once wrote 67,862 ERROR lines),
and the agent goes on serving."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_agent import kv_buffers, kv_layout  # the agent tests' small dense-KV pool

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.links import LocalHub
from kvbridge.logs import LineBudget
from kvbridge.protocol.wire import Codec, Heartbeat, KVPoll, Role


def test_a_line_budget_counts_what_it_suppresses() -> None:
    now = [0.0]
    budget = LineBudget(per_interval=2, interval_s=10.0, clock=lambda: now[0])
    assert [budget.take("x") for _ in range(5)] == [True, True, False, False, False]
    assert budget.take("y")                                   # another kind has its own budget
    now[0] = 10.0
    assert budget.take("x") and "3 more like it" in budget.suppressed_note("x")
    assert budget.suppressed_note("x") == ""


def test_forged_frames_are_counted_and_logged_a_bounded_number_of_times(caplog: pytest.LogCaptureFixture) -> None:
    hub = LocalHub()
    cfg = AgentConfig(secret=b"the cluster's secret")
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=cfg, name="p0")
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                        link=hub.link("d0"), config=cfg, name="d0")
    try:
        forger = Codec(b"a guess", sender="p0", address="p0", incarnation=pre.incarnation)
        with caplog.at_level(logging.DEBUG, logger="kvbridge.agent"):
            for seq in range(3000):
                dec.handle_frame(forger.encode(Heartbeat(agent="p0", address="p0", seq=seq, sent_at=0.0),
                                               to="d0", to_incarnation=dec.incarnation))
        lines = [r for r in caplog.records if "control frame" in r.getMessage()]
        assert dec.rejected_frames == 3000
        assert len(lines) <= 25, f"{len(lines)} log lines for 3000 forged frames"
        shake = dec.connect_async("inst")                     # and a genuine peer is still served
        for _ in range(2000):
            pre.progress()
            dec.progress()
            if shake.done:
                break
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([3])})
        for _ in range(50):
            pre.progress()
            dec.progress()
        sender.send(np.array([5]), last=True)
        for _ in range(50):
            pre.progress()
            dec.progress()
        assert receiver.poll() == KVPoll.Success
    finally:
        pre.close()
        dec.close()

"""Repeated errors are rate-limited (issue 15 item 6): the agent's background loop logs a persisting error
once with its traceback, then a count per interval, not a traceback every 5 ms."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvbridge.agent import TransferAgent
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis
from kvbridge.links import LocalHub
from kvbridge.logs import RateLimitedLog
from kvbridge.protocol.wire import Role


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fail(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


def test_a_persisting_error_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    limited = RateLimitedLog(logging.getLogger("kvbridge.test"), "%s: step failed", "agent-1", interval_s=10,
                             clock=clock)
    caplog.set_level(logging.ERROR, "kvbridge.test")
    for _ in range(1000):                     # 1000 failures within 5 s: one record, with the traceback
        limited.error(_fail("engine gone"))
        clock.now += 0.005
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None
    clock.now = 10.5
    limited.error(_fail("engine gone"))       # the interval passed: one line with the count, no traceback
    assert len(caplog.records) == 2 and caplog.records[1].exc_info is None
    assert "again: RuntimeError: engine gone; 1000 times in the last 10 s" in caplog.records[1].getMessage()
    limited.error(_fail("another error"))     # a different error: logged at once, with its own traceback
    assert len(caplog.records) == 3 and "another error" in str(caplog.records[2].exc_info[1])
    limited.error(_fail("another error"))
    limited.clear()                           # success: the suppressed repeats are reported once
    assert len(caplog.records) == 4 and "repeated 1 more times, then stopped" in caplog.records[3].getMessage()
    limited.clear()
    assert len(caplog.records) == 4


def _layout() -> PoolLayout:
    bufs = tuple(BufferGeometry(name=f"k.{i}", num_items=4, item_shape=(4, 2, 8), dtype=DType.BFLOAT16,
                                shard=ShardAxis(1, 2)) for i in range(2))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1, tp_rank=0,
                      page_size=4, model="m")


def test_the_agent_loop_does_not_log_a_traceback_per_iteration(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout()
    buffers = {"kv": [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]}
    caplog.set_level(logging.ERROR, "kvbridge.agent")
    with TransferAgent(layout=layout, buffers=buffers, role=Role.DECODE, link=LocalHub().link("d")) as agent:
        calls = 0

        def broken() -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("the engine went away")

        monkeypatch.setattr(agent, "progress", broken)
        agent.start()
        time.sleep(0.6)
    failures = [r for r in caplog.records if "progress failed" in r.getMessage()]
    assert calls > 50, calls                   # the loop kept trying
    assert 1 <= len(failures) <= 2, [r.getMessage() for r in failures]
    assert failures[0].exc_info is not None

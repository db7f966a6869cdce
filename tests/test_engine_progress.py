"""``AgentConfig.engine_progress_s``: beside the progress thread, the engine's own calls (handle polls, ``events()``)
run a progress step themselves, at most that often; unset (the default), they never do and leave it to the thread.
Byte-exact either way."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_agent import hand_pair, wait

from kvbridge.agent import AgentConfig
from kvbridge.protocol.wire import KVPoll


@pytest.mark.parametrize("every", [None, 0.05], ids=["unset", "every-50ms"])
def test_the_engines_calls_run_progress_steps_only_when_asked_and_at_most_that_often(every: float | None) -> None:
    pre, dec = hand_pair(AgentConfig(engine_progress_s=every), threads=True)
    try:
        engine = threading.get_ident()
        steps: list[float] = []
        real = pre.progress

        def counted() -> None:
            if threading.get_ident() == engine:
                steps.append(time.monotonic())
            real()
        pre.progress = counted                  # type: ignore[method-assign]
        src = pre.buffers.views["kv"]
        for b, buf in enumerate(src):
            buf[:] = (np.arange(buf.size, dtype=np.uint32) * (b + 5)).astype(np.uint8).reshape(buf.shape)
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([3, 4])})
        started = time.monotonic()
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send(np.array([1, 2]), last=True)
        wait(lambda: receiver.poll() == KVPoll.Success)
        for _ in range(200):                    # an engine polling every 1 ms for 0.2 s
            pre.events()
            sender.poll()
            time.sleep(0.001)
        elapsed = time.monotonic() - started
        for b, buf in enumerate(dec.buffers.views["kv"]):
            assert np.array_equal(buf[[3, 4]], src[b][[1, 2]])
        if every is None:
            assert steps == [], "no progress step in the engine's thread unless asked"
        else:
            assert steps, "the engine's calls never ran a progress step"
            assert len(steps) <= elapsed / every + 2, (len(steps), elapsed)
            gaps = np.diff(steps)
            assert not len(gaps) or gaps.min() >= every * 0.99, gaps.min()
    finally:
        pre.close()
        dec.close()

"""Drain: a rank stops taking rooms (with a reason the engine can route around), lets the ones in flight
finish, fails what is left after the timeout, tells its peers and closes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from test_agent import hand_pair  # the agent tests' small dense-KV pool

from kvbridge import Draining
from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.protocol.states import PeerState
from kvbridge.protocol.wire import KVPoll


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=2.0, heartbeat_interval_s=0.1), threads=True)
    yield pre, dec
    pre.close()
    dec.close()

def _wait(what: str, cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:   # type: ignore[operator]
        time.sleep(0.002)
    assert cond(), what                                  # type: ignore[operator]


def test_a_draining_prefill_finishes_what_is_in_flight_and_refuses_the_rest(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    pre, dec = pair
    src = pre.buffers.views["kv"]
    for b, buf in enumerate(src):
        buf[:] = (np.arange(buf.size, dtype=np.uint32) * (b + 3)).astype(np.uint8).reshape(buf.shape)
    sender = pre.sender(1)
    receiver = dec.receiver(1, "inst")
    receiver.send_metadata({"kv": np.array([7, 8])})
    _wait("request arrived", lambda: sender.poll() == KVPoll.WaitingForInput)
    report: dict[str, int] = {}
    drainer = threading.Thread(target=lambda: report.update(pre.drain(10.0, "rolling upgrade")))
    drainer.start()
    _wait("draining", lambda: pre.prefill is not None and pre.prefill.draining)
    with pytest.raises(Draining, match="rolling upgrade"):
        pre.sender(2)
    late = dec.receiver(3, "inst")                       # a decode that did not hear yet: told at once, with why
    late.send_metadata({"kv": np.array([1])})
    _wait("refused", lambda: late.poll() == KVPoll.Failed, 5.0)
    assert "draining (rolling upgrade)" in late.failure_reason
    assert drainer.is_alive()                            # room 1 is still in flight: the drain waits for it
    sender.send(np.array([2, 3]), last=True)             # the engine keeps working during the drain
    drainer.join(10)
    assert not drainer.is_alive() and report == {"success": 1, "failed": 0, "unsafe": 0}
    _wait("delivered", lambda: receiver.poll() == KVPoll.Success)
    for b, buf in enumerate(dec.buffers.views["kv"]):
        assert np.array_equal(buf[[7, 8]], src[b][[2, 3]])
    _wait("goodbye", lambda: dec.peers.peers.get("p0") is None or dec.peers.peers["p0"].state is not PeerState.ALIVE)


def test_a_drain_that_times_out_fails_the_rest_safely(pair: tuple[TransferAgent, TransferAgent]) -> None:
    pre, dec = pair
    sender = pre.sender(5)
    receiver = dec.receiver(5, "inst")
    receiver.send_metadata({"kv": np.array([4, 5])})
    _wait("request arrived", lambda: sender.poll() == KVPoll.WaitingForInput)
    report = pre.drain(0.3, "node maintenance")          # the engine never sends: the room fails at the timeout
    assert report == {"success": 0, "failed": 1, "unsafe": 0}
    _wait("failed", lambda: receiver.poll() == KVPoll.Failed)
    assert "drain timeout" in receiver.failure_reason
    _wait("safe to reuse", lambda: receiver.safe_to_reuse)


def test_a_draining_decode_takes_no_new_rooms(pair: tuple[TransferAgent, TransferAgent]) -> None:
    _pre, dec = pair
    dec.begin_drain("scale down")
    with pytest.raises(Draining, match="scale down"):
        dec.receiver(9, "inst")
    assert dec.drained

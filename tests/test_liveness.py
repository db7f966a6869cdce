"""Proof of a writer's exit from its kernel (kvbridge.agent.liveness): the decode's connection to a prefill
rank's listener reads EOF when that process ends, never while it is only stopped; an agent turns it into
``safe_to_reuse`` after the grace, without declare_gone. The multi-process kill -9 over every backend is
probe 1 of tests/test_fault_matrix.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from test_agent import hand_pair, kv_buffers, kv_layout  # the agent tests' small dense-KV pool

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent.liveness import LivenessListener, LivenessWatch, host_of, split_address
from kvbridge.links import LocalHub
from kvbridge.protocol.states import PeerState, RecvState
from kvbridge.protocol.wire import Abort, KVPoll, Role

CHILD = """
import sys, time
from kvbridge.agent.liveness import LivenessListener
listener = LivenessListener("127.0.0.1")
print(listener.address, flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    listener.poll()
    time.sleep(0.01)
"""


def _closed_within(watch: LivenessWatch, seconds: float) -> list[object]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = watch.closed()
        if found:
            return list(found)
        time.sleep(0.01)
    return []


def test_addresses() -> None:
    assert split_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="not host:port"):
        split_address("nohost")
    assert host_of("tcp://198.18.0.7:5000") == "198.18.0.7"
    assert host_of("tcp://0.0.0.0:5000") == host_of("p0") == "127.0.0.1"


def test_a_closed_listener_reads_as_exited_and_a_live_one_never() -> None:
    listener, watch = LivenessListener("127.0.0.1"), LivenessWatch()
    try:
        watch.watch(("p", 1), listener.address)
        for _ in range(20):
            listener.poll()
            assert watch.closed() == []
            time.sleep(0.005)
        assert listener.held == 1
        listener.close()                       # what the kernel does when the process ends
        assert _closed_within(watch, 2.0) == [("p", 1)]
        assert watch.closed() == []            # each once
    finally:
        watch.close()


def test_a_connection_never_established_proves_nothing() -> None:
    """Refused (or a firewall, or unreachable): the writer may live behind it, so it is no proof of exit."""
    listener = LivenessListener("127.0.0.1")
    address = listener.address
    listener.close()
    watch = LivenessWatch()
    try:
        watch.watch(("p", 2), address)
        assert _closed_within(watch, 1.0) == []
        assert [key for key, _ in watch.unproven()] == [("p", 2)]
    finally:
        watch.close()


def test_a_listener_forgets_connections_its_peers_closed() -> None:
    listener = LivenessListener("127.0.0.1")
    watches = [LivenessWatch() for _ in range(3)]
    try:
        for i, watch in enumerate(watches):
            watch.watch(("p", i), listener.address)
        deadline = time.monotonic() + 2
        while listener.held < 3 and time.monotonic() < deadline:
            listener.poll()
        assert listener.held == 3
        watches[0].close()
        deadline = time.monotonic() + 2
        while listener.held > 2 and time.monotonic() < deadline:
            listener.poll()
        assert listener.held == 2                # no descriptor kept for a decode that left
    finally:
        for watch in watches[1:]:
            watch.close()
        listener.close()


def test_sigstop_is_not_death_and_kill9_is() -> None:
    """A real process: stopped past any timeout, its connection stays open; killed, it closes at once."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    watch = LivenessWatch()
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        watch.watch(("prefill", 1), address)
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGSTOP)
        assert _closed_within(watch, 1.5) == [], "a stopped process was taken for dead"
        os.kill(child.pid, signal.SIGCONT)
        assert _closed_within(watch, 0.3) == []
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        assert _closed_within(watch, 2.0) == [("prefill", 1)]
        assert time.monotonic() - killed < 2.0
    finally:
        watch.close()
        child.kill()
        child.wait(5)


# ------------------------------------------------------------------ the agent: safe without declare_gone
@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=30.0, writer_exit_grace_s=0.3))
    yield pre, dec
    pre.close()
    dec.close()

def test_a_writer_whose_process_exited_is_fenced_after_the_grace(pair: tuple[TransferAgent, TransferAgent]) -> None:
    pre, dec = pair
    assert dec.decode is not None and dec.peers.liveness is not None
    pre.sender(5)
    receiver = dec.receiver(5, "inst")
    receiver.send_metadata({"kv": np.array([1, 2, 3])})
    for _ in range(20):
        pre.progress()
        dec.progress()
    assert receiver.poll() is KVPoll.WaitingForInput
    assert pre._liveness is not None
    pre._liveness.close()                     # the kernel's part of the prefill's exit (its heartbeats would go
    #                                           on here: the peer timeout is 30 s, so only the EOF can decide)
    seen_exit = time.monotonic()
    while not receiver.safe_to_reuse and time.monotonic() - seen_exit < 3.0:
        dec.progress()
        time.sleep(0.005)
    took = time.monotonic() - seen_exit
    assert receiver.safe_to_reuse and receiver.poll() is KVPoll.Failed
    assert took >= 0.3, "safe before the grace for in-flight writes"
    assert "exited" in receiver.failure_reason
    assert dec.decode.rooms[5].state is RecvState.FAILED
    assert dec.peers.peers["p0"].state is PeerState.DEPARTED


def test_no_proof_without_the_listener(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """A prefill that is only silent (progress no longer called, listener open) is never fenced by it."""
    pre, dec = pair
    pre.sender(6)
    receiver = dec.receiver(6, "inst")
    receiver.send_metadata({"kv": np.array([4])})
    for _ in range(20):
        pre.progress()
        dec.progress()
    receiver.abort("gave up")                 # the prefill never answers: FENCING
    until = time.monotonic() + 0.8
    while time.monotonic() < until:
        dec.progress()
        time.sleep(0.005)
    assert receiver.poll() is KVPoll.Failed and not receiver.safe_to_reuse


def test_a_same_name_replacement_cannot_release_the_old_writers_fence(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    """Split brain: the old p0 still lives (its data path could still write) and a replacement starts under
    the same name. The decode's room bound to the old incarnation fails and stays FENCING whatever the
    replacement acknowledges; the old process's exit (its liveness EOF) is what fences it."""
    pre, dec = pair
    hub: LocalHub = pre.link._hub         # type: ignore[attr-defined]
    assert dec.decode is not None
    pre.sender(8)
    receiver = dec.receiver(8, "inst")
    receiver.send_metadata({"kv": np.array([1, 2])})
    for _ in range(20):
        pre.progress()
        dec.progress()
    assert receiver.poll() is KVPoll.WaitingForInput
    cfg = AgentConfig(peer_timeout_s=30.0, writer_exit_grace_s=0.3)
    new = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0-again"), instance="inst", config=cfg, name="p0")
    try:
        shake = dec.connect_async("inst")
        for _ in range(2000):
            new.progress()
            dec.progress()
            if shake.done:
                break
        assert shake.done and dec.peers.peers["p0"].incarnation == new.incarnation
        room = dec.decode.rooms[8]
        assert room.state is RecvState.FENCING and not receiver.safe_to_reuse
        ack = Abort(room=8, agent="p0", reason="never knew it", quiesced=True)
        dec.handle_frame(new.context.codec.encode(ack, to=dec.link.address, to_incarnation=dec.incarnation))
        for _ in range(50):                   # and whatever the replacement says on its own
            new.progress()
            dec.progress()
        assert room.state is RecvState.FENCING and not receiver.safe_to_reuse, "the replacement's ack fenced it"
        assert pre._liveness is not None
        pre._liveness.close()                 # the old process exits
        deadline = time.monotonic() + 3.0
        while not receiver.safe_to_reuse and time.monotonic() < deadline:
            dec.progress()
            new.progress()
            time.sleep(0.005)
        assert receiver.safe_to_reuse and room.state is RecvState.FAILED
        assert dec.peers.peers["p0"].incarnation == new.incarnation and dec.peers.peers["p0"].alive
    finally:
        new.close()

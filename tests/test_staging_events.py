"""The event-driven staging pipeline, on the host with a stand-in for the CUDA stream: the agents take
their buffers for device memory (``LocalBuffers.is_cuda``) and get a stager whose events complete only when
the test lets them. Checks what the GPU path promises without a GPU: nothing is posted before the engine's
event and the gather's event completed, nothing counts before the scatter's event completed, and a failed
room is safe to reuse only once no queued gather or running scatter can touch memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_staging_paths as tsp
from test_staging_paths import POOL, World, check, fill, wait

from kvbridge.agent import AgentConfig
from kvbridge.protocol.wire import KVPoll
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(tsp.worlds, name="make_world")


class Gate:
    """Events of one side: each completes once the gate is open (and its predecessor completed)."""

    def __init__(self) -> None:
        self.open = False
        self.made: list[Event] = []


class Event:
    def __init__(self, gate: Gate, after: Event | None = None) -> None:
        self.gate, self.after = gate, after
        gate.made.append(self)

    def query(self) -> bool:
        return self.gate.open and (self.after is None or self.after.query())


class FakeStager:
    """Runs the work at once (the bytes are host memory) but reports it done only through its event."""

    def __init__(self, engine: Gate, stream: Gate) -> None:
        self.engine, self.stream = engine, stream
        self.runs = 0

    def engine_event(self) -> Event:
        return Event(self.engine)

    def to_device(self, index: np.ndarray) -> tuple[np.ndarray, None]:
        return index, None

    def run(self, work: Callable[[], None], after: Any = None) -> Event:
        work()
        self.runs += 1
        return Event(self.stream, after)


def _as_device(world: World) -> dict[str, Gate]:
    gates = {"engine": Gate(), "gather": Gate(), "scatter": Gate()}
    for agent in world.prefill:
        agent.buffers.is_cuda = lambda name: True  # type: ignore[method-assign]
        agent.buffers._stager = FakeStager(gates["engine"], gates["gather"])  # type: ignore[assignment]
    for agent in world.decode:
        agent.buffers.is_cuda = lambda name: True  # type: ignore[method-assign]
        agent.buffers._stager = FakeStager(gates["engine"], gates["scatter"])  # type: ignore[assignment]
    return gates


def _open(world: World, room: int, n: int = 8) -> tuple[list, list, np.ndarray]:
    rng = np.random.default_rng(room)
    src_pages, dst_pages = rng.permutation(POOL)[:n], rng.permutation(POOL)[:n]
    fill(world, room, src_pages)
    receivers = [d.receiver(room, "inst") for d in world.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages})
    senders = [a.sender(room) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    return senders, receivers, src_pages


def _hold(seconds: float, condition: Callable[[], bool]) -> None:
    """``condition`` stays true for a while (the progress threads keep running meanwhile)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition()
        time.sleep(0.005)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_nothing_is_posted_before_the_engines_event(make_world: Callable[..., World], mode: str) -> None:
    config = AgentConfig(staging=mode, staging_bytes=1 << 20, staging_piece_bytes=16 << 10)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=config, decode=config)
    gates = _as_device(world)
    gates["gather"].open = gates["scatter"].open = True
    senders, receivers, pages = _open(world, 61)
    for s in senders:
        s.send(pages, last=True)                      # returns at once: the engine's work is not done
    _hold(0.3, lambda: all(s.stats == (0, 0) for s in senders) and receivers[0].poll() < KVPoll.Success)
    assert not any(s.safe_to_reuse for s in senders)
    gates["engine"].open = True
    wait(lambda: receivers[0].poll() == KVPoll.Success)
    wait(lambda: all(s.safe_to_reuse for s in senders))
    rooms = world.decode[0].decode.rooms
    check(world, 61, rooms[61].indices["kv"])


def test_pieces_post_when_their_gather_completes_and_count_when_scattered(make_world: Callable[..., World]) -> None:
    config = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=16 << 10)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=config, decode=config)
    gates = _as_device(world)
    gates["engine"].open = True
    senders, receivers, pages = _open(world, 62)
    senders[0].send(pages, last=True)
    _hold(0.3, lambda: senders[0].stats == (0, 0))                 # gathers queued, none complete
    assert gates["gather"].made, "no gather was queued"
    gates["gather"].open = True
    wait(lambda: senders[0].stats[1] > 1)                          # pieces posted ...
    wait(lambda: bool(world.decode[0].decode.rooms[62].scattering))
    _hold(0.3, lambda: receivers[0].poll() < KVPoll.Success and not receivers[0].safe_to_reuse)  # ... not counted
    gates["scatter"].open = True
    wait(lambda: receivers[0].poll() == KVPoll.Success)
    check(world, 62, world.decode[0].decode.rooms[62].indices["kv"])
    assert world.prefill[0].buffers._stager.runs == len(gates["gather"].made)  # type: ignore[union-attr]


def test_a_failed_room_waits_for_queued_gathers_and_running_scatters(make_world: Callable[..., World]) -> None:
    config = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=16 << 10)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=config, decode=config)
    gates = _as_device(world)
    gates["engine"].open = True
    senders, receivers, pages = _open(world, 63)
    senders[0].send(pages[:4])
    senders[0].abort("engine gave up")
    assert senders[0].poll() == KVPoll.Failed
    _hold(0.3, lambda: not senders[0].safe_to_reuse)               # a queued gather may still read the pages
    gates["gather"].open = True
    wait(lambda: senders[0].safe_to_reuse)
    staging = world.prefill[0].staging
    assert staging is not None and staging.free_bytes == 1 << 20
    # decode side: a piece whose scatter still runs keeps the room unsafe after it failed
    senders2, receivers2, pages2 = _open(world, 64)
    senders2[0].send(pages2[:4])
    wait(lambda: bool(world.decode[0].decode.rooms[64].scattering))
    receivers2[0].abort("client went away")
    wait(lambda: receivers2[0].poll() == KVPoll.Failed)
    wait(lambda: senders2[0].poll() == KVPoll.Failed)
    _hold(0.3, lambda: not receivers2[0].safe_to_reuse)
    gates["scatter"].open = True
    wait(lambda: receivers2[0].safe_to_reuse)

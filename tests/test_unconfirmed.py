"""What a prefill sends again before its Goodbye (kvbridge.agent.unconfirmed): bounded, per decode incarnation,
never a notice of a room the decode is done with."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import decode as decode_side
from kvbridge.agent.prefill import PrefillSide
from kvbridge.agent.unconfirmed import Unconfirmed
from kvbridge.protocol.wire import KVPoll, ReplayWindow
from kvbridge.sim.cluster import INSTANCE, Cluster
from kvbridge.sim.scheduler import CONFIG
from kvbridge.sim.world import FRAME, LAND, NOTIFY, Knobs, World


def test_kept_notices_come_back_in_order_for_that_incarnation_only() -> None:
    kept = Unconfirmed()
    kept.keep("d0", 7, room=1, frame=b"n1a", seq=1)
    kept.keep("d0", 7, room=2, frame=b"n2a", seq=2)
    kept.keep("d0", 7, room=1, frame=b"n1b", seq=3)     # room 1 again: it moves after room 2
    assert kept.frames("d0", 7, seq=3) == [b"n2a", b"n1a", b"n1b"]
    assert kept.frames("d0", 8, seq=3) == []             # another incarnation under that name: nothing
    assert kept.frames("d1", 7, seq=3) == []
    kept.keep("d0", 8, room=3, frame=b"n3", seq=1)      # a new incarnation replaces the old one's notices
    assert kept.frames("d0", 8, seq=1) == [b"n3"] and kept.frames("d0", 7, seq=3) == []


def test_a_room_the_decode_is_done_with_is_never_sent_again() -> None:
    kept = Unconfirmed()
    kept.keep("d0", 7, room=1, frame=b"old", seq=1)
    kept.forget_room("d0", 1)            # the decode aborted room 1, or asked for it again (a new request)
    kept.keep("d0", 7, room=1, frame=b"new", seq=2)
    assert kept.frames("d0", 7, seq=2) == [b"new"]
    kept.forget("d0")                    # the decode died or left
    assert kept.frames("d0", 7, seq=2) == [] and len(kept) == 0
    kept.forget_room("nobody", 5)        # unknown agent or room: nothing happens
    kept.forget("nobody")


def test_bounded_by_the_decodes_replay_window() -> None:
    """A copy older than the decode's replay window would be dropped there: it is not kept (memory bound)."""
    kept = Unconfirmed()
    size = ReplayWindow.SIZE
    for seq in range(1, 10 * size + 1):
        kept.keep("d0", 7, room=seq, frame=seq.to_bytes(4, "little"), seq=seq)
        assert len(kept) <= size
    frames = kept.frames("d0", 7, seq=10 * size)
    assert len(frames) == size
    assert frames[0] == (9 * size + 1).to_bytes(4, "little")     # the oldest the decode still accepts
    assert kept.frames("d0", 7, seq=11 * size) == []   # heartbeats moved the sequence on: all out of the window


# ---------------------------------------------------------------------- with real agents, in the simulator
def _world() -> tuple[Any, Any]:
    world = World(seed=1, rng=random.Random(1), knobs=Knobs(notify_via_link=0.0, latency=0.001))
    cluster = Cluster(world, 1, 1, CONFIG)
    cluster.hub.ordered = True
    for proc in cluster.procs:
        cluster.start(proc)
    return world, cluster


def _run(world: Any, cluster: Any, until: Callable[[], bool], *, drop_notices: bool = False) -> None:
    """Deliver everything due (in order), progress every agent, move the clock; until ``until()`` (bounded)."""
    for _ in range(500):
        for item in sorted(world.ready(), key=lambda d: d.id):
            if world.pending.pop(item.id, None) is None:
                continue
            if item.kind == FRAME:
                world.deliver_frame(item)
            elif item.kind == LAND:
                cluster.net.land(item)
            elif not drop_notices:
                cluster.net.notify(item)
        for proc in cluster.live():
            proc.agent.progress()
        if until():
            return
        world.now += 0.01
    raise AssertionError("the world did not get there in 500 steps")

def _written_with_lost_notice(world: Any, cluster: Any, room: int, *, src: list[int], dst: list[int],
                              fill: int) -> tuple[Any, Any, Any, Any]:
    """p0 writes ``src`` (filled with ``fill``) into d0's ``dst`` for ``room``; the write lands and the
    prefill's room succeeds, but the backend's notice is lost for good. (p0, d0, sender, receiver)."""
    p, d = cluster.by_name["p0"], cluster.by_name["d0"]
    _run(world, cluster, lambda: not d.agent.peers.handshakes)
    sender = p.agent.sender(room)
    for buf in p.buffers:
        buf[src] = fill
    receiver = d.agent.receiver(room, INSTANCE)
    receiver.send_metadata({"kv": np.array(dst)})
    _run(world, cluster, lambda: sender.poll() >= KVPoll.WaitingForInput)
    sender.send(np.array(src), last=True)
    _run(world, cluster, lambda: sender.poll() is KVPoll.Success, drop_notices=True)
    for item in [item for item in world.pending.values() if item.kind == NOTIFY]:
        del world.pending[item.id]
    return p, d, sender, receiver



@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-no-forget"])
def test_a_copy_never_completes_a_later_request_that_reused_the_room_number(
        planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room 7's notice went by the backend and was lost; the decode aborted room 7 and asks for room 7 again
    (other pages) while the prefill closes. The prefill's goodbye must not send the old notice: it would
    complete the new room with pages nothing wrote (the old frame was never seen there, so no replay window
    catches it: the abort must have made the prefill forget it). ``planted``: without forgetting, the new room
    reports Success: the test has teeth (the decode's own check, that a frame about a room was sent after its
    request, is planted away too: it drops the stale copy as well)."""
    if planted:
        monkeypatch.setattr(Unconfirmed, "forget_room", lambda self, agent, room: None)
        monkeypatch.setattr(decode_side, "_after_request", lambda room, env, what: None)
    world, cluster = _world()
    try:
        p, d, sender, receiver = _written_with_lost_notice(world, cluster, 7, src=[0, 1], dst=[2, 3], fill=0x5A)
        assert receiver.poll() is not KVPoll.Success and p.agent.prefill is not None
        assert p.agent.prefill.unconfirmed == 1
        receiver.abort("the engine gave up")
        _run(world, cluster, lambda: receiver.safe_to_reuse and sender.safe_to_reuse)
        receiver.clear()
        sender.clear()
        again = d.agent.receiver(7, INSTANCE)                 # the room number, reused for another request
        again.send_metadata({"kv": np.array([8, 9])})
        p.agent.close()                                       # its goodbye crosses the new request
        _run(world, cluster, lambda: again.poll() in (KVPoll.Success, KVPoll.Failed))
        if planted:
            assert again.poll() is KVPoll.Success, again.failure_reason   # by the stale copy: pages 8, 9 unwritten
        else:
            assert again.poll() is KVPoll.Failed, again.failure_reason
            assert all(not buf[[8, 9]].any() for buf in d.buffers)
    finally:
        cluster.close()


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-no-resend"])
def test_the_notice_a_closed_backend_lost_still_reaches_the_decode_before_the_goodbye(
        planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue 26 race, deterministic: the write landed, its notice went by the backend and is lost (the
    backend closed before it left), the prefill closes right after. The decode's room is Success byte-exact
    (``planted``: without the copies, it fails "said goodbye", as it did)."""
    if planted:
        monkeypatch.setattr(PrefillSide, "resend_unconfirmed", lambda self: 0)
    world, cluster = _world()
    try:
        p, d, sender, receiver = _written_with_lost_notice(world, cluster, 11, src=[4, 5], dst=[6, 1], fill=0x3C)
        p.agent.close()
        _run(world, cluster, lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        if planted:
            assert receiver.poll() is KVPoll.Failed and "said goodbye" in receiver.failure_reason
        else:
            assert receiver.poll() is KVPoll.Success, receiver.failure_reason
            assert all((buf[[6, 1]] == 0x3C).all() for buf in d.buffers)
    finally:
        cluster.close()

"""``clear_when_safe()``: an engine lets a room go once, whatever its state (SGLang's clear() and abort()), and kvbridge
forgets it when it is over, with no thread of the engine's coming back. Tried against what it must not do: forget a
room while a write still reads its pages (prefill) or may still land in them (decode), keep staging reserved for
good, report events of a room the engine let go, or end a drain before such a room is over."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_agent import hand_pair, wait
from test_runtime_calls_adversary import _agent, _Async, _registry

from kvbridge.agent import AgentConfig
from kvbridge.errors import KVBridgeError
from kvbridge.links import LocalHub
from kvbridge.protocol.states import WriteState
from kvbridge.protocol.wire import KVPoll, Role


def test_a_prefill_room_let_go_with_a_write_in_flight_is_cleared_once_the_write_ended() -> None:
    _Async.calls.clear()
    _Async.fail_add.clear()
    registry, hub = _registry("async", _Async), LocalHub()
    pre = _agent(hub, Role.PREFILL, "p0", registry, "async")
    dec = _agent(hub, Role.DECODE, "d0", registry, "async")
    try:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=8)
        sender, receiver = pre.sender(1), dec.receiver(1, "inst")
        receiver.send_metadata({"kv": np.array([1, 2])})
        wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        pre.events()                                       # READY taken: what follows is of the let-go room only
        sender.send(np.array([3, 4]), last=True)
        assert pre.prefill is not None
        with pre.context.lock:
            assert [w.state for w in pre.prefill.rooms[1].inflight] == [WriteState.POSTED]
        sender.abort("the client went away")
        with pytest.raises(KVBridgeError, match="still in flight"):
            sender.clear()                                 # a plain clear refuses: the write reads the pages
        sender.clear_when_safe()
        with pre.context.lock:
            assert 1 in pre.prefill.rooms                  # kept: the write still reads its pages
        assert not pre.drained                             # ... and a drain waits for it
        wait(lambda: 1 not in pre.prefill.rooms, 8)        # cleared by the progress thread once the write ended
        assert pre.drained
        assert [e for e in pre.events() if e.room == 1] == []   # nothing of it reported after it was let go
        sender.clear_when_safe()                           # again: nothing to do, no error
        wait(lambda: receiver.poll() == KVPoll.Failed, 8)
        wait(lambda: receiver.safe_to_reuse, 8)
        again = pre.sender(1)                              # the room number is free again
        assert again.poll() == KVPoll.Bootstrapping
    finally:
        pre.close()
        dec.close()


def test_a_prefill_room_that_is_over_is_cleared_at_once() -> None:
    pre, dec = hand_pair()
    try:
        sender, receiver = pre.sender(2), dec.receiver(2, "inst")
        receiver.send_metadata({"kv": np.array([5])})
        for _ in range(200):
            pre.progress()
            dec.progress()
        sender.send(np.array([6]), last=True)
        for _ in range(200):
            pre.progress()
            dec.progress()
        assert sender.poll() == KVPoll.Success and receiver.poll() == KVPoll.Success
        sender.clear_when_safe()
        receiver.clear_when_safe()
        assert pre.prefill is not None and dec.decode is not None
        assert 2 not in pre.prefill.rooms and 2 not in dec.decode.rooms
    finally:
        pre.close()
        dec.close()


def test_a_decode_room_let_go_while_fencing_frees_its_staging_once_safe() -> None:
    """Receiver.clear() before the room is safe keeps its staging reservations for good (a write may still land);
    clear_when_safe() keeps the room until its writer confirmed quiescence, then frees them."""
    config = AgentConfig(staging="always", staging_bytes=1 << 20, peer_timeout_s=30.0, heartbeat_interval_s=0.5)
    pre, dec = hand_pair(config)              # driven by hand: the prefill answers only when we let it
    try:
        staging = dec.staging
        assert staging is not None
        free = staging.free_bytes
        pre.sender(3)
        receiver = dec.receiver(3, "inst")
        receiver.send_metadata({"kv": np.array([1, 2, 3])})
        for _ in range(50):
            dec.progress()
        assert staging.free_bytes < free, "the room reserved no staging: the test proves nothing"
        receiver.abort("request cancelled")
        receiver.clear_when_safe()
        for _ in range(50):                   # the prefill is not progressed: no confirmation, still fencing
            dec.progress()
        assert dec.decode is not None
        with dec.context.lock:
            assert 3 in dec.decode.rooms and not dec.decode.safe_to_reuse(3)
        assert staging.free_bytes < free and not dec.drained
        deadline = time.monotonic() + 10
        while 3 in dec.decode.rooms and time.monotonic() < deadline:
            pre.progress()
            dec.progress()
        assert 3 not in dec.decode.rooms, "the let-go room was never cleared"
        assert staging.free_bytes == free, "its staging reservations were kept"
        assert dec.drained and [e for e in dec.events() if e.room == 3] == []
    finally:
        pre.close()
        dec.close()

"""Frames are actions: a protocol handler queues them under the agent lock and they leave when the outermost holder
releases it (``kvbridge.agent.actions``), in queue order across threads; the event's instant is read once per
outermost hold. And, on whole transfers, no frame of any rank is handed to its link while that rank's lock is held."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from test_agent import check, fill, kv_buffers, kv_layout, spin, start_room, wait

from kvbridge.agent import TransferAgent
from kvbridge.agent.actions import AgentLock
from kvbridge.links import LocalHub, LocalLink
from kvbridge.protocol.wire import KVPoll, Role


def _lock(sent: list[tuple[str, bytes, str]], ticks: list[float] | None = None) -> AgentLock:
    clock = iter(ticks or [float(i) for i in range(1000)]).__next__
    return AgentLock(clock=clock, deliver=lambda a, f, w: sent.append((a, f, w)))


def test_frames_queued_under_the_lock_leave_in_order_at_the_outermost_release() -> None:
    sent: list[tuple[str, bytes, str]] = []
    lock = _lock(sent, [10.0, 20.0])
    with lock:
        lock.send("a", b"1", "first")
        with lock:                              # a handler calling another under the same hold
            lock.send("b", b"2", "second")
            assert lock.now == 10.0             # one instant per outermost hold
        assert sent == [] and lock.queued == 2
        lock.send("a", b"3", "third")
    assert [f for _, f, _ in sent] == [b"1", b"2", b"3"] and not lock.held_here()
    with lock:
        assert lock.now == 20.0
    lock.send("c", b"4", "outside")             # not held: sent at once
    assert sent[-1] == ("c", b"4", "outside")


def test_a_slow_send_keeps_the_order_across_threads_and_does_not_hold_the_lock() -> None:
    """Thread A's frames are being sent slowly after it released the lock; thread B takes the lock meanwhile (not
    blocked by A's socket) and queues its own, which leave only after A's: the peer sees the order of the holds."""
    sent: list[bytes] = []
    slow = threading.Event()

    def deliver(address: str, frame: bytes, what: str) -> None:
        if frame == b"A1":
            slow.wait(5)
        sent.append(frame)

    lock = AgentLock(clock=time.monotonic, deliver=deliver)

    def a() -> None:
        with lock:
            lock.send("x", b"A1", "a")
            lock.send("x", b"A2", "a")

    ta = threading.Thread(target=a)
    ta.start()
    time.sleep(0.05)                            # A released the lock and is stuck in its first send
    took = threading.Event()

    def b() -> None:
        with lock:
            took.set()
            lock.send("x", b"B1", "b")

    tb = threading.Thread(target=b)
    tb.start()
    assert took.wait(5), "the agent lock was held during a send"
    time.sleep(0.05)
    assert sent == []                           # B's frame waits behind A's
    slow.set()
    ta.join(5)
    tb.join(5)
    assert sent == [b"A1", b"A2", b"B1"]


class _WatchedLink:
    """An in-process link that records every frame handed to it while its agent's lock was held."""

    def __init__(self, inner: LocalLink, under_lock: list[str]) -> None:
        self._inner, self._under_lock = inner, under_lock
        self.agent: TransferAgent | None = None

    def send(self, address: str, frame: bytes) -> None:
        if self.agent is not None and self.agent.context.lock.held_here():
            self._under_lock.append(f"{self.agent.name} -> {address}")
        self._inner.send(address, frame)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_no_rank_hands_a_frame_to_its_link_while_holding_its_lock() -> None:
    """Handshake, a TP 2 -> 1 room byte-exact, an abort and goodbyes, hand-driven and threaded: every frame left
    outside the sending rank's lock (the heartbeat thread never takes it)."""
    hub = LocalHub()
    under: list[str] = []
    agents: list[TransferAgent] = []

    def make(role: Role, tp: int, rank: int, address: str, **kw: Any) -> TransferAgent:
        link = _WatchedLink(hub.link(address), under)
        agent = TransferAgent(layout=kv_layout(tp, rank), buffers={"kv": kv_buffers(kv_layout(tp, rank))}, role=role,
                              link=link, name=address, **kw)   # type: ignore[arg-type]
        link.agent = agent
        agents.append(agent)
        return agent

    try:
        pre = [make(Role.PREFILL, 2, r, f"p{r}", instance="inst") for r in range(2)]
        dec = make(Role.DECODE, 1, 0, "d0")
        for agent in pre:
            agent.start()
        dec.start()
        dec.connect("inst", timeout_s=10)

        class _Pair:                    # what test_agent's helpers read
            prefill, decode = pre, [dec]
            src = [[b for b in a.buffers.views["kv"]] for a in pre]
            dst = [[b for b in dec.buffers.views["kv"]]]

        pages, positions = np.array([3, 1, 4]), np.arange(3)
        fill(_Pair, 2, 7, pages, positions)   # type: ignore[arg-type]
        senders, receivers = start_room(_Pair, 41, np.array([5, 9, 2]))   # type: ignore[arg-type]
        for s in senders:
            s.send(pages, last=True)
        wait(lambda: receivers[0].poll() == KVPoll.Success and all(s.poll() == KVPoll.Success for s in senders))
        check(_Pair, 1, 7, np.array([5, 9, 2]), positions)   # type: ignore[arg-type]
        aborted = dec.receiver(42, "inst")
        aborted.send_metadata({"kv": np.array([6])})
        aborted.abort("the engine dropped the request")
        wait(lambda: aborted.poll() == KVPoll.Failed)
        spin(*agents, steps=5)
    finally:
        for agent in agents:
            agent.close()
    assert under == [], under[:5]

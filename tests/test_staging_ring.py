"""Staging rings: a decode whose staging area cannot hold a request's slice reserves a ring of a few pieces,
and the prefill reuses its slots as credits come back. Byte-exact against the independent reference over
loopback and NIXL, for equal and different TP sizes, several chunks and layer-wise sends; a prefill that
writes into a slot whose scatter has not finished fails the room instead of corrupting it; duplicate,
stale and foreign credits change nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_staging_paths import BACKENDS, LAYERS, POOL, World, check, fill, run_room, wait, worlds

from kvbridge.agent import AgentConfig
from kvbridge.agent import decode as decode_module
from kvbridge.agent.send_room import StagingRing
from kvbridge.protocol.wire import Credit, KVPoll
from kvbridge.testkit import reference as ref

PIECE = 16 << 10
PREFILL = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=PIECE)
# 20 pages x 2 x 4 layers x 4 KiB = 640 KiB at TP 1 never fit 160 KiB: the decode reserves a ring of 4 pieces
DECODE = AgentConfig(staging="always", staging_bytes=160 << 10, staging_piece_bytes=PIECE)

make_world = pytest.fixture(worlds, name="make_world")


def _rings_of(world: World, room: int) -> list[dict[Any, tuple[int, int, Any]]]:
    return [dict(d.decode.rooms[room].staged) for d in world.decode]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.HEAD_MAJOR, 1, 2)])
def test_a_ring_smaller_than_the_request_is_byte_exact(make_world: Callable[..., World], backend: str, kind: str,
                                                      pt: int, dt: int) -> None:
    world = make_world(backend, kind, pt, dt, prefill=PREFILL, decode=DECODE, layers=LAYERS + 1)
    rng = np.random.default_rng(pt * 10 + dt)
    src_pages, dst_pages = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    senders, receivers, reserved = run_room(world, 21, src_pages, dst_pages, [7, 13])
    for res in reserved:
        assert res, "nothing was staged"
        for (_rank, _comp), (_offset, nbytes, plan) in res.items():
            whole = plan.per_item * len(dst_pages)
            assert nbytes < whole and nbytes <= 4 * PIECE, (nbytes, whole)   # a ring, not the slice
    pieces = sum(s.stats[1] for s in senders)
    assert pieces > 4 * len(world.decode), pieces                           # slots were reused
    for rc in receivers:
        rc.clear()
    for s in senders:
        s.clear()
    for agent in world.decode + world.prefill:
        assert agent.staging is not None and agent.staging.free_bytes == agent.config.staging_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_layerwise_sends_through_a_ring(make_world: Callable[..., World], backend: str) -> None:
    world = make_world(backend, ref.TOKEN_MAJOR, 2, 1, prefill=PREFILL, decode=DECODE, layers=LAYERS + 1)
    layers = LAYERS + 1
    rng = np.random.default_rng(9)
    src_pages, dst_pages = rng.permutation(POOL)[:24], rng.permutation(POOL)[:24]
    fill(world, 11, src_pages)
    receiver = world.decode[0].receiver(22, "inst")
    receiver.send_metadata({"kv": dst_pages})
    senders = [a.sender(22) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    assert world.decode[0].decode.rooms[22].rings
    for s in senders:
        for lo, hi in ((0, 10), (10, 24)):
            for layer in range(layers):
                s.send(src_pages[lo:hi], last=hi == 24 and layer == layers - 1, layers=range(layer, layer + 1))
    wait(lambda: receiver.poll() == KVPoll.Success, 60)
    wait(lambda: all(s.safe_to_reuse for s in senders), 60)
    check(world, 11, dst_pages)


class _Stuck:
    """A scatter 'on the device' that has not finished (the test releases it)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_prefill_writing_into_a_busy_slot_fails_the_room(make_world: Callable[..., World],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's first scatter has not finished (so no credit went back); a prefill that ignores credits
    writes its next piece into the same slot: the decode fails the room rather than scatter a slot that
    was overwritten under it."""
    stuck: list[_Stuck] = []
    real = decode_module.DecodeSide._scatter

    def slow(self: Any, room: Any, notice: Any, layers: range) -> Any:
        work = real(self, room, notice, layers)

        def run() -> Any:
            work()                                # the bytes move now; the 'event' says not yet
            stuck.append(_Stuck())
            return stuck[-1], []

        return run

    def greedy(self: StagingRing, chunk: int) -> int:
        return 0                                  # every piece into slot 0, credits or not

    monkeypatch.setattr(decode_module.DecodeSide, "_scatter", slow)
    monkeypatch.setattr(StagingRing, "take", greedy)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=DECODE, layers=LAYERS + 1)
    rng = np.random.default_rng(2)
    src_pages, dst_pages = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill(world, 3, src_pages)
    receiver = world.decode[0].receiver(23, "inst")
    receiver.send_metadata({"kv": dst_pages})
    sender = world.prefill[0].sender(23)
    wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
    sender.send(src_pages, last=True)
    wait(lambda: receiver.poll() == KVPoll.Failed)
    assert "ring slot" in receiver.failure_reason and "no credit" in receiver.failure_reason
    for s in stuck:
        s.done = True
    wait(lambda: sender.safe_to_reuse and receiver.safe_to_reuse, 30)


def test_duplicate_stale_and_foreign_credits_change_nothing(make_world: Callable[..., World]) -> None:
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=DECODE, layers=LAYERS + 1)
    pre, dec = world.prefill[0], world.decode[0]
    rng = np.random.default_rng(4)
    src_pages, dst_pages = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill(world, 5, src_pages)
    receiver = dec.receiver(24, "inst")
    receiver.send_metadata({"kv": dst_pages})
    sender = pre.sender(24)
    wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
    # before anything was sent: credits for pieces no slot holds (stale, or from a confused peer)
    for chunk in (0, 1, 99):
        for _ in range(2):
            dec.context.post(pre.link.address, Credit(room=24, agent=dec.name, component="kv", chunk=chunk),
                             incarnation=pre.incarnation)
    rejected = pre.rejected_frames
    # a credit naming another decode agent than its sender is dropped
    dec.context.post(pre.link.address, Credit(room=24, agent="decode-impostor", component="kv", chunk=0),
                     incarnation=pre.incarnation)
    wait(lambda: pre.rejected_frames > rejected)
    # a decode rank has no ring to credit: a credit sent to it is refused, the room goes on
    rejected = dec.rejected_frames
    pre.context.post(dec.link.address, Credit(room=24, agent=pre.name, component="kv", chunk=0),
                     incarnation=dec.incarnation)
    wait(lambda: dec.rejected_frames > rejected)
    sender.send(src_pages, last=True)
    wait(lambda: receiver.poll() == KVPoll.Success, 60)
    wait(lambda: sender.safe_to_reuse, 30)
    check(world, 5, dst_pages)
    ring = pre.prefill.rooms[24].rings[(dec.name, "kv")]
    # every slot comes back exactly once: the last credits may still be on their way when the prefill's writes are
    # done (its pages are safe once staged; the ring's slots are the decode's to give back)
    wait(lambda: ring.slots == [None] * len(ring.slots), 10)
    time.sleep(0.05)

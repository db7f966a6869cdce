"""Adversarial: credits and slot reuse (guarantees 2 and 3).

A slot may be written again only once the decode scattered the piece in it. Credits are authenticated like
every frame, name the request (``TransferRequest.nonce``) as well as the room, and a replayed credit of an
earlier request that used the same room number frees nothing: those cases must deliver the right bytes.

A peer that breaks the credit protocol itself (a prefill that ignores credits, ``StagingRing.take`` patched;
a decode that sends a credit before its scatter) is a bug, not a fault: on host memory the decode scatters a
piece when its notice is handled, so a slot overwritten before that is invisible to it, and only checksums
(``AgentConfig.checksums``) catch the wrong bytes. Those tests run with checksums and require a failed room
naming the mismatch (docs/integrity.md says so). On CUDA a write into a slot whose scatter is still queued fails
the room without checksums (tests/test_staging_ring.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_staging_paths import POOL, World, worlds
from test_staging_ring_bytes import fill_random, open_rooms, verify, wait

from kvbridge.agent import AgentConfig
from kvbridge.agent import decode as decode_module
from kvbridge.agent.send_room import StagingRing
from kvbridge.protocol.wire import Credit, KVPoll
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(worlds, name="make_world")
PIECE = 16 << 10
# no peer dies in these tests: a peer timeout a loaded CI host cannot reach (3 s was reached, failing a room)
_LIVE = {"heartbeat_interval_s": 0.5, "peer_timeout_s": 30.0}
PREFILL = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=PIECE, **_LIVE)
DECODE = AgentConfig(staging="always", staging_bytes=160 << 10, staging_piece_bytes=PIECE, **_LIVE)
DECODE_SUMS = AgentConfig(staging="always", staging_bytes=160 << 10, staging_piece_bytes=PIECE, checksums=True,
                          **_LIVE)


def _outcome(receiver: Any, timeout_s: float = 20.0) -> KVPoll:
    wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), timeout_s, "an outcome")
    return receiver.poll()


def _wrong_pages(world: World, src: np.ndarray, dst: np.ndarray) -> str | None:
    try:
        verify(world, src, dst)
    except AssertionError as exc:
        return str(exc)
    return None


def _no_silent_corruption(world: World, receiver: Any, src: np.ndarray, dst: np.ndarray) -> None:
    state = _outcome(receiver)
    wrong = _wrong_pages(world, src, dst)
    if state is KVPoll.Success:
        assert wrong is None, f"decode reported Success but {wrong}"
    else:
        assert receiver.failure_reason, "failed without a reason"
    if world.decode[0].config.checksums and wrong is not None:
        assert state is KVPoll.Failed and "checksum mismatch" in receiver.failure_reason, receiver.failure_reason


# ---------------------------------------------------------------- guarantee 3: a prefill ignoring credits
@pytest.mark.parametrize("decode_config", [DECODE_SUMS], ids=["checksums"])
def test_host_prefill_ignoring_credits_never_yields_success_with_wrong_bytes(
        make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch, decode_config: AgentConfig) -> None:
    """Host memory (the decode scatters synchronously when a notice comes, so nothing is ever in
    ``RecvRoom.scattering``): a prefill that puts every piece into slot 0 overwrites piece k with piece k+1
    before the decode read it. The existing test covers only a scatter queued on a CUDA stream."""
    monkeypatch.setattr(StagingRing, "take", lambda self, chunk: 0)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=decode_config, layers=4)
    rng = np.random.default_rng(2)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 3, src)
    senders, receivers = open_rooms(world, 51, dst)
    assert world.decode[0].decode.rooms[51].rings
    senders[0].send(src, last=True)
    _no_silent_corruption(world, receivers[0], src, dst)


@pytest.mark.parametrize("decode_config", [DECODE_SUMS], ids=["checksums"])
def test_host_prefill_reusing_a_slot_before_its_credit_with_late_notices(
        make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch, decode_config: AgentConfig) -> None:
    """Subtler: the prefill honours the ring's bookkeeping for all but one slot and reuses slot 0 for the
    piece right after the one in it (the pieces in the other slots are right)."""
    calls = {"n": 0}
    real_take = StagingRing.take

    def sloppy(self: StagingRing, chunk: int) -> int | None:
        calls["n"] += 1
        if calls["n"] == 2:
            return 0                                  # the second piece lands on the first, no credit yet
        return real_take(self, chunk)

    monkeypatch.setattr(StagingRing, "take", sloppy)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=decode_config, layers=4)
    rng = np.random.default_rng(12)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 13, src)
    senders, receivers = open_rooms(world, 52, dst)
    senders[0].send(src, last=True)
    _no_silent_corruption(world, receivers[0], src, dst)


# ---------------------------------------------------------------- guarantee 2: credits the decode never sent
def _hold_staged_notices(monkeypatch: pytest.MonkeyPatch, world: World, room: int,
                         forge: Callable[[Any], None], hold_s: float = 0.3) -> list[int]:
    """Before the decode handles each of the first staged notices of ``room``, call ``forge(notice)`` (it
    sends a credit the decode has not earned) and give the prefill ``hold_s`` to act on it."""
    real = decode_module.DecodeSide.on_notice
    held: list[int] = []

    def on_notice(self: Any, notice: Any, env: Any) -> None:
        if notice.room == room and notice.staged and len(held) < 4 and notice.chunk not in held:
            held.append(notice.chunk)
            forge(notice)
            time.sleep(hold_s)        # the prefill handles the credit and writes the next piece meanwhile
        real(self, notice, env)

    monkeypatch.setattr(decode_module.DecodeSide, "on_notice", on_notice)
    return held


@pytest.mark.parametrize("decode_config, nonce", [(DECODE, "wrong"), (DECODE_SUMS, "right")],
                         ids=["wrong-nonce", "decode-bug-checksums"])
def test_an_early_credit_never_yields_success_with_wrong_bytes(
        make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch, decode_config: AgentConfig,
        nonce: str) -> None:
    """A credit for piece k that arrives before the decode scattered piece k, from the decode's own identity:
    without the request's nonce (forged, or of another request) it frees nothing and the bytes are right;
    with it (a decode that credits before its scatter) the checksums fail the room."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=decode_config, layers=4)
    pre, dec = world.prefill[0], world.decode[0]

    def forge(notice: Any) -> None:
        real = dec.decode.rooms[notice.room].nonce
        dec.context.post(pre.link.address, Credit(room=notice.room, agent=dec.name, component=notice.component,
                                                  chunk=notice.chunk, nonce=real if nonce == "right" else real ^ 1),
                         incarnation=pre.incarnation)

    held = _hold_staged_notices(monkeypatch, world, 53, forge)
    rng = np.random.default_rng(22)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 23, src)
    senders, receivers = open_rooms(world, 53, dst)
    senders[0].send(src, last=True)
    _no_silent_corruption(world, receivers[0], src, dst)
    assert held
    if nonce == "wrong":
        assert receivers[0].poll() is KVPoll.Success, receivers[0].failure_reason


def test_a_replayed_credit_of_an_earlier_room_with_the_same_id(make_world: Callable[..., World],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Room 54 runs to success; its credits (re-sent with fresh envelopes, as a delayed copy would be) reach
    the prefill while room 54 is reused for another request."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PREFILL, decode=DECODE, layers=4)
    pre, dec = world.prefill[0], world.decode[0]
    sent: list[Credit] = []
    real_credit = decode_module.DecodeSide._credit

    def spy(self: Any, room: Any, notice: Any) -> None:
        sent.append(Credit(room=room.room, agent=dec.name, component=notice.component, chunk=notice.chunk,
                           nonce=room.nonce))
        real_credit(self, room, notice)

    monkeypatch.setattr(decode_module.DecodeSide, "_credit", spy)
    rng = np.random.default_rng(32)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 33, src)
    senders, receivers = open_rooms(world, 54, dst)
    senders[0].send(src, last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success and senders[0].safe_to_reuse)
    verify(world, src, dst)
    receivers[0].clear()
    senders[0].clear()
    old = list(sent)
    assert old
    for d in world.dst[0]:
        d[:] = 0

    def forge(notice: Any) -> None:
        for c in old:
            if c.chunk == notice.chunk:
                dec.context.post(pre.link.address, c, incarnation=pre.incarnation)

    _hold_staged_notices(monkeypatch, world, 54, forge)
    src2, dst2 = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 34, src2)
    senders, receivers = open_rooms(world, 54, dst2)
    senders[0].send(src2, last=True)
    _no_silent_corruption(world, receivers[0], src2, dst2)
    assert receivers[0].poll() is KVPoll.Success, receivers[0].failure_reason


def test_unknown_rooms_components_chunks_and_floods_are_harmless(make_world: Callable[..., World]) -> None:
    """Credits for unknown rooms, components and chunks, negative and huge numbers, duplicates, sent
    while a ring is in use: the room still succeeds byte-exact, and both agents' threads live on."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=PREFILL, decode=DECODE, layers=4)
    dec = world.decode[0]
    rng = np.random.default_rng(42)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(world, 43, src)
    senders, receivers = open_rooms(world, 55, dst)
    stop = threading.Event()
    errors: list[BaseException] = []

    def flood() -> None:
        junk = [(55, "nope", 0), (55, "kv", 10**9), (55, "kv", -1), (99, "kv", 0), (2**62, "kv", 0),
                (55, "", 3), (55, "kv", 2**63 - 1)]
        n = 0
        try:
            while not stop.is_set() and n < 3000:
                room, comp, chunk = junk[n % len(junk)]
                for pre in world.prefill:
                    dec.context.post(pre.link.address, Credit(room=room, agent=dec.name, component=comp,
                                                              chunk=chunk), incarnation=pre.incarnation)
                n += 1
                if n % 50 == 0:
                    time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        for s in senders:
            s.send(src[:9], last=False)
            s.send(src[9:], last=True)
        wait(lambda: receivers[0].poll() in (KVPoll.Success, KVPoll.Failed), 30)
    finally:
        stop.set()
        t.join(10)
    assert receivers[0].poll() == KVPoll.Success, receivers[0].failure_reason
    wait(lambda: all(s.safe_to_reuse for s in senders))
    verify(world, src, dst)
    assert not errors, errors
    for agent in world.prefill + world.decode:
        assert agent._thread is not None and agent._thread.is_alive(), f"{agent.name}'s progress thread died"
    # the agents still work: another room through the same rings
    for d in world.dst[0]:
        d[:] = 0
    src2, dst2 = rng.permutation(POOL)[:10], rng.permutation(POOL)[:10]
    fill_random(world, 44, src2)
    senders, receivers = open_rooms(world, 56, dst2)
    for s in senders:
        s.send(src2, last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success, 30)
    verify(world, src2, dst2)

"""Adversarial: rings across failures (guarantees 4, 5 and 6).

* safe_to_reuse on the decode: after a failed (aborted) or successful room, nothing more lands in its
  destination pages or its staging slots, even when credits it withheld arrive late, and the area it
  frees serves the next room byte-exact;
* a decode that closes, dies or aborts mid-ring: the prefill's room fails within the peer timeout, its
  staging area is handed back, its threads live and a later room works;
* bad reservation sizes from a decode (zero, negative, smaller than one item of one layer, larger than its
  registered staging area): refused with a clear error or plain descriptors, never a write outside
  registered memory (the decode's staging area sits between guard bytes here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from test_staging_paths import POOL, World, layout_of
from test_staging_ring_bytes import fill_random, open_rooms, verify, wait

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent import decode as decode_module
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.testkit import reference as ref

PIECE = 16 << 10
GUARD = 64 << 10
TIMING = dict(heartbeat_interval_s=0.1, peer_timeout_s=1.0, waiting_timeout_s=4.0, bootstrap_timeout_s=10.0)
PREFILL = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=PIECE, **TIMING)
DECODE = AgentConfig(staging="always", staging_bytes=160 << 10, staging_piece_bytes=PIECE, **TIMING)


@dataclass
class Rig(World):
    hub: Any = None
    registry: Any = None
    guards: list[np.ndarray] = field(default_factory=list)     # decode staging areas with guard bytes around

    def add_decode(self, config: AgentConfig = DECODE, rank: int = 0, replace: bool = False) -> TransferAgent:
        n = len(self.extra) + len(self.decode)
        dst = [np.zeros((g.num_items, g.item_nbytes), np.uint8)
               for g in layout_of(self.kind, self.dt, rank, self.layers).components[0].buffers]
        whole = np.full(config.staging_bytes + 2 * GUARD, 0xA5, np.uint8)
        whole[GUARD: GUARD + config.staging_bytes] = 0
        self.guards.append(whole)
        agent = TransferAgent(layout=layout_of(self.kind, self.dt, rank, self.layers), buffers={"kv": dst},
                              role=Role.DECODE, backend="loopback", registry=self.registry,
                              link=self.hub.link(f"d{n}"), config=config,
                              staging=whole[GUARD: GUARD + config.staging_bytes])
        agent.start()
        agent.connect("inst", timeout_s=30)
        if replace:
            self.extra.append(self.decode[rank])
            self.decode[rank], self.dst[rank] = agent, dst
        else:
            self.decode.append(agent)
            self.dst.append(dst)
        return agent

    def guards_intact(self) -> None:
        for whole in self.guards:
            assert (whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all(), \
                "bytes outside a decode's registered staging area changed"


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(pt: int = 1, layers: int = 4, prefill: AgentConfig = PREFILL, decode: AgentConfig = DECODE) -> Rig:
        hub, registry = LocalHub(), Registry.build()
        src = [[np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout_of(ref.TOKEN_MAJOR, pt, r, layers)
                .components[0].buffers] for r in range(pt)]
        pre = [TransferAgent(layout=layout_of(ref.TOKEN_MAJOR, pt, r, layers), buffers={"kv": src[r]},
                             role=Role.PREFILL, backend="loopback", registry=registry, link=hub.link(f"p{r}"),
                             instance="inst", config=prefill) for r in range(pt)]
        r = Rig(ref.TOKEN_MAJOR, pt, 1, pre, [], src, [], layers, hub=hub, registry=registry)
        made.append(r)
        for a in pre:
            a.start()
        r.add_decode(decode)
        return r

    yield make
    for r in made:
        for agent in r.prefill + r.decode + r.extra:
            agent.close()


def withhold_credits(monkeypatch: pytest.MonkeyPatch, rooms: set[int]) -> list[tuple[Any, Any, Any]]:
    """The decode scatters but sends no credit for ``rooms`` (kept to be sent late)."""
    real = decode_module.DecodeSide._credit
    kept: list[tuple[Any, Any, Any]] = []

    def hold(self: Any, room: Any, notice: Any) -> None:
        if room.room in rooms:
            kept.append((self, room, notice))
            return
        real(self, room, notice)

    monkeypatch.setattr(decode_module.DecodeSide, "_credit", hold)
    return kept


_REAL_CREDIT = decode_module.DecodeSide._credit


def send_late(kept: list[tuple[Any, Any, Any]]) -> None:
    """Send the credits ``kept`` now (the real ``_credit``, whatever is patched)."""
    for side, room, notice in kept:
        with side._ctx.lock:
            _REAL_CREDIT(side, room, notice)


def ring_full(pre: TransferAgent, room: int) -> bool:
    with pre.context.lock:
        state = pre.prefill.rooms.get(room)
        return bool(state and state.pending and state.rings
                    and all(s is not None for ring in state.rings.values() for s in ring.slots))


def snapshot(r: Rig, dec: TransferAgent) -> tuple[list[np.ndarray], np.ndarray]:
    idx = r.decode.index(dec) if dec in r.decode else None
    bufs = [b.copy() for b in r.dst[idx]] if idx is not None else []
    return bufs, dec.staging.array.copy()


def threads_alive(*agents: TransferAgent) -> None:
    for a in agents:
        assert a._thread is not None and a._thread.is_alive(), f"{a.name}'s progress thread died"


# ---------------------------------------------------------------- guarantee 4 and 5: abort mid-ring
@pytest.mark.parametrize("pt", [1, 2])
def test_abort_mid_ring_then_nothing_lands_and_the_area_serves_the_next_room(
        rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, pt: int) -> None:
    r = rig(pt)
    dec = r.decode[0]
    kept = withhold_credits(monkeypatch, {61})
    rng = np.random.default_rng(61)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 1, src)
    senders, receivers = open_rooms(r, 61, dst)
    assert dec.decode.rooms[61].rings
    for s in senders:
        s.send(src, last=True)
    wait(lambda: all(ring_full(p, 61) for p in r.prefill), 10, "every ring slot taken, pieces waiting")
    t0 = time.monotonic()
    receivers[0].abort("engine gave up")
    wait(lambda: receivers[0].safe_to_reuse, 10, "decode safe_to_reuse after abort")
    wait(lambda: all(s.poll() == KVPoll.Failed and s.safe_to_reuse for s in senders), 10, "prefill failed, drained")
    assert time.monotonic() - t0 < 3
    before = snapshot(r, dec)
    send_late(kept)                               # the credits the decode withheld arrive after all
    time.sleep(0.3)
    after = snapshot(r, dec)
    for a, b in zip(before[0], after[0]):
        assert np.array_equal(a, b), "a destination page changed after safe_to_reuse"
    assert np.array_equal(before[1], after[1]), "the staging area changed after safe_to_reuse"
    for p in r.prefill:
        assert p.staging.free_bytes == p.config.staging_bytes, "prefill staging not handed back"
    receivers[0].clear()
    for s in senders:
        s.clear()
    assert dec.staging.free_bytes == dec.config.staging_bytes
    # the next room over the same area and the same pages
    for b in r.dst[0]:
        b[:] = 0
    src2 = rng.permutation(POOL)[:20]
    fill_random(r, 2, src2)
    senders, receivers = open_rooms(r, 62, dst)
    for s in senders:
        s.send(src2[:8], last=False)
        s.send(src2[8:], last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success, 30, "next room")
    verify(r, src2, dst)
    threads_alive(*r.prefill, dec)
    r.guards_intact()


def test_success_then_late_duplicate_credits_change_nothing(rig: Callable[..., Rig]) -> None:
    """After Success (safe_to_reuse at once), the room's pages and slots stay as they are although the
    decode's credits for it are sent again."""
    r = rig(1)
    dec = r.decode[0]
    sent: list[tuple[Any, Any, Any]] = []

    rng = np.random.default_rng(63)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 3, src)
    senders, receivers = open_rooms(r, 63, dst)
    senders[0].send(src, last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success, 20)
    assert receivers[0].safe_to_reuse
    verify(r, src, dst)
    before = snapshot(r, dec)
    state = dec.decode.rooms[63]
    from kvbridge.protocol.wire import Notice
    for chunk in range(40):
        sent.append((dec.decode, state, Notice(room=63, sender=0, component="kv", chunk=chunk, last=False)))
    send_late(sent)
    time.sleep(0.3)
    after = snapshot(r, dec)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0]))
    assert np.array_equal(before[1], after[1])
    threads_alive(r.prefill[0], dec)


# ---------------------------------------------------------------- guarantee 5: the decode goes away mid-ring
@pytest.mark.parametrize("how", ["close", "kill"])
def test_decode_gone_mid_ring_fails_the_prefill_room_in_time_and_frees_its_staging(
        rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    r = rig(2)
    dec = r.decode[0]
    withhold_credits(monkeypatch, {64})
    rng = np.random.default_rng(64)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 4, src)
    senders, _ = open_rooms(r, 64, dst)
    for s in senders:
        s.send(src, last=True)
    wait(lambda: all(ring_full(p, 64) for p in r.prefill), 10, "every ring slot taken")
    t0 = time.monotonic()
    if how == "close":
        dec.close()
    else:
        dec._stop.set()
        dec._thread.join(timeout=5)
        dec.link.close()
    limit = PREFILL.peer_timeout_s * 3 + 1.0
    wait(lambda: all(s.poll() == KVPoll.Failed for s in senders), limit, "prefill room failed")
    took = time.monotonic() - t0
    wait(lambda: all(s.safe_to_reuse for s in senders), 5, "prefill drained")
    for p in r.prefill:
        wait(lambda p=p: p.staging.free_bytes == p.config.staging_bytes, 5, "prefill staging freed")
    assert took <= limit
    reasons = [s.failure_reason for s in senders]
    assert all(reasons), reasons
    for s in senders:
        s.clear()
    threads_alive(*r.prefill)
    # a new decode agent: later rooms work through fresh rings
    d2 = r.add_decode(replace=True)
    src2, dst2 = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 5, src2)
    senders, receivers = open_rooms(r, 65, dst2)
    assert d2.decode.rooms[65].rings
    for s in senders:
        s.send(src2, last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success, 30, "a later room")
    verify(r, src2, dst2)
    threads_alive(*r.prefill, d2)


# ---------------------------------------------------------------- guarantee 6: bad reservation sizes
def _lie(monkeypatch: pytest.MonkeyPatch, room: int, value: Callable[[int], int]) -> None:
    """The decode's request for ``room`` names ``value(real)`` as every ring's size (its own records keep
    the real reservation)."""
    real = decode_module.TransferRequest

    def forged(**kw: Any) -> Any:
        if kw["room"] == room:
            sizes = kw["staging_bytes"]
            if not sizes:                        # the decode reserved the whole slice: claim a ring anyway
                sizes = {c: {rank: 0 for rank in ranks} for c, ranks in kw["staging"].items()}
            kw["staging_bytes"] = {c: {rank: value(n) for rank, n in ranks.items()} for c, ranks in sizes.items()}
        return real(**kw)

    monkeypatch.setattr(decode_module, "TransferRequest", forged)


LAYER_ITEM = 8192      # bytes of one item of one layer (K and V, 4 KiB each) at TP 1


@pytest.mark.parametrize("name, value", [
    ("zero", lambda n: 0),
    ("negative", lambda n: -4096),
    ("one byte", lambda n: 1),
    ("less than one item of one layer", lambda n: LAYER_ITEM - 1),
    ("exactly one item of one layer", lambda n: LAYER_ITEM),
    ("past the registered area", lambda n: n + (1 << 20)),
    ("huge", lambda n: 1 << 33),
])
def test_bad_ring_sizes_are_refused_or_fall_back(rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch,
                                                 name: str, value: Callable[[int], int]) -> None:
    r = rig(1)
    dec = r.decode[0]
    _lie(monkeypatch, 66, value)
    rng = np.random.default_rng(66)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 6, src)
    receivers = [dec.receiver(66, "inst")]
    receivers[0].send_metadata({"kv": dst})
    sender = r.prefill[0].sender(66)
    deadline = time.monotonic() + 10
    while sender.poll() < KVPoll.WaitingForInput and time.monotonic() < deadline:
        time.sleep(0.005)
    if sender.poll() is KVPoll.Failed:
        assert sender.failure_reason
        return                                     # refused: fine
    t0 = time.monotonic()
    try:
        sender.send(src[:11], last=False)
        sender.send(src[11:], last=True)
    except Exception as exc:                       # noqa: BLE001 - refused with an error: fine if clear
        assert str(exc)
    took = time.monotonic() - t0
    wait(lambda: receivers[0].poll() in (KVPoll.Success, KVPoll.Failed), 15, "an outcome")
    state, reason = receivers[0].poll(), receivers[0].failure_reason
    r.guards_intact()
    if state is KVPoll.Success:
        verify(r, src, dst)
    else:
        assert reason
        assert "waiting timeout" not in reason, f"{name}: not refused, the room only timed out: {reason}"
    assert took < 2, f"{name}: send() took {took:.1f} s"
    with r.prefill[0].context.lock:
        rings = r.prefill[0].prefill.rooms[66].rings
        slots = max((len(ring.slots) for ring in rings.values()), default=0)
    assert slots <= 64, f"{name}: the prefill keeps a ring of {slots} slots for a {dec.config.staging_bytes} B area"
    threads_alive(r.prefill[0], dec)


def test_a_ring_size_past_the_staging_area_is_refused_and_harms_no_other_room(rig: Callable[..., Rig],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Room 67's request names a ring larger than the decode's whole staging area (room 68, honest, has its
    ring right after room 67's reservation): the prefill refuses room 67's request, naming the area, and
    writes nothing for it; room 68 ends byte-exact."""
    from test_staging_ring_credits import _hold_staged_notices

    r = rig(1)
    dec = r.decode[0]
    _lie(monkeypatch, 67, lambda n: n + (1 << 20))
    _hold_staged_notices(monkeypatch, r, 68, lambda notice: None, hold_s=0.3)
    rng = np.random.default_rng(67)
    perm_s, perm_d = rng.permutation(POOL), rng.permutation(POOL)
    src_b, dst_b = perm_s[:20], perm_d[:20]
    src_a, dst_a = perm_s[20:40], perm_d[20:40]
    fill_random(r, 7, src_b)
    fill_random(r, 8, src_a)
    receiver_b = dec.receiver(67, "inst")
    receiver_b.send_metadata({"kv": dst_b})                 # reserved first: the lower offset
    sender_b = r.prefill[0].sender(67)
    senders_a, receivers_a = open_rooms(r, 68, dst_a)
    (ob, nb, _), = dec.decode.rooms[67].staged.values()
    (oa, na, _), = dec.decode.rooms[68].staged.values()
    assert ob + nb <= oa, (ob, nb, oa)
    wait(lambda: sender_b.poll() is KVPoll.Failed, 10, "room 67 refused")
    assert "outside the" in sender_b.failure_reason and "staging area" in sender_b.failure_reason, \
        sender_b.failure_reason
    wait(lambda: receiver_b.poll() is KVPoll.Failed, 10, "room 67 failed on the decode")
    senders_a[0].send(src_a, last=True)                     # its notices wait on the decode a moment
    wait(lambda: receivers_a[0].poll() in (KVPoll.Success, KVPoll.Failed), 15, "room 68's outcome")
    assert receivers_a[0].poll() is KVPoll.Success, receivers_a[0].failure_reason
    verify(r, src_a, dst_a, "room 68 (honest): ")
    r.guards_intact()


@pytest.mark.parametrize("after", [0, 2])
def test_staging_refused_by_the_engine_mid_ring_falls_back_and_completes(rig: Callable[..., Rig],
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       after: int) -> None:
    """The engine refuses writes into the decode's staging area (RegionError: e.g. a decode in another
    process whose staging area is private memory) after ``after`` staged pieces: the prefill goes on with
    plain descriptors for that peer, as documented. Pieces already queued for a ring slot go plain too, so
    no credit will ever come for their slots: the room must still complete (not stall until the decode's
    waiting timeout)."""
    from kvbridge.backends.loopback import LoopbackBackend
    from kvbridge.errors import RegionError
    from kvbridge.staging import STAGING

    real = LoopbackBackend.send_component
    staged = {"n": 0}

    def refusing(self: Any, transfer: Any) -> Any:
        if transfer.component == STAGING:
            staged["n"] += 1
            if staged["n"] > after:
                raise RegionError("staging area unreachable (test)")
        return real(self, transfer)

    monkeypatch.setattr(LoopbackBackend, "send_component", refusing)
    r = rig(1)
    rng = np.random.default_rng(69)
    src, dst = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    fill_random(r, 9, src)
    senders, receivers = open_rooms(r, 69, dst)
    assert r.decode[0].decode.rooms[69].rings
    senders[0].send(src, last=True)
    wait(lambda: receivers[0].poll() in (KVPoll.Success, KVPoll.Failed), 8, "an outcome")
    assert receivers[0].poll() is KVPoll.Success, receivers[0].failure_reason
    verify(r, src, dst)

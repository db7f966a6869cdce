"""Adversarial: staging rings deliver every byte to the right place (guarantee 1).

The expected bytes are computed here from the source pools themselves (random bytes, heads re-split by
hand), not by the kit's pattern: a decode page is the concatenation over the prefill ranks' head shards
of the source page, cut again for the decode rank. Rings are made small (two to four slots) so slots are
reused many times; pieces are uneven; several prefill ranks share one decode's area; layer-wise sends
and whole chunks mix; several rooms are in flight at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_staging_paths import HEADS, PAGE, POOL, World, worlds

from kvbridge.agent import AgentConfig
from kvbridge.protocol.wire import KVPoll
from kvbridge.testkit import reference as ref

HB = 16           # bf16 elements per head (HEAD_BYTES 32 / 2): the layouts of test_staging_paths
make_world = pytest.fixture(worlds, name="make_world")


def wait(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.002)


def fill_random(world: World, seed: int, pages: np.ndarray) -> None:
    """Random bytes in ``pages`` of every source buffer of every prefill rank."""
    rng = np.random.default_rng(seed)
    for bufs in world.src:
        for buf in bufs:
            buf[pages] = rng.integers(1, 256, size=(len(pages), buf.shape[1]), dtype=np.uint8)


def _pages4(world: World, buf: np.ndarray, tp: int) -> np.ndarray:
    local = HEADS // tp
    b16 = buf.view(np.uint16)
    if world.kind == ref.TOKEN_MAJOR:
        return b16.reshape(POOL, PAGE, local, HB)
    return b16.reshape(POOL, local, PAGE, HB)


def expected(world: World, b: int, dst_rank: int, src_pages: np.ndarray) -> np.ndarray:
    """Decode rank ``dst_rank``'s view of buffer ``b`` of the source pages (independent reshard)."""
    axis = 2 if world.kind == ref.TOKEN_MAJOR else 1
    full = np.concatenate([_pages4(world, world.src[r][b], world.pt)[src_pages] for r in range(world.pt)], axis=axis)
    local = HEADS // world.dt
    assert list(ref.units_held(HEADS, world.dt, dst_rank)) == list(range(dst_rank * local, (dst_rank + 1) * local))
    sl = [slice(None)] * 4
    sl[axis] = slice(dst_rank * local, (dst_rank + 1) * local)
    return full[tuple(sl)]


def verify(world: World, src_pages: np.ndarray, dst_pages: np.ndarray, what: str = "") -> None:
    for r in range(world.dt):
        for b, buf in enumerate(world.dst[r]):
            got = _pages4(world, buf, world.dt)[dst_pages]
            want = expected(world, b, r, src_pages)
            bad = [int(dst_pages[i]) for i in range(len(dst_pages)) if not np.array_equal(got[i], want[i])]
            assert not bad, f"{what}decode rank {r} buffer {b}: destination pages {bad} differ from the source"


def untouched(world: World, written: np.ndarray) -> None:
    rest = np.setdiff1d(np.arange(POOL), written)
    for r in range(world.dt):
        for b, buf in enumerate(world.dst[r]):
            assert not buf[rest].any(), f"decode rank {r} buffer {b}: bytes outside every request changed"


def open_rooms(world: World, room: int, dst_pages: np.ndarray) -> tuple[list[Any], list[Any]]:
    receivers = [d.receiver(room, "inst") for d in world.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages})
    senders = [a.sender(room) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders), what="requests")
    return senders, receivers


def finish(world: World, senders: list[Any], receivers: list[Any], timeout_s: float = 60.0) -> None:
    def done() -> bool:
        states = [rc.poll() for rc in receivers]
        assert KVPoll.Failed not in states, [rc.failure_reason for rc in receivers]
        return all(s == KVPoll.Success for s in states)
    wait(done, timeout_s, "decode success")
    wait(lambda: all(s.safe_to_reuse for s in senders), timeout_s, "prefill drained")


def ring_slots(world: World, room: int) -> int:
    return sum(len(ring.slots) for p in world.prefill for ring in p.prefill.rooms[room].rings.values())


def staging_back(world: World) -> None:
    for agent in world.decode + world.prefill:
        assert agent.staging is not None
        wait(lambda a=agent: a.staging.free_bytes == a.config.staging_bytes, 10, f"{agent.name} staging freed")


PREFILL = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=20000)   # uneven pieces


@pytest.mark.parametrize("kind, pt, dt, dec_bytes, piece, splits, layers", [
    (ref.TOKEN_MAJOR, 1, 1, 32 << 10, 20000, [7, 13], 4),       # a ring of two 16 KiB slots
    (ref.TOKEN_MAJOR, 2, 1, 48 << 10, 10000, [3, 11], 3),       # two prefill ranks share the area
    (ref.TOKEN_MAJOR, 4, 1, 64 << 10, 5000, [5], 3),            # four ranks, 1 KiB runs
    (ref.HEAD_MAJOR, 2, 1, 40 << 10, 12345, [1, 2, 9], 4),
    (ref.HEAD_MAJOR, 1, 2, 24 << 10, 7777, [6], 3),             # one prefill, two decode agents
    (ref.TOKEN_MAJOR, 2, 2, 24 << 10, 9999, [4, 17], 5),
])
def test_small_rings_are_byte_exact(make_world: Callable[..., World], kind: str, pt: int, dt: int, dec_bytes: int,
                                    piece: int, splits: list[int], layers: int) -> None:
    pre = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=piece)
    dec = AgentConfig(staging="always", staging_bytes=dec_bytes, staging_piece_bytes=piece)
    world = make_world("loopback", kind, pt, dt, prefill=pre, decode=dec, layers=layers)
    rng = np.random.default_rng(pt * 100 + dt * 10 + layers)
    src_pages, dst_pages = rng.permutation(POOL)[:21], rng.permutation(POOL)[:21]
    fill_random(world, 1, src_pages)
    senders, receivers = open_rooms(world, 31, dst_pages)
    assert all(d.decode.rooms[31].rings for d in world.decode), "no ring was reserved"
    bounds = [0, *splits, len(src_pages)]
    for s in senders:
        for i in range(len(bounds) - 1):
            s.send(src_pages[bounds[i]: bounds[i + 1]], last=i == len(bounds) - 2)
    finish(world, senders, receivers)
    verify(world, src_pages, dst_pages)
    untouched(world, dst_pages)
    slots = ring_slots(world, 31)
    pieces = sum(s.stats[1] for s in senders)
    assert slots and pieces >= 3 * slots, (pieces, slots)          # every slot reused several times
    for rc in receivers:
        rc.clear()
    for s in senders:
        s.clear()
    staging_back(world)


@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1)])
def test_layerwise_groups_and_whole_chunks_mix_through_a_ring(make_world: Callable[..., World], pt: int,
                                                              dt: int) -> None:
    layers = 5
    pre = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=9000)
    dec = AgentConfig(staging="always", staging_bytes=40 << 10, staging_piece_bytes=9000)
    world = make_world("loopback", ref.TOKEN_MAJOR, pt, dt, prefill=pre, decode=dec, layers=layers)
    rng = np.random.default_rng(5)
    src_pages, dst_pages = rng.permutation(POOL)[:23], rng.permutation(POOL)[:23]
    fill_random(world, 2, src_pages)
    senders, receivers = open_rooms(world, 32, dst_pages)
    assert world.decode[0].decode.rooms[32].rings
    plan = [((0, 5), None), ((5, 6), [range(0, 2), range(2, 3), range(3, 5)]), ((6, 14), None),
            ((14, 23), [range(0, 1), range(1, 4), range(4, 5)])]
    for s in senders:
        for (lo, hi), groups in plan:
            if groups is None:
                s.send(src_pages[lo:hi], last=hi == 23)
            else:
                for g in groups:
                    s.send(src_pages[lo:hi], last=hi == 23 and g.stop == layers, layers=g)
    finish(world, senders, receivers)
    verify(world, src_pages, dst_pages)
    untouched(world, dst_pages)
    assert sum(s.stats[1] for s in senders) >= 3 * ring_slots(world, 32)


@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1), (1, 2)])
def test_several_rooms_in_flight_share_the_staging_area(make_world: Callable[..., World], pt: int, dt: int) -> None:
    """Three rooms requested before any is sent, sent interleaved: each gets its own ring (or plain
    descriptors when the area is full) and its own bytes."""
    pre = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=8192)
    dec = AgentConfig(staging="always", staging_bytes=64 << 10, staging_piece_bytes=8192)
    world = make_world("loopback", ref.TOKEN_MAJOR, pt, dt, prefill=pre, decode=dec, layers=3)
    perm_s, perm_d = np.random.default_rng(8).permutation(POOL), np.random.default_rng(9).permutation(POOL)
    rooms = {40 + i: (perm_s[i * 12: i * 12 + 12], perm_d[i * 12: i * 12 + 12]) for i in range(3)}
    for i, (src, _) in enumerate(rooms.values()):
        fill_random(world, 10 + i, src)
    opened = {room: open_rooms(world, room, dst) for room, (_, dst) in rooms.items()}
    assert any(d.decode.rooms[r].rings for d in world.decode for r in rooms), "no room got a ring"
    for lo, hi in ((0, 5), (5, 12)):
        for room, (src, _) in rooms.items():
            for s in opened[room][0]:
                s.send(src[lo:hi], last=hi == 12)
    for room in rooms:
        finish(world, *opened[room])
    for room, (src, dst) in rooms.items():
        verify(world, src, dst, f"room {room}: ")
    untouched(world, np.concatenate([dst for _, dst in rooms.values()]))
    for senders, receivers in opened.values():
        for rc in receivers:
            rc.clear()
        for s in senders:
            s.clear()
    staging_back(world)

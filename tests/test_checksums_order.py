"""Adversarial: digests are order-correct and see every changed byte.

docs/integrity.md: "The digest (a position-weighted sum of 64-bit words, mod 2^64) catches any single changed
byte and any swap of two different words". Identical bytes moved to permuted destinations (two pages'
destinations swapped) must be detected; so must one changed byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_checksums_paths import PLAIN, PRE_NO, PRE_ST, STAGED, send_all, settle, start_room
from test_staging_paths import POOL, World, worlds

from kvbridge.agent import decode as decode_module
from kvbridge.agent import posting as posting_module
from kvbridge.digests import digest_items, run_bytes
from kvbridge.protocol.wire import KVPoll
from kvbridge.slicing import Segments
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(worlds, name="make_world")
M64 = (1 << 64) - 1


def _whole(nbytes: int) -> Any:
    return run_bytes(Segments(np.array([0], np.int64), np.array([0], np.int64), np.array([nbytes], np.int64)), "src")


def _swap_destinations(monkeypatch: pytest.MonkeyPatch, a: int, b: int) -> list[bool]:
    """The planner sends the item meant for destination page ``a`` to ``b`` and the other way round."""
    real = posting_module.plan_transfer
    hit: list[bool] = []

    def swapped(pairs: Any, s_idx: np.ndarray, d_idx: np.ndarray) -> Any:
        d = np.asarray(d_idx).copy()
        ia, ib = np.flatnonzero(d == a), np.flatnonzero(d == b)
        if ia.size and ib.size:
            d[ia[0]], d[ib[0]] = b, a
            hit.append(True)
        return real(pairs, s_idx, d)

    monkeypatch.setattr(posting_module, "plan_transfer", swapped)
    return hit


def _swap_scatter(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The decode's scatter puts the first two items of a staged piece into each other's pages."""
    real = decode_module.scatter_rows
    hit: list[bool] = []

    def swapped(buf: np.ndarray, rows: Any, items: np.ndarray, staged: np.ndarray, **kw: Any) -> None:
        items = np.asarray(items).copy()
        if len(items) >= 2:
            items[0], items[1] = items[1], items[0]
            hit.append(True)
        real(buf, rows, items, staged, **kw)

    monkeypatch.setattr(decode_module, "scatter_rows", swapped)
    return hit


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.HEAD_MAJOR, 1, 2)])
def test_swapped_page_destinations_fail_the_room(make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch,
                                                  kind: str, pt: int, dt: int) -> None:
    """Plain descriptors: the same bytes, two pages' destinations swapped (generic data)."""
    world = make_world("loopback", kind, pt, dt, prefill=PRE_NO, decode=PLAIN)
    senders, receivers, src_pages, dst_pages = start_room(world, 50, 9)
    hit = _swap_destinations(monkeypatch, int(dst_pages[0]), int(dst_pages[1]))
    send_all(senders, src_pages, "chunks", world.layers)
    states = settle(receivers)
    assert hit and KVPoll.Failed in states, states
    assert any("checksum mismatch" in r.failure_reason for r in receivers), [r.failure_reason for r in receivers]


def test_a_swapped_scatter_fails_the_room(make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged pieces: the scatter swaps two items' pages."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=PRE_ST, decode=STAGED)
    hit = _swap_scatter(monkeypatch)
    senders, receivers, src_pages, _ = start_room(world, 51, 9)
    send_all(senders, src_pages, "chunks", world.layers)
    states = settle(receivers)
    assert hit and states == [KVPoll.Failed], states
    assert "checksum mismatch" in receivers[0].failure_reason, receivers[0].failure_reason


# ------------------------------------------------------------------------------------------- the digest's claims
def test_a_swap_of_two_different_words_changes_the_digest() -> None:
    """Two words that differ only in their top bit (one bf16 sign): the documented 'any swap of two
    different words changes it'. The weights are odd, so w_i - w_k is even and (w_i - w_k) * 2^63 = 0 mod
    2^64: such a swap never changes the sum."""
    rng = np.random.default_rng(0)
    view = rng.integers(0, 256, (1, 4096), dtype=np.uint8)
    words = view.view(np.uint64)
    words[0, 5] = words[0, 3] ^ np.uint64(1 << 63)
    runs = _whole(4096)
    before = digest_items(view, np.arange(1), runs)
    swapped = view.copy()
    sw = swapped.view(np.uint64)
    sw[0, 3], sw[0, 5] = words[0, 5], words[0, 3]
    assert not np.array_equal(swapped, view)
    assert digest_items(swapped, np.arange(1), runs)[0] != before[0], "swap of two different words not seen"


def _two_sign_flips(page: np.ndarray) -> np.ndarray:
    """The same page with the top bit of its first two 64-bit words flipped (two bf16 signs)."""
    other = page.copy()
    other[..., 7] ^= 0x80
    other[..., 15] ^= 0x80
    return other


def test_two_pages_that_differ_are_told_apart() -> None:
    """Two pages differing in two bf16 sign bits: their digests must differ, or a swap of them goes unseen."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    view = np.stack([a, _two_sign_flips(a)])
    d = digest_items(view, np.arange(2), _whole(4096))
    assert d[0] != d[1], f"pages differ in {int((view[0] != view[1]).sum())} bytes, digests both {d[0]:#x}"


def test_identical_looking_pages_swapped_end_to_end(make_world: Callable[..., World],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 1 -> 1, plain: source pages A and B differ only in two bf16 sign bits (every buffer); the planner
    swaps their destinations. Both destination pages then hold wrong bytes."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PRE_NO, decode=PLAIN)
    rng = np.random.default_rng(52)
    src_pages, dst_pages = rng.permutation(POOL)[:9], rng.permutation(POOL)[:9]
    hit = _swap_destinations(monkeypatch, int(dst_pages[0]), int(dst_pages[1]))
    senders, receivers, got_src, _ = start_room(world, 52, 9)
    assert np.array_equal(got_src, src_pages)
    for buf in world.src[0]:
        buf[src_pages[1]] = _two_sign_flips(buf[src_pages[0]])
    send_all(senders, src_pages, "chunks", world.layers)
    states = settle(receivers)
    wrong = [b for b, buf in enumerate(world.dst[0])
             if not np.array_equal(buf[dst_pages[0]], world.src[0][b][src_pages[0]])]
    assert hit and wrong, "the swap did not happen"
    assert states == [KVPoll.Failed], (f"room {states[0].name} with destination page {dst_pages[0]} holding "
                                       f"source page {src_pages[1]} in {len(wrong)} buffers")


def test_two_sign_bits_flipped_in_a_landed_page(make_world: Callable[..., World],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Generic data (the fill pattern, nothing crafted), TP 1 -> 1 plain: two bits of one landed page flipped
    before verification (the top bit of bytes 7 and 15: the sign of two bf16 values). The room must fail."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=PRE_NO, decode=PLAIN)
    real = decode_module.DecodeSide._verified
    planted: list[int] = []

    def corrupt(self: Any, room: Any, notice: Any, layers: range) -> bool:
        if not planted and room.room == 54 and notice.count:
            page = int(room.indices["kv"][notice.first])
            world.dst[0][0][page, 7] ^= 0x80
            world.dst[0][0][page, 15] ^= 0x80
            planted.append(page)
        return real(self, room, notice, layers)

    monkeypatch.setattr(decode_module.DecodeSide, "_verified", corrupt)
    senders, receivers, src_pages, _ = start_room(world, 54, 9)
    send_all(senders, src_pages, "chunks", world.layers)
    states = settle(receivers)
    assert planted
    assert states == [KVPoll.Failed], f"room {states[0].name} with two flipped bits in page {planted[0]}"

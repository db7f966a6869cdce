"""Per-destination checksums (``AgentConfig(checksums=True)`` on the decode): every write carries digests of
exactly the bytes each decode rank receives, so they hold for any TP ratio; a byte planted into a landed
page (descriptor path) or into a scattered piece (staged path) fails the room naming the component, the
buffer and the destination page; a prefill that sends no digests fails it too. Byte-exact against the
independent reference with checksums on, over loopback and NIXL."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_staging_paths import BACKENDS, POOL, World, check, open_room, wait, worlds

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent import decode as decode_module
from kvbridge.agent import posting as posting_module
from kvbridge.digests import digest_items, run_bytes
from kvbridge.errors import TransferError
from kvbridge.protocol.wire import KVPoll
from kvbridge.slicing import Segments
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(worlds, name="make_world")


def _config(mode: str, checksums: bool = True) -> AgentConfig:
    return AgentConfig(staging=mode, staging_bytes=1 << 20, staging_piece_bytes=12 << 10, checksums=checksums)


def _room(world: World, room: int, n: int = 9, seed: int = 3) -> tuple[list[Any], list[Any], np.ndarray]:
    rng = np.random.default_rng(room)
    src_pages, dst_pages = rng.permutation(POOL)[:n], rng.permutation(POOL)[:n]
    senders, receivers = open_room(world, room, src_pages, dst_pages, seed)
    for s in senders:
        try:
            s.send(src_pages[:4], last=False)
            s.send(src_pages[4:], last=True)
        except TransferError:       # the decode already failed the room (a planted byte): its reason is checked
            pass
    return senders, receivers, dst_pages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 2, 1), (ref.TOKEN_MAJOR, 1, 2), (ref.HEAD_MAJOR, 4, 2)])
def test_checksums_hold_across_tp_ratios(make_world: Callable[..., World], backend: str, mode: str, kind: str,
                                         pt: int, dt: int) -> None:
    world = make_world(backend, kind, pt, dt, prefill=_config(mode, False), decode=_config(mode))
    senders, receivers, dst_pages = _room(world, 31)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers), 60)
    wait(lambda: all(s.safe_to_reuse for s in senders), 60)
    check(world, 3, dst_pages)


def _first_run_byte(dec: TransferAgent, notice: Any) -> tuple[int, int, int]:
    """(buffer, page, byte) of the first byte this notice moved into the decode's pages."""
    room = dec.decode.rooms[notice.room]
    peer = dec.peers.get(room.targets[notice.sender])
    segs = dec.decode._plans.slice_for(peer, 0)
    layer = notice.layer_first
    buffer = next(b for b in dec.decode._plans.layers(0).buffers(range(layer, layer + max(1, notice.layer_count)))
                  if len(segs.buffers[b]))
    page = int(room.indices["kv"][notice.first])
    return buffer, page, int(dec.decode._plans.run_bytes(peer, 0, buffer, "dst").index[0])


def test_a_byte_planted_into_a_landed_page_fails_the_room(make_world: Callable[..., World],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Descriptor path, TP 2 -> 1: one byte of a landed page flipped before its notice is counted."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=_config("never", False), decode=_config("never"))
    dec = world.decode[0]
    planted: list[tuple[int, int]] = []
    real = decode_module.DecodeSide.on_notice

    def corrupt(self: Any, notice: Any, env: Any) -> None:
        if not planted and notice.room == 32 and notice.count:
            buffer, page, byte = _first_run_byte(dec, notice)
            world.dst[0][buffer][page, byte] ^= 0x5A
            planted.append((buffer, page))
        real(self, notice, env)

    monkeypatch.setattr(decode_module.DecodeSide, "on_notice", corrupt)
    _, receivers, _ = _room(world, 32)
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    buffer, page = planted[0]
    reason = receivers[0].failure_reason
    name = dec.layout.components[0].buffers[buffer].name
    assert "checksum mismatch" in reason and f"kv buffer {name} " in reason and f"page {page} " in reason, reason


def test_a_byte_planted_into_a_scattered_piece_fails_the_room(make_world: Callable[..., World],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged path, TP 2 -> 1: the scatter leaves one wrong byte in a page (as a bad staging copy would)."""
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=_config("always", False),
                       decode=_config("always"))
    real = decode_module.scatter_rows
    hit: list[bool] = []

    def bad_scatter(buf: np.ndarray, rows: Any, items: np.ndarray, staged: np.ndarray, **kw: Any) -> None:
        real(buf, rows, items, staged, **kw)
        if not hit:
            buf[int(items[0]), rows.dst_col] ^= 0x01
            hit.append(True)

    monkeypatch.setattr(decode_module, "scatter_rows", bad_scatter)
    _, receivers, _ = _room(world, 33)
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "checksum mismatch" in receivers[0].failure_reason, receivers[0].failure_reason


def test_a_prefill_that_sends_no_digests_fails_the_room(make_world: Callable[..., World],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(posting_module.Poster, "_wants_digests", staticmethod(lambda room, peer: False))
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=_config("never", False), decode=_config("never"))
    _, receivers, _ = _room(world, 34)
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "sent 0 B of digests" in receivers[0].failure_reason


@pytest.mark.parametrize("segs", [
    Segments(np.array([512, 2048], np.int64), np.array([0, 1024], np.int64), np.array([256, 1024], np.int64)),
    Segments(np.arange(16, dtype=np.int64) * 256 + 64, np.arange(16, dtype=np.int64) * 128,
             np.full(16, 100, np.int64)),                              # regular runs, lengths not words
    Segments(np.array([1024], np.int64), np.array([0], np.int64), np.array([2048], np.int64))])
def test_every_run_shape_digests_the_same_bytes_as_the_reference(segs: Segments) -> None:
    """The fast paths (one run, regular runs) digest what gathering every run byte would."""
    rng = np.random.default_rng(1)
    view = rng.integers(0, 256, (16, 4096), dtype=np.uint8)
    runs = run_bytes(segs, "src")
    general = dataclasses.replace(runs, regular=False)
    items = rng.permutation(16)[:9]
    np.testing.assert_array_equal(digest_items(view, items, runs), digest_items(view, items, general))


@pytest.mark.parametrize("segs", [
    Segments(np.array([512, 2048], np.int64), np.array([0, 1024], np.int64), np.array([256, 1024], np.int64)),
    Segments(np.arange(16, dtype=np.int64) * 256 + 64, np.arange(16, dtype=np.int64) * 128,
             np.full(16, 100, np.int64)),                              # regular runs, lengths not words
    Segments(np.array([1024], np.int64), np.array([0], np.int64), np.array([2052], np.int64)),
    Segments(np.array([8, 3000], np.int64), np.array([0, 40], np.int64), np.array([5, 33], np.int64))])
def test_a_tensor_is_digested_where_it_lives_exactly_as_numpy_digests_it(segs: Segments) -> None:
    """The torch path (GPU checksums; here a CPU tensor, the same int64 code) gives the numpy path's digests for
    every run shape, high bits set in every word included (a logical, not arithmetic, shift of the high half)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    view = rng.integers(0, 256, (16, 4096), dtype=np.uint8)
    view[:, 7::8] |= 0x80                                   # every 64-bit word negative as int64
    runs = run_bytes(segs, "src")
    items = rng.permutation(16)[:11]
    want = digest_items(view, items, runs)
    for shape in (runs, dataclasses.replace(runs, regular=False)):
        got = digest_items(torch.from_numpy(view.copy()), items, shape)
        np.testing.assert_array_equal(got, want)
    flipped = torch.from_numpy(view.copy())
    flipped[int(items[4]), int(runs.index[-1])] ^= 0x01
    changed = digest_items(flipped, items, runs) != want
    assert changed.tolist() == [i == 4 for i in range(len(items))]


def test_the_digest_sees_every_byte_and_every_swap() -> None:
    rng = np.random.default_rng(0)
    view = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    segs = Segments(np.array([512, 2048], np.int64), np.array([0, 1024], np.int64), np.array([256, 1024], np.int64))
    runs = run_bytes(segs, "src")
    index = runs.index
    assert runs.nbytes == 1280 and index[0] == 512 and index[256] == 2048 and not runs.regular
    items = np.arange(8)
    base = digest_items(view, items, runs)
    for byte in (0, 255, 256, 1279):          # first and last byte of each run
        bent = view.copy()
        bent[3, index[byte]] ^= 0x80
        assert (digest_items(bent, items, runs) != base).tolist() == [k == 3 for k in range(8)]
    swapped = view.copy()
    a, b = index[0:4].copy(), index[4:8].copy()
    if not np.array_equal(view[5, a], view[5, b]):
        swapped[5, a], swapped[5, b] = view[5, b], view[5, a]
        assert digest_items(swapped, items, runs)[5] != base[5]
    outside = view.copy()
    outside[:, 0:512] ^= 0xFF                 # bytes no run covers change nothing
    assert np.array_equal(digest_items(outside, items, runs), base)


def test_the_digest_is_the_weighted_sum_of_32_bit_words() -> None:
    """The two-matmul form on 64-bit words equals its definition: sum of e_p * word_p over 32-bit words, mod 2^64,
    e_p = 2p + 1 modulo 2^33 (computed here the slow, obvious way, in Python integers)."""
    from kvbridge.digests import _weights

    rng = np.random.default_rng(3)
    view = rng.integers(0, 256, (3, 200), dtype=np.uint8)              # 200 B: padded to 25 words of 8 B
    runs = run_bytes(Segments(np.array([0], np.int64), np.array([0], np.int64), np.array([200], np.int64)), "src")
    lo, hi = _weights(25)
    weights = [int(w) for pair in zip(lo, hi) for w in (pair[0], (int(pair[0]) << 32) + int(pair[1]))]
    assert all(w % (1 << 33) == 2 * p + 1 for p, w in enumerate(weights))
    for item in range(3):
        words = np.concatenate([view[item], np.zeros(8, np.uint8)]).view(np.uint32)
        want = sum(int(x) * w for x, w in zip(words, weights)) % (1 << 64)
        assert int(digest_items(view, np.array([item]), runs)[0]) == want


def test_the_digest_has_no_blind_pairs_of_words() -> None:
    """What a sum over 64-bit words mod 2^64 misses (two flipped top bits cancel: 2^63 * (odd + odd)) and what a
    fold to 32 bits may cancel: every one of these changes the digest now, for every position tried."""
    rng = np.random.default_rng(7)
    view = rng.integers(0, 256, (1, 2048), dtype=np.uint8)
    runs = run_bytes(Segments(np.array([0], np.int64), np.array([0], np.int64), np.array([2048], np.int64)), "src")
    one = np.zeros(1, np.int64)
    base = digest_items(view, one, runs)[0]
    words = view.view(np.uint32)
    for bit in (0, 7, 15, 31):                                       # the same bit flipped in two words
        for a, b in ((0, 1), (1, 3), (0, 511), (17, 400), (255, 256)):
            bent = words.copy()
            bent[0, a] ^= np.uint32(1 << bit)
            bent[0, b] ^= np.uint32(1 << bit)
            assert digest_items(bent.view(np.uint8), one, runs)[0] != base, (bit, a, b)
    for a, b in ((0, 1), (2, 300), (100, 511)):                      # swaps of words that differ in one bit only
        bent = words.copy()
        bent[0, b] = bent[0, a] ^ np.uint32(1 << 31)
        ref = digest_items(bent.view(np.uint8), one, runs)[0]
        bent[0, a], bent[0, b] = bent[0, b], bent[0, a]
        assert digest_items(bent.view(np.uint8), one, runs)[0] != ref, (a, b)
    for byte in range(0, 2048, 7):                                   # any single changed byte, any value
        bent = view.copy()
        bent[0, byte] ^= np.uint8(rng.integers(1, 256))
        assert digest_items(bent, one, runs)[0] != base, byte


def test_settings_turn_checksums_on() -> None:
    from kvbridge.settings import load_settings

    assert load_settings(env={"KVBRIDGE_CHECKSUMS": "true"}, check_backend=False).agent_config().checksums is True

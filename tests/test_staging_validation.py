"""Adversarial tests of 8a3242a (_validate_staging, ring nonces) and ee7750f (digests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_staging_paths import POOL, World
from test_staging_ring_bytes import (  # noqa: F401
    fill_random,
    finish,
    make_world,
    open_rooms,
    staging_back,
    untouched,
    verify,
)
from test_staging_ring_lifecycle import Rig, rig, threads_alive, wait  # noqa: F401

from kvbridge.agent import AgentConfig
from kvbridge.agent import decode as decode_module
from kvbridge.digests import _weights, digest_items, run_bytes
from kvbridge.protocol.wire import KVPoll
from kvbridge.slicing import Segments
from kvbridge.testkit import reference as ref

# ---------------------------------------------------------------- legit requests never refused
ITEM_TP1 = 16 * 8 * 32          # PAGE x HEADS x HEAD_BYTES: one buffer's item at TP 1 (test_staging_paths)


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.HEAD_MAJOR, 4, 1),
                                          (ref.TOKEN_MAJOR, 1, 2), (ref.HEAD_MAJOR, 2, 2)])
def test_a_staging_area_exactly_full_is_accepted(make_world: Callable[..., World], kind: str, pt: int,  # noqa: F811 - a fixture
                                                 dt: int) -> None:
    """The decode's area holds exactly the request's slices (the last reservation ends at the area's end):
    whole reservations, no ring, and the prefill must accept them."""
    layers, n = 3, 5
    per_rank_item = 2 * layers * ITEM_TP1 // dt            # bytes one decode rank receives per item
    dec_bytes = per_rank_item * n
    pre = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=7000)
    dec = AgentConfig(staging="always", staging_bytes=dec_bytes, staging_piece_bytes=7000)
    world = make_world("loopback", kind, pt, dt, prefill=pre, decode=dec, layers=layers)
    rng = np.random.default_rng(pt * 10 + dt)
    src, dst = rng.permutation(POOL)[:n], rng.permutation(POOL)[:n]
    fill_random(world, 3, src)
    senders, receivers = open_rooms(world, 41, dst)
    for d in world.decode:
        room = d.decode.rooms[41]
        assert not room.rings, "expected whole reservations"
        ends = [o + nb for o, nb, _ in room.staged.values()]
        assert len(room.staged) == len(room.expected) and max(ends) == dec_bytes, (ends, dec_bytes)
    for s in senders:
        assert s.poll() is not KVPoll.Failed, s.failure_reason
        s.send(src, last=True)
    finish(world, senders, receivers)
    verify(world, src, dst)
    untouched(world, dst)


# ---------------------------------------------------------------- a whole reservation running past the area
def test_a_whole_reservation_running_past_the_area_end_is_refused(rig: Callable[..., Rig],  # noqa: F811 - a fixture
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode reserves the whole slice (4 items x 4 layers x 8 KiB = 128 KiB of its 160 KiB area) but its
    request names offset 64 KiB (inside the area; the slice would run 32 KiB past its end). No ring size is
    given, so _validate_staging only checks the offset."""
    r = rig(1)
    dec = r.decode[0]
    real = decode_module.TransferRequest

    def forged(**kw: Any) -> Any:
        if kw["room"] == 71:
            kw["staging"] = {c: {rank: 64 << 10 for rank in ranks} for c, ranks in kw["staging"].items()}
        return real(**kw)

    monkeypatch.setattr(decode_module, "TransferRequest", forged)
    rng = np.random.default_rng(71)
    src, dst = rng.permutation(POOL)[:4], rng.permutation(POOL)[:4]
    fill_random(r, 71, src)
    receiver = dec.receiver(71, "inst")
    receiver.send_metadata({"kv": dst})
    assert dec.decode.rooms[71].staged and not dec.decode.rooms[71].rings
    sender = r.prefill[0].sender(71)
    wait(lambda: sender.poll() >= KVPoll.WaitingForInput or sender.poll() is KVPoll.Failed, 10, "the request")
    refused = sender.poll() is KVPoll.Failed
    if not refused:
        sender.send(src, last=True)
    wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 15, "an outcome")
    r.guards_intact()
    threads_alive(r.prefill[0], dec)
    with r.prefill[0].context.lock:
        fell_back = dec.name in r.prefill[0].prefill._poster._no_staging if hasattr(r.prefill[0].prefill, "_poster") \
            else None
    assert refused, (f"not refused at the request: decode {receiver.poll().name} "
                     f"({receiver.failure_reason!r}); staging to this decode disabled afterwards: {fell_back}")


# ---------------------------------------------------------------- digests: byte-exact, reference formula
def _reference(data: bytes) -> int:
    """sum over 32-bit LE words p of e_p * word_p mod 2^64, e_p the weight digests.py documents."""
    words = -(-len(data) // 8)
    lo, hi = _weights(words)
    padded = data + b"\0" * (8 * words - len(data))
    total = 0
    for j in range(words):
        w0 = int.from_bytes(padded[8 * j: 8 * j + 4], "little")
        w1 = int.from_bytes(padded[8 * j + 4: 8 * j + 8], "little")
        e0 = int(lo[j])
        e1 = ((int(lo[j]) << 32) + int(hi[j])) % (1 << 64)
        assert e0 % (1 << 33) == 4 * j + 1 and e1 % (1 << 33) == 4 * j + 3
        total += e0 * w0 + e1 * w1
    return total % (1 << 64)


def _segments(rng: np.random.Generator, item: int, shape: str) -> Segments:
    if shape == "empty":
        z = np.zeros(0, np.int64)
        return Segments(z, z, z)
    if shape == "whole":
        return Segments.whole(item)
    if shape == "regular":
        length = int(rng.integers(1, 9))
        stride = length + int(rng.integers(0, 5))
        count = max(1, item // stride - 1)
        src = np.arange(count, dtype=np.int64) * stride + int(rng.integers(0, stride))
        src = src[src + length <= item]
        dst = np.arange(len(src), dtype=np.int64) * length
        return Segments(src, dst, np.full(len(src), length, np.int64))
    # irregular: random disjoint runs of 1..13 bytes (some zero-length), scattered to a permuted dst order
    cuts = np.sort(rng.choice(np.arange(1, item), size=min(item - 1, int(rng.integers(1, 12))), replace=False))
    bounds = np.concatenate(([0], cuts, [item]))
    src = bounds[:-1].astype(np.int64)
    lens = np.diff(bounds).astype(np.int64)
    keep = rng.random(len(src)) < 0.7
    src, lens = src[keep], lens[keep]
    if shape == "irregular0" and len(lens):
        lens[0] = 0
    dst = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if len(lens) else np.zeros(0, np.int64)
    return Segments(src, dst, lens)


CASES = [(item, shape) for item in (1, 2, 3, 5, 7, 8, 9, 12, 13, 31, 64, 100, 4099)
         for shape in ("empty", "whole", "regular", "irregular", "irregular0")
         if item >= 2 or shape not in ("irregular", "irregular0")]          # a 1-byte item cannot be cut


@pytest.mark.parametrize("item, shape", CASES)
def test_digests_are_byte_exact_and_match_the_documented_formula(item: int, shape: str) -> None:
    rng = np.random.default_rng(item * 7 + len(shape))
    segs = _segments(rng, item, shape)
    dst_item = max(1, int(segs.dst_off.max() + segs.nbytes.max()) if len(segs) else 1) + 3
    n = 37
    src = rng.integers(0, 256, (n, item), dtype=np.uint8)
    dst = rng.integers(0, 256, (n, dst_item), dtype=np.uint8)
    items_src = rng.permutation(n)[:11]
    items_dst = rng.permutation(n)[:11]
    for s, d in zip(items_src, items_dst):
        for so, do, nb in zip(segs.src_off, segs.dst_off, segs.nbytes):
            dst[d, do: do + nb] = src[s, so: so + nb]
    a = digest_items(src, items_src, run_bytes(segs, "src"))
    b = digest_items(dst, items_dst, run_bytes(segs, "dst"))
    assert np.array_equal(a, b), (shape, item, a, b)
    for k, s in enumerate(items_src):
        data = b"".join(bytes(src[s, so: so + nb]) for so, nb in zip(segs.src_off, segs.nbytes))
        assert int(a[k]) == (_reference(data) if data else 0), (shape, item, k)


def test_digests_in_several_batches_match_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCH_BYTES / SHIFT_BYTES cut the items into batches and the high halves into pieces: same digests."""
    import kvbridge.digests as dg

    rng = np.random.default_rng(5)
    view = rng.integers(0, 256, (300, 1000), dtype=np.uint8)
    items = rng.permutation(300)
    runs = run_bytes(Segments(np.array([3, 500], np.int64), np.array([0, 17], np.int64),
                              np.array([17, 333], np.int64)), "src")
    whole = digest_items(view, items, runs)
    monkeypatch.setattr(dg, "BATCH_BYTES", 3000)
    monkeypatch.setattr(dg, "SHIFT_BYTES", 700)
    assert np.array_equal(digest_items(view, items, runs), whole)
    monkeypatch.setattr(dg, "BATCH_BYTES", 1)
    monkeypatch.setattr(dg, "SHIFT_BYTES", 1)
    assert np.array_equal(digest_items(view, items, runs), whole)


def test_one_flipped_bit_and_two_same_bits_always_change_the_digest() -> None:
    rng = np.random.default_rng(9)
    size = 203
    base = rng.integers(0, 256, (1, size), dtype=np.uint8)
    runs = run_bytes(Segments.whole(size), "src")
    d0 = int(digest_items(base, np.array([0]), runs)[0])
    trials = 0
    for byte in range(size):
        for bit in range(8):
            x = base.copy()
            x[0, byte] ^= 1 << bit
            assert int(digest_items(x, np.array([0]), runs)[0]) != d0, (byte, bit)
            trials += 1
    for _ in range(3000):
        w1, w2 = rng.choice(size // 4, 2, replace=False)
        bit = int(rng.integers(0, 32))
        x = base.copy()
        v = x.view(np.uint8)[0]
        for w in (w1, w2):
            v[4 * w + bit // 8] ^= 1 << (bit % 8)
        assert int(digest_items(x, np.array([0]), runs)[0]) != d0, (w1, w2, bit)

"""send(from_start=True): a chunk sent before the decode's request arrived is held by the core and posted, in
order and without the decode's cached prefix, once every request of the room came (issue 21: engines no longer
keep their own queue and thread for it). Each test tries to make a held chunk land where it must not."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_agent import (
    NUM_PAGES,
    P,
    Pair,
    check,
    fill,
    make_pair,  # noqa: F401 - the agent tests' fixture, taken by `pairs`
    wait,
)

from kvbridge.agent import RoomEventKind
from kvbridge.errors import KVBridgeError, TransferError
from kvbridge.protocol.wire import KVPoll

SRC = np.array([3, 9, 4, 11, 5, 12])        # the request's pages from position 0 on the prefill rank
DST = np.array([14, 2, 7, 1, 8, 6])


@pytest.fixture
def pairs(request: pytest.FixtureRequest) -> Callable[..., Pair]:
    """``make_pair`` of the agent tests (closes what it made)."""
    maker: Callable[..., Pair] = request.getfixturevalue("make_pair")
    return maker


def _senders(pair: Pair, room: int) -> list:
    return [a.sender(room) for a in pair.prefill]


@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_chunks_sent_before_the_request_land_byte_exact_once_it_comes(pairs: Callable[..., Pair], pt: int,
                                                                      dt: int) -> None:
    pair = pairs(pt, dt)
    fill(pair, pt, 7, SRC, np.arange(len(SRC)))
    senders = _senders(pair, 21)
    for s in senders:                                     # nobody asked yet: held, not refused
        assert s.poll() is KVPoll.Bootstrapping
        s.send(SRC[:2], from_start=True)
        s.send(SRC[2:], last=True, from_start=True)
    assert all(s.poll() is KVPoll.Bootstrapping for s in senders)
    receivers = [d.receiver(21, "inst") for d in pair.decode]
    for r in receivers:
        r.send_metadata({"kv": DST})
    wait(lambda: all(r.poll() is KVPoll.Success for r in receivers))
    wait(lambda: all(s.poll() is KVPoll.Success and s.safe_to_reuse for s in senders))
    check(pair, dt, 7, DST, np.arange(len(SRC)))
    kinds = [e.kind for e in pair.prefill[0].events() if e.room == 21]
    assert kinds == [RoomEventKind.READY, RoomEventKind.FINISHED, RoomEventKind.SAFE_TO_REUSE]


def test_the_decodes_cached_prefix_is_dropped_across_held_chunks(pairs: Callable[..., Pair]) -> None:
    """The decode holds the first 3 pages; the engine's chunks (2 + 4 pages from position 0) lose 2 and 1 of
    theirs; the decode's pages (positions 3..5) get exactly positions 3..5, and nothing lands elsewhere."""
    pair = pairs(2, 2)
    fill(pair, 2, 11, SRC, np.arange(len(SRC)))
    senders = _senders(pair, 22)
    for s in senders:
        s.send(SRC[:2], from_start=True)
        s.send(SRC[2:], last=True, from_start=True)
    receivers = [d.receiver(22, "inst") for d in pair.decode]
    for r in receivers:
        r.send_metadata({"kv": DST[3:]}, prefix_len=3 * P)
    wait(lambda: all(r.poll() is KVPoll.Success for r in receivers))
    check(pair, 2, 11, DST[3:], np.arange(3, len(SRC)))
    untouched = np.setdiff1d(np.arange(NUM_PAGES), DST[3:])
    assert all(not buf[untouched].any() for bufs in pair.dst for buf in bufs), "a byte landed outside the request"


def test_a_room_serving_two_decode_ranks_holds_until_both_asked(pairs: Callable[..., Pair]) -> None:
    pair = pairs(1, 2)
    fill(pair, 1, 5, SRC, np.arange(len(SRC)))
    (sender,) = _senders(pair, 23)
    sender.send(SRC, last=True, from_start=True)
    first = pair.decode[0].receiver(23, "inst")
    first.send_metadata({"kv": DST})
    for _ in range(50):
        assert sender.poll() is KVPoll.Bootstrapping                  # one of two requests: still held
    assert not any(buf.any() for buf in pair.dst[0]), "a held chunk was written before every request came"
    second = pair.decode[1].receiver(23, "inst")
    second.send_metadata({"kv": DST})
    wait(lambda: first.poll() is KVPoll.Success and second.poll() is KVPoll.Success)
    check(pair, 2, 5, DST, np.arange(len(SRC)))


def test_an_abort_while_held_writes_nothing_and_is_safe_at_once(pairs: Callable[..., Pair]) -> None:
    pair = pairs(1, 1)
    fill(pair, 1, 3, SRC, np.arange(len(SRC)))
    (sender,) = _senders(pair, 24)
    sender.send(SRC, last=True, from_start=True)
    sender.abort("the engine dropped the request")
    assert sender.poll() is KVPoll.Failed and sender.safe_to_reuse
    receiver = pair.decode[0].receiver(24, "inst")
    receiver.send_metadata({"kv": DST})
    wait(lambda: receiver.poll() is KVPoll.Failed)
    wait(lambda: receiver.safe_to_reuse)
    assert not any(buf.any() for buf in pair.dst[0]), "an aborted room's held chunk was written"
    with pytest.raises(TransferError):
        sender.send(SRC[:1], from_start=True)


def test_a_bad_held_chunk_fails_the_room_on_both_sides_with_the_reason(pairs: Callable[..., Pair]) -> None:
    pair = pairs(1, 1)
    (sender,) = _senders(pair, 25)
    sender.send(np.array([1, NUM_PAGES + 5]), last=True, from_start=True)      # a page the pool does not have
    receiver = pair.decode[0].receiver(25, "inst")
    receiver.send_metadata({"kv": DST[:2]})
    wait(lambda: sender.poll() is KVPoll.Failed and receiver.poll() is KVPoll.Failed)
    assert str(NUM_PAGES + 5) in sender.failure_reason
    wait(lambda: receiver.safe_to_reuse and sender.safe_to_reuse)
    assert not any(buf.any() for buf in pair.dst[0])


def test_misuse_is_refused_with_the_reason(pairs: Callable[..., Pair]) -> None:
    pair = pairs(1, 1)
    (sender,) = _senders(pair, 26)
    with pytest.raises(KVBridgeError, match="still bootstrapping.*from_start=True"):
        sender.send(SRC[:1])                                    # positioned after the prefix: must wait
    with pytest.raises(KVBridgeError, match="whole chunks"):
        sender.send(SRC[:1], layers=range(0, 1), from_start=True)
    sender.send(SRC, last=True, from_start=True)
    with pytest.raises(KVBridgeError, match="last chunk was already sent"):
        sender.send(SRC[:1], from_start=True)
    (other,) = _senders(pair, 27)
    receiver = pair.decode[0].receiver(27, "inst")
    receiver.send_metadata({"kv": DST})
    wait(lambda: other.poll() is KVPoll.WaitingForInput)
    other.send(SRC[:2])
    with pytest.raises(KVBridgeError, match="same from_start"):
        other.send(SRC[2:], last=True, from_start=True)

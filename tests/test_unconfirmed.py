"""What a prefill sends again before its Goodbye (kvbridge.agent.unconfirmed): bounded, per decode incarnation,
never a notice of a room the decode is done with."""

from __future__ import annotations

from kvbridge.agent.unconfirmed import Unconfirmed
from kvbridge.protocol.wire import ReplayWindow


def test_kept_notices_come_back_in_order_for_that_incarnation_only() -> None:
    kept = Unconfirmed()
    kept.keep("d0", 7, room=1, frame=b"n1a", seq=1)
    kept.keep("d0", 7, room=2, frame=b"n2a", seq=2)
    kept.keep("d0", 7, room=1, frame=b"n1b", seq=3)     # room 1 again: it moves after room 2
    assert kept.frames("d0", 7, seq=3) == [b"n2a", b"n1a", b"n1b"]
    assert kept.frames("d0", 8, seq=3) == []             # another incarnation under that name: nothing
    assert kept.frames("d1", 7, seq=3) == []
    kept.keep("d0", 8, room=3, frame=b"n3", seq=1)      # a new incarnation replaces the old one's notices
    assert kept.frames("d0", 8, seq=1) == [b"n3"] and kept.frames("d0", 7, seq=3) == []


def test_a_room_the_decode_is_done_with_is_never_sent_again() -> None:
    kept = Unconfirmed()
    kept.keep("d0", 7, room=1, frame=b"old", seq=1)
    kept.forget_room("d0", 1)            # the decode aborted room 1, or asked for it again (a new request)
    kept.keep("d0", 7, room=1, frame=b"new", seq=2)
    assert kept.frames("d0", 7, seq=2) == [b"new"]
    kept.forget("d0")                    # the decode died or left
    assert kept.frames("d0", 7, seq=2) == [] and len(kept) == 0
    kept.forget_room("nobody", 5)        # unknown agent or room: nothing happens
    kept.forget("nobody")


def test_bounded_by_the_decodes_replay_window() -> None:
    """A copy older than the decode's replay window would be dropped there: it is not kept (memory bound)."""
    kept = Unconfirmed()
    size = ReplayWindow.SIZE
    for seq in range(1, 10 * size + 1):
        kept.keep("d0", 7, room=seq, frame=seq.to_bytes(4, "little"), seq=seq)
        assert len(kept) <= size
    frames = kept.frames("d0", 7, seq=10 * size)
    assert len(frames) == size
    assert frames[0] == (9 * size + 1).to_bytes(4, "little")     # the oldest the decode still accepts
    assert kept.frames("d0", 7, seq=11 * size) == []   # heartbeats moved the sequence on: all out of the window

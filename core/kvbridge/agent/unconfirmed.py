"""Notices a prefill rank handed to the backend's own channel, kept so that its Goodbye cannot overtake them.

A backend that carries notices itself (NIXL attaches them to the write and sends them again after it) reports
a write done on the writer before the decode has read the notice. A prefill that says Goodbye (over the
control link) and releases its backend right after its last write could leave the decode with a room whose
bytes all landed but whose last notice comes after the goodbye's grace, or never (NIXL: the agent that would
send it is gone); the decode then fails the room. So before its Goodbye a prefill sends every notice kept here
again over the control link, which is ordered per peer: the copies arrive before the Goodbye.

Each copy is the same frame (same sequence number): a decode that already has it drops it as a replay, so a
copy can never count for another request that reused the room number. Kept per decode incarnation, room by
room, until the notice falls out of the decode's replay window (:class:`~kvbridge.protocol.wire.ReplayWindow`:
a decode drops anything older anyway), the decode aborts the room, sends a new request for its number, or dies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvbridge.protocol.wire import ReplayWindow


@dataclass(slots=True, kw_only=True)
class _Kept:
    """One decode incarnation's notices, by room, oldest room first: (highest sequence number, frames)."""

    incarnation: int
    rooms: OrderedDict[int, tuple[int, list[bytes]]] = field(default_factory=OrderedDict)


class Unconfirmed:
    """Notices the backend took, per decode agent (call under the agent lock)."""

    def __init__(self, window: int = ReplayWindow.SIZE) -> None:
        self._window = window
        self._by_agent: dict[str, _Kept] = {}

    def keep(self, agent: str, incarnation: int, room: int, frame: bytes, seq: int) -> None:
        """``frame`` (a notice of ``room``, sequence number at most ``seq``) went by the backend's channel."""
        kept = self._by_agent.get(agent)
        if kept is None or kept.incarnation != incarnation:
            kept = self._by_agent[agent] = _Kept(incarnation=incarnation)
        entry = kept.rooms.pop(room, None)
        frames = entry[1] if entry is not None else []
        frames.append(frame)
        kept.rooms[room] = (seq, frames)
        self._prune(kept, seq)

    def _prune(self, kept: _Kept, seq: int) -> None:
        """Forget rooms whose newest notice is out of the decode's replay window (it would drop a copy)."""
        rooms = kept.rooms
        while rooms:
            newest, _ = next(iter(rooms.values()))
            if newest > seq - self._window:
                return
            rooms.popitem(last=False)

    def drop(self, agent: str, room: int, frame: bytes) -> None:
        """The backend did not take ``frame`` after all (it went by the control link, ordered before any Goodbye)."""
        kept = self._by_agent.get(agent)
        entry = kept.rooms.get(room) if kept is not None else None
        if entry is not None and frame in entry[1]:
            entry[1].remove(frame)

    def forget_room(self, agent: str, room: int) -> None:
        """The decode aborted ``room`` or asks for it again: its earlier notices must not be sent again."""
        kept = self._by_agent.get(agent)
        if kept is not None:
            kept.rooms.pop(room, None)

    def forget(self, agent: str) -> None:
        """The decode died or left: nothing of it is sent again."""
        self._by_agent.pop(agent, None)

    def frames(self, agent: str, incarnation: int, seq: int) -> list[bytes]:
        """The frames to send again to that incarnation of ``agent`` (``seq``: our latest sequence number to it),
        oldest first."""
        kept = self._by_agent.get(agent)
        if kept is None or kept.incarnation != incarnation:
            return []
        self._prune(kept, seq)
        return [frame for _, frames in kept.rooms.values() for frame in frames]

    def __len__(self) -> int:
        return sum(len(frames) for kept in self._by_agent.values() for _, frames in kept.rooms.values())

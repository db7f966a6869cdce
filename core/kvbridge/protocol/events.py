"""Room events: what an engine learns per step instead of polling every room.

A prefill room reports ``READY`` once every decode request it serves arrived (``send()`` may go). A room reports
``FINISHED`` (Success) or ``FAILED`` (with the reason) once, and ``SAFE_TO_REUSE`` once when nothing more can
land in (decode) or be read from (prefill) its pages. They are emitted by the state
machines' transitions (``kvbridge.protocol.states``), under the agent lock in the same step as the state change,
so a state that ``poll()`` or ``safe_to_reuse`` shows was announced by then (the simulator checks it). They are
drained by :meth:`TransferAgent.events`, the way vLLM's connector reports finished request ids per step:

    for event in agent.events():
        if event.kind is RoomEventKind.SAFE_TO_REUSE:
            free_blocks(event.room)

Events of a room that the engine cleared are dropped with it, so an engine that never asks keeps nothing.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass


class RoomEventKind(enum.Enum):
    READY = "ready"                  # prefill: every decode request arrived (WaitingForInput): send() may go
    FINISHED = "finished"            # Success: every byte landed (decode) / every write completed (prefill)
    FAILED = "failed"                # the room failed; ``reason`` says why (its pages may not be reusable yet)
    SAFE_TO_REUSE = "safe_to_reuse"  # nothing more can land in or be read from the room's pages


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomEvent:
    room: int
    kind: RoomEventKind
    reason: str = ""


class RoomEvents:
    """The events not yet taken by the engine, by room (a room's events stay in order)."""

    def __init__(self) -> None:
        self._queued: OrderedDict[int, list[RoomEvent]] = OrderedDict()
        self._safe: set[int] = set()          # rooms that reported SAFE_TO_REUSE (once per room)
        self._muted: set[int] = set()         # rooms the engine released: nothing of them is reported any more
        # its own lock: an emit racing a take (a callback thread without the agent lock) must not be lost
        self._lock = threading.Lock()

    def emit(self, room: int, kind: RoomEventKind, reason: str = "") -> None:
        with self._lock:
            if room in self._muted:
                return
            if kind is RoomEventKind.SAFE_TO_REUSE:
                if room in self._safe:
                    return
                self._safe.add(room)
            self._queued.setdefault(room, []).append(RoomEvent(room=room, kind=kind, reason=reason))

    def queued(self) -> bool:
        """Is any event queued? A lock-free peek (an emit racing it shows in the next one); ``take`` to have them."""
        return bool(self._queued)

    def take(self) -> list[RoomEvent]:
        """Every queued event, oldest room first, and forget them."""
        with self._lock:
            taken = [event for events in self._queued.values() for event in events]
            self._queued.clear()
            return taken

    def forget(self, room: int) -> None:
        """The room was cleared: its events go too (a room number may be used again)."""
        with self._lock:
            self._queued.pop(room, None)
            self._safe.discard(room)
            self._muted.discard(room)

    def mute(self, room: int) -> None:
        """The engine released the room (it is cleared once safe): its queued events go, and none come later."""
        with self._lock:
            self._queued.pop(room, None)
            self._muted.add(room)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(events) for events in self._queued.values())

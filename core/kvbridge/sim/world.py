"""The simulated world: one seeded RNG, the simulated clock, scheduled deliveries, partitions and the trace.

Everything that crosses a process boundary (a control frame, a backend write landing, a backend
notification) is a :class:`Delivery` held here until the scheduler executes, drops or duplicates it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

FRAME, LAND, NOTIFY = "frame", "land", "notify"


@dataclass(slots=True, kw_only=True)
class Delivery:
    """One thing in flight from process ``src`` to process ``dst``, executable once ``due`` has passed."""

    id: int
    kind: str                  # FRAME, LAND or NOTIFY
    src: str
    dst: str
    due: float
    label: str
    payload: Any = None        # FRAME/NOTIFY: the bytes; LAND: the backend's write handle


@dataclass(slots=True, kw_only=True)
class Knobs:
    """Per-schedule fault rates, drawn from the seed."""

    drop: float = 0.0          # a control frame is lost
    dup: float = 0.0           # a control frame or notification arrives twice
    notify_via_link: float = 0.3   # the backend declines to carry a notice (the control link does)
    latency: float = 0.01      # mean delivery latency (s)


class SimFailure(AssertionError):
    """An invariant was violated; carries the seed and the trace."""

    def __init__(self, seed: int, message: str, trace: list[str]) -> None:
        super().__init__(f"seed {seed}: {message}")
        self.seed, self.message, self.trace = seed, message, trace


@dataclass(slots=True, kw_only=True)
class World:
    """Clock, RNG, in-flight deliveries, partitions and the event trace of one schedule."""

    seed: int
    rng: random.Random
    knobs: Knobs = field(default_factory=Knobs)
    now: float = 0.0
    step: int = 0
    pending: dict[int, Delivery] = field(default_factory=dict)
    cuts: set[tuple[str, str]] = field(default_factory=set)
    trace: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    deliver_frame: Callable[[Delivery], None] | None = None   # set by the hub
    _next: int = 0

    def clock(self) -> float:
        return self.now

    def log(self, text: str) -> None:
        self.trace.append(f"{self.step:4d} {self.now:7.3f} {text}")

    def violate(self, text: str) -> None:
        """Record an invariant violation found inside a simulated component (raised after the step)."""
        self.violations.append(text)
        self.log(f"VIOLATION {text}")

    # ------------------------------------------------------------------ partitions
    def cut(self, a: str, b: str) -> bool:
        return bool(self.cuts) and ((a, b) if a < b else (b, a)) in self.cuts

    def partition(self, group: list[str], others: list[str]) -> None:
        for a in group:
            for b in others:
                self.cuts.add((min(a, b), max(a, b)))

    # ------------------------------------------------------------------ deliveries
    def schedule(self, kind: str, src: str, dst: str, label: str, payload: Any, delay: float | None = None) -> Delivery:
        self._next += 1
        lag = delay if delay is not None else self.rng.expovariate(1.0 / self.knobs.latency)
        item = Delivery(id=self._next, kind=kind, src=src, dst=dst, due=self.now + lag, label=label, payload=payload)
        self.pending[item.id] = item
        return item

    def ready(self) -> list[Delivery]:
        """Deliveries due now whose endpoints are not cut off from each other, oldest first."""
        return [d for d in self.pending.values() if d.due <= self.now and not self.cut(d.src, d.dst)]


class _Body(msgspec.Struct, kw_only=True):
    type: str = "?"
    room: int | None = None
    sender: int | str | None = None
    chunk: int | None = None
    last: bool = False
    quiesced: bool = False


class _Peek(msgspec.Struct, array_like=True, kw_only=True):
    version: int
    from_agent: str
    address: str
    incarnation: int
    to_incarnation: int
    seq: int
    body: _Body


_PEEK = msgspec.msgpack.Decoder(_Peek)


def frame_label(frame: bytes) -> str:
    """A short, deterministic description of a control frame (message type, room) for the trace."""
    try:
        body = _PEEK.decode(frame).body
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"frame[{len(frame)}]"
    extra = ""
    if body.type == "notice":
        extra = f" r{body.sender} c{body.chunk}{' last' if body.last else ''}"
    elif body.quiesced:
        extra = " quiesced"
    return f"{body.type}{'' if body.room is None else f' room={body.room}'}{extra}"

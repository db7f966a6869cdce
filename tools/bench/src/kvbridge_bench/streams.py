"""Request streams for ``kvbridge bench transfer --concurrency N [--rate R]``: many requests in flight per rank
pair, driven the way an engine drives kvbridge, and the engine-loop probe.

An engine runs one Python loop (scheduler + forward pass) and calls ``agent.events()`` once per step; kvbridge's
own progress thread (``agent.start()``) moves the bytes. :class:`EngineLoop` is that loop: each step does a fixed
amount of GIL-bound Python work (and, on a GPU, launches a small CUDA op), then one step of a stream driver
(:class:`DecodeStream` or :class:`PrefillStream`): open the requests that are due, act on the room events. Steps
per second with traffic against the same loop without traffic is what kvbridge costs the engine's thread.

Example (in a rank process; ``agent`` started with ``agent.start()``)::

    loop = EngineLoop(work_us=200, device="cuda:0")
    idle = loop.run(NoStream(), seconds=1.0)
    busy = loop.run(DecodeStream(agent, instance, rooms, dst_slots, concurrency=8, rate=200.0), seconds=60.0)
    lost = 1 - busy.steps_per_s / idle.steps_per_s
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["DecodeStream", "EngineLoop", "LoopResult", "NoStream", "PrefillStream", "StreamDriver"]


class StreamDriver(Protocol):
    """One step of an engine's use of kvbridge; ``done`` once every request ended and was cleared."""

    def step(self) -> None: ...

    @property
    def done(self) -> bool: ...


class NoStream:
    """The baseline driver: an engine step with no kvbridge traffic."""

    done = False

    def step(self) -> None:
        return None


@dataclass(kw_only=True)
class DecodeStream:
    """Decode side: asks for ``rooms`` in order, at most ``concurrency`` in flight, no faster than ``rate`` per
    second (0: as fast as slots free up); each request reads into a free slot of ``dst_slots`` (page arrays:
    a slot is reused only after its room is safe to reuse). Records each request's latency (asked -> FINISHED)."""

    agent: Any
    instance: str
    rooms: Sequence[int]
    dst_slots: Sequence[np.ndarray]
    concurrency: int
    rate: float = 0.0
    latencies: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    started_at: float | None = None
    ended_at: float | None = None
    _next: int = 0
    _due: float = 0.0
    _free: deque[int] = field(default_factory=deque)
    _open: dict[int, tuple[Any, float, int]] = field(default_factory=dict)    # room -> (receiver, asked at, slot)

    def __post_init__(self) -> None:
        self._free.extend(range(min(self.concurrency, len(self.dst_slots))))

    @property
    def done(self) -> bool:
        return self._next >= len(self.rooms) and not self._open

    def step(self) -> None:
        now = time.perf_counter()
        if self.started_at is None:
            self.started_at = self._due = now
        while self._next < len(self.rooms) and self._free and (self.rate <= 0 or now >= self._due):
            room, slot = self.rooms[self._next], self._free.popleft()
            receiver = self.agent.receiver(room, self.instance)
            receiver.send_metadata({"kv": self.dst_slots[slot]})
            self._open[room] = (receiver, time.perf_counter(), slot)
            self._next += 1
            self._due += 1.0 / self.rate if self.rate > 0 else 0.0
        for event in self.agent.events():
            entry = self._open.get(event.room)
            if entry is None:
                continue
            receiver, asked, slot = entry
            kind = event.kind.value
            if kind == "finished":
                self.latencies.append(time.perf_counter() - asked)
            elif kind == "failed":
                self.failed.append(f"room {event.room}: {event.reason}")
            elif kind == "safe_to_reuse":
                receiver.clear()
                del self._open[event.room]
                self._free.append(slot)
        if self.done and self.ended_at is None:
            self.ended_at = time.perf_counter()


@dataclass(kw_only=True)
class PrefillStream:
    """Prefill side: opens ``rooms`` in order, ``window`` ahead of the decode's requests; sends ``src`` (the
    whole request, last=True) when a room is READY (every decode rank asked); clears it once safe to reuse."""

    agent: Any
    rooms: Sequence[int]
    src: np.ndarray
    window: int
    failed: list[str] = field(default_factory=list)
    finished: int = 0
    _next: int = 0
    _open: dict[int, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self._next >= len(self.rooms) and not self._open

    def step(self) -> None:
        while self._next < len(self.rooms) and len(self._open) < self.window:
            room = self.rooms[self._next]
            self._open[room] = self.agent.sender(room)
            self._next += 1
        for event in self.agent.events():
            sender = self._open.get(event.room)
            if sender is None:
                continue
            kind = event.kind.value
            if kind == "ready":
                sender.send(self.src, last=True)
            elif kind == "finished":
                self.finished += 1
            elif kind == "failed":
                self.failed.append(f"room {event.room}: {event.reason}")
            elif kind == "safe_to_reuse":
                sender.clear()
                del self._open[event.room]


@dataclass(frozen=True, kw_only=True)
class LoopResult:
    steps: int
    seconds: float
    driver_cpu_s: float          # the engine thread's CPU inside the driver's steps (kvbridge calls the engine makes)
    other_threads_cpu_s: float   # every other thread of the process (kvbridge's progress and heartbeat threads,
    #                              the link's and the backend's own)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


class EngineLoop:
    """A stand-in for an engine's Python loop: GIL-bound work of about ``work_us`` per step (calibrated once),
    plus a small CUDA op on ``device`` when it is a GPU, then one step of the stream driver."""

    def __init__(self, *, work_us: float = 200.0, device: str = "cpu") -> None:
        self.device = device
        self._cuda_op: Any = None
        if device.startswith("cuda"):
            import torch

            scratch = torch.zeros(256, device=device)
            self._cuda_op = lambda: scratch.add_(1.0)         # launched, never waited for (like a forward pass)
        self._spins = 1
        self._spins = max(1, int(self._calibrate() * work_us))

    def _work(self) -> int:
        total = 0
        for i in range(self._spins):
            total += i & 7
        return total

    def _calibrate(self) -> float:
        """Spins per microsecond of this host's Python."""
        self._spins = 20_000
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            self._work()
            best = min(best, time.perf_counter() - t0)
        return 20_000 / (best * 1e6)

    def run(self, driver: StreamDriver, *, seconds: float | None = None, timeout_s: float = 300.0) -> LoopResult:
        """Run steps until ``driver.done`` (or ``seconds`` passed, for a baseline); raises TimeoutError after
        ``timeout_s``."""
        proc0, main0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        limit = t0 + (seconds if seconds is not None else timeout_s)
        steps, driver_cpu = 0, 0.0
        while True:
            self._work()
            if self._cuda_op is not None:
                self._cuda_op()
            d0 = time.thread_time()
            driver.step()
            driver_cpu += time.thread_time() - d0
            steps += 1
            now = time.perf_counter()
            if driver.done or now >= limit:
                break
        if seconds is None and not driver.done:
            raise TimeoutError(f"the request stream did not end in {timeout_s:.0f} s")
        main = time.thread_time() - main0
        return LoopResult(steps=steps, seconds=now - t0, driver_cpu_s=driver_cpu,
                          other_threads_cpu_s=max(0.0, time.process_time() - proc0 - main))

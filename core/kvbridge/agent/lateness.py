"""Time this rank itself was not running: the one measure every timer of the protocol excuses.

A periodic check that runs later than one heartbeat interval after the previous one was held up by the rank
itself (the host starved it, SIGSTOP, a GC pause, an engine step between two polls). Its link did not read the
frames sent meanwhile, and on a shared host its peers were starved too, so that time is neither a peer's silence
nor a room's wait. Each timer excuses at most its own bound of it, so a room or a dead peer is still judged within
twice its bound however rarely the rank runs.

    lateness = OwnLateness(interval_s=0.5)
    lateness.note(now=10.0); lateness.note(now=10.5)
    waiting = lateness.since(now=10.5)          # a room starts waiting
    lateness.note(now=18.0)                      # stopped for 7 s
    lateness.running(waiting, now=18.0, bound=8.0)    # 0.5 (7 of the 7.5 s excused)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Since:
    """When a timer started (this rank's clock) and how much lateness had accrued by then."""

    at: float
    mark: float


class OwnLateness:
    """Accrues the lateness of one rank's periodic check (call :meth:`note` once per check, under the lock)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.total = 0.0                       # seconds of lateness accrued since the rank started
        self._last: float | None = None        # when the previous check ran

    def note(self, now: float) -> float:
        """The check at ``now``: returns its lateness (0 when on time) and adds it to the total."""
        previous, self._last = self._last, now
        late = 0.0 if previous is None else max(0.0, now - previous - self.interval_s)
        self.total += late
        return late

    def since(self, now: float) -> Since:
        """A timer starting at ``now``: lateness of the coming check that accrued before ``now`` is not its own."""
        pending = 0.0 if self._last is None else max(0.0, now - self._last - self.interval_s)
        return Since(at=now, mark=self.total + pending)

    def excused(self, since: Since, bound: float) -> float:
        """Lateness accrued since ``since``, at most ``bound``."""
        return min(bound, max(0.0, self.total - since.mark))

    def running(self, since: Since, now: float, bound: float) -> float:
        """Seconds since ``since`` that this rank was running: at most ``bound`` of its lateness is excused."""
        return now - since.at - self.excused(since, bound)

    def unobserved(self, since: Since, bound: float) -> str:
        """The part of a timeout message that names the excused time ('' when none)."""
        excused = self.excused(since, bound)
        return f" (plus {excused:.1f} s while this rank was not running)" if excused >= 0.05 else ""

"""kvbridge's logging: ``KVBRIDGE_LOG`` for every entry point, and repeated errors logged at a bounded rate.

``KVBRIDGE_LOG=INFO`` (or ``DEBUG``, ``WARNING``, a number) shows the records of the ``kvbridge`` loggers
on stderr in any process that imports kvbridge: the command line, the demo's rank processes, an engine
that uses the library, the vLLM connector. Without it kvbridge adds no handler (Python's last-resort
handler still prints warnings and errors). :func:`configure_logging` is what ``import kvbridge`` runs; a
process may call it again to change the level or the format (the demo ranks prefix their name).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["LOG_ENV", "RateLimitedLog", "configure_logging", "parse_level"]

LOG_ENV = "KVBRIDGE_LOG"
DEFAULT_FORMAT = "%(asctime)s pid %(process)d %(name)s %(levelname)s %(message)s"


class _Handler(logging.StreamHandler):
    """The one handler kvbridge installs (recognised on later calls, never added twice)."""


def parse_level(value: str) -> int:
    """``"info"``, ``"DEBUG"``, ``"20"`` -> a logging level; ValueError naming the accepted values."""
    text = value.strip().upper()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text)
    if not isinstance(level, int):
        raise ValueError(f"{LOG_ENV}={value!r}: expected DEBUG, INFO, WARNING, ERROR, CRITICAL or a number")
    return level


def configure_logging(level: str | int | None = None, *, fmt: str | None = None,
                      stream: TextIO | None = None) -> logging.Logger:
    """Show the ``kvbridge`` loggers' records at ``level`` (default: ``$KVBRIDGE_LOG``) on ``stream``
    (default: stderr). With neither a level nor the variable, it changes nothing. A bad value of the
    variable is reported once on stderr and ignored (an import must not fail over a log level)."""
    logger = logging.getLogger("kvbridge")
    if level is None:
        raw = os.environ.get(LOG_ENV, "").strip()
        if not raw:
            return logger
        try:
            level = parse_level(raw)
        except ValueError as exc:
            print(f"kvbridge: {exc}; ignored", file=sys.stderr)
            return logger
    elif isinstance(level, str):
        level = parse_level(level)
    handler = next((h for h in logger.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(stream or sys.stderr)
        logger.addHandler(handler)
    elif stream is not None:
        handler.setStream(stream)
    handler.setFormatter(logging.Formatter(fmt or DEFAULT_FORMAT))
    logger.setLevel(level)
    return logger


class RateLimitedLog:
    """Log an error that repeats (the same exception type and message) at most once per ``interval_s``.

    The first occurrence is logged with its traceback; while it persists, one line per interval says how
    often it recurred; when another error comes, or :meth:`clear` is called after a success, the count of
    suppressed repeats is logged once::

        errors = RateLimitedLog(log, "%s: progress failed", name)
        while running:
            try:
                step()
                errors.clear()
            except Exception as exc:
                errors.error(exc)
    """

    def __init__(self, logger: logging.Logger, message: str, *args: object, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.message, self.args, self.interval_s = logger, message, args, interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._key: tuple[str, str] | None = None
        self._since = 0.0
        self._repeats = 0          # suppressed since the last line

    def error(self, exc: BaseException) -> None:
        """Record one occurrence of ``exc`` (call from the ``except`` block: the traceback is ``exc``'s)."""
        key = (type(exc).__name__, str(exc))
        now = self._clock()
        with self._lock:
            if key == self._key:
                self._repeats += 1
                if now - self._since < self.interval_s:
                    return
                repeats, self._repeats, self._since = self._repeats, 0, now
                self.logger.error(self.message + " (again: %s: %s; %d times in the last %.0f s)", *self.args,
                                  key[0], key[1], repeats, self.interval_s)
                return
            self._flush()
            self._key, self._since, self._repeats = key, now, 0
        self.logger.error(self.message, *self.args, exc_info=exc)

    def clear(self) -> None:
        """The failing operation succeeded: report what was suppressed and forget the error."""
        if self._key is None:
            return
        with self._lock:
            self._flush()
            self._key = None

    def _flush(self) -> None:
        if self._key is not None and self._repeats:
            self.logger.error(self.message + " (%s: %s repeated %d more times, then stopped)", *self.args,
                              self._key[0], self._key[1], self._repeats)
        self._repeats = 0


class LineBudget:
    """At most ``per_interval`` lines per ``interval_s`` for each kind of message; the rest are counted and
    the count is said with the next line that gets through (a flood of bad frames must not become a flood
    of log lines)::

        budget = LineBudget()
        if budget.take("bad frame"):
            log.warning("dropped: %s%s", why, budget.suppressed_note("bad frame"))
    """

    def __init__(self, per_interval: int = 20, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_interval, self.interval_s, self._clock = per_interval, interval_s, clock
        self._window: dict[str, tuple[float, int]] = {}      # kind -> (window start, lines in it)
        self._suppressed: dict[str, int] = {}

    def take(self, kind: str) -> bool:
        now = self._clock()
        start, used = self._window.get(kind, (now, 0))
        if now - start >= self.interval_s:
            start, used = now, 0
        if used >= self.per_interval:
            self._window[kind] = (start, used)
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._window[kind] = (start, used + 1)
        return True

    def suppressed_note(self, kind: str) -> str:
        """`` (N more like it not logged)`` once after lines were suppressed, else ``""``."""
        count = self._suppressed.pop(kind, 0)
        return f" ({count} more like it not logged in the last {self.interval_s:.0f} s)" if count else ""

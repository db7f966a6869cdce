"""Clock skew against the authenticated time window: the injectable wall clock, the window's setting, and the
log budget that says so once per address and minute instead of once per rejected request.

With a secret, every bootstrap request carries its sender's wall-clock time; the server refuses one whose
time is further than ``clock_window_s`` (``KVBRIDGE_CLOCK_WINDOW_S``, default 60 s) from its own clock, and
both sides log the measured offset once a minute per peer address.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping

from kvbridge.logs import LineBudget

__all__ = ["CLOCK_WINDOW_ENV", "CLOCK_WINDOW_SETTING", "DEFAULT_CLOCK_WINDOW_S", "SKEW_LOG_INTERVAL_S", "Clock",
           "check_window", "clock_window_from_env", "skew_log_budget"]

Clock = Callable[[], float]
DEFAULT_CLOCK_WINDOW_S = 60.0
CLOCK_WINDOW_SETTING = "clock_window_s"
CLOCK_WINDOW_ENV = "KVBRIDGE_CLOCK_WINDOW_S"
SKEW_LOG_INTERVAL_S = 60.0       # one skew warning per peer address this often at most


def check_window(value: float, what: str = CLOCK_WINDOW_SETTING) -> float:
    """``value`` if it is a finite number of seconds > 0; ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{what}={value!r} must be a finite number of seconds > 0")
    return float(value)


def clock_window_from_env(env: Mapping[str, str] | None = None) -> float:
    """The window from ``KVBRIDGE_CLOCK_WINDOW_S`` (validated like every setting), else the default: for a
    bootstrap server built without a :class:`~kvbridge.settings.Settings` (the adapters')."""
    text = (os.environ if env is None else env).get(CLOCK_WINDOW_ENV)
    if text is None or not text.strip():
        return DEFAULT_CLOCK_WINDOW_S
    from kvbridge.settings import Settings, parse_options

    settings = parse_options(Settings, {CLOCK_WINDOW_SETTING: text}, "setting",
                             {CLOCK_WINDOW_SETTING: CLOCK_WINDOW_ENV})
    return settings.clock_window_s


def skew_log_budget(clock: Callable[[], float] = time.monotonic) -> LineBudget:
    """One skew warning per key (a peer address) per :data:`SKEW_LOG_INTERVAL_S`; the next one says how many
    refusals were not logged meanwhile."""
    return LineBudget(per_interval=1, interval_s=SKEW_LOG_INTERVAL_S, clock=clock)

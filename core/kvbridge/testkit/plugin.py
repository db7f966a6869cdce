"""pytest11 entry point of the kvbridge conformance kit: options, markers and the hooks that apply them.

Markers (registered in every run, namespaced, inert on tests that do not use them):
``kvbridge_multiprocess``, ``kvbridge_hardware(kind)``, ``kvbridge_requires(capability)``.

Cheap to load (every pytest run in an environment with kvbridge installed loads it): it imports only
pytest; the kit's classes decide their own skips and expected failures, lazily, at collection.

Options:

* ``--kvbridge-backend NAME`` (repeatable): run the backend kit only for these backends; with
  ``pytest --pyargs kvbridge.testkit.installed`` it runs the kit against each named installed backend.
* ``--kvbridge-hardware {none,cuda}``: the hardware tier. Default: run it when a CUDA device is present;
  ``none`` skips it; ``cuda`` requires it (fails when there is no device).
* ``--kvbridge-no-shrink`` (or the environment variable ``KVBRIDGE_KIT_NO_SHRINK=1``): hypothesis reports
  the first failing example it finds instead of shrinking it to a minimal one. Shrinking a failing
  state-machine run of a slow engine can take many minutes; turn it off while iterating on a fix, and
  back on to get the small example for a bug report.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

STRICT_STATES_ENV = "KVBRIDGE_STRICT_STATES"

if TYPE_CHECKING:
    from hypothesis import Phase, settings

# Every marker, option and environment variable of the kit carries the ``kvbridge`` prefix: the plugin loads
# into every pytest run of an environment where kvbridge is installed, and must not claim names (``hardware``,
# ``requires``) that the project under test may use for its own markers. The hooks below act only on tests that
# carry these markers or belong to a kit class; any other test is left as it is.
MARK_MULTIPROCESS = "kvbridge_multiprocess"
MARK_HARDWARE = "kvbridge_hardware"
MARK_REQUIRES = "kvbridge_requires"
MARKERS = (
    f"{MARK_MULTIPROCESS}: kvbridge kit: starts peer processes (real sockets on the loopback interface)",
    f"{MARK_HARDWARE}(kind): kvbridge kit: needs accelerator memory of that kind ('cuda'); see --kvbridge-hardware",
    f"{MARK_REQUIRES}(capability): kvbridge kit: skipped unless the plugin's spec declares the capability",
)

_CUDA: bool | None = None
_NO_SHRINK_OPTION = False
NO_SHRINK_ENV = "KVBRIDGE_KIT_NO_SHRINK"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvbridge", "kvbridge conformance kit")
    group.addoption("--kvbridge-backend", action="append", default=[], metavar="NAME",
                    help="run the backend kit only for this backend (repeatable)")
    group.addoption("--kvbridge-hardware", choices=("none", "cuda"), default=None,
                    help="hardware tier: 'none' skips it, 'cuda' requires a CUDA device "
                         "(default: run it when a CUDA device is present)")
    group.addoption("--kvbridge-no-shrink", action="store_true", default=False,
                    help=f"report the first failing hypothesis example without shrinking it (also: {NO_SHRINK_ENV}=1)")


def pytest_configure(config: pytest.Config) -> None:
    global _NO_SHRINK_OPTION
    # an event the protocol's transition tables do not allow raises under test (and in the processes the
    # tests start), instead of failing the room; KVBRIDGE_STRICT_STATES=0 turns it off
    os.environ.setdefault(STRICT_STATES_ENV, "1")
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    _NO_SHRINK_OPTION = bool(config.getoption("kvbridge_no_shrink", default=False))


def pytest_unconfigure(config: pytest.Config) -> None:
    global _NO_SHRINK_OPTION
    _NO_SHRINK_OPTION = False


def shrinking() -> bool:
    """Should the kit's hypothesis tests shrink a failing example? (no with --kvbridge-no-shrink or
    KVBRIDGE_KIT_NO_SHRINK set to anything but "", "0", "false", "no")"""
    env = os.environ.get(NO_SHRINK_ENV, "").strip().lower()
    return not (_NO_SHRINK_OPTION or env not in ("", "0", "false", "no"))


def hypothesis_phases() -> tuple[Phase, ...] | None:
    """The ``phases`` for the kit's hypothesis settings: None (hypothesis's own, from the active profile)
    while shrinking is on, else every phase of the active profile but shrinking (and explaining, which
    needs it)."""
    if shrinking():
        return None
    from hypothesis import Phase, settings

    return tuple(p for p in settings().phases if p not in (Phase.shrink, Phase.explain))


def kit_settings(**kwargs: Any) -> settings:
    """``hypothesis.settings(**kwargs)`` for the kit's property tests, with :func:`hypothesis_phases`."""
    from hypothesis import settings

    phases = hypothesis_phases()
    return settings(**kwargs) if phases is None else settings(**kwargs, phases=phases)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Kit classes add their skips (undeclared capability, unavailable plugin) and strict xfails."""
    for item in items:
        marks_for = getattr(getattr(item, "cls", None), "_kvbridge_marks", None)
        if marks_for is not None:
            for mark in marks_for(item, config):
                item.add_marker(mark)


def cuda_present() -> bool:
    """Is a CUDA device usable here? (cheap device-file check first; torch only when one may exist)"""
    global _CUDA
    if _CUDA is None:
        _CUDA = False
        if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia"):
            try:
                import torch

                _CUDA = bool(torch.cuda.is_available())
            except Exception:  # noqa: BLE001 - no usable torch means no CUDA tier
                _CUDA = False
    return _CUDA


def hardware_decision(kind: str, option: str | None) -> tuple[str, str]:
    """("run" | "skip" | "fail", reason) for a test marked ``kvbridge_hardware(kind)``."""
    if kind != "cuda":
        return "skip", f"the kit has no {kind!r} hardware tier"
    if option == "none":
        return "skip", "hardware tier disabled (--kvbridge-hardware none)"
    if cuda_present():
        return "run", ""
    if option == "cuda":
        return "fail", "--kvbridge-hardware cuda was given, but no CUDA device is usable here"
    return "skip", "no CUDA device here; the hardware tier runs on a GPU host (--kvbridge-hardware cuda requires it)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A test during which this process saw an illegal state transition fails, naming it (a handler that
    catches every exception, like the agent's frame handler, would otherwise hide it)."""
    from kvbridge.protocol.states import illegal_events

    illegal_events(clear=True)
    yield
    seen = illegal_events(clear=True)
    if seen:
        pytest.fail("illegal protocol state transitions:\n" + "\n".join(seen), pytrace=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(MARK_HARDWARE):
        kind = str(mark.args[0]) if mark.args else "cuda"
        verdict, reason = hardware_decision(kind, item.config.getoption("kvbridge_hardware"))
        if verdict == "skip":
            pytest.skip(reason)
        if verdict == "fail":
            pytest.fail(reason, pytrace=False)


"""pytest11 entry point of the kvbridge conformance kit: markers and options only (cheap to load)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvbridge", "kvbridge conformance kit")
    group.addoption("--kvbridge-backend", action="append", default=[], metavar="NAME",
                    help="run the backend kit against this backend (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: starts peer processes")
    config.addinivalue_line("markers", "hardware(kind): needs GPU memory of that kind")

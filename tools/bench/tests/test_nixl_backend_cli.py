"""``kvbridge bench --backend nixl`` calls ``kvbridge_bench.nixl_backend.main()`` with no argv: the defaults, never
the caller's sys.argv."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from kvbridge_bench import nixl_backend as bench


def test_main_without_argv_runs_the_defaults_whatever_sys_argv_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(sys, "argv", ["kvbridge", "bench", "--backend", "nixl"])
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: seen.update(kwargs) or {})
    monkeypatch.setattr(bench, "format_report", lambda result: "report")
    assert bench.main() == 0
    assert seen["layers"] == 64 and seen["pages"] == 256 and seen["two_process"] is False


def test_main_parses_the_argv_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: seen.update(kwargs) or {})
    monkeypatch.setattr(bench, "format_report", lambda result: "report")
    assert bench.main(["--layers", "2", "--two-process"]) == 0
    assert seen["layers"] == 2 and seen["two_process"] is True

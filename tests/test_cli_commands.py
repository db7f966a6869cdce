"""Subcommands from other distributions (entry point group ``kvbridge.cli``): found without the core importing
them by name, a missing one answers with what to install, and a broken or colliding one is reported and left out
while the built-in commands keep working. Entry points are faked (``importlib.metadata.entry_points``)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
from collections.abc import Callable
from typing import Any

import pytest

from kvbridge import cli


class _EP:
    """What ``_add_commands`` uses of an ``EntryPoint``: name, value, load()."""

    def __init__(self, name: str, load: Callable[[], Any], value: str = "fake.module:add") -> None:
        self.name, self.value, self._load = name, value, load

    def load(self) -> Any:
        return self._load()


def _install(monkeypatch: pytest.MonkeyPatch, *eps: Any) -> None:
    def entry_points(**params: Any) -> list[Any]:
        return list(eps) if params.get("group") == cli.COMMAND_GROUP else []
    monkeypatch.setattr(md, "entry_points", entry_points)


def _hello(sub: Any) -> None:
    p = sub.add_parser("hello", help="says hello")
    p.add_argument("--times", type=int, default=1)
    p.set_defaults(func=lambda args: 40 + args.times)


def test_without_kvbridge_bench_the_bench_command_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _install(monkeypatch)
    for argv in (["bench"], ["bench", "transfer", "--quick", "--json", "r.json"], ["bench", "--help"]):
        assert cli.main(argv) == cli.EXIT_UNAVAILABLE
        assert "pip install kvbridge-bench" in capsys.readouterr().err
    assert "not installed here: pip install kvbridge-bench" in cli.build_parser().format_help()


def test_an_entry_point_adds_a_command_that_runs_and_refuses_unknown_flags(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _install(monkeypatch, _EP("hello", lambda: _hello))
    assert cli.main(["hello", "--times", "2"]) == 42
    with pytest.raises(SystemExit) as exc:
        cli.main(["hello", "--loud"])
    assert exc.value.code == cli.EXIT_USAGE and "unrecognized arguments: --loud" in capsys.readouterr().err


def test_a_broken_entry_point_is_reported_and_the_rest_keeps_working(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing() -> Any:
        raise ModuleNotFoundError("No module named 'kvbridge_gone'")

    def half(sub: Any) -> None:            # adds its parser, then fails: the half-added command is taken out
        sub.add_parser("bench")
        raise RuntimeError("half-way")

    _install(monkeypatch, _EP("hello", missing), _EP("bench", lambda: half), _EP("extra", lambda: 42))
    parser = cli.build_parser()
    err = capsys.readouterr().err
    assert "'hello' command (fake.module:add) could not be loaded: ModuleNotFoundError" in err
    assert "'bench' command (fake.module:add) could not be loaded: RuntimeError: half-way" in err
    assert "could not be loaded: TypeError" in err          # an entry point that is not a callable of one argument
    assert parser.parse_args(["demo", "--prefill-tp", "4"]).prefill_tp == 4
    assert cli.main(["bench", "planner"]) == cli.EXIT_UNAVAILABLE      # the fallback, not the broken half
    assert "pip install kvbridge-bench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["hello"])
    assert exc.value.code == cli.EXIT_USAGE


def test_an_entry_point_cannot_replace_a_built_in_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    loaded: list[str] = []

    def hijack() -> Any:
        loaded.append("demo")
        return _hello

    _install(monkeypatch, _EP("demo", hijack), _EP("plugins", hijack))
    parser = cli.build_parser()
    assert loaded == []                                                    # never even imported
    assert "ignoring the 'demo' command" in capsys.readouterr().err
    assert parser.parse_args(["demo", "--requests", "3"]).func is cli._demo


def test_the_same_entry_point_twice_is_not_a_conflict(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _install(monkeypatch, _EP("hello", lambda: _hello), _EP("hello", lambda: _hello))
    assert cli.main(["hello"]) == 41 and capsys.readouterr().err == ""
    _install(monkeypatch, _EP("hello", lambda: _hello), _EP("hello", lambda: _hello, value="other.module:add"))
    assert cli.main(["hello"]) == 41
    assert "ignoring the 'hello' command of entry point 'other.module:add'" in capsys.readouterr().err


def test_a_command_without_func_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def bare(sub: Any) -> argparse.ArgumentParser:
        return sub.add_parser("bare")      # type: ignore[no-any-return]

    _install(monkeypatch, _EP("bare", lambda: bare))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bare"])
    assert exc.value.code == cli.EXIT_USAGE and "nothing to run" in capsys.readouterr().err

"""``kvbridge bench`` reaches kvbridge-bench through the ``kvbridge.cli`` entry point its pyproject declares (the
core never imports it by name); the command's flags and exit codes are those of the old built-in one."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbridge import cli
from kvbridge_bench import cli as bench_cli

tomllib = pytest.importorskip("tomllib")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _declared() -> md.EntryPoint:
    eps = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][cli.COMMAND_GROUP]
    assert list(eps) == ["bench"]
    return md.EntryPoint(name="bench", value=eps["bench"], group=cli.COMMAND_GROUP)


@pytest.fixture
def as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point as pip installs it from the pyproject (this tree may run without installing it)."""
    declared = _declared()

    def entry_points(**params: Any) -> list[md.EntryPoint]:
        return [declared] if params.get("group") == cli.COMMAND_GROUP else []
    monkeypatch.setattr(md, "entry_points", entry_points)


def test_the_declared_entry_point_is_add_command() -> None:
    assert _declared().load() is bench_cli.add_command


def test_an_installed_kvbridge_bench_declares_the_same_entry_point() -> None:
    installed = [ep for ep in md.entry_points(group=cli.COMMAND_GROUP) if ep.name == "bench"]
    if not installed:
        pytest.skip("kvbridge-bench is not installed here (a source tree on PYTHONPATH)")
    assert [ep.value for ep in installed] == [_declared().value]


@pytest.mark.usefixtures("as_installed")
def test_kvbridge_bench_through_the_entry_point_keeps_its_flags_and_exit_codes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "bench               benchmarks, printed as ratios" in cli.build_parser().format_help()
    assert cli.main(["bench", "planner", "--sizes", "1GiB", "--quick"]) == 2
    assert "--sizes, --quick apply to `kvbridge bench transfer` only" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--tp-pairs", "3-1"]) == 2
    assert "8 KV heads must split evenly" in capsys.readouterr().err
    assert cli.main(["bench", "--backend", "no-such-backend"]) == 2
    assert "no backend named 'no-such-backend' is installed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "sideways"])
    assert exc.value.code == cli.EXIT_USAGE and "invalid choice: 'sideways'" in capsys.readouterr().err


def test_python_m_kvbridge_bench_has_the_same_options() -> None:
    done = subprocess.run([sys.executable, "-m", "kvbridge_bench", "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for flag in ("--tp-pairs", "--layerwise", "--json", "--plots", "--backend", "planner,control,transfer,flood"):
        assert flag in done.stdout
    bad = subprocess.run([sys.executable, "-m", "kvbridge_bench", "--no-such-flag"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == bench_cli.EXIT_USAGE and "unrecognized arguments" in bad.stderr

"""Release hygiene: every distribution of this repository has one version, depends on this minor of kvbridge,
and the CHANGELOG has a dated entry for it; the previous release the version-skew test runs is the one whose
protocol this release still speaks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvbridge.protocol import wire

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
PROJECTS = [REPO / "pyproject.toml", *sorted(REPO.glob("plugins/*/pyproject.toml")),
            *sorted(REPO.glob("adapters/*/pyproject.toml")), *sorted(REPO.glob("tools/*/pyproject.toml"))]


def _project(path: Path) -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads(path.read_text())["project"]
    return project


def test_every_distribution_is_checked() -> None:
    names = {_project(path)["name"] for path in PROJECTS}
    assert {"kvbridge", "kvbridge-nixl", "kvbridge-vllm", "kvbridge-bench"} <= names, names


def test_every_distribution_has_the_same_version_and_depends_on_this_minor() -> None:
    versions = {path.relative_to(REPO).as_posix(): _project(path)["version"] for path in PROJECTS}
    assert len(set(versions.values())) == 1, versions
    version = next(iter(versions.values()))
    major, minor = (int(x) for x in version.split(".")[:2])
    want = f">={major}.{minor},<{major}.{minor + 1}"
    for path in PROJECTS:
        for dep in _project(path).get("dependencies", []):
            name = re.match(r"[A-Za-z0-9_.-]+", dep)
            if name and name.group().startswith("kvbridge"):
                assert dep == f"{name.group()}{want}", f"{path.relative_to(REPO)}: {dep!r}, expected {want}"


def test_the_changelog_has_a_dated_entry_for_this_version() -> None:
    version = _project(REPO / "pyproject.toml")["version"]
    text = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), (
        f"CHANGELOG.md has no dated '## [{version}] - YYYY-MM-DD' entry")
    assert text.index("## [Unreleased]") < text.index(f"## [{version}]")


def test_every_older_protocol_spoken_is_tested_against_a_release_that_spoke_it() -> None:
    import test_version_skew

    assert test_version_skew.PREVIOUS_VERSION == wire.MIN_PROTOCOL_VERSION
    assert sorted(test_version_skew.RELEASES) == list(range(wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION))

"""Real wheels (issue 25): every distribution of this tree builds as a wheel and an sdist through its own build
backend (from a copy of its sources, not the editable install), their metadata says what its pyproject.toml says
(name, version, dependencies, entry points, ``py.typed``), and the wheels installed into a fresh venv run:
``kvbridge plugins`` lists every plugin (none broken) and a short loopback demo is byte-exact.

Only kvbridge's own small dependencies (numpy, msgspec, pyzmq, pluggy) are installed from the index into that
venv; the plugins' transfer engines (NIXL pulls a CUDA torch) are not, so their backends are listed as
unavailable with the reason, which is what a user without them sees.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from email.parser import HeaderParser
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DISTS = [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml")),
         *sorted(p.parent for p in ROOT.glob("adapters/*/pyproject.toml")),
         *sorted(p.parent for p in ROOT.glob("tools/*/pyproject.toml"))]
SKIP = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".venv*", "*.pyc")


def _project(path: Path) -> dict[str, object]:
    return dict(tomllib.loads((path / "pyproject.toml").read_text())["project"])


def _copy(src: Path, dst: Path) -> Path:
    """The sources a build needs, without the tree's build outputs (the root: its pyproject, README, core/)."""
    if src == ROOT:
        dst.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (src / name).exists():
                shutil.copy2(src / name, dst / name)
        shutil.copytree(src / "core", dst / "core", ignore=SKIP)
        return dst
    return Path(shutil.copytree(src, dst, ignore=SKIP))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Path]]]:
    """name -> (wheel, sdist), each built by ``setuptools.build_meta`` in a copy of its sources."""
    tmp = tmp_path_factory.mktemp("wheels")
    out, dist = {}, tmp / "dist"
    dist.mkdir()
    for i, src in enumerate(DISTS):
        work = _copy(src, tmp / f"src{i}")
        built_names = []
        for hook in ("build_wheel", "build_sdist"):    # one process each: setuptools keeps state between them
            code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
            done = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=work, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, f"{src}: {hook} failed\n{done.stderr[-3000:]}"
            built_names.append(next(line for line in done.stdout.splitlines() if line.startswith("BUILT ")).split()[1])
        out[str(_project(src)["name"])] = (dist / built_names[0], dist / built_names[1])
    yield out


def _metadata(wheel: Path) -> tuple[object, str, set[str]]:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(z.read(info).decode())
        eps = next((z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    return meta, eps, names


@pytest.mark.parametrize("src", DISTS, ids=lambda p: p.name if p != ROOT else "kvbridge")
def test_each_wheel_and_sdist_says_what_its_pyproject_says(built: dict[str, tuple[Path, Path]],
                                                           src: Path) -> None:
    project = _project(src)
    name = str(project["name"])
    wheel, sdist = built[name]
    meta, eps, names = _metadata(wheel)
    assert canonicalize_name(meta["Name"]) == canonicalize_name(name) and meta["Version"] == project["version"]
    # dependencies: the same requirements (extras' ones carry their marker)
    declared = {str(Requirement(r)) for r in project.get("dependencies", [])}  # type: ignore[union-attr]
    shipped = {str(Requirement(r)) for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r}
    assert shipped == declared, f"{name}: Requires-Dist {sorted(shipped)} != pyproject {sorted(declared)}"
    extras = dict(project.get("optional-dependencies", {}))  # type: ignore[call-overload]
    assert set(meta.get_all("Provides-Extra") or []) == set(extras), name
    # entry points: every group and name of the pyproject
    for group, entries in dict(project.get("entry-points", {})).items():  # type: ignore[call-overload]
        for key, value in entries.items():
            assert f"[{group}]" in eps and f"{key} = {value}" in eps, f"{name}: entry point {group}:{key} missing"
    for key, value in dict(project.get("scripts", {})).items():  # type: ignore[call-overload]
        assert "[console_scripts]" in eps and f"{key} = {value}" in eps, f"{name}: script {key} missing"
    # package data: each package's py.typed, and no test, cache or build output in the wheel
    data = tomllib.loads((src / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    for package, files in data.get("package-data", {}).items():
        for file in files:
            assert f"{package.replace('.', '/')}/{file}" in names, f"{name}: {package}/{file} not in the wheel"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or "/tests/" in f"/{n}"], name
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert any(m.endswith("/pyproject.toml") for m in members) and any(m.endswith(".py") for m in members), name


def test_the_wheels_run_in_a_fresh_venv(built: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    wheels = {name: str(w) for name, (w, _) in built.items()}
    core = wheels.pop("kvbridge")
    done = subprocess.run([*pip, core], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the plugins and adapters without their engines (NIXL would pull a CUDA torch): as a user without them
    done = subprocess.run([*pip, "--no-deps", *wheels.values()], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kvbridge = str(venv / "bin" / "kvbridge")
    listed = subprocess.run([kvbridge, "plugins", "--json"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    records = {r["name"]: r for r in json.loads(listed.stdout)}
    broken = {n: r["reason"][:200] for n, r in records.items() if r["status"] == "error"}
    assert not broken, f"plugins that fail to load from their wheels: {broken}"
    for name in ("kv", "loopback", "mamba", "swa", "nsa", "row"):
        assert records.get(name, {}).get("status") == "available", (name, records.get(name))
    for name in ("nixl", "mooncake"):
        assert records[name]["status"] == "unavailable" and records[name]["reason"], records[name]
    demo = subprocess.run([kvbridge, "demo", "--backend", "loopback", "--requests", "6", "--prefill-tp", "2",
                           "--decode-tp", "1", "--timeout", "120"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert demo.returncode == 0 and "verified: 6/6 byte-exact" in demo.stdout, demo.stdout[-2000:] + demo.stderr[-2000:]

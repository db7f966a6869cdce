"""The conformance kit's pytest11 plugin loads into every pytest run where kvbridge is installed: it must
claim only ``kvbridge``-prefixed names and leave every test that does not use the kit as it is."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kvbridge.testkit import plugin

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def test_every_kit_marker_is_namespaced() -> None:
    names = [line.split(":", 1)[0].split("(", 1)[0] for line in plugin.MARKERS]
    assert names == [plugin.MARK_MULTIPROCESS, plugin.MARK_HARDWARE, plugin.MARK_REQUIRES]
    assert all(name.startswith("kvbridge_") for name in names), names


def test_the_kit_registers_no_bare_marker(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--markers")
    registered = {m.group(1) for m in re.finditer(r"^@pytest\.mark\.(\w+)", result.stdout.str(), re.M)}
    assert {"kvbridge_multiprocess", "kvbridge_hardware", "kvbridge_requires"} <= registered
    assert not registered & {"hardware", "requires", "multiprocess"}, registered


def test_a_project_may_own_hardware_and_requires_markers(pytester: pytest.Pytester) -> None:
    """A project with its own ``hardware``/``requires`` markers (another meaning, other arguments) runs under
    --strict-markers with the kit loaded, and the kit does not skip or fail its tests."""
    pytester.makeini("[pytest]\nmarkers =\n    hardware(kind): the project's own\n"
                     "    requires(thing): the project's own\n")
    pytester.makepyfile('''
import pytest

@pytest.mark.hardware("cuda")
def test_theirs_cuda():
    pass

@pytest.mark.requires("notifications")
def test_theirs_requires():
    pass
''')
    result = pytester.runpytest_inprocess("--strict-markers", "--kvbridge-hardware", "none", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_bare_names_are_not_registered_by_the_kit(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
import pytest

@pytest.mark.hardware("cuda")
def test_old_name():
    pass
''')
    # a subprocess: pytest's marker generator remembers names registered by earlier in-process runs
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'hardware' not found in `markers` configuration option*"])


def test_kit_markers_act_only_where_used(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
import pytest

def test_plain():
    pass

@pytest.mark.kvbridge_hardware("cuda")
def test_gpu_tier():
    pass
''')
    result = pytester.runpytest_inprocess("--strict-markers", "--kvbridge-hardware", "none", "-rs",
                                          "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*hardware tier disabled (--kvbridge-hardware none)*"])


def test_the_repository_uses_no_bare_kit_marker() -> None:
    """Every use in this repository was moved to the namespaced names (this file uses the bare ones on
    purpose, in the projects it writes)."""
    done = subprocess.run(["git", "grep", "-nE", r"pytest\.mark\.(hardware|requires|multiprocess)\b", "--",
                           "*.py",
                           ":!tests/test_kit_hygiene.py"], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        pytest.skip(f"git grep is not usable here: {done.stderr.strip()}")
    assert done.stdout == "", done.stdout

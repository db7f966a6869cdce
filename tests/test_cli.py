"""The ``kvbridge`` command as a user runs it: a subprocess of the installed console script."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("kvbridge")
    cmd = [str(script)] if script.exists() else [shutil.which("kvbridge") or "kvbridge"]
    env = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS")}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env, check=False)


@pytest.fixture(scope="module")
def listed() -> dict[str, dict[str, Any]]:
    done = kvbridge("plugins", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert isinstance(rows, list)
    for row in rows:
        assert set(row) >= {"name", "kind", "distribution", "version", "status", "reason", "hint", "capabilities"}
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name, kind, distribution, capabilities", [
    ("loopback", "backend", "kvbridge", ["host-memory", "multi-process", "notifications", "writer-gone"]),
    ("kv", "state", "kvbridge", []),
    ("mamba", "state", "kvbridge-mamba", []),
    ("swa", "state", "kvbridge-swa", []),
    ("nsa", "state", "kvbridge-nsa", []),
])
def test_plugins_json_lists_available_plugin(listed: dict[str, dict[str, Any]], name: str, kind: str,
                                             distribution: str, capabilities: list[str]) -> None:
    row = listed.get(name)
    assert row is not None, f"{name} is not listed; listed: {sorted(listed)}"
    assert row["kind"] == kind
    assert row["distribution"] == distribution
    assert row["version"] == md.version(distribution)
    assert row["status"] == "available", row["reason"]
    assert row["reason"] == ""
    assert sorted(row["capabilities"]) == capabilities


def test_plugins_table_names_the_state_types() -> None:
    done = kvbridge("plugins")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:] if line.strip()}
    for name, dist in (("mamba", "kvbridge-mamba"), ("swa", "kvbridge-swa"), ("nsa", "kvbridge-nsa")):
        assert rows[name][1:5] == ["state", dist, md.version(dist), "available"]


def test_demo_refuses_a_topology_before_starting_any_rank() -> None:
    done = kvbridge("demo", "--backend", "loopback", "--model", "qwen3-next", "--prefill-tp", "3", "--decode-tp", "1")
    assert done.returncode == 64                     # a usage error (EX_USAGE)
    assert "preset 'qwen3-next' cannot run prefill TP 3 -> decode TP 1" in done.stderr
    assert "2 KV heads cannot be sharded over TP 3" in done.stderr
    assert "requests" not in done.stdout            # no rank process ran

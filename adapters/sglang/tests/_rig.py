"""Start the SGLang ranks of a scenario as .venv-sglang processes and collect their results."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "sglang_driver.py"


def need_sglang() -> None:
    if not PYTHON.exists():
        pytest.skip(".venv-sglang is missing (scripts/setup.sh makes it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """Every rank of a scenario: ``ranks()`` lists (role, dp, pp, tp_rank)."""

    def __init__(self, scenario: dict[str, Any], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.sc = dict(scenario, port=free_port())
        self.tmp = tmp
        self.procs: dict[tuple[str, int, int, int], subprocess.Popen[bytes]] = {}
        self.results: dict[tuple[str, int, int, int], Path] = {}
        base = {**os.environ, "PYTHONUNBUFFERED": "1", "KVBRIDGE_BACKEND": "loopback", "OMP_NUM_THREADS": "1",
                "KVBRIDGE_STAGING_MIB": "4", "KVBRIDGE_PEER_TIMEOUT_S": "3", "KVBRIDGE_HEARTBEAT_S": "0.5",
                "KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "120", "KVBRIDGE_WAITING_TIMEOUT_S": "120", **(env or {})}
        for key in self.ranks():
            role, dp, pp, tp = key
            result = tmp / f"{role}-dp{dp}-pp{pp}-tp{tp}.json"
            log = open(tmp / f"{role}-dp{dp}-pp{pp}-tp{tp}.log", "wb")
            self.results[key] = result
            self.procs[key] = subprocess.Popen(
                [str(PYTHON), str(DRIVER), json.dumps(self.sc), role, str(dp), str(pp), str(tp), str(result)],
                stdout=log, stderr=subprocess.STDOUT, env=base, start_new_session=True)

    def ranks(self) -> list[tuple[str, int, int, int]]:
        out = []
        for role in ("prefill", "decode"):
            side = self.sc[role]
            for dp in range(side.get("dp", 1)):
                for pp in range(side.get("pp", 1)):
                    for tp in range(side["tp"]):
                        out.append((role, dp, pp, tp))
        return out

    def result(self, key: tuple[str, int, int, int]) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.results[key].read_text())
            return data
        except (OSError, ValueError):
            return {}

    def wait(self, timeout_s: float = 400) -> dict[tuple[str, int, int, int], dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        for key, proc in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{key} did not finish; log:\n{self.log(key)}") from None
        return {key: self.result(key) for key in self.procs}

    def log(self, key: tuple[str, int, int, int]) -> str:
        role, dp, pp, tp = key
        try:
            return "\n".join((self.tmp / f"{role}-dp{dp}-pp{pp}-tp{tp}.log").read_text().splitlines()[-40:])
        except OSError:
            return ""

    def signal(self, key: tuple[str, int, int, int], sig: int) -> None:
        os.killpg(self.procs[key].pid, sig)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for name in os.listdir("/dev/shm"):
            if name.startswith("kvbridge-sglangtest-"):
                pid = name.split("-")[2]
                if not Path(f"/proc/{pid}").exists():
                    try:
                        os.unlink(f"/dev/shm/{name}")
                    except FileNotFoundError:
                        pass


def check_clean(run: Run, results: dict[tuple[str, int, int, int], dict[str, Any]]) -> None:
    """Every rank finished without an exception; every decode request verified byte for byte."""
    for key, res in results.items():
        assert res.get("done"), f"{key}: {res.get('exception', 'no result')}\n{run.log(key)}"
        assert not res.get("errors"), f"{key}: byte mismatches {res['errors'][:10]}"
        assert not res.get("unfinished"), f"{key}: unfinished rooms {res['unfinished']}\n{run.log(key)}"

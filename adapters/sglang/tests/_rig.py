"""Start the SGLang ranks of a scenario as .venv-sglang processes and collect their results.

A rank is forked from a warm zygote (``zygote.py``: torch and SGLang imported once per pytest worker) unless
``KVBRIDGE_SGLANG_TEST_FRESH=1`` is set, a test asks for ``fresh=True``, or the rank's environment differs
from the zygote's in anything but ``KVBRIDGE_*`` settings (read when a rank starts, not at import): then it is
a fresh ``python`` process, as in a deployment. Either way the test sees a Popen-like handle (pid, poll,
wait, returncode), the rank leads its own process group, and writes its log and result files.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import pytest

# importing it sets this run's /dev/shm tag in os.environ now, before any zygote starts
from kvbridge.shmnames import RUN_ENV

ROOT = Path(__file__).resolve().parents[3]
PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "sglang_driver.py"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
FRESH_ENV = "KVBRIDGE_SGLANG_TEST_FRESH"
#: what every rank gets in its environment (a test's ``env`` comes on top). NIXL_LOG_LEVEL: NIXL reads it at import,
#: and kvbridge's demo sets it in the pytest worker's own environment (``os.environ.setdefault``) when a demo test runs
#: there; fixed here, a zygote started before such a test still forks the ranks of the tests after it (it spawned
#: fresh interpreters instead, each importing torch and SGLang again)
BASE_ENV = {"PYTHONUNBUFFERED": "1", "KVBRIDGE_BACKEND": "loopback", "OMP_NUM_THREADS": "1", "NIXL_LOG_LEVEL": "WARN",
            "KVBRIDGE_STAGING_MIB": "4", "KVBRIDGE_PEER_TIMEOUT_S": "3", "KVBRIDGE_HEARTBEAT_S": "0.5",
            "KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "120", "KVBRIDGE_WAITING_TIMEOUT_S": "120"}
ZYGOTE_START_S = 400.0           # importing torch + SGLang on a loaded 2-core host
ZYGOTE_ANSWER_S = 60.0


class ZygoteError(RuntimeError):
    """The zygote died or stopped answering: the ranks it forked cannot be waited for."""


class Proc(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Zygote:
    """A zygote.py process and its line protocol (one request at a time, every answer bounded in time)."""

    def __init__(self, env: dict[str, str], *, flags: tuple[str, ...] = ()) -> None:
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="kvbridge-sglang-zygote-")
        self.log_path = Path(self.dir) / "zygote.log"
        self._lock = threading.Lock()
        self._buf = b""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(PYTHON), str(ZYGOTE), *flags],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
                                         cwd=ROOT, start_new_session=True)
        hello = self._read(ZYGOTE_START_S)
        if not hello.get("ready"):
            self.close()
            raise ZygoteError(f"the SGLang zygote did not start: {hello.get('error', hello)}\n{self.log()}")
        self.pid = int(hello["pid"])
        self.import_s = float(hello["import_s"])

    def log(self) -> str:
        try:
            return "zygote log (last lines):\n" + "\n".join(self.log_path.read_text().splitlines()[-30:])
        except OSError:
            return ""

    def _dead(self, why: str) -> ZygoteError:
        rc = self.proc.poll()
        return ZygoteError(f"the SGLang zygote (pid {self.proc.pid}) {why}"
                           f"{'' if rc is None else f' (exit status {rc})'}; its ranks cannot be waited for\n"
                           f"{self.log()}")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._dead(f"gave no answer in {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._dead("died")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise self._dead("died") from None
            answer = self._read(ZYGOTE_ANSWER_S)
        if "error" in answer:
            raise ZygoteError(f"the SGLang zygote refused {request.get('op')}: {answer['error']}")
        return answer

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> ZygoteProc:
        answer = self.call({"op": "spawn", "argv": argv, "env": env, "cwd": str(cwd or os.getcwd()),
                            "log": str(log)})
        return ZygoteProc(self, int(answer["pid"]))

    def close(self) -> None:
        """EOF on its stdin: it kills the children it still has and exits."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.log_path.unlink()
            os.rmdir(self.dir)
        except OSError:
            pass


class ZygoteProc:
    """A rank forked by the zygote, with what the tests use of ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            rc = self.zygote.call({"op": "poll", "pids": [self.pid]})["status"][str(self.pid)]
            self.returncode = None if rc is None else int(rc)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
        return rc


_ZYGOTE: Zygote | None = None


def zygote() -> Zygote:
    """This pytest worker's zygote (started on first use, again if it died; closed when pytest exits)."""
    global _ZYGOTE
    if _ZYGOTE is not None and not _ZYGOTE.alive():
        _ZYGOTE.close()
        _ZYGOTE = None
    if _ZYGOTE is None:
        _ZYGOTE = Zygote(zygote_env())
        atexit.register(_ZYGOTE.close)
    return _ZYGOTE


def runtime_key(key: str) -> bool:
    """An environment variable read only after a rank started: kvbridge's settings (not ``KVBRIDGE_LOG`` nor the
    shm run tag, read at import), the SGLang heartbeat count the adapter reads, and pytest's name of the current
    test (it changes every test)."""
    if key in ("PYTEST_CURRENT_TEST", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"):
        return True            # the second: read by the adapter's decode manager (SGLang's own one is replaced)
    return key.startswith("KVBRIDGE_") and key not in ("KVBRIDGE_LOG", RUN_ENV)


def forkable(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """A rank may come from the zygote when its environment differs from the zygote's only in variables read at
    run time (``runtime_key``); anything else may have been read at import."""
    return all(runtime_key(k) for k in env.keys() | zygote_env.keys() if env.get(k) != zygote_env.get(k))


def zygote_env() -> dict[str, str]:
    """The environment a new zygote imports under: the ranks' base without a test's ``KVBRIDGE_*`` settings."""
    env = {**os.environ, **BASE_ENV}
    for key in [k for k in env if runtime_key(k) and k not in BASE_ENV]:
        del env[key]
    return env


def spawn(argv: list[str], env: dict[str, str], log: Path, *, fresh: bool = False, cwd: Path | None = None
          ) -> Proc:
    """One .venv-sglang process running ``argv`` (a script and its arguments, or ``-c`` code) in its own session,
    stdout and stderr on ``log``: forked from the zygote, or a fresh interpreter (``fresh``, $KVBRIDGE_SGLANG_
    TEST_FRESH=1, or an environment the zygote cannot give)."""
    if not fresh and os.environ.get(FRESH_ENV, "") in ("", "0"):
        running = _ZYGOTE is not None and _ZYGOTE.alive()
        z_env = _ZYGOTE.env if _ZYGOTE is not None and running else zygote_env()
        if forkable(env, z_env):
            return zygote().spawn(argv, env, log, cwd)
        differ = sorted(k for k in env.keys() | z_env.keys() if env.get(k) != z_env.get(k) and not runtime_key(k))
        warnings.warn(f"a fresh SGLang rank (slow): its environment differs from the zygote's in {differ}",
                      stacklevel=2)
    with open(log, "wb") as out:
        return subprocess.Popen([str(PYTHON), *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)


def run_script(code: str, timeout_s: float) -> tuple[int, str]:
    """``python -c code`` under .venv-sglang in the repository root: its exit code and output (bounded)."""
    env = {**os.environ, **BASE_ENV}
    with tempfile.TemporaryDirectory(prefix="kvbridge-sglang-script-") as tmp:
        log = Path(tmp) / "out.log"
        proc = spawn(["-c", code], env, log, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise AssertionError(f"the script did not finish in {timeout_s} s:\n{log.read_text()[-4000:]}") from None
        return rc, log.read_text()


def need_sglang() -> None:
    if not PYTHON.exists():
        pytest.skip(".venv-sglang is missing (scripts/setup.sh makes it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """Every rank of a scenario: ``ranks()`` lists (role, dp, pp, tp_rank)."""

    def __init__(self, scenario: dict[str, Any], tmp: Path, env: dict[str, str] | None = None, *,
                 fresh: bool = False) -> None:
        self.sc = dict(scenario, port=free_port())
        self.tmp = tmp
        self.procs: dict[tuple[str, int, int, int], Proc] = {}
        self.results: dict[tuple[str, int, int, int], Path] = {}
        base = {**os.environ, **BASE_ENV, **(env or {})}
        try:
            for key in self.ranks():
                role, dp, pp, tp = key
                result = tmp / f"{role}-dp{dp}-pp{pp}-tp{tp}.json"
                self.results[key] = result
                self.procs[key] = spawn(
                    [str(DRIVER), json.dumps(self.sc), role, str(dp), str(pp), str(tp), str(result)], base,
                    tmp / f"{role}-dp{dp}-pp{pp}-tp{tp}.log", fresh=fresh)
        except BaseException:
            self.kill()
            raise

    def add(self, label: str, role: str, dp: int, pp: int, tp: int, scenario: dict[str, Any],
            env: dict[str, str] | None = None) -> tuple[str, int, int, int]:
        """Start one more rank (``role``'s driver over ``scenario``, e.g. a restarted prefill at the same port),
        known to ``wait``, ``log``, ``result`` and ``kill`` as ``(label, dp, pp, tp)``."""
        key = (label, dp, pp, tp)
        assert key not in self.procs, f"{key} was started already"
        result = self.tmp / f"{label}-dp{dp}-pp{pp}-tp{tp}.json"
        self.results[key] = result
        argv = [str(DRIVER), json.dumps(scenario), role, str(dp), str(pp), str(tp), str(result)]
        self.procs[key] = spawn(argv, {**os.environ, **BASE_ENV, **(env or {})},
                                self.tmp / f"{label}-dp{dp}-pp{pp}-tp{tp}.log")
        return key

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
        """Every rank still running is SIGKILLed and reaped (a dead zygote: killed, not waited for)."""
        for proc in self.procs.values():
            try:
                if proc.poll() is not None:
                    continue
            except ZygoteError:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except (ZygoteError, subprocess.TimeoutExpired):
                pass
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

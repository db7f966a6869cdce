"""The rank zygote of the SGLang tests (``zygote.py``, used by ``_rig.py``): a forked rank must be what a fresh
``python script.py`` would be as far as the tests can see (its own pid in module globals, its own session, its
environment, its log, its exit status, its atexit handlers), and a dead or unsafe zygote fails loudly and in
bounded time. These run a light zygote (no SGLang imported), its own, never the shared one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import _rig
import pytest
from _rig import BASE_ENV, Zygote, ZygoteError, forkable, need_sglang

SCRIPT = r'''
import atexit, json, os, sys, time
PID_AT_IMPORT = os.getpid()                  # what sglang_driver's SEG does at import
def report(**kw):
    with open(sys.argv[1], "w") as f:
        json.dump(dict(kw, pid=PID_AT_IMPORT, sid=os.getsid(0), pgid=os.getpgid(0), argv=sys.argv[1:],
                       env=os.environ.get("KVBRIDGE_ZYGOTE_PROBE"), cwd=os.getcwd(), name=__name__), f)
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").close())
print("to stdout")
print("to stderr", file=sys.stderr)
how = sys.argv[2]
report()
if how == "exit3":
    sys.exit(3)
if how == "raise":
    raise ValueError("boom")
if how == "sleep":
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def zyg() -> Iterator[Zygote]:
    need_sglang()
    z = Zygote({**os.environ, **BASE_ENV}, flags=("--light",))
    yield z
    z.close()


def _spawn(z: Zygote, tmp: Path, how: str, **env: str) -> tuple[_rig.ZygoteProc, Path]:
    script = tmp / f"probe-{how}.py"      # one per child: rewriting a file another child is reading races
    script.write_text(SCRIPT)
    out = tmp / f"{how}.json"
    proc = z.spawn([str(script), str(out), how], {**os.environ, **BASE_ENV, **env}, tmp / f"{how}.log", cwd=tmp)
    return proc, out


def test_a_child_is_its_own_process(zyg: Zygote, tmp_path: Path) -> None:
    """Module globals computed at import carry the child's pid; it leads its own session and process group
    (the tests signal a rank with killpg); its environment, working directory, argv and __name__ are the
    rank's; stdout and stderr land in its log; atexit handlers it registered run; exit status 0."""
    import json

    proc, out = _spawn(zyg, tmp_path, "ok", KVBRIDGE_ZYGOTE_PROBE="rank-env")
    assert proc.wait(timeout=30) == 0
    got = json.loads(out.read_text())
    assert got["pid"] == proc.pid != zyg.pid
    assert got["sid"] == got["pgid"] == proc.pid
    assert got["env"] == "rank-env" and got["cwd"] == str(tmp_path) and got["name"] == "__main__"
    assert got["argv"] == [str(out), "ok"]
    log = (tmp_path / "ok.log").read_text()
    assert "to stdout" in log and "to stderr" in log
    assert Path(str(out) + ".atexit").exists(), "the child's atexit handlers did not run"


def test_exit_status_as_popen_reports_it(zyg: Zygote, tmp_path: Path) -> None:
    """sys.exit(3) -> 3; an uncaught exception -> 1 with its traceback in the log; SIGKILL -> -9; a stopped
    child is still running (poll None) until it continues."""
    p3, _ = _spawn(zyg, tmp_path, "exit3")
    praise, _ = _spawn(zyg, tmp_path, "raise")
    psleep, out = _spawn(zyg, tmp_path, "sleep")
    assert p3.wait(timeout=30) == 3
    assert praise.wait(timeout=30) == 1 and "ValueError: boom" in (tmp_path / "raise.log").read_text()
    end = time.monotonic() + 30
    while not out.exists() and time.monotonic() < end:
        time.sleep(0.05)
    os.killpg(psleep.pid, signal.SIGSTOP)
    time.sleep(0.3)
    assert psleep.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        psleep.wait(timeout=0.3)
    os.killpg(psleep.pid, signal.SIGCONT)
    os.killpg(psleep.pid, signal.SIGKILL)
    assert psleep.wait(timeout=30) == -signal.SIGKILL


def test_a_dead_zygote_fails_the_wait_with_the_reason(tmp_path: Path) -> None:
    """The zygote is SIGKILLed while its child runs: waiting for the child raises ZygoteError naming the zygote
    and its exit status within seconds (no hang); Run.kill's path still kills the orphan's group."""
    need_sglang()
    z = Zygote({**os.environ, **BASE_ENV}, flags=("--light",))
    try:
        proc, _ = _spawn(z, tmp_path, "sleep")
        os.kill(z.proc.pid, signal.SIGKILL)
        z.proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ZygoteError, match=r"zygote \(pid \d+\) died \(exit status -9\)"):
            proc.wait(timeout=60)
        assert time.monotonic() - t0 < 5
        os.killpg(proc.pid, signal.SIGKILL)          # the orphan, as Run.kill does
    finally:
        z.close()


def test_a_zygote_with_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    """Forking a process with another thread could copy a lock held mid-operation: the zygote refuses, naming
    the threads."""
    need_sglang()
    z = Zygote({**os.environ, **BASE_ENV}, flags=("--light", "--thread"))
    try:
        with pytest.raises(ZygoteError, match="2 threads.*unsafe"):
            _spawn(z, tmp_path, "ok")
    finally:
        z.close()


def test_only_runtime_settings_may_differ_from_the_zygote() -> None:
    """A rank environment that differs in what may have been read at import (anything but KVBRIDGE_*, and
    KVBRIDGE_LOG / KVBRIDGE_SHM_RUN) gets a fresh process."""
    base = {"PATH": "/bin", "KVBRIDGE_BACKEND": "loopback"}
    assert forkable({**base, "KVBRIDGE_SECRET": "x", "KVBRIDGE_BACKEND": "nixl"}, base)
    assert not forkable({**base, "OMP_NUM_THREADS": "4"}, base)
    assert not forkable({**base, "KVBRIDGE_LOG": "DEBUG"}, base)
    assert not forkable({**base, "KVBRIDGE_SHM_RUN": "abcd1234"}, base)
    assert not forkable({"PATH": "/bin"}, {**base, "LD_PRELOAD": "x"})
    assert forkable({**base, "PYTEST_CURRENT_TEST": "test_b (call)"}, {**base, "PYTEST_CURRENT_TEST": "test_a"})


def test_every_rank_of_a_session_comes_from_one_zygote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What pytest changes between tests (PYTEST_CURRENT_TEST) and a test's KVBRIDGE_* settings do not send a
    rank to a fresh interpreter (the whole gain), and KVBRIDGE_SGLANG_TEST_FRESH=1 does. The /dev/shm run tag
    (set in os.environ when kvbridge is first imported) is there since _rig's import, so a zygote started
    before the test process imported kvbridge elsewhere does not turn every later rank into a fresh one."""
    from kvbridge.shmnames import RUN_ENV, RUN_TAG

    assert os.environ.get(RUN_ENV) == RUN_TAG
    seen: list[str] = []

    class Fake:
        def __init__(self, env: dict[str, str]) -> None:
            self.env = env

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

        def spawn(self, *a: object) -> None:
            seen.append("zygote")

    monkeypatch.setattr(_rig, "Zygote", Fake)
    monkeypatch.setattr(_rig, "_ZYGOTE", None)
    monkeypatch.setattr(_rig.subprocess, "Popen", lambda *a, **kw: seen.append("fresh"))
    log = tmp_path / "x.log"
    _rig.spawn(["x.py"], {**os.environ, **BASE_ENV}, log)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    _rig.spawn(["x.py"], {**os.environ, **BASE_ENV, "KVBRIDGE_SECRET": "s" * 32, "KVBRIDGE_CHECKSUMS": "1"}, log)
    with pytest.warns(UserWarning, match=r"fresh SGLang rank.*\['OMP_NUM_THREADS'\]"):
        _rig.spawn(["x.py"], {**os.environ, **BASE_ENV, "OMP_NUM_THREADS": "2"}, log)
    monkeypatch.setenv("KVBRIDGE_SGLANG_TEST_FRESH", "1")
    _rig.spawn(["x.py"], {**os.environ, **BASE_ENV}, log)
    assert seen == ["zygote", "zygote", "fresh", "fresh"]

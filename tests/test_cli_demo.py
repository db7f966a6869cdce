"""The command line behaves (issue 15 item 6): --version, availability refused before any rank starts (exit 2
with the reason and what to install), documented exit codes, progress without carriage returns in a pipe, a
plugins table that wraps instead of cutting, and a rank killed mid-demo ends the run within seconds, naming
the rank and its signal, leaving no process and no /dev/shm segment behind."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbridge.demo.run import EXIT_MISMATCH, EXIT_OK, EXIT_TERMINATED, EXIT_TRANSFER, Summary
from kvbridge.registry import Registry

pytestmark = pytest.mark.kvbridge_multiprocess

SCRIPT = Path(sys.executable).with_name("kvbridge")
CMD = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("kvbridge") or "kvbridge"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS")}
    return env | extra


def kvbridge(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=180, env=_env(**env), check=False)


def test_version() -> None:
    done = kvbridge("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"kvbridge {md.version('kvbridge')}"


def test_a_usage_error_is_not_an_unavailable_plugin() -> None:
    done = kvbridge("demo", "--requests", "many")
    assert done.returncode == 64, done.stderr
    assert "invalid int value: 'many'" in done.stderr


def test_a_backend_that_is_not_installed_exits_2_with_the_package_to_install() -> None:
    done = kvbridge("demo", "--backend", "nixl", "--requests", "2", KVBRIDGE_DISABLE_PLUGINS="nixl")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "backend 'nixl' is not installed" in done.stderr
    assert "pip install kvbridge-nixl" in done.stderr
    assert "Traceback" not in done.stderr and "requests" not in done.stdout     # no rank ever started


@pytest.mark.skipif("mori" not in Registry.build().backend_names(available_only=False) or
                    "mori" in Registry.build().backend_names(), reason="needs kvbridge-mori installed, unusable here")
def test_a_backend_that_cannot_run_here_exits_2_with_its_reason_and_hint() -> None:
    done = kvbridge("demo", "--backend", "mori", "--requests", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "plugin 'mori' is unavailable" in done.stderr and "hint:" in done.stderr
    assert "Traceback" not in done.stderr and "requests" not in done.stdout


def test_a_missing_state_type_exits_2_with_the_package_to_install() -> None:
    done = kvbridge("demo", "--backend", "loopback", "--model", "swa", "--requests", "2",
                    KVBRIDGE_DISABLE_PLUGINS="swa")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs the state type 'swa': pip install kvbridge-swa" in done.stderr
    assert "No module named" not in done.stderr and "requests" not in done.stdout


def test_exit_codes_of_a_summary() -> None:
    assert Summary(requests=1, verified=1).exit_code == EXIT_OK
    assert Summary(requests=2, verified=1, failed=["request 1: peer died"]).exit_code == EXIT_TRANSFER
    assert Summary(requests=2, verified=2, crashed=["decode rank 0 was killed"]).exit_code == EXIT_TRANSFER
    assert Summary(requests=2, mismatched=["request 0: 3 bytes differ"],
                   failed=["request 1: x"]).exit_code == EXIT_MISMATCH
    assert len({EXIT_OK, EXIT_MISMATCH, 2, EXIT_TRANSFER, 64, EXIT_TERMINATED}) == 6
    # SIGTERM cut the run: 143 only when every request started finished byte-exact
    assert Summary(requests=5, verified=3, refused=2).exit_code == EXIT_TERMINATED
    assert Summary(requests=5, verified=2, refused=2, failed=["request 2: x"]).exit_code == EXIT_TRANSFER
    mismatch = Summary(requests=5, verified=2, refused=2, mismatched=["request 2: 1 bytes differ"])
    assert mismatch.exit_code == EXIT_MISMATCH
    assert Summary(requests=5, verified=2, refused=2).exit_code == EXIT_TRANSFER       # one started, never finished


def test_piped_output_has_no_carriage_return() -> None:
    done = kvbridge("demo", "--backend", "loopback", "--requests", "12", "--prefill-tp", "1", "--decode-tp", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\r" not in done.stdout and "\r" not in done.stderr
    progress = [line for line in done.stdout.splitlines() if line.endswith(" requests") and "/12" in line]
    assert progress and progress[-1].endswith("12/12 requests"), done.stdout
    assert len(progress) <= 12
    assert "verified: 12/12 byte-exact" in done.stdout


def test_the_plugins_table_wraps_instead_of_cutting() -> None:
    from kvbridge.cli import format_table

    reason = " ".join(f"word{i}" for i in range(40))
    lines = format_table([("NAME", "STATUS", "REASON"), ("x", "unavailable", reason)], width=60).splitlines()
    assert all(len(line) <= 60 for line in lines), lines
    assert lines[1].startswith("x     unavailable  word0")
    indent = len("NAME  unavailable  ")
    assert all(line[:indent].strip() == "" for line in lines[2:])
    assert " ".join(" ".join(line[indent:].split()) for line in lines[1:]) == reason
    done = kvbridge("plugins", COLUMNS="70")
    assert done.returncode == 0
    flat = " ".join(done.stdout.split())
    for record in Registry.build().records():
        if record.status.value == "unavailable":
            assert " ".join(record.reason.split()) in flat, f"{record.name}'s reason was cut:\n{done.stdout}"


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited process whose new parent has not reaped it yet, e.g.
    under a subreaper: it holds no memory, descriptor or segment mapping any more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ranks(pid: int) -> list[int]:
    """The launcher's rank processes, in start order: children of its fork server (kvbridge.demo.ranks), or
    of the launcher itself where ranks are spawned."""
    out = []
    for child in _children(pid):
        cmdline = _cmdline(child)
        if b"forkserver" in cmdline:
            out += _children(child)
        elif b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(child)
    return sorted(out)

def _busy_demo() -> subprocess.Popen[str]:
    """A 3000-request loopback demo (2 -> 2) that has verified its first request: every rank is working."""
    proc = subprocess.Popen([*CMD, "demo", "--backend", "loopback", "--requests", "3000", "--prefill-tp", "2",
                             "--decode-tp", "2", "--timeout", "200"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(r"\] [1-9]\d*/3000 requests", line):
            return proc
    proc.kill()
    proc.wait()
    pytest.fail(f"the demo never made progress: {proc.stderr.read() if proc.stderr else ''}")


def _assert_gone(pids: list[int], ranks: list[int], alive: Callable[[int], bool] = _running) -> None:
    """No one of ``pids`` is ``alive`` (within 5 s: an exited child may linger until it is reaped) and no
    /dev/shm segment of the ``ranks`` is left."""
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived the demo"
    for rank in ranks:
        assert not [n for n in os.listdir("/dev/shm") if f"-{rank}-" in n and n.startswith("kvbridge-demo-")]


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_demo_ends_the_run_within_seconds() -> None:
    proc = _busy_demo()
    try:
        ranks = _ranks(proc.pid)
        assert len(ranks) == 4, ranks
        victim = ranks[-1]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 10, f"the demo ran on {took:.1f} s after a rank was killed"
    assert proc.returncode == EXIT_TRANSFER, out + err
    assert re.search(rf"(prefill|decode) rank \d \(pid {victim}\) was killed by SIGKILL \(signal 9\)", err), err
    assert re.search(rf"! (prefill|decode) rank \d \(pid {victim}\) was killed by SIGKILL", out), out
    _assert_gone(ranks, ranks, alive=lambda pid: Path(f"/proc/{pid}").exists())    # not even a zombie


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", ["launcher", "rank"])
def test_sigterm_drains_every_rank_and_the_requests_in_flight_finish(target: str) -> None:
    """SIGTERM to the launcher mid-run (or to one rank only, as an orchestrator that signals the whole
    process group reaches it first): the requests some rank had started finish and are verified byte by
    byte, every rank drains (its report: nothing failed, nothing unsafe) and exits, the rest are counted as
    refused, the launcher exits 143, and no rank, fork server or /dev/shm segment is left."""
    proc = _busy_demo()
    try:
        ranks = _ranks(proc.pid)
        server = [c for c in _children(proc.pid) if b"forkserver" in _cmdline(c)]
        assert len(ranks) == 4, ranks
        termed = time.monotonic()
        os.kill(proc.pid if target == "launcher" else ranks[-1], signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - termed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"\nSIGTERM -> exit in {took:.2f} s\n{out}")
    assert proc.returncode == EXIT_TERMINATED, out + err
    assert ("SIGTERM: draining every rank" in err) == (target == "launcher"), err
    done = re.search(r"requests +(\d+)/3000 completed, (\d+) failed, (\d+) refused", out)
    verified = re.search(r"verified: (\d+)/3000 byte-exact", out)
    assert done and verified, out
    completed, failed, refused = map(int, done.groups())
    assert failed == 0 and completed >= 1 and refused >= 1 and completed + refused == 3000, out
    assert int(verified.group(1)) == completed, out            # every completed request was byte-checked
    drained = re.findall(r"drained (prefill|decode) rank (\d): \{'success': \d+, 'failed': (\d+), 'unsafe': (\d+)\}",
                         out)
    assert len(drained) == 4 and all(f == "0" and u == "0" for *_, f, u in drained), out
    _assert_gone(ranks + server, ranks)


@pytest.mark.timeout(240)
def test_a_launcher_killed_mid_demo_takes_its_ranks_with_it() -> None:
    """kill -9 of the launcher: its ranks (the fork server's children, not the launcher's) and the fork server
    exit within seconds."""
    from kvbridge.hostpool import reap_segments

    proc = subprocess.Popen([*CMD, "demo", "--backend", "loopback", "--requests", "3000", "--prefill-tp", "2",
                             "--decode-tp", "2", "--timeout", "200"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_env())
    ranks: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if re.search(r"\] [1-9]\d*/3000 requests", line):
                break
        else:
            pytest.fail("the demo never made progress")
        ranks = _ranks(proc.pid)
        servers = [c for c in _children(proc.pid) if b"forkserver" in _cmdline(c)]
        assert len(ranks) == 4, ranks
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_running(p) for p in ranks + servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in ranks + servers if _running(p)]
        assert not left, f"{left} outlived the launcher by 10 s (ranks {ranks}, fork server {servers})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for rank in ranks:
            reap_segments(rank)                     # a killed launcher cannot reap its ranks' segments


def test_the_demo_refuses_bad_settings_before_starting(tmp_path: Path) -> None:
    config = tmp_path / "kvbridge.toml"
    config.write_text("peer_timout_s = 5\n")
    done = kvbridge("demo", "--backend", "loopback", "--config", str(config), "--requests", "2")
    assert done.returncode == 64, done.stdout + done.stderr
    assert "unknown setting 'peer_timout_s'" in done.stderr and "did you mean 'peer_timeout_s'" in done.stderr
    done = kvbridge("demo", "--backend", "loopback", "--requests", "2", KVBRIDGE_STAGING="sometimes")
    assert done.returncode == 64 and "(from KVBRIDGE_STAGING)" in done.stderr, done.stderr
    assert "requests" not in done.stdout


def test_the_ranks_take_their_agent_settings_from_the_configuration(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.demo.worker import WorkerConfig, agent_config
    from kvbridge.protocol.wire import Role

    config = tmp_path / "kvbridge.toml"
    config.write_text('peer_timeout_s = 7.5\nstaging = "never"\nsecret = "from-the-file"\n')
    monkeypatch.setenv("KVBRIDGE_HEARTBEAT_INTERVAL_S", "0.2")
    cfg = WorkerConfig(role=Role.DECODE, rank=0, prefill_tp=1, decode_tp=1, preset="dense-gqa", backend="loopback",
                       bootstrap="tcp://127.0.0.1:1", requests=1, seed=0, window=1, region_pages=2, timeout_s=5,
                       settings_file=str(config))
    agent = agent_config(cfg)
    assert (agent.peer_timeout_s, agent.staging, agent.heartbeat_interval_s) == (7.5, "never", 0.2)
    assert agent.secret == b"from-the-file" and agent.staging_bytes == cfg.staging_bytes
    from dataclasses import replace

    fixed = agent_config(replace(cfg, peer_timeout_s=1.0, secret=b"launcher"))
    assert (fixed.peer_timeout_s, fixed.secret) == (1.0, b"launcher")

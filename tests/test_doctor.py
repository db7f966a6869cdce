"""``kvbridge doctor`` reports what it must, each with what to do, and exits by the worst finding: a bootstrap
server whose clock is skewed (in a child process, with and without a secret), an unreachable one, a tiny
locked-memory limit (a child with ``RLIMIT_MEMLOCK`` lowered), a /dev/shm too small for the staging areas,
settings every rank would refuse, a backend that cannot run here."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.doctor import Finding, Severity, exit_status, run_checks

SECRET = "doctor-suite-shared-secret-0123"
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[object]:
    """``start(offset_s, secret)``: a bootstrap server in a child process whose wall clock is ``offset_s`` ahead."""
    children: list[subprocess.Popen[str]] = []

    def start(offset_s: float, secret: str = "") -> str:
        url = f"tcp://127.0.0.1:{_free_port()}"
        code = textwrap.dedent(f"""
            import sys, time
            from kvbridge.zmq_link import BootstrapServer
            server = BootstrapServer({url!r}, secret={secret.encode()!r} or None,
                                     clock=lambda: time.time() + {offset_s}).start()
            print("up", flush=True)
            sys.stdin.read()
        """)
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        return url

    yield start
    for child in children:
        child.kill()
        child.wait(timeout=10)


def _env(**extra: str) -> dict[str, str]:
    """The environment without KVBRIDGE_* settings; the backend is loopback unless given (the backends' own checks,
    e.g. NIXL's transport probe, have tests of their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env.update({"KVBRIDGE_BACKEND": "loopback", **extra})
    return env


def _by(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.check == check]


def test_a_healthy_server_and_clock_are_ok(server: object) -> None:
    url = server(0.0, SECRET)  # type: ignore[operator]
    findings = run_checks(bootstrap=url, env=_env(KVBRIDGE_SECRET=SECRET))
    clock = _by(findings, "clock")
    assert clock and clock[0].severity is Severity.OK and "well inside" in clock[0].text, clock
    assert _by(findings, "bootstrap")[0].severity is Severity.OK


@pytest.mark.parametrize("secret", ["", SECRET], ids=["no-secret", "secret"])
def test_a_skewed_server_clock_is_an_error_naming_the_offset_and_the_window(server: object, secret: str) -> None:
    url = server(120.0, secret)  # type: ignore[operator]
    findings = run_checks(bootstrap=url, env=_env(KVBRIDGE_SECRET=secret) if secret else _env())
    clock = _by(findings, "clock")
    assert clock and clock[0].severity is Severity.ERROR, findings
    text = clock[0].text
    assert "+12" in text and "clock_window_s=60" in text and "NTP" in text, text
    assert exit_status(findings) == 2


def test_a_drifting_clock_inside_the_window_is_a_warning(server: object) -> None:
    url = server(-20.0)  # type: ignore[operator]
    clock = _by(run_checks(bootstrap=url, env=_env()), "clock")
    assert clock and clock[0].severity is Severity.WARNING, clock
    offset = float(re.search(r"clock is ([-+][0-9.]+) s", clock[0].text).group(1))  # type: ignore[union-attr]
    assert abs(offset + 20.0) < 1.0, clock[0].text


def test_an_unreachable_bootstrap_server_is_an_error() -> None:
    started = time.monotonic()
    findings = run_checks(bootstrap=f"tcp://127.0.0.1:{_free_port()}", env=_env())
    found = _by(findings, "bootstrap")
    assert found and found[0].severity is Severity.ERROR and "did not answer" in found[0].text, found
    assert time.monotonic() - started < 15


def test_a_tiny_memlock_limit_is_reported_by_the_command() -> None:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))

    done = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, preexec_fn=lower, env=_env(KVBRIDGE_BACKEND="loopback"))
    lines = [line for line in done.stdout.splitlines() if " memlock " in f" {line} "]
    assert lines and "64 KiB" in lines[0] and "ulimit -l unlimited" in lines[0], done.stdout + done.stderr
    # loopback does not pin memory: worth knowing, nothing to fix
    assert lines[0].startswith("info"), lines


def test_a_small_shm_for_the_staging_areas_is_an_error(tmp_path: Path) -> None:
    findings = run_checks(ranks=8, shm_path=str(tmp_path), env=_env(KVBRIDGE_STAGING_BYTES=str(1 << 46)))
    shm = _by(findings, "shm")
    assert shm and shm[0].severity is Severity.ERROR and "8 rank(s)" in shm[0].text and "--shm-size" in shm[0].text


def test_settings_every_rank_refuses_are_an_error_and_the_command_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, env=_env(KVBRIDGE_PEER_TIMEOUT_S="nan"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("error    settings") and "peer_timeout_s" in done.stdout, done.stdout


def test_a_backend_that_cannot_run_here_is_an_error() -> None:
    findings = run_checks(env=_env(KVBRIDGE_BACKEND="mori"))
    backend = _by(findings, "backend")
    assert backend and backend[0].severity is Severity.ERROR and "'mori'" in backend[0].text, findings


def _quiet_range(count: int) -> int:
    """The first port of ``count`` consecutive bindable ports above the ephemeral range (skips if none)."""
    for lo in range(61000, 65536 - count, count):
        probes = []
        try:
            for port in range(lo, lo + count):
                sock = socket.socket()
                probes.append(sock)
                sock.bind(("127.0.0.1", port))
            return lo
        except OSError:
            continue
        finally:
            for sock in probes:
                sock.close()
    pytest.skip("no free ports above the ephemeral range")


def test_a_port_range_with_too_few_free_ports_is_an_error_and_enough_is_ok() -> None:
    held = []
    try:
        # above the kernel's ephemeral range (32768-60999 here), where no other test's socket lands by chance: a
        # range drawn from a free ephemeral port lost its fourth port to a parallel test once
        lo = _quiet_range(4)
        for port in (lo, lo + 1, lo + 2):                    # three of the range's four ports taken
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            held.append(sock)
        ports = _by(run_checks(ranks=2, port_range=f"{lo}-{lo + 3}", bind_host="127.0.0.1", env=_env()), "ports")[0]
        assert ports.severity is Severity.ERROR and "1 of 4 ports free" in ports.text and "2 rank(s)" in ports.text
        ok = _by(run_checks(ranks=1, port_range=f"{lo + 3}-{lo + 3}", bind_host="127.0.0.1", env=_env()), "ports")[0]
        assert ok.severity is Severity.WARNING and "1 of 1" in ok.text         # no room for an overlapping restart
    finally:
        for sock in held:
            sock.close()


def test_a_discovery_url_without_its_plugin_is_an_error_naming_the_scheme() -> None:
    finding = _by(run_checks(bootstrap="nosuch://10.0.0.1:1/x", env=_env()), "discovery")[0]
    assert finding.severity is Severity.ERROR and "no discovery service opens nosuch://" in finding.text


def test_an_etcd_service_is_checked_answering_and_unreachable(tmp_path: Path) -> None:
    testing = pytest.importorskip("kvbridge_etcd.testing")
    why = testing.etcd_unavailable()
    if why:
        pytest.skip(why)
    down = _by(run_checks(bootstrap=f"etcd://127.0.0.1:{_free_port()}/kvb", env=_env()), "discovery")[0]
    assert down.severity is Severity.ERROR and "cannot be used" in down.text
    with testing.EtcdServer(tmp_path / "etcd") as etcd:
        up = _by(run_checks(bootstrap=etcd.url, env=_env()), "discovery")[0]
    assert up.severity is Severity.OK and "answers a lookup in" in up.text


def test_a_backends_own_checks_are_reported_and_a_broken_one_is_a_warning() -> None:
    """``BackendSpec.diagnose``: the findings of each usable backend's checks (of the configured one only, when one
    is configured); a check that raises is a warning naming the error, and the other backends' checks still run."""
    from kvbridge.doctor import _diagnoses
    from kvbridge.plugin import BackendSpec, hookimpl
    from kvbridge.registry import Registry

    def fine() -> Iterator[Finding]:
        yield Finding(severity=Severity.WARNING, check="alpha", text="no RDMA device here: TCP only")

    def broken() -> Iterator[Finding]:
        raise OSError("cannot open /sys/class/infiniband")

    class _Backends:
        @hookimpl
        def kvbridge_transfer_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="alpha", factory="kvbridge.backends.loopback:LoopbackBackend", diagnose=fine),
                    BackendSpec(name="beta", factory="kvbridge.backends.loopback:LoopbackBackend", diagnose=broken)]

    registry = Registry.build(plugins=[_Backends()], entry_points=False)
    findings = list(_diagnoses("", registry))
    assert [(f.check, f.severity) for f in findings] == [("alpha", Severity.WARNING), ("beta", Severity.WARNING)]
    assert "TCP only" in findings[0].text and "OSError: cannot open /sys/class/infiniband" in findings[1].text
    assert [f.check for f in _diagnoses("alpha", registry)] == ["alpha"]


def test_a_prefill_instance_is_checked_rank_by_rank() -> None:
    """``--instance``: each rank the bootstrap server lists is tried from here; a rank whose port refuses is an
    error naming the rank and its address, a rank not published yet is an error naming it, an unknown instance is
    an error; a listening rank is ok."""
    from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap

    server = BootstrapServer().start()
    listening, closed = socket.socket(), socket.socket()
    client = ZmqBootstrap(server.address, republish_s=0.0)     # closing it withdraws what it published
    try:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))            # bound, never listening: connections are refused
        client.publish("doc-inst", 3, 0, f"tcp://127.0.0.1:{listening.getsockname()[1]}")
        client.publish("doc-inst", 3, 1, f"tcp://127.0.0.1:{closed.getsockname()[1]}")
        findings = _by(run_checks(bootstrap=server.address, instance="doc-inst", env=_env()), "instance")
        by_text = {f.text.split(" of ")[0] if f.text.startswith("rank") else "published": f for f in findings}
        assert by_text["rank 0"].severity is Severity.OK, findings
        assert by_text["rank 1"].severity is Severity.ERROR and "not reachable" in by_text["rank 1"].text
        assert by_text["published"].severity is Severity.ERROR and "missing [2]" in by_text["published"].text
        unknown = _by(run_checks(bootstrap=server.address, instance="nobody", env=_env()), "instance")
        assert unknown[0].severity is Severity.ERROR and "knows no prefill instance 'nobody'" in unknown[0].text
    finally:
        client.close()
        listening.close()
        closed.close()
        server.close()


def test_each_ranks_clock_is_judged_against_the_bootstrap_servers_window() -> None:
    """With a secret, ``--instance`` says how far each rank's clock was from the server's at its last publication:
    a rank 20 s off is a warning (a quarter of the 60 s window), one 90 s off is an error saying its publications
    are refused (it is not listed: the finding is the only place that says why), an exact one is ok."""
    from kvbridge.discovery import DiscoveryError
    from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap

    server = BootstrapServer(secret=SECRET.encode(), clock_window_s=60.0).start()
    clients = [ZmqBootstrap(server.address, secret=SECRET.encode(), republish_s=0.0,
                            clock=lambda offset=offset: time.time() + offset) for offset in (0.0, 20.0, 90.0)]
    try:
        for rank, client in enumerate(clients):
            try:
                client.publish("clocked", 3, rank, f"tcp://127.0.0.1:{_free_port()}")
            except DiscoveryError as exc:
                assert rank == 2 and "clock skew" in str(exc), exc
        findings = {f.text.split(" of ")[0]: f for f in _by(run_checks(
            bootstrap=server.address, instance="clocked", env=_env(KVBRIDGE_SECRET=SECRET)), "clock")
            if f.text.startswith("rank")}
        assert findings["rank 0"].severity is Severity.OK and "0.0 s from" in findings["rank 0"].text, findings
        assert findings["rank 1"].severity is Severity.WARNING and "+20.0 s" in findings["rank 1"].text, findings
        assert findings["rank 2"].severity is Severity.ERROR and "+90.0 s" in findings["rank 2"].text, findings
        assert "refused as stale" in findings["rank 2"].text and "not listed" in findings["rank 2"].text
        unsealed = _by(run_checks(bootstrap=server.address, instance="clocked", env=_env()), "clock")
        assert not any(f.text.startswith("rank ") for f in unsealed)     # without the secret it learns nothing
        assert any("without a secret nothing" in f.text for f in unsealed), unsealed
    finally:
        for client in clients:
            client.close()
        server.close()

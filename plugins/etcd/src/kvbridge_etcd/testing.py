"""A real etcd server for tests: started on free ports with its data in a given directory, stopped after.

    with EtcdServer(tmp_path / "etcd") as server:          # the ``etcd`` binary (Debian: etcd-server)
        client = EtcdDiscovery(server.url, secret=key)

``prefix`` runs it through another command, e.g. ``["ip", "netns", "exec", "ns1"]`` with ``host`` the
namespace's address and fixed ``client_port``/``peer_port`` (ports inside a namespace are its own).
Readiness is read from etcd's log ("ready to serve client requests"), so it works where this process cannot
reach the server. ``kill()`` ends it with SIGKILL (a crash); ``stop()`` with SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["EtcdServer", "etcd_unavailable", "free_port"]


def etcd_unavailable() -> str:
    """Why no etcd server can be started here ('' when it can)."""
    if shutil.which("etcd") is None:
        return "the etcd server binary is not installed (Debian: apt install etcd-server; scripts/setup.sh does)"
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is in state T (stopped), read from /proc."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


class EtcdServer:
    """One single-member etcd cluster (see the module docstring)."""

    def __init__(self, data_dir: str | Path, *, host: str = "127.0.0.1", client_port: int | None = None,
                 peer_port: int | None = None, prefix: Sequence[str] = (), name: str = "kvbridge-test",
                 start_timeout_s: float = 30.0) -> None:
        why = etcd_unavailable()
        if why:
            raise RuntimeError(why)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.url = f"etcd://{host}:{self.client_port}/kvbridge"
        self.endpoint = f"http://{host}:{self.client_port}"
        self._argv = [*prefix, shutil.which("etcd") or "etcd", "--name", name,
                      "--data-dir", str(self.data_dir / "data"),
                      "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                      "--listen-peer-urls", f"http://{host}:{self.peer_port}",
                      "--initial-advertise-peer-urls", f"http://{host}:{self.peer_port}",
                      "--initial-cluster", f"{name}=http://{host}:{self.peer_port}",
                      "--initial-cluster-state", "new", "--log-level", "info"]
        self._log_path = self.data_dir / "etcd.log"
        self._start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> EtcdServer:
        """Start it (again, on the same data and ports) and wait until it serves clients."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        with open(self._log_path, "ab") as log:
            start_at = log.tell()
            self.proc = subprocess.Popen(self._argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            with open(self._log_path, "rb") as log:
                log.seek(start_at)
                if b"ready to serve client requests" in log.read():
                    return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log()[-2000:]
        self.kill()
        raise RuntimeError(f"etcd did not start in {self._start_timeout_s:.0f} s: {' '.join(self._argv)}\n{tail}")

    def log(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _end(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self.proc = None

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP it and return once every one of its threads is stopped (a hung server, not a dead one).

        The signal alone is not enough: a thread running on another CPU stops only when it next enters the
        kernel, and on a loaded host it may still answer a request sent right after ``kill`` returned.
        """
        assert self.proc is not None, "etcd is not running"
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd (pid {self.proc.pid}) did not stop within {timeout_s:.0f} s")
            time.sleep(0.01)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

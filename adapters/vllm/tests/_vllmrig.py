"""Real vLLM instances as child processes of the test (driven by ``vllm_driver.py`` under .venv-vllm).

Engine startups dominate these tests' time on a 2-core host: importing vLLM alone costs ~15 CPU-seconds a
process. A ``Zygote`` imports it once and forks every instance of a module from there (each instance is
still its own process, with its own session, pipes and environment).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


def engine_env() -> dict[str, str]:
    """The environment every instance shares. No VLLM_CPU_KVCACHE_SPACE: it would override the driver's
    64 MiB ``kv_cache_memory_bytes`` with whole GiBs (1 GiB zeroed per rank, and copied to /dev/shm on a
    loopback decode)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def tp_env(tp: int) -> dict[str, str | None]:
    """The engine core runs in the driver's process (no process of its own to spawn: one vLLM import less);
    TP 1 computes there too, TP 2 in two worker processes vLLM spawns, pinned one per core."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "all" if tp == 1 else "0|1"}


class Zygote:
    """``vllm_driver.py zygote``: vLLM imported once; ``fork`` starts an instance from it.

    The zygote must have one thread when it forks (a child gets only the forking thread; locks other threads
    held stay held): numpy's OpenBLAS starts a pool thread per extra core at import, so the zygote imports
    with OPENBLAS_NUM_THREADS=1, and each child gets the variable back as it was (for the processes vLLM
    spawns; torch computes with OpenMP/oneDNN, not OpenBLAS)."""

    def __init__(self, logdir: Path, start_s: float = 600) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = logdir / "zygote.log"
        env = engine_env()
        self._child_env: dict[str, str | None] = {"OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), "zygote", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        theirs.close()
        self._lock = threading.Lock()
        self.sock.settimeout(start_s)
        try:
            ready = self.sock.recv(1 << 16)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"zygote: vLLM not imported in {start_s} s; log {self.log}") from None
        if not ready:
            self.close()
            raise RuntimeError(f"zygote exited (rc {self.proc.wait()}); log {self.log}:\n{self.log.read_text()}")
        self.sock.settimeout(60)

    def fork(self, config: dict[str, Any], env: dict[str, str | None], stdin: int, stdout: int) -> int:
        with self._lock:
            request = {"config": config, "env": self._child_env | env}
            socket.send_fds(self.sock, [json.dumps(request).encode()], [stdin, stdout])
            answer = self.sock.recv(1 << 16)
        if not answer:
            raise RuntimeError(f"zygote exited; log {self.log}:\n{self.log.read_text()[-3000:]}")
        pid: int = json.loads(answer)["pid"]
        return pid

    def close(self) -> None:
        self.sock.close()               # the zygote exits at end of file
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class Forked:
    """The part of ``subprocess.Popen`` that ``Instance`` uses, for a process the zygote forked (not our
    child: its exit status is the zygote's to collect, which the kernel does for it)."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return -1
        return -1 if state in ("Z", "X") else None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return -1


class Instance:
    """One vLLM engine (its own process group: TP workers die with it); forked from ``zygote`` if given."""

    def __init__(self, name: str, config: dict[str, Any], logdir: Path, *, tp: int = 1,
                 zygote: Zygote | None = None) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        argument = config | {"tp": tp}
        self.proc: subprocess.Popen[str] | Forked
        if zygote is None:
            env = engine_env()
            for key, value in tp_env(tp).items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
            self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), "serve", json.dumps(argument)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=env, start_new_session=True)
        else:
            child_in, to_child = os.pipe()
            from_child, child_out = os.pipe()
            try:
                pid = zygote.fork(argument, tp_env(tp), child_in, child_out)
            except BaseException:
                for fd in (to_child, from_child):
                    os.close(fd)
                raise
            finally:
                os.close(child_in)
                os.close(child_out)
            self.proc = Forked(pid, open(to_child, "w"), open(from_child))
        self._answers: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("KVB-JSON "):
                    with self._cv:
                        self._answers.append(json.loads(line[len("KVB-JSON "):]))
                        self._cv.notify_all()
        with self._cv:
            self._answers.append({"eof": True})
            self._cv.notify_all()

    def answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no answer in {timeout_s} s; log {self.log}:\n{self.tail()}")
                self._cv.wait(left)
            got = self._answers.pop(0)
        if got.get("eof"):
            raise RuntimeError(f"{self.name} exited (rc {self.proc.poll()}); log {self.log}:\n{self.tail()}")
        return got

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def submit(self, requests: list[dict[str, Any]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "generate", "requests": requests}) + "\n")
        self.proc.stdin.flush()

    def generate(self, requests: list[dict[str, Any]], timeout_s: float = 240) -> list[dict[str, Any]]:
        self.submit(requests)
        outputs: list[dict[str, Any]] = self.answer(timeout_s)["outputs"]
        return outputs

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def reap_dead_segments() -> None:
    """Unlink the /dev/shm segments of kvbridge-vllm processes that are gone (a killed driver cannot)."""
    for name in os.listdir("/dev/shm"):
        if not name.startswith("kvbridge-vllm-"):
            continue
        pid = name[len("kvbridge-vllm-"):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def make_model(path: Path) -> None:
    subprocess.run([str(VLLM_PYTHON), str(DRIVER), "make-model", str(path)], check=True, timeout=300,
                   capture_output=True)


def shared_model(basetemp: Path) -> Path:
    """The tiny model, made once per test run: in the directory every pytest-xdist worker's basetemp is in
    (each worker's basetemp is ``<base>/popen-gwN``), made aside and renamed into place (a worker that loses
    the race uses the winner's)."""
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    model = root / "tiny-llama"
    if not (model / "model.safetensors").exists():
        aside = root / f"tiny-llama.{os.getpid()}"
        make_model(aside)
        try:
            aside.rename(model)
        except OSError:                 # made meanwhile by another worker
            shutil.rmtree(aside, ignore_errors=True)
    return model

"""Real vLLM instances as child processes of the test (driven by ``vllm_driver.py`` under .venv-vllm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


class Instance:
    """One vLLM engine (its own process group: TP workers die with it)."""

    def __init__(self, name: str, config: dict[str, Any], logdir: Path, *, tp: int = 1) -> None:
        self.name = name
        # OMP_WAIT_POLICY=PASSIVE: an engine's OpenMP threads sleep between parallel regions instead of spinning
        # (torch's libgomp spins by default), which starved every other test process on the 2-core CI host
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
        if tp == 1:
            env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "all"}
        else:
            env |= {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        self.log = logdir / f"{name}.log"
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), "serve", json.dumps(config | {"tp": tp})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
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

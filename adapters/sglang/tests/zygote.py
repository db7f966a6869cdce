"""A warm parent for the SGLang rank processes of the tests (run under .venv-sglang by ``_rig.py``).

Importing torch and SGLang costs a rank process ~14 CPU-seconds; a scenario starts 3-8 ranks. This process
imports them once (what every rank imports anyway, nothing more: no plugin loaded, no thread, socket, agent or
shared-memory segment), then forks one child per rank. A child becomes what ``python <argv...>`` would be:
its own session (the tests signal a rank's process group), stdout and stderr on the rank's log, stdin on
/dev/null, the rank's environment and working directory, the script run as ``__main__`` (re-executed, so its
module globals - the /dev/shm names with the pid - are the child's own), and at the end what the interpreter
does on exit (join non-daemon threads, run the atexit handlers) before ``os._exit`` with Python's exit code.

Protocol: one JSON object per line. Requests on stdin, answers on stdout (the file descriptors it started
with; its fd 1 and 2 then go to stderr, so nothing an import prints can garble an answer). First the zygote
writes ``{"ready": true, "pid": ..., "import_s": ...}`` (or ``{"ready": false, "error": ...}``), then per
request:

    {"op": "spawn", "argv": [script or "-c", ...], "env": {...}, "cwd": "...", "log": "..."}  -> {"pid": n}
    {"op": "poll", "pids": [n, ...]}   -> {"status": {"n": exit code or null}} (a signal: minus its number)
    {"op": "ping"}                     -> {"pid": ..., "threads": ...}

Any failure answers ``{"error": "..."}``. It exits at EOF on stdin (the test process ended), killing the
children it still has. ``--light`` skips the imports, ``--thread`` starts a thread (tests of this mechanism).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: the modules every rank imports (sglang_driver, adversary_driver, kvbridge-sglang), heaviest first
PRELOAD = ("torch", "numpy", "sglang.srt.plugins", "sglang.srt.disaggregation.base.conn",
           "sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.utils", "sglang.srt.runtime_context",
           "kvbridge_sglang.plugin", "kvbridge_sglang.conn", "kvbridge.agent.decode", "multiprocessing.shared_memory",
           "runpy", "json", "traceback")


def preload() -> None:
    """What every rank imports before it does anything: torch (with torchvision's CPU schemas), SGLang's
    disaggregation modules and plugin loader, kvbridge-sglang, numpy. Imports only: state a rank changes
    (the plugin registration, the parallel position) is changed in the child, as in a fresh process."""
    sys.path.insert(0, HERE)
    from _cpu_torch import allow_cpu_torchvision

    allow_cpu_torchvision()
    for name in PRELOAD:
        importlib.import_module(name)


def threads() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    return len(os.listdir("/proc/self/task"))


def run_child(req: dict[str, Any], proto: tuple[int, int]) -> None:
    """In the forked child: become the rank; never returns."""
    code = 1
    try:
        os.setsid()
        for fd in proto:
            os.close(fd)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if "numpy" in sys.modules:               # its global generator, seeded from the OS as at import
            sys.modules["numpy"].random.seed()
        if "kvbridge.logs" in sys.modules:       # what kvbridge's import does with $KVBRIDGE_LOG
            from kvbridge.logs import configure_logging

            configure_logging()
        code = run_main(req["argv"])
        try:
            threading._shutdown()                # type: ignore[attr-defined]  # as the interpreter's exit does
        except Exception:   # noqa: BLE001
            traceback.print_exc()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:   # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:   # noqa: BLE001
                pass
        os._exit(code)


def run_main(argv: list[str]) -> int:
    """Run ``argv`` as ``python`` would (a script path or ``-c`` code); Python's exit code."""
    import runpy

    try:
        if argv[0] == "-c":
            import types

            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:   # noqa: BLE001
        traceback.print_exc()
        return 1


class Zygote:
    def __init__(self, proto_in: int, proto_out: int) -> None:
        self.fin, self.fout = proto_in, proto_out
        self.children: set[int] = set()
        self.status: dict[int, int] = {}
        self.buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(self.fout, data):]

    def reap(self) -> None:
        while self.children:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.status[pid] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)

    def spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        n = threads()
        if n != 1 or threading.active_count() != 1:
            return {"error": f"the zygote has {n} threads ({threading.enumerate()}): forking it is unsafe"}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(req, (self.fin, self.fout))
        self.children.add(pid)
        return {"pid": pid}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "spawn":
            return self.spawn(req)
        if op == "poll":
            self.reap()
            out: dict[str, int | None] = {}
            for pid in req["pids"]:
                if pid in self.status:
                    out[str(pid)] = self.status[pid]
                elif pid in self.children:
                    out[str(pid)] = None
                else:
                    return {"error": f"pid {pid} is no child of this zygote"}
            return {"status": out}
        if op == "ping":
            return {"pid": os.getpid(), "threads": threads()}
        return {"error": f"unknown op {op!r}"}

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.fin], [], [], 0.5)
            self.reap()
            if not ready:
                continue
            chunk = os.read(self.fin, 1 << 16)
            if not chunk:
                return
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    answer = self.handle(json.loads(line))
                except Exception as exc:   # noqa: BLE001
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                self.send(answer)

    def close(self) -> None:
        """The test process is gone: no rank outlives it."""
        self.reap()
        for pid in self.children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + 10
        while self.children and time.monotonic() < end:
            self.reap()
            time.sleep(0.05)


def main() -> None:
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)                       # a stray print goes to the zygote's log, not into the protocol
    zygote = Zygote(proto_in, proto_out)
    t0 = time.monotonic()
    try:
        if "--light" not in sys.argv:
            preload()
        if "--thread" in sys.argv:          # the tests' unsafe zygote: one more thread before any fork
            threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="unsafe").start()
        import gc

        gc.collect()
        gc.freeze()                     # the imported objects stay shared with the children (no copy on GC)
    except BaseException:   # noqa: BLE001
        zygote.send({"ready": False, "error": traceback.format_exc()})
        return
    zygote.send({"ready": True, "pid": os.getpid(), "import_s": round(time.monotonic() - t0, 2),
                 "threads": threads()})
    try:
        zygote.serve()
    finally:
        zygote.close()


if __name__ == "__main__":
    main()

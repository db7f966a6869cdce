"""The churn/soak rig: one long-lived prefill process and short-lived decode processes, over ZMQ.

``python tests/_churnrig.py [BACKEND]`` imports what a rank of ``BACKEND`` imports (kvbridge's agent, link and
kit, the engine's Python module: :data:`PRELOAD`), says ``spawned`` and waits for its job (one JSON line on
stdin), so the test can start the next decode process while the current one runs and its imports are off
the critical path (they were not before 2026-11: ``spawned`` came before any kvbridge import, and a NIXL
decode then imported torch and NIXL inside the timed restart). After the job every
stdin line is a command; the child answers ``CHURNRIG {json}`` lines on stdout and exits when stdin closes
(or on ``exit``).

Prefill job ``{"role": "prefill", ...}``: a 1-rank instance ``churn-prefill`` with a host-memory
:class:`kvbridge.testkit.kvmodel.KVPool`. Commands: ``room`` (fill the request's pages with the reference
pattern, wait for the decode request, send two chunks, wait for Success and safe_to_reuse, clear; answers
``room`` with the status), ``stats`` (answers ``stats``: fds, RSS, /dev/shm mappings, peers, link queues).

Decode job ``{"role": "decode", ...}``: a 1-rank decode with its pool in /dev/shm (``kvbridge-kit-<run>-<pid>-n``,
so the parent can reap it after a kill -9), connects, asks for one room, waits, checks every byte against
:mod:`kvbridge.pattern` (through ``kvbridge.testkit.reference``) and answers ``result``; after the room is
safe to reuse and cleared it answers ``done`` and waits: ``close`` closes the agent and pool cleanly.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _childproc import TaggedChild

_TAG = "CHURNRIG "
HERE = Path(__file__).resolve()
INSTANCE = "churn-prefill"
#: imported before ``spawned``: always, and per backend (what creating its engine imports)
PRELOAD: dict[str, tuple[str, ...]] = {
    "": ("numpy", "kvbridge.agent", "kvbridge.protocol.wire", "kvbridge.testkit.kvmodel", "kvbridge.testkit.pools",
         "kvbridge.zmq_link", "kvbridge.registry"),
    "nixl": ("kvbridge_nixl.backend",),
    "mooncake": ("mooncake.engine",),
}

# ============================================================================ parent side


class Child(TaggedChild):
    """One rank process; events are read by a thread; every wait is bounded."""

    def __init__(self, label: str, script: Path = HERE, backend: str = "") -> None:
        self._cond = threading.Condition()
        self._items: list[dict[str, Any]] = []
        self._closed = False
        super().__init__(label, script, _TAG, argv=[backend] if backend else [],
                         env_defaults={"GLOG_minloglevel": "1", "NIXL_LOG_LEVEL": "WARN"})

    def _event(self, item: dict[str, Any]) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def _eof(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, event: str, timeout_s: float, **match: Any) -> dict[str, Any]:
        """The first not yet consumed ``event`` whose fields include ``match`` (consumed by this call)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for k, e in enumerate(self._items):
                    if e["event"] == "error":
                        raise AssertionError(f"{self.label} (pid {self.pid}) failed: {e['text']}")
                    if e["event"] == event and all(e.get(key) == value for key, value in match.items()):
                        return self._items.pop(k)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    why = f"exited ({self.proc.poll()})" if self._closed else f"sent nothing in {timeout_s:.1f} s"
                    raise AssertionError(f"no {event!r} from {self.label} (pid {self.pid}): it {why}\n--- stderr:\n"
                                         f"{self.stderr()}")
                self._cond.wait(min(left, 0.1))

    def ask(self, event: str, timeout_s: float, **command: Any) -> dict[str, Any]:
        self.send(cmd=event, **command)
        return self.wait(event, timeout_s)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self, timeout_s: float) -> int:
        """Close stdin and wait for a clean exit; returns the exit code (SIGKILL after ``timeout_s``)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9

    def kill(self) -> None:
        """Idempotent teardown: SIGKILL if still running, close pipes and log, reap its segments."""
        from kvbridge.testkit.pools import reap_segments

        if self.proc.poll() is None:
            self.kill9()
        self._close_pipes()
        reap_segments(self.pid)
        self.log.close()


def shm_segments(prefix: str, pids: set[int] | None = None) -> tuple[int, int]:
    """(count, bytes) of this run's /dev/shm segments named ``<prefix><pid>-...`` (of ``pids`` if given)."""
    count = total = 0
    for name in os.listdir("/dev/shm"):
        if not name.startswith(prefix):
            continue
        if pids is not None and int(name[len(prefix):].split("-")[0]) not in pids:
            continue
        try:
            total += os.stat(f"/dev/shm/{name}").st_size
            count += 1
        except FileNotFoundError:
            pass
    return count, total


def process_stats(pid: int | str = "self") -> dict[str, Any]:
    """fds (total and by kind), RSS, threads and /dev/shm mappings of a process (Linux /proc)."""
    base = f"/proc/{pid}"
    kinds: Counter[str] = Counter()
    fds = 0
    for fd in os.listdir(f"{base}/fd"):
        try:
            target = os.readlink(f"{base}/fd/{fd}")
        except OSError:
            continue
        fds += 1
        kinds[target.split(":[", 1)[0] if target.startswith(("socket:", "pipe:")) else
              ("/dev/shm" if target.startswith("/dev/shm/") else
               target if target.startswith("anon_inode") else "file")] += 1
    with open(f"{base}/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    maps: dict[str, int] = {}
    with open(f"{base}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps[parts[5].strip()] = maps.get(parts[5].strip(), 0) + hi - lo
    threads = len(os.listdir(f"{base}/task"))
    return {"fds": fds, "fd_kinds": dict(kinds), "rss": rss, "threads": threads, "shm_maps": len(maps),
            "shm_mapped": sum(maps.values())}


# ============================================================================ child side

def _say(event: str, **fields: Any) -> None:
    sys.stdout.write(_TAG + json.dumps(dict(event=event, **fields)) + "\n")
    sys.stdout.flush()


def _wait(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _config(job: dict[str, Any]) -> Any:
    from kvbridge.agent import AgentConfig

    return AgentConfig(heartbeat_interval_s=job.get("heartbeat_s", 0.1), peer_timeout_s=job["peer_timeout_s"],
                       bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["bound_s"],
                       staging_bytes=1 << 20)


def _prefill(job: dict[str, Any]) -> None:
    import numpy as np

    from kvbridge.agent import TransferAgent
    from kvbridge.protocol.wire import KVPoll, Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.zmq_link import ZmqLink

    pool = KVPool(1, 0, role="prefill")
    link = ZmqLink(bootstrap=job["bootstrap"])
    agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL, link=link,
                          backend=job["backend"], instance=INSTANCE, name=f"churn-prefill-{os.getpid()}",
                          config=_config(job))
    agent.start()
    _say("ready")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            if cmd["cmd"] == "stats":
                # one consistent sample: the agent thread releases a departed peer (backend maps, link socket,
                # table entry) under this lock. Unlocked, /proc/self/fd could be listed before a release,
                # /proc/self/maps read during it and the peers counted after: "0 peers, 11 /dev/shm fds,
                # 1 mapping" with nothing leaked (it failed CI once on a loaded host)
                with agent.context.lock:
                    stats = process_stats()
                    table = agent.peers
                    stats.update(
                        peers=len(table.peers), alive_peers=sum(p.alive for p in table.peers.values()),
                        beat_targets=len(table.beat_targets()), link_queues=len(link._queues),
                        link_queued=sum(link.queued.values()), link_forgotten=len(link._forgotten),
                        backend_peers=len(getattr(agent.backend, "_peers", ()) or ()),
                        plan_slices=len(agent.peers._plans._slices),
                        rooms=len(agent.prefill.rooms),  # type: ignore[union-attr]
                        early=len(agent.prefill._early),  # type: ignore[union-attr]
                        replay_windows=len(table._windows))
                _say("stats", **stats)
                continue
            if cmd["cmd"] != "room":
                raise ValueError(f"unknown command {cmd!r}")
            started = time.monotonic()
            src, positions = np.array(cmd["src"], np.int64), np.array(cmd["positions"], np.int64)
            pool.fill(cmd["seed"], 100, src, positions)
            sender = agent.sender(cmd["room"])
            status, reason = "", ""
            if not _wait(lambda sender=sender: sender.poll() >= KVPoll.WaitingForInput, job["bound_s"]):
                reason = f"no request: {sender.poll().name} {sender.failure_reason}"
            elif sender.poll() is not KVPoll.Failed:
                half = max(1, len(src) // 2)
                sender.send(src[:half])
                sender.send(src[half:], last=True)
                _wait(lambda sender=sender: sender.poll() in (KVPoll.Success, KVPoll.Failed), job["bound_s"])
            status, reason = sender.poll().name, reason or sender.failure_reason
            safe = _wait(lambda sender=sender: sender.safe_to_reuse, job["bound_s"])
            if safe:
                sender.clear()
            _say("room", room=cmd["room"], status=status, reason=reason, safe=safe, took=time.monotonic() - started)
    finally:
        agent.close()       # closes its link too
        pool.close()


def _decode(job: dict[str, Any]) -> None:
    import numpy as np

    from kvbridge.agent import TransferAgent
    from kvbridge.protocol.wire import KVPoll, Role
    from kvbridge.testkit.kvmodel import KVPool
    from kvbridge.testkit.pools import GuardedBuffer
    from kvbridge.zmq_link import ZmqLink

    owned: list[Any] = []
    try:
        pool = KVPool(1, 0, memory="shm", role="decode")
        owned.append(pool)
        staging = GuardedBuffer(1 << 20, memory="shm")
        owned.append(staging)
        seed = job["seed"]
        dst, positions = np.array(job["dst"], np.int64), np.array(job["positions"], np.int64)
        pool.fill(seed, 200)
        link = ZmqLink(bootstrap=job["bootstrap"])    # the agent closes it
        agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.DECODE, link=link,
                              backend=job["backend"], name=f"churn-decode-{os.getpid()}", config=_config(job),
                              staging=staging.data)
        owned.append(agent)
        agent.start()
        agent.connect(INSTANCE, timeout_s=job["bound_s"])
        receiver = agent.receiver(job["room"], INSTANCE)
        receiver.send_metadata({k.name: dst for k in pool.kinds})
        _say("ready")
        _wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), job["bound_s"])
        problems = [] if receiver.poll() is KVPoll.Success else \
            [f"decode room {job['room']}: {receiver.poll().name} ({receiver.failure_reason})"]
        if not problems:
            problems += pool.check(seed, 200, dst, positions)
            if receiver.nbytes != pool.expected_nbytes(len(dst)):
                problems.append(f"counted {receiver.nbytes} bytes, the request is {pool.expected_nbytes(len(dst))}")
        _say("result", problems=problems)
        safe = _wait(lambda: receiver.safe_to_reuse, job["bound_s"])
        if safe:
            receiver.clear()
        _say("done", safe=safe)
        for line in sys.stdin:
            if json.loads(line).get("cmd") == "close":
                break
    finally:
        for item in reversed(owned):
            try:
                item.close()
            except Exception as exc:  # noqa: BLE001 - closing everything anyway; reported
                sys.stderr.write(f"closing {type(item).__name__} failed: {exc}\n")


def preload(backend: str) -> None:
    """Import :data:`PRELOAD` for ``backend`` (a module that fails to import is left to the job to report)."""
    import importlib

    for name in (*PRELOAD[""], *PRELOAD.get(backend, ())):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the job's own import says why, where the test sees it
            pass
    if backend == "nixl":
        try:
            importlib.import_module("kvbridge_nixl.api").load()   # NIXL's module as the backend loads it
        except Exception:  # noqa: BLE001 - as above
            pass


def run_job(job_handler: Any, backend: str = "") -> int:
    """A rig child's entry point: preload ``backend``'s imports (if named), say ``spawned``, read the job (one
    JSON line), run ``job_handler(job)``; an exception is reported as an ``error`` event and exit code 1."""
    if backend:
        preload(backend)
    _say("spawned")
    line = sys.stdin.readline()
    if not line:
        return 0
    try:
        job_handler(json.loads(line))
    except Exception as exc:  # noqa: BLE001 - report, then fail
        import traceback

        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        sys.stderr.write(text)
        _say("error", text=text)
        return 1
    return 0


def _main() -> int:
    roles: list[str] = []

    def job(job: dict[str, Any]) -> None:
        roles.append(job["role"])
        _prefill(job) if job["role"] == "prefill" else _decode(job)

    code = run_job(job, sys.argv[1] if len(sys.argv) > 1 else "")
    if roles == ["decode"]:
        # its agent and pool are closed (Goodbye sent, segments unlinked) or its error reported: the interpreter's
        # teardown of torch and NIXL (~1 CPU-s) is nothing the prefill can see, and on a loaded 2-core host it took
        # 3-15 s, past the test's 15 s bound for a clean exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(_main())

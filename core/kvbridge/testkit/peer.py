"""The multi-process tier: decode ranks in a child process (``python -m kvbridge.testkit.peer``), prefill
ranks in the test process, a BootstrapServer and ZmqLinks on 127.0.0.1 between them.

The parent writes one JSON job line to the child's stdin; the child answers with ``KVBRIDGE-KIT {json}``
lines on stdout (other output is ignored) and exits when its stdin closes. Every wait is bounded; the
child is killed in ``finally`` and its /dev/shm segments are reaped.

    run_remote_room(spec, {}, pt=2, dt=1, seed=7, mode="transfer", bound_s=15, spawn_timeout_s=60,
                    waiting_timeout_s=3, tracker=Tracker())
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.specs import BackendSpec
from kvbridge.testkit.checked import Tracker, find_spec_path, installed_registry, kit_registry, load_spec
from kvbridge.testkit.kvmodel import KVPool
from kvbridge.testkit.leaks import CHILD_PIDS
from kvbridge.testkit.pools import GuardedBuffer, reap_segments
from kvbridge.testkit.world import wait_until

__all__ = ["run_remote_room"]

_TAG = "KVBRIDGE-KIT "
_INSTANCE = "kit-mp-prefill"
_ROOM = 4242


def _config(job: dict[str, Any]) -> AgentConfig:
    return AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=job["peer_timeout_s"],
                       bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["waiting_timeout_s"],
                       staging_bytes=1 << 20, backend_options=job["options"])


def _spec_ref(spec: BackendSpec) -> str:
    """How a child finds the spec: "" (by name, installed) or "module:attr"."""
    if spec.name in installed_registry().backend_names() and installed_registry().backend_spec(spec.name) == spec:
        return ""
    path = find_spec_path(spec)
    if path is None:
        raise AssertionError(f"the multi-process tier needs '{spec.name}' in a child process, but its spec is neither "
                             "installed by entry point nor a module attribute a child could import")
    return path


class _Child:
    def __init__(self, job: dict[str, Any]) -> None:
        self.log = tempfile.TemporaryFile()  # the child's stderr, closed in kill()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge.testkit.peer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        CHILD_PIDS.add(self.proc.pid)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        self._buffer = b""

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        out = self.proc.stdout
        assert out is not None
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_TAG):
                    message = json.loads(text[len(_TAG):])
                    if message["event"] == "error":
                        raise AssertionError(f"the decode process failed: {message['text']}\n--- its stderr:\n"
                                             f"{self.stderr()}")
                    if message["event"] == event:
                        return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the decode process sent no {event!r} within {timeout_s:.0f} s\n--- its "
                                     f"stderr:\n{self.stderr()}")
            ready, _, _ = select.select([out], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(out.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"the decode process exited (code {self.proc.wait()}) before {event!r}\n"
                                         f"--- its stderr:\n{self.stderr()}")
                self._buffer += chunk

    def finish(self, timeout_s: float) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the decode process did not exit within {timeout_s:.0f} s") from None
        assert code == 0, f"the decode process exited with {code}\n--- its stderr:\n{self.stderr()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        reap_segments(self.proc.pid)
        self.log.close()


def run_remote_room(spec: BackendSpec, options: dict[str, str], pt: int, dt: int, *, seed: int, mode: str,
                    bound_s: float, spawn_timeout_s: float, waiting_timeout_s: float, tracker: Tracker) -> None:
    """Run one request Pt (here) -> Dt (child). ``mode``: "transfer" (byte-exact) or "kill" (the child is
    killed after the first chunk; prefill rooms must fail within the peer timeout)."""
    from kvbridge.zmq_link import BootstrapServer, ZmqLink

    peer_timeout = 1.0 if mode == "kill" else max(10.0, bound_s)
    rng = np.random.default_rng(seed)
    pools = [KVPool(pt, r, role="prefill") for r in range(pt)]
    num = pools[0].num_pages
    src = rng.permutation(num)[:5].astype(np.int64)
    dst = rng.permutation(num)[:5].astype(np.int64)
    positions = np.arange(5, dtype=np.int64)
    job: dict[str, Any] = {
        "spec": _spec_ref(spec), "backend": spec.name, "options": options, "pt": pt, "dt": dt, "seed": seed,
        "mode": mode, "dst": dst.tolist(), "positions": positions.tolist(), "bound_s": bound_s,
        "waiting_timeout_s": waiting_timeout_s, "peer_timeout_s": peer_timeout}
    server = BootstrapServer().start()
    job["bootstrap"] = server.address
    registry = kit_registry(spec, tracker=tracker)
    agents: list[TransferAgent] = []
    child: _Child | None = None
    try:
        for pool in pools:
            pool.fill(seed, 100 + pool.rank, src, positions)
            agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL,
                                  link=ZmqLink(bootstrap=server.address), backend=spec.name, registry=registry,
                                  instance=_INSTANCE, name=f"kit-mp-prefill-{pool.rank}-{os.getpid()}",
                                  config=_config(job))
            agents.append(agent)
            agent.start(0.002)
        child = _Child(job)
        child.expect("ready", spawn_timeout_s)
        senders = [a.sender(_ROOM) for a in agents]
        wait_until(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders), bound_s,
                   lambda: f"prefill ranks never got the child's requests: {[s.poll().name for s in senders]}")
        if mode == "kill":
            for s in senders:
                s.send(src[:2])
            child.kill()
            took = wait_until(lambda: all(s.poll() is KVPoll.Failed for s in senders), peer_timeout + 5.0,
                              lambda: f"prefill rooms did not fail after the decode process died: "
                                      f"{[(s.poll().name, s.failure_reason) for s in senders]}")
            assert took <= peer_timeout + 5.0
            for s in senders:
                assert s.failure_reason, "a prefill room failed without a reason"
            wait_until(lambda: all(s.safe_to_reuse for s in senders), bound_s,
                       lambda: "prefill rooms never became safe to reuse after their peer died")
            for s in senders:
                s.clear()
            return
        for s in senders:
            s.send(src[:2])
            s.send(src[2:], last=True)
        wait_until(lambda: all(s.poll() is KVPoll.Success for s in senders), bound_s,
                   lambda: f"prefill ranks did not finish: {[(s.poll().name, s.failure_reason) for s in senders]}")
        result = child.expect("result", bound_s)
        assert not result["problems"], "the decode process found wrong bytes:\n  " + "\n  ".join(result["problems"])
        wait_until(lambda: all(s.safe_to_reuse for s in senders), bound_s, lambda: "prefill rooms never settled")
        for s in senders:
            s.clear()
        child.finish(bound_s)
    finally:
        if child is not None:
            child.kill()
        for agent in agents:
            agent.close()
        for pool in pools:
            pool.close()
        server.close()


# ------------------------------------------------------------------------------------------ child side
def _say(event: str, **fields: Any) -> None:
    sys.stdout.write(_TAG + json.dumps(dict(event=event, **fields)) + "\n")
    sys.stdout.flush()


@contextmanager
def _closing(items: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for item in reversed(items):
            with suppress(Exception):   # exiting anyway
                item.close()


def _child_main() -> int:
    from kvbridge.zmq_link import ZmqLink

    job = json.loads(sys.stdin.readline())
    spec = load_spec(job["spec"]) if job["spec"] else installed_registry().backend_spec(job["backend"])
    registry = kit_registry(spec, tracker=Tracker())
    owned: list[Any] = []
    with _closing(owned):
        dt = job["dt"]
        dst, positions = np.array(job["dst"], np.int64), np.array(job["positions"], np.int64)
        pools = [KVPool(dt, r, memory="shm", role="decode") for r in range(dt)]
        owned.extend(pools)
        agents = []
        for pool in pools:
            pool.fill(job["seed"], 200 + pool.rank)
            staging = GuardedBuffer(1 << 20, memory="shm")
            owned.append(staging)
            agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.DECODE,
                                  link=ZmqLink(bootstrap=job["bootstrap"]), backend=spec.name, registry=registry,
                                  name=f"kit-mp-decode-{pool.rank}-{os.getpid()}", config=_config(job),
                                  staging=staging.data)
            owned.append(agent)
            agents.append(agent)
            agent.start(0.002)
        for agent in agents:
            agent.connect(_INSTANCE, timeout_s=job["bound_s"])
        receivers = [a.receiver(_ROOM, _INSTANCE) for a in agents]
        for receiver in receivers:
            receiver.send_metadata({k.name: dst for k in pools[0].kinds})
        _say("ready")
        if job["mode"] == "kill":
            sys.stdin.read()                # until the parent kills us
            return 0
        deadline = time.monotonic() + job["bound_s"]
        while not all(r.poll() in (KVPoll.Success, KVPoll.Failed) for r in receivers):
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        problems = [f"decode rank {i}: {r.poll().name} ({r.failure_reason})"
                    for i, r in enumerate(receivers) if r.poll() is not KVPoll.Success]
        if not problems:
            for pool in pools:
                problems += pool.check(job["seed"], 200 + pool.rank, dst, positions)
            for receiver, pool in zip(receivers, pools):
                if receiver.nbytes != pool.expected_nbytes(len(dst)):
                    problems.append(f"decode rank {pool.rank} counted {receiver.nbytes} bytes, the request is "
                                    f"{pool.expected_nbytes(len(dst))}")
        _say("result", problems=problems)
        while not all(r.safe_to_reuse for r in receivers) and time.monotonic() < deadline:
            time.sleep(0.001)
        for receiver in receivers:
            receiver.clear()
        sys.stdin.read()                    # the parent closes stdin when it is done with us
    return 0


def _run() -> int:
    try:
        return _child_main()
    except Exception as exc:  # noqa: BLE001 - report, then fail
        import traceback

        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        sys.stderr.write(text)
        _say("error", text=text)
        return 1


if __name__ == "__main__":
    sys.exit(_run())

"""The multi-process tiers: decode ranks in a child process (``python -m kvbridge.testkit.peer``), prefill
ranks in the test process, a BootstrapServer and ZmqLinks on 127.0.0.1 between them; for the fence tier
(:func:`run_fenced_writer`) the other way round: the writer (prefill) in the child, the decode here.

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
import signal
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
from kvbridge.testkit.kvmodel import KINDS, NUM_PAGES, KVPool
from kvbridge.testkit.leaks import CHILD_PIDS, child_env
from kvbridge.testkit.pools import GuardedBuffer, reap_segments
from kvbridge.testkit.world import wait_until

__all__ = ["FENCE_PEER_TIMEOUT_S", "run_fenced_writer", "run_remote_room"]

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
        env = dict(child_env(), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
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
            agent.start()
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


#: the fence tier's peer timeout: a stopped writer's rooms fail after this much silence (and stay fenced)
FENCE_PEER_TIMEOUT_S = 1.0
_WRITER = "kit-fence-writer"


def _fence_decode(spec: BackendSpec, registry: Any, job: dict[str, Any], owned: list[Any]) -> TransferAgent:
    """The decode rank of the fence tier: shm pool (a writer in another process maps it), and no kernel proof of
    a writer's exit (``prove_writer_death=False``), so only the writer, ``writer_gone`` or the engine fence."""
    from kvbridge.zmq_link import ZmqLink

    pool = KVPool(1, 0, memory="shm", role="decode")
    staging = GuardedBuffer(1 << 20, memory="shm")
    owned += [pool, staging]
    pool.fill(job["seed"], 200)
    config = AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=FENCE_PEER_TIMEOUT_S,
                         bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["bound_s"], staging_bytes=1 << 20,
                         backend_options=job["options"], prove_writer_death=False)
    agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.DECODE,
                          link=ZmqLink(bootstrap=job["bootstrap"]), backend=spec.name, registry=registry,
                          name=f"kit-fence-decode-{os.getpid()}", config=config, staging=staging.data)
    owned.append(agent)
    agent.start()
    return agent


def run_fenced_writer(spec: BackendSpec, options: dict[str, str], *, seed: int, stop: bool, gone_bound_s: float,
                      bound_s: float, spawn_timeout_s: float, tracker: Tracker) -> float:
    """A writer (prefill, in a child process) with a room in flight to a decode rank here, then stopped
    (``stop``: SIGSTOP past the peer timeout, then SIGCONT) or killed (SIGKILL). Stopped, the backend's
    ``writer_gone`` must keep answering False for the writer's endpoint and the room stay unsafe; killed, it must
    answer True within ``gone_bound_s`` and the room become safe. Returns how long ``writer_gone`` took (killed)."""
    failure, took = _fenced_writer(spec, options, seed=seed, stop=stop, gone_bound_s=gone_bound_s, bound_s=bound_s,
                                   spawn_timeout_s=spawn_timeout_s, tracker=tracker)
    if failure:       # raised here, once everything is closed: a traceback would keep the pools' mappings open
        raise AssertionError(failure)
    return took


def _fenced_writer(spec: BackendSpec, options: dict[str, str], *, seed: int, stop: bool, gone_bound_s: float,
                   bound_s: float, spawn_timeout_s: float, tracker: Tracker) -> tuple[str, float]:
    """:func:`run_fenced_writer`'s run: ("", seconds) or (why it failed, 0)."""
    from kvbridge.zmq_link import BootstrapServer

    rng = np.random.default_rng(seed)
    src = rng.permutation(NUM_PAGES)[:5].astype(np.int64)
    dst = rng.permutation(NUM_PAGES)[:5].astype(np.int64)
    server = BootstrapServer().start()
    job: dict[str, Any] = {
        "spec": _spec_ref(spec), "backend": spec.name, "options": options, "seed": seed, "mode": "writer",
        "src": src.tolist(), "bound_s": bound_s, "waiting_timeout_s": bound_s, "peer_timeout_s": FENCE_PEER_TIMEOUT_S,
        "bootstrap": server.address}
    owned: list[Any] = [server]
    child: _Child | None = None
    try:
        with _closing(owned):
            decode = _fence_decode(spec, kit_registry(spec, tracker=tracker), job, owned)
            child = _Child(job)
            ready = child.expect("ready", spawn_timeout_s)
            decode.connect(_INSTANCE, timeout_s=bound_s)
            receiver = decode.receiver(_ROOM, _INSTANCE)
            receiver.send_metadata({k.name: dst for k in KINDS})
            child.expect("sent", bound_s)
            wait_until(lambda: receiver.nbytes > 0, bound_s,
                       lambda: f"the writer's first chunk never arrived: {receiver.poll().name} "
                               f"({receiver.failure_reason})")
            fence = _Fence(decode, receiver, bytes.fromhex(ready["endpoint"]), ready["agent"], spec.name, bound_s)
            if stop:
                fence.stopped(child, gone_bound_s)
                return "", 0.0
            return "", fence.killed(child, gone_bound_s)
    except AssertionError as exc:
        return str(exc), 0.0
    finally:
        if child is not None:
            child.kill()


class _Fence:
    """The decode side's view of one writer: its room, and the backend's ``writer_gone`` for its endpoint."""

    def __init__(self, decode: TransferAgent, receiver: Any, endpoint: bytes, writer: str, name: str,
                 bound_s: float) -> None:
        self.decode, self.receiver, self.endpoint, self.writer = decode, receiver, endpoint, writer
        self.name, self.bound_s = name, bound_s

    def gone(self) -> bool:
        return bool(self.decode.backend.writer_gone(self.endpoint))  # type: ignore[attr-defined]

    def state(self) -> str:
        return (f"the decode room is {self.receiver.poll().name} ({self.receiver.failure_reason or 'no reason'}), "
                f"safe_to_reuse={self.receiver.safe_to_reuse}")

    def assert_fenced(self, why: str) -> None:
        assert not self.gone(), (f"'{self.name}': writer_gone(endpoint) answered True for a writer that {why}, not "
                                 "gone: it still maps the decode's pages and writes when it resumes. writer_gone may "
                                 "answer True only once the writer's process is proven gone (never on silence); "
                                 f"{self.state()}")
        assert not self.receiver.safe_to_reuse, (f"'{self.name}': the decode reported its room safe to reuse while "
                                                 f"its writer {why}; {self.state()}")

    def stopped(self, child: _Child, observe_s: float) -> None:
        """SIGSTOP past the peer timeout: the room fails, yet stays fenced while the writer is stopped."""
        os.kill(child.proc.pid, signal.SIGSTOP)
        try:
            self.assert_fenced("is stopped (SIGSTOP)")
            wait_until(lambda: self.receiver.poll() is KVPoll.Failed, self.bound_s,
                       lambda: f"the decode never judged its stopped writer dead: {self.state()}")
            until = time.monotonic() + observe_s
            while time.monotonic() < until:
                self.assert_fenced(f"is stopped (SIGSTOP) past the peer timeout ({FENCE_PEER_TIMEOUT_S:g} s)")
                time.sleep(0.05)
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)
        if not _settled(self.receiver, self.bound_s):      # the resumed writer did not acknowledge the abort
            self.decode.declare_gone(self.writer)
        wait_until(lambda: self.receiver.safe_to_reuse, self.bound_s, lambda: f"cleaning up: {self.state()}")
        self.receiver.clear()
        child.finish(self.bound_s)

    def killed(self, child: _Child, bound_s: float) -> float:
        """SIGKILL: ``writer_gone`` turns True within the stated bound, and the room becomes safe."""
        os.kill(child.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(self.gone, bound_s,
                   lambda: f"'{self.name}': writer_gone(endpoint) still answered False after its writer's process "
                           f"was killed (SIGKILL); the backend states writer_gone_bound_s={bound_s:g}",
                   poll_s=0.005)
        took = time.monotonic() - killed
        wait_until(lambda: self.receiver.safe_to_reuse, self.bound_s,
                   lambda: f"'{self.name}': writer_gone answered True, yet the decode room never became safe to "
                           f"reuse: {self.state()}")
        self.receiver.clear()
        return took


def _settled(receiver: Any, timeout_s: float) -> bool:
    try:
        wait_until(lambda: receiver.safe_to_reuse, timeout_s, lambda: "")
    except AssertionError:
        return False
    return True


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
    if job["mode"] == "writer":
        return _writer_main(job)
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
            agent.start()
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


def _writer_main(job: dict[str, Any]) -> int:
    """The fence tier's writer: one prefill rank that sends the first chunk of a room and holds the rest."""
    from kvbridge.zmq_link import ZmqLink

    spec = load_spec(job["spec"]) if job["spec"] else installed_registry().backend_spec(job["backend"])
    owned: list[Any] = []
    with _closing(owned):
        pool = KVPool(1, 0, role="prefill")
        owned.append(pool)
        src = np.array(job["src"], np.int64)
        pool.fill(job["seed"], 100, src, np.arange(len(src), dtype=np.int64))
        agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL,
                              link=ZmqLink(bootstrap=job["bootstrap"]), backend=spec.name,
                              registry=kit_registry(spec, tracker=Tracker()), instance=_INSTANCE,
                              name=f"{_WRITER}-{os.getpid()}", config=_config(job))
        owned.append(agent)
        agent.start()
        _say("ready", agent=agent.name, endpoint=agent.backend.endpoint.hex())
        sender = agent.sender(_ROOM)
        wait_until(lambda: sender.poll() >= KVPoll.WaitingForInput, job["bound_s"],
                   lambda: f"the decode's request never came: {sender.poll().name}")
        sender.send(src[:2])                # not the last chunk: the room stays in flight
        _say("sent")
        sys.stdin.read()                    # until the parent is done (or kills us)
        deadline = time.monotonic() + job["bound_s"]
        while not sender.safe_to_reuse and time.monotonic() < deadline:
            time.sleep(0.005)
        with suppress(Exception):           # a room that did not settle is the parent's report, not ours
            sender.clear()
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

"""The fault matrix's rig: prefill and decode agents in their own processes, pools the test can read.

Each rank is a child process (``python tests/_faultrig.py``) that imports kvbridge, says ``spawned``
and then waits for its job (one JSON line on stdin), so a test can start a process ahead of time and
hand it its identity at the moment it matters (a same-name restart within milliseconds of a kill).
After the job, every further stdin line is a command; the child answers with ``FAULTRIG {json}``
lines on stdout; it exits when stdin closes.

Memory. A decode rank's pool and staging area are /dev/shm segments the TEST process creates
(:class:`kvbridge.testkit.kvmodel.KVPool` with ``memory="shm"``: guard zones on both sides, names
``kvbridge-kit-<run tag>-<test pid>-<n>`` from :mod:`kvbridge.shmnames`); the child maps them by name.
So the test reads the destination bytes on its own, checks them against :mod:`kvbridge.pattern`
(never through the agent), and unlinks every segment itself, even after a ``kill -9``.
A prefill rank's pool is private host memory of its process, filled with the reference pattern.

Rooms. ``serve`` (prefill) runs an engine thread that sends chunks with a pause between them (a
chunked prefill) and a watcher thread that reports every status change with its CLOCK_MONOTONIC time
(comparable across processes of one host) and the moment ``safe_to_reuse`` becomes True. ``recv``
(decode) does the same on the receiving side and can snapshot the whole pool (guards and staging
included) the instant ``safe_to_reuse`` is seen True, and the instant the room fails.

Bootstrap. ``python tests/_faultrig.py bootstrap ADDRESS`` runs a BootstrapServer at ADDRESS (``tcp://
127.0.0.1:0`` for a fresh port) and prints its address; the test kills and restarts it.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _childproc import TaggedChild

_TAG = "FAULTRIG "
HERE = Path(__file__).resolve()

# ============================================================================ parent side


class Events:
    """Every event line of one child, kept in order; waits are bounded."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.items: list[dict[str, Any]] = []
        self.closed = False

    def push(self, item: dict[str, Any]) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def find(self, event: str, **match: Any) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.items if e["event"] == event and all(e.get(k) == v for k, v in match.items())]

    def wait(self, event: str, timeout_s: float, what: Callable[[], str] = lambda: "",
             **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for e in self.items:
                    if e["event"] == "error":
                        raise AssertionError(f"child error: {e['text']}")
                    if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    why = "exited" if self.closed else f"sent nothing within {timeout_s:.1f} s"
                    raise AssertionError(f"no {event!r} {match} event: the child {why}. {what()}")
                self._cond.wait(min(left, 0.1))


class Child(TaggedChild):
    """One rank process. ``start`` it early; ``job()`` gives it its identity; ``kill()`` in a finally."""

    def __init__(self, label: str, argv: list[str] | None = None) -> None:
        self.events = Events()
        super().__init__(label, HERE, _TAG, argv or [])

    def _event(self, item: dict[str, Any]) -> None:
        self.events.push(item)

    def _eof(self) -> None:
        self.events.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the monotonic time that bounds its effect conservatively.

        SIGCONT: the time just *before* the signal (the child may run, and act, before ``kill`` returns to us).
        Any other signal: the time just *after* it (the child may act until then).
        """
        before = time.monotonic()
        os.kill(self.pid, sig)
        return before if sig == signal.SIGCONT else time.monotonic()

    def kill9(self) -> float:
        """SIGKILL and reap; returns the monotonic time of the kill."""
        at = self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return at

    def fds(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return -1

    def kill(self) -> None:
        """Idempotent teardown: continue (a stopped child cannot die cleanly otherwise), close stdin,
        give it a moment to close its agent, then SIGKILL."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                if self.proc.stdin is not None and not self.proc.stdin.closed:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_pipes()
        self.log.close()


def spawn_bootstrap(address: str = "tcp://127.0.0.1:0") -> tuple[Child, str]:
    child = Child("bootstrap", ["bootstrap", address])
    try:
        ready = child.events.wait("bootstrap", 30, child.stderr)
    except BaseException:
        child.kill()
        raise
    return child, ready["address"]


def segment_spec(pool: Any, staging: Any) -> dict[str, Any]:
    """What a decode child needs to map the test's pool: per component, per buffer, the segment name."""
    return {"buffers": {name: [b.shm_name for b in bufs] for name, bufs in pool.buffers.items()},
            "staging": staging.shm_name if staging is not None else "", "staging_bytes": staging.nbytes if staging
            is not None else 0}


def pool_bytes(pool: Any, staging: Any) -> np.ndarray:
    """Every byte of a pool's segments (guards included) and of its staging area, in segment order; read
    through the test's own mappings."""
    parts = [np.array(b._whole) for bufs in pool.buffers.values() for b in bufs]
    if staging is not None:
        parts.append(np.array(staging._whole))
    return np.concatenate(parts)


def check_pool(pool: Any, seed: int, background: int, *, exact: Sequence[tuple[Any, Any]] = (),
               partial: Sequence[tuple[Any, Any]] = ()) -> tuple[int, list[str]]:
    """Judge a decode pool (through the test's own mapping) against the reference pattern.

    ``exact``: (pages, positions) of rooms that succeeded: every byte must be the reference. ``partial``:
    rooms that did not: every byte of their pages is the reference or still the canary (background),
    nothing else. Every other page must be the canary, and every guard zone intact. Returns the bytes of
    the partial rooms' pages that hold reference data (where it differs from the canary) and the problems.
    """
    from kvbridge.testkit import reference as ref

    def cat(rooms: Sequence[tuple[Any, Any]], i: int) -> np.ndarray:
        return np.concatenate([np.asarray(r[i], np.int64) for r in rooms]) if rooms else np.zeros(0, np.int64)

    ex_pages, pa_pages = cat(exact, 0), cat(partial, 0)
    all_pages = np.concatenate([ex_pages, pa_pages])
    all_positions = np.concatenate([cat(exact, 1), cat(partial, 1)])
    if len(np.unique(all_pages)) != len(all_pages):
        raise ValueError("rooms of one pool must use disjoint pages")
    others = np.setdiff1d(np.arange(pool.num_pages), all_pages)
    good, problems = 0, []
    for k, kind in enumerate(pool.kinds):
        spec = kind.spec()
        for b, (name, layer, tensor) in enumerate(kind.coords()):
            key = 1000 * k + b                      # KVPool's buffer key
            buf = pool.buffers[kind.name][b]
            full = ref.expected_buffer(spec, seed, layer, tensor, pool.tp, pool.rank, pool.num_pages, all_pages,
                                       all_positions, background, key)
            canary = ref.expected_buffer(spec, seed, layer, tensor, pool.tp, pool.rank, pool.num_pages, [], [],
                                         background, key)
            got = buf.read().reshape(full.shape)
            where = f"{kind.name}/{name}"
            if ex_pages.size and (got[ex_pages] != full[ex_pages]).any():
                bad = int((got[ex_pages] != full[ex_pages]).sum())
                problems.append(f"{where}: {bad} bytes of a succeeded room's pages differ from the reference")
            if pa_pages.size:
                ok_data = got[pa_pages] == full[pa_pages]
                wild = ~(ok_data | (got[pa_pages] == canary[pa_pages]))
                good += int(np.count_nonzero(ok_data & (full[pa_pages] != canary[pa_pages])))
                if wild.any():
                    problems.append(f"{where}: {int(wild.sum())} bytes of an unfinished room's pages are neither "
                                    "the reference nor the canary")
            if others.size and (got[others] != canary[others]).any():
                first = int(others[np.argwhere(got[others] != canary[others])[0][0]])
                problems.append(f"{where}: {int((got[others] != canary[others]).sum())} bytes outside every "
                                f"requested page changed (first on page {first})")
            if buf.guard_damage():
                problems.append(f"{where}: {buf.guard_damage()}")
    return good, problems


# ============================================================================ child side


def _say(event: str, **fields: Any) -> None:
    line = _TAG + json.dumps(dict(event=event, **fields), default=str) + "\n"
    with _SAY_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


_SAY_LOCK = threading.Lock()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Mapped:
    """A /dev/shm segment created by the test, mapped here; ``data`` is the registered part."""

    def __init__(self, name: str, nbytes: int) -> None:
        from kvbridge.testkit.pools import GUARD

        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, nbytes + 2 * GUARD)
        finally:
            os.close(fd)
        self.whole = np.frombuffer(self.map, np.uint8)
        self.data = self.whole[GUARD: GUARD + nbytes]


def _config(job: dict[str, Any]) -> Any:
    from kvbridge.agent import AgentConfig

    c = job["config"]
    return AgentConfig(heartbeat_interval_s=c["heartbeat_s"], peer_timeout_s=c["peer_timeout_s"],
                       bootstrap_timeout_s=c["bootstrap_timeout_s"], waiting_timeout_s=c["waiting_timeout_s"],
                       staging_bytes=c["staging_bytes"], write_flight_bound_s=c.get("write_flight_bound_s"),
                       backend_options=job.get("options", {}))


def _link(job: dict[str, Any]) -> Any:
    import inspect

    from kvbridge.zmq_link import ZmqLink

    kwargs: dict[str, Any] = {"bootstrap": job["bootstrap"]}
    if "republish_s" in inspect.signature(ZmqLink).parameters and job.get("republish_s"):
        kwargs["republish_s"] = job["republish_s"]
    return ZmqLink(**kwargs)


def _watch(handle: Any, room: int, stop: threading.Event, snapshot: Callable[[str], None] | None,
           snap_dir: str, clear: bool = False) -> None:
    """Report every status change and the first time safe_to_reuse is True (snapshotting the pool then);
    ``clear``: then clear the room, as an engine does (its peer can then be released)."""
    from kvbridge.errors import KVBridgeError
    from kvbridge.protocol.wire import KVPoll

    last = None
    safe_seen = False
    failed_snap = False
    while not stop.is_set():
        try:
            status = handle.poll()
            if status is not last:
                _say("status", room=room, status=status.name, t=time.monotonic(),
                     reason=handle.failure_reason if status is KVPoll.Failed else "")
                last = status
            if status is KVPoll.Failed and snapshot is not None and not failed_snap:
                failed_snap = True
                snapshot(os.path.join(snap_dir, f"room{room}-failed.npy"))
            if status in (KVPoll.Success, KVPoll.Failed) and not safe_seen and handle.safe_to_reuse:
                if snapshot is not None:
                    snapshot(os.path.join(snap_dir, f"room{room}-safe.npy"))   # before anything else
                safe_seen = True
                _say("safe", room=room, t=time.monotonic(), status=status.name)
                if clear:
                    handle.clear()
                    _say("cleared", room=room, t=time.monotonic())
                    return
        except KVBridgeError as exc:          # the room was cleared
            _say("watch-end", room=room, why=str(exc))
            return
        time.sleep(0.002)


def _serve(agent: Any, cmd: dict[str, Any], stop: threading.Event, timeout_s: float) -> None:
    """A chunked prefill: wait for the decode's request, then send each chunk, pausing between them."""
    from kvbridge.errors import KVBridgeError
    from kvbridge.protocol.wire import KVPoll

    room = cmd["room"]
    sender = agent.sender(room)
    threading.Thread(target=_watch, args=(sender, room, stop, None, "", True), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while sender.poll() < KVPoll.WaitingForInput:
        if sender.poll() is KVPoll.Failed or time.monotonic() > deadline:
            _say("refused", room=room, chunk=-1, reason=f"never requested: {sender.poll().name} "
                 f"{sender.failure_reason}", t=time.monotonic())
            return
        time.sleep(0.001)
    _say("requested", room=room, t=time.monotonic())
    chunks = cmd["chunks"]
    for i, pages in enumerate(chunks):
        if i and cmd.get("pace_s"):
            time.sleep(cmd["pace_s"])
        try:
            sender.send(np.asarray(pages, np.int64), last=i == len(chunks) - 1)
        except KVBridgeError as exc:
            _say("refused", room=room, chunk=i, reason=str(exc), t=time.monotonic())
            break
        _say("sent", room=room, chunk=i, t=time.monotonic())
    _say("engine-done", room=room, t=time.monotonic())


def _lie_short(keep: dict[int, int]) -> None:
    """An adversarial prefill: for rooms in ``keep``, it believes the decode asked for only the first
    ``keep[room]`` pages of each component (so its own short-send check passes and it sends with last=True)."""
    import msgspec

    from kvbridge.agent.prefill import PrefillSide
    from kvbridge.protocol.wire import PackedIndices

    real = PrefillSide.on_request

    def on_request(self: Any, req: Any, peer: Any) -> None:
        n = keep.get(req.room)
        if n is not None:
            req = msgspec.structs.replace(req, indices={k: PackedIndices.pack(v.unpack()[:n], v.first)
                                                        for k, v in req.indices.items()})
        real(self, req, peer)

    PrefillSide.on_request = on_request  # type: ignore[method-assign]


def _connect(agent: Any, job: dict[str, Any]) -> None:
    from kvbridge.specs import Capability

    agent.connect(job["instance"], timeout_s=job["connect_timeout_s"])
    _say("connected", t=time.monotonic(), fds=_fds(),
         writer_gone=Capability.WRITER_GONE in agent.context.calls.capabilities)


def _child_main() -> int:
    from kvbridge.agent import TransferAgent
    from kvbridge.protocol.wire import Role
    from kvbridge.registry import Registry
    from kvbridge.testkit.kvmodel import KVPool, kv_layout

    _say("spawned", pid=os.getpid(), t=time.monotonic())
    line = sys.stdin.readline()
    if not line:
        return 0
    job = json.loads(line)
    stop = threading.Event()
    keep: list[Any] = []
    registry = Registry.build()
    role = job["role"]
    if job.get("lie_short"):
        _lie_short({int(k): v for k, v in job["lie_short"].items()})
    num_pages = job["num_pages"]
    agent = None
    try:
        if role == "prefill":
            pool = KVPool(1, 0, memory="host", num_pages=num_pages, role="prefill")
            keep.append(pool)
            pool.fill(job["seed"], job["background"], job["src"], job["positions"])
            agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL, link=_link(job),
                                  backend=job["backend"], registry=registry, instance=job["instance"],
                                  name=job["name"], config=_config(job))
            agent.start()
            _say("ready", t=time.monotonic(), fds=_fds())
        else:
            layout = kv_layout(1, 0, num_pages=num_pages)
            segs = job["segments"]
            mapped = {comp.name: [_Mapped(n, g.nbytes) for n, g in zip(segs["buffers"][comp.name], comp.buffers)]
                      for comp in layout.components}
            staging = _Mapped(segs["staging"], segs["staging_bytes"]) if segs["staging"] else None
            keep.extend([mapped, staging])
            wholes = [m.whole for ms in mapped.values() for m in ms] + ([staging.whole] if staging else [])

            def snapshot(path: str) -> None:
                np.save(path, np.concatenate(wholes))

            agent = TransferAgent(layout=layout, buffers={k: [m.data for m in v] for k, v in mapped.items()},
                                  role=Role.DECODE, link=_link(job), backend=job["backend"], registry=registry,
                                  name=job["name"], config=_config(job),
                                  staging=staging.data if staging is not None else None)
            agent.start()
            _say("started", t=time.monotonic())
            if not job.get("defer_connect"):
                _connect(agent, job)
        receivers: dict[int, Any] = {}
        for line in sys.stdin:
            cmd = json.loads(line)
            what = cmd["cmd"]
            if what == "serve":
                threading.Thread(target=_serve, args=(agent, cmd, stop, job["config"]["bootstrap_timeout_s"]),
                                 daemon=True).start()
            elif what == "recv":
                receiver = agent.receiver(cmd["room"], job["instance"])
                receivers[cmd["room"]] = receiver
                receiver.send_metadata({c.name: np.asarray(cmd["dst"], np.int64) for c in agent.layout.components})
                snap_dir = cmd.get("snap_dir", "")      # no directory given: no snapshots (never the cwd)
                threading.Thread(target=_watch, args=(receiver, cmd["room"], stop, snapshot if snap_dir else None,
                                                      snap_dir),
                                 daemon=True).start()
            elif what == "connect":
                _connect(agent, job)
            elif what == "ping":
                peers = agent.peers
                with agent.context.lock:
                    alive = sorted(p.agent for p in peers.peers.values() if p.alive)
                    known = len(peers.peers)
                _say("pong", t=time.monotonic(), fds=_fds(), alive=alive, peers=known, nonce=cmd.get("nonce"))
            elif what == "nbytes":
                _say("nbytes", room=cmd["room"], nbytes=receivers[cmd["room"]].nbytes)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the child exits 1
        import traceback

        _say("error", text=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    finally:
        stop.set()
        if agent is not None:
            try:
                agent.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
    return 0


def _bootstrap_main(address: str) -> int:
    from kvbridge.zmq_link import BootstrapServer

    server = BootstrapServer(address).start()
    _say("bootstrap", address=server.address)
    sys.stdin.read()
    server.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "bootstrap":
        sys.exit(_bootstrap_main(sys.argv[2]))
    sys.exit(_child_main())

"""Adversarial tests of wave 3: the liveness proof of a writer's exit, the fences it releases, room events.

In-process (LocalHub, loopback backend, real TCP liveness sockets):

* a connection flood at the liveness listener's cap (4096 held connections; no secret protects that port)
  must neither evict a decode connected before it nor make a decode that connects after it take a live
  writer for dead (the listener accepts, then closes, a connection above the cap: an EOF on an
  established connection, the very proof of exit);
* a peer that streams bytes into a held liveness connection must not stall the prefill's progress loop;
* many decode restarts leave no held connection or peer record on the prefill; many prefill restarts (in
  both orders: exit then restart within the grace, restart then exit) leave no liveness watch of a
  retired incarnation on the decode, and every bound room fails once, then becomes safe once.

Real processes (tests/_faultrig.py via tests/_wave3_child.py, ZmqLink + BootstrapServer on 127.0.0.1,
Mooncake over TCP, which has no backend proof of death of its own, so only the liveness connection
fences; pools in /dev/shm judged against kvbridge.pattern by this process):

* SIGSTOP the prefill past the peer timeout (and past the reaping linger), then kill -9 it while stopped;
* kill -9 the prefill mid-transfer, then a same-name replacement at the same ZMQ address within the grace;
* two decodes share a prefill; one is killed -9 mid-transfer, the other's room must still be exact.

Room events are checked in every child at the moment they are emitted: exactly once per room,
FAILED/FINISHED before SAFE_TO_REUSE, never SAFE while FENCING or while a scatter runs, nothing for a
room the engine cleared.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _childproc import TaggedChild
from _faultrig import _TAG, Child, Events, check_pool, pool_bytes, segment_spec
from test_agent import kv_buffers, kv_layout

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent.liveness import MAX_HELD, split_address
from kvbridge.links import LocalHub
from kvbridge.protocol.events import RoomEventKind
from kvbridge.protocol.states import RecvState
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.testkit.kvmodel import KVPool
from kvbridge.testkit.pools import SHM_PREFIX, GuardedBuffer
from kvbridge.zmq_link import BootstrapServer

pytestmark = pytest.mark.timeout(120)

W3_CHILD = Path(__file__).resolve().parent / "_wave3_child.py"
GRACE_S = 0.5


# ============================================================================ in-process helpers
def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _agent(hub: LocalHub, role: Role, name: str, cfg: AgentConfig, fill: int = 0,
           address: str | None = None) -> tuple[TransferAgent, list[np.ndarray]]:
    bufs = kv_buffers(kv_layout(1, 0))
    for b in bufs:
        b[:] = fill
    agent = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": bufs}, role=role, link=hub.link(address or name),
                          instance="inst" if role is Role.PREFILL else "", config=cfg, name=name)
    return agent, bufs


def _step(agents: list[TransferAgent], seconds: float = 0.0, rounds: int = 0,
          until: Any = None) -> None:
    """Drive ``progress()`` of every agent for ``rounds`` rounds or ``seconds`` (or until ``until()``)."""
    deadline = time.monotonic() + seconds
    n = 0
    while n < rounds or time.monotonic() < deadline:
        for a in agents:
            a.progress()
        n += 1
        if until is not None and until():
            return
        if seconds:
            time.sleep(0.003)


def _shake(dec: TransferAgent, others: list[TransferAgent], timeout_s: float = 10.0) -> None:
    shake = dec.connect_async("inst")
    _step([dec, *others], seconds=timeout_s, until=lambda: shake.done)
    assert shake.done, f"handshake not done: {shake.refused}"


def _check_events(events: list[Any], rooms: set[int]) -> None:
    """Exactly one terminal event, then exactly one SAFE_TO_REUSE, per room (in that order)."""
    for room in rooms:
        kinds = [e.kind for e in events if e.room == room]
        if kinds and kinds[0] is RoomEventKind.READY:        # a prefill room: its decode requests arrived
            kinds = kinds[1:]
        assert kinds in ([RoomEventKind.FAILED, RoomEventKind.SAFE_TO_REUSE],
                         [RoomEventKind.FINISHED, RoomEventKind.SAFE_TO_REUSE]), f"room {room}: events {kinds}"
    strays = sorted({e.room for e in events} - rooms)
    assert not strays, f"events for rooms never opened: {strays}"


# ============================================================================ 1. the listener's cap
def test_a_connection_flood_at_the_cap_never_proves_a_live_writer_gone() -> None:
    """An attacker (no secret needed: the liveness port is raw TCP) opens MAX_HELD connections to a prefill
    rank's liveness listener. A decode connected before the flood must keep its connection; a decode that
    connects after it must not take the prefill, alive and serving, for dead: its room must not fail and
    become safe_to_reuse while the prefill can still write into its pages (the agents use a secret, and
    plain writes (staging 'never') so a write lands in the room's pages themselves)."""
    _raise_fd_limit(2 * MAX_HELD + 1024)
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=30.0, secret=b"wave3-secret", staging="never", writer_exit_grace_s=GRACE_S)
    pre, _ = _agent(hub, Role.PREFILL, "p0", cfg, fill=0xAB)
    early, early_bufs = _agent(hub, Role.DECODE, "d-early", cfg)
    late, late_bufs = _agent(hub, Role.DECODE, "d-late", cfg)
    flood: list[socket.socket] = []
    try:
        _shake(early, [pre])
        _step([pre, early], rounds=20)
        assert pre._liveness is not None and pre._liveness.held == 1
        host, port = split_address(pre._liveness.address)
        for i in range(MAX_HELD + 64):
            flood.append(socket.create_connection((host, port), timeout=5))
            if i % 64 == 0:
                pre._liveness.poll()
        _step([pre], rounds=5)
        assert pre._liveness.held == MAX_HELD
        flooded = time.monotonic()
        _shake(late, [pre])
        senders = {room: pre.sender(room) for room in (1, 2)}
        r_early, r_late = early.receiver(1, "inst"), late.receiver(2, "inst")
        r_early.send_metadata({"kv": np.array([1, 2, 3])})
        r_late.send_metadata({"kv": np.array([1, 2, 3])})
        safe_at: dict[int, float] = {}

        def watch() -> None:
            for room, r in ((1, r_early), (2, r_late)):
                if room not in safe_at and r.poll() is KVPoll.Failed and r.safe_to_reuse:
                    safe_at[room] = time.monotonic()

        deadline = time.monotonic() + 4 * GRACE_S + 0.5     # well past the exit grace
        while time.monotonic() < deadline:
            _step([pre, early, late], rounds=1)
            watch()
            time.sleep(0.003)
        # the prefill's engine now sends each room (it was alive and serving all along)
        before = {1: [b.copy() for b in early_bufs], 2: [b.copy() for b in late_bufs]}
        for s in senders.values():
            if s.poll() is KVPoll.WaitingForInput:
                s.send(np.array([4, 5, 6]), last=True)
        _step([pre, early, late], rounds=30)
        landed_after_safe = {room: sum(int((a != b).sum()) for a, b in zip(before[room], bufs))
                             for room, bufs in ((1, early_bufs), (2, late_bufs)) if room in safe_at}
        late_state = (r_late.poll().name, r_late.failure_reason if r_late.poll() is KVPoll.Failed else "")
        early_state = (r_early.poll().name, r_early.failure_reason if r_early.poll() is KVPoll.Failed else "")
        assert 1 not in safe_at and r_early.poll() is KVPoll.Success, (
            f"the decode connected before the flood lost its writer: {early_state}")
        assert 2 not in safe_at, (
            f"a decode that connected during the flood took the live prefill for dead: room 2 {late_state}, "
            f"safe_to_reuse {safe_at[2] - flooded:.2f} s after the flood; the prefill then "
            f"wrote {landed_after_safe.get(2, 0)} bytes into the room's pages after safe_to_reuse")
    finally:
        for s in flood:
            s.close()
        for a in (pre, early, late):
            a.close()


# ============================================================================ 2. bytes streamed into a held connection
_STREAMER = """
import os, socket, sys, time
try:
    os.nice(-19)          # the writer must outrun the reader (root: it may); else it only tries
except OSError:
    pass
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
buf = b"x" * (1 << 20)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(buf)
"""


def test_bytes_streamed_into_a_liveness_connection_do_not_stall_the_prefill() -> None:
    """A held liveness connection carries nothing; a peer that streams bytes into it (anyone: no secret covers
    that port) must not keep the prefill's progress step (which runs under the agent lock) busy: one
    ``progress()`` must not burn more than 0.25 s of CPU (an idle step takes well under a millisecond; CPU
    time of this thread, so a loaded host that deschedules it does not count)."""
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=30.0)
    pre, _ = _agent(hub, Role.PREFILL, "p0", cfg)
    streamer = None
    try:
        assert pre._liveness is not None
        host, port = split_address(pre._liveness.address)
        streamer = subprocess.Popen([sys.executable, "-c", _STREAMER, host, str(port), "5.0"])
        worst, wall, began = 0.0, 0.0, time.monotonic()
        while time.monotonic() - began < 3.0:
            t, c = time.monotonic(), time.thread_time()
            pre.progress()
            worst, wall = max(worst, time.thread_time() - c), max(wall, time.monotonic() - t)
            time.sleep(0.002)
        assert worst < 0.25, (f"one progress() of the prefill burnt {worst:.2f} s of CPU ({wall:.2f} s wall, the "
                              "agent lock held all along) reading what a peer streamed into its liveness listener")
    finally:
        if streamer is not None:
            streamer.kill()
            streamer.wait(10)
        pre.close()


# ============================================================================ 3. restarts: leaks and fences
def test_many_decode_restarts_leave_nothing_held_on_the_prefill() -> None:
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=0.5, heartbeat_interval_s=0.1, writer_exit_grace_s=GRACE_S)
    pre, _ = _agent(hub, Role.PREFILL, "p0", cfg, fill=0x11)
    fds_before = len(os.listdir("/proc/self/fd"))
    senders = []
    try:
        for cycle in range(12):
            dec, bufs = _agent(hub, Role.DECODE, "d0", cfg, address=f"d0-{cycle}")
            try:
                _shake(dec, [pre])
                room = 1000 + cycle
                s = pre.sender(room)
                senders.append(s)
                r = dec.receiver(room, "inst")
                r.send_metadata({"kv": np.array([cycle % 8, 8 + cycle % 8])})
                _step([pre, dec], seconds=5, until=lambda s=s: s.poll() is KVPoll.WaitingForInput)
                if cycle % 2:
                    s.send(np.array([1, 2]), last=True)
                    _step([pre, dec], seconds=5, until=lambda r=r: r.poll() is KVPoll.Success)
                    assert r.poll() is KVPoll.Success
            finally:
                if cycle % 3 == 0:
                    assert dec.peers.liveness is not None
                    dec.peers.liveness.close()         # what a kill -9 leaves: the kernel closes its sockets
                    dec.link.close()
                dec.close()
        _step([pre], seconds=5, until=lambda: all(s.safe_to_reuse for s in senders))
        for s in senders:                              # the engine hands every room back once it is safe
            assert s.safe_to_reuse
            s.clear()
        assert pre._liveness is not None
        _step([pre], seconds=6, until=lambda: pre._liveness.held == 0 and len(pre.peers.peers) == 0)
        fds_after = len(os.listdir("/proc/self/fd"))
        assert pre._liveness.held == 0, f"the prefill still holds {pre._liveness.held} liveness connections"
        assert len(pre.peers.peers) == 0, f"peer records kept: {sorted(pre.peers.peers)}"
        assert fds_after - fds_before <= 4, f"{fds_after - fds_before} descriptors more after 12 decode restarts"
    finally:
        pre.close()


def test_many_prefill_restarts_leave_no_watch_of_a_retired_incarnation() -> None:
    """A prefill rank restarts 16 times under one name, each time with a room of the decode bound to it and
    its request sent (nothing written). Even cycles: the old process exits, then its replacement shakes
    hands within the grace; odd cycles: the replacement first (split brain), then the old one exits. Every
    room fails once and becomes safe once (only after its own writer's exit); the decode keeps one watch."""
    hub = LocalHub()
    cfg = AgentConfig(peer_timeout_s=30.0, writer_exit_grace_s=0.3)
    dec, _ = _agent(hub, Role.DECODE, "d0", cfg)
    old: TransferAgent | None = None
    retired: list[TransferAgent] = []
    rooms: dict[int, Any] = {}
    events: list[Any] = []
    try:
        for cycle in range(16):
            new, _ = _agent(hub, Role.PREFILL, "p0", cfg, address=f"p0-{cycle}")
            if old is not None and cycle % 2 == 0:
                assert old._liveness is not None
                old._liveness.close()                  # the old process exits ...
                _step([dec], rounds=3)
            _shake(dec, [new])                         # ... and its replacement is there within the grace
            if rooms:                                  # the previous room: failed, its writer not proven gone
                last = rooms[max(rooms)]
                assert last.poll() is KVPoll.Failed
                if cycle % 2 == 1:                     # split brain: the old writer still lives
                    _step([dec, new], rounds=5)
                    assert not last.safe_to_reuse, "safe while its (replaced) writer still lives"
            if old is not None and cycle % 2 == 1:
                assert old._liveness is not None
                old._liveness.close()
            room = 500 + cycle
            new.sender(room)
            r = dec.receiver(room, "inst")
            r.send_metadata({"kv": np.array([cycle % 16])})
            _step([dec, new], rounds=10)
            rooms[room] = r
            events += dec.events()
            if old is not None:
                retired.append(old)
            old = new
        assert old is not None and old._liveness is not None
        old._liveness.close()
        _step([dec], seconds=5, until=lambda: all(r.safe_to_reuse for r in rooms.values()))
        events += dec.events()
        unsafe = sorted(room for room, r in rooms.items() if not r.safe_to_reuse)
        assert not unsafe, f"rooms never safe although their writers exited: {unsafe}"
        assert all(r.poll() is KVPoll.Failed for r in rooms.values())
        assert dec.decode is not None
        assert all(dec.decode.rooms[room].state is RecvState.FAILED for room in rooms)
        _check_events(events, set(rooms))
        watch = dec.peers.liveness
        assert watch is not None
        assert len(watch._keys) <= 1, f"{len(watch._keys)} liveness watches kept: {sorted(watch._keys)}"
        assert not dec.peers._exits, f"exits never settled: {dec.peers._exits}"
    finally:
        for a in [*retired, *([old] if old is not None else []), dec]:
            a.close()


# ============================================================================ real processes
HEARTBEAT_S, PEER_TIMEOUT_S = 0.1, 1.0
FAIL_BOUND_S = PEER_TIMEOUT_S + 2.0
SETTLE_S, SPAWN_S = 8.0, 60.0
NUM_PAGES, SEED, PREFILL_BG = 48, 11, 13
STAGING_BYTES = 1 << 20
_DST = np.random.default_rng(99).permutation(NUM_PAGES)
ROOMS = {room: {"src": np.arange(8 * k, 8 * k + 8), "pos": np.arange(100 * k, 100 * k + 8),
                "dst": _DST[8 * k: 8 * k + 8]} for k, room in enumerate((201, 202, 203, 204, 205, 206))}


def _backend() -> str:
    try:
        if importlib.util.find_spec("mooncake.engine") is not None:
            return "mooncake"                # no writer_gone of its own: only the liveness connection fences
    except (ImportError, ValueError):
        pass
    return "loopback"


class W3Child(Child):
    def __init__(self, label: str) -> None:
        self.events = Events()
        TaggedChild.__init__(self, label, W3_CHILD, _TAG, [])


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.uid = uuid.uuid4().hex[:6]
        self.instance = f"w3-{self.uid}"
        self.backend = _backend()
        self.tmp = tmp
        self.server = BootstrapServer().start()
        self.children: list[W3Child] = []
        self.buffers: list[Any] = []

    def spawn(self, label: str) -> W3Child:
        child = W3Child(label)
        self.children.append(child)
        return child

    def pool(self, background: int) -> tuple[KVPool, GuardedBuffer]:
        pool = KVPool(1, 0, memory="shm", num_pages=NUM_PAGES, role="decode")
        self.buffers.append(pool)
        staging = GuardedBuffer(STAGING_BYTES, memory="shm")
        self.buffers.append(staging)
        pool.fill(SEED, background)
        staging.write(np.full(STAGING_BYTES, 0x5A, np.uint8))
        return pool, staging

    def job(self, role: str, name: str, **extra: Any) -> dict[str, Any]:
        return {"role": role, "name": name, "backend": self.backend, "bootstrap": self.server.address,
                "instance": self.instance, "num_pages": NUM_PAGES, "republish_s": 0.5, "grace_s": GRACE_S,
                "config": {"heartbeat_s": HEARTBEAT_S, "peer_timeout_s": PEER_TIMEOUT_S, "bootstrap_timeout_s": 20.0,
                           "waiting_timeout_s": 60.0, "staging_bytes": STAGING_BYTES}, **extra}

    def start_prefill(self, child: W3Child, name: str, **extra: Any) -> None:
        src = np.concatenate([r["src"] for r in ROOMS.values()])
        pos = np.concatenate([r["pos"] for r in ROOMS.values()])
        child.send(**self.job("prefill", name, seed=SEED, background=PREFILL_BG, src=src.tolist(),
                              positions=pos.tolist(), lie_short={}, **extra))

    def start_decode(self, child: W3Child, name: str, pool: KVPool, staging: GuardedBuffer) -> None:
        child.send(**self.job("decode", name, segments=segment_spec(pool, staging), connect_timeout_s=SPAWN_S))

    def close(self) -> None:
        for child in self.children:
            child.kill()
        for buf in self.buffers:
            buf.close()
        self.server.close()


@contextmanager
def _rig(tmp: Path) -> Iterator[Rig]:
    rig = Rig(tmp)
    try:
        yield rig
    finally:
        rig.close()
        ours = f"{SHM_PREFIX}{os.getpid()}-"
        leaked = sorted(n for n in os.listdir("/dev/shm") if n.startswith(ours))
        assert not leaked, f"left /dev/shm segments behind: {leaked}"


def _serve(child: W3Child, room: int, pace_s: float = 0.0, per_chunk: int = 4) -> None:
    src = ROOMS[room]["src"]
    chunks = [src[i: i + per_chunk].tolist() for i in range(0, len(src), per_chunk)]
    child.send(cmd="serve", room=room, chunks=chunks, pace_s=pace_s)


def _recv(child: W3Child, room: int, snap_dir: Path | None = None) -> None:
    child.send(cmd="recv", room=room, dst=ROOMS[room]["dst"].tolist(), snap_dir=str(snap_dir or ""))


def _pages_changed(pool: KVPool, snapshot: np.ndarray, pages: np.ndarray) -> int:
    """Bytes of ``pages`` (every buffer) that differ between a child's pool snapshot and the pool now."""
    from kvbridge.testkit.pools import GUARD

    changed, cursor = 0, 0
    for bufs in pool.buffers.values():
        for b in bufs:
            whole = np.array(b._whole)
            then = snapshot[cursor: cursor + whole.size]
            cursor += whole.size
            data_now = whole[GUARD: whole.size - GUARD].reshape(pool.num_pages, -1)
            data_then = then[GUARD: whole.size - GUARD].reshape(pool.num_pages, -1)
            changed += int(np.count_nonzero(data_now[pages] != data_then[pages]))
    return changed


def _judge(pool: KVPool, background: int, *, exact: tuple[int, ...] = (), partial: tuple[int, ...] = ()) -> int:
    good, problems = check_pool(pool, SEED, background, exact=[(ROOMS[r]["dst"], ROOMS[r]["pos"]) for r in exact],
                                partial=[(ROOMS[r]["dst"], ROOMS[r]["pos"]) for r in partial])
    assert not problems, "decode pool differs from the reference:\n  " + "\n  ".join(problems)
    return good


def _absent(child: W3Child, event: str, window_s: float, **match: Any) -> None:
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        found = child.events.find(event, **match)
        assert not found, f"{child.label}: unexpected {event} {match}: {found}"
        time.sleep(0.01)


def _wait_held(child: W3Child, timeout_s: float, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        items = child.events.find("held")
        if items and all(items[-1].get(k) == v for k, v in match.items()):
            return items[-1]
        time.sleep(0.02)
    items = child.events.find("held")
    raise AssertionError(f"{child.label}: never {match}; last {items[-1] if items else None}")


def _audit_events(child: W3Child, rooms: tuple[int, ...], complete: bool = True) -> None:
    """What the child's agent emitted and what events() returned: once per room, terminal first, SAFE only
    in a fenced state with no scatter, nothing for an unknown (cleared) room. ``complete=False`` (a prefill
    child's engine clears its rooms as soon as they are safe, dropping events not taken yet): a prefix."""
    emits = child.events.find("emit")
    safes = child.events.find("emit-safe")
    for e in emits + safes:
        assert e["known"], f"{child.label}: an event for a room it does not hold (cleared?): {e}"
    for e in safes:
        assert e["state"] in ("success", "failed") and not e["scattering"], (
            f"{child.label}: SAFE_TO_REUSE emitted in state {e['state']!r} (scattering {e['scattering']}): {e}")
    got = child.events.find("roomevent")
    for room in rooms:
        kinds = [e["kind"] for e in got if e["room"] == room]
        if kinds[:1] == ["ready"]:           # a prefill room: its decode requests arrived (before any terminal)
            kinds = kinds[1:]
        allowed = (["failed", "safe_to_reuse"], ["finished", "safe_to_reuse"])
        ok = kinds in allowed if complete else any(kinds == seq[:len(kinds)] for seq in allowed)
        assert ok, f"{child.label}: room {room} events {kinds}"
        terminal = [e["kind"] for e in emits if e["room"] == room and e["kind"] != "ready"]
        assert len(terminal) <= 1 and len([e for e in safes if e["room"] == room]) <= 1, (
            f"{child.label}: room {room} emitted {terminal} and "
            f"{len([e for e in safes if e['room'] == room])} SAFE_TO_REUSE")


def _wait_events(child: W3Child, room: int, timeout_s: float) -> None:
    child.events.wait("roomevent", timeout_s, child.stderr, room=room, kind="safe_to_reuse")


def test_sigstop_past_the_timeout_then_kill9_while_stopped(tmp_path: Path) -> None:
    """The writer is stopped mid-transfer past the peer timeout and past the reaping linger (2 x the
    timeout): the room fails, and is NOT safe (stopped is not dead). Then it is killed while still stopped:
    the room becomes safe only after the kill, and not one byte of the pool changes after that."""
    with _rig(tmp_path) as rig:
        pre, dec = rig.spawn("prefill"), rig.spawn("decode")
        pool, staging = rig.pool(21)
        rig.start_prefill(pre, f"w3-prefill-{rig.uid}")
        rig.start_decode(dec, f"w3-decode-{rig.uid}", pool, staging)
        pre.events.wait("ready", SPAWN_S, pre.stderr)
        dec.events.wait("connected", SPAWN_S, dec.stderr)
        room = 201
        _recv(dec, room, tmp_path)
        _serve(pre, room, pace_s=0.3, per_chunk=1)
        pre.events.wait("sent", 20, pre.stderr, room=room, chunk=1)
        dec.events.wait("status", 10, dec.stderr, room=room, status="Transferring")
        _wait_held(pre, 5, held=1)
        stopped = pre.signal(signal.SIGSTOP)
        failed = dec.events.wait("status", FAIL_BOUND_S + 2, dec.stderr, room=room, status="Failed")
        assert failed["t"] - stopped <= FAIL_BOUND_S + 1
        _absent(dec, "safe", 2 * PEER_TIMEOUT_S + 1.5, room=room)     # past the linger: still not safe
        killed = pre.kill9()
        safe = dec.events.wait("safe", FAIL_BOUND_S + GRACE_S, dec.stderr, room=room)
        assert safe["t"] >= killed, "safe_to_reuse before the stopped writer was killed"
        time.sleep(1.0)
        after = int(np.count_nonzero(pool_bytes(pool, staging) != np.load(tmp_path / f"room{room}-safe.npy")))
        assert after == 0, f"{after} bytes changed after safe_to_reuse"
        assert not dec.events.find("status", room=room, status="Success")
        _judge(pool, 21, partial=(room,))
        _wait_events(dec, room, SETTLE_S)
        _audit_events(dec, (room,))
        assert dec.alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kill9_then_same_name_restart_at_the_same_address_within_the_grace(tmp_path: Path) -> None:
    """kill -9 the prefill mid-transfer, and start a replacement with the same name at the same ZMQ address
    at once (within the grace). The old room fails and is safe only after the kill, with no byte after it;
    a room opened in the turmoil is exact or failed (never a wrong Success); a later room is exact; every
    event once, in order, on the decode and on the replacement."""
    port = _free_port()
    with _rig(tmp_path) as rig:
        name = f"w3-prefill-{rig.uid}"
        pre, successor, dec = rig.spawn("prefill"), rig.spawn("successor"), rig.spawn("decode")
        pool, staging = rig.pool(31)
        rig.start_prefill(pre, name, port=port)
        rig.start_decode(dec, f"w3-decode-{rig.uid}", pool, staging)
        pre.events.wait("ready", SPAWN_S, pre.stderr)
        dec.events.wait("connected", SPAWN_S, dec.stderr)
        successor.events.wait("spawned", SPAWN_S, successor.stderr)
        a, b, c = 202, 203, 204
        _recv(dec, a, tmp_path)
        _serve(pre, a, pace_s=0.3, per_chunk=1)
        pre.events.wait("sent", 20, pre.stderr, room=a, chunk=1)
        dec.events.wait("status", 10, dec.stderr, room=a, status="Transferring")
        killed = pre.kill9()
        rig.start_prefill(successor, name, port=port)
        successor.events.wait("ready", SPAWN_S, successor.stderr)
        _recv(dec, b)
        _serve(successor, b)
        safe = dec.events.wait("safe", FAIL_BOUND_S + SETTLE_S, dec.stderr, room=a)
        assert safe["t"] >= killed
        assert dec.events.find("status", room=a, status="Failed")
        assert not dec.events.find("status", room=a, status="Success")
        end_b = dec.events.wait("safe", SETTLE_S + 20, dec.stderr, room=b)
        time.sleep(0.8)
        snap = np.load(tmp_path / f"room{a}-safe.npy")
        after = _pages_changed(pool, snap, ROOMS[a]["dst"])
        b_ok = end_b["status"] == "Success"
        _judge(pool, 31, exact=(b,) if b_ok else (), partial=(a,) if b_ok else (a, b))
        assert after == 0, f"{after} bytes of room A's pages changed after its safe_to_reuse"
        _recv(dec, c)
        _serve(successor, c)
        dec.events.wait("status", 30, dec.stderr, room=c, status="Success")
        _judge(pool, 31, exact=(c,) + ((b,) if b_ok else ()), partial=(a,) + (() if b_ok else (b,)))
        _wait_events(dec, c, SETTLE_S)
        _audit_events(dec, (a, b, c))
        successor.events.wait("cleared", SETTLE_S, successor.stderr, room=c)
        _audit_events(successor, (b, c), complete=False)
        _wait_held(successor, 5, held=1)


def test_two_decodes_share_a_prefill_and_one_is_killed(tmp_path: Path) -> None:
    """Two decodes receive from one prefill at the same time; one is killed -9 mid-transfer. The other's
    room is byte-exact, the prefill lets go of the dead decode's liveness connection, and a stopped
    survivor is never taken for anything but alive by the prefill's listener."""
    with _rig(tmp_path) as rig:
        pre, d1, d2 = rig.spawn("prefill"), rig.spawn("decode-1"), rig.spawn("decode-2")
        pool1, staging1 = rig.pool(41)
        pool2, staging2 = rig.pool(42)
        rig.start_prefill(pre, f"w3-prefill-{rig.uid}")
        rig.start_decode(d1, f"w3-decode1-{rig.uid}", pool1, staging1)
        rig.start_decode(d2, f"w3-decode2-{rig.uid}", pool2, staging2)
        pre.events.wait("ready", SPAWN_S, pre.stderr)
        d1.events.wait("connected", SPAWN_S, d1.stderr)
        d2.events.wait("connected", SPAWN_S, d2.stderr)
        _wait_held(pre, 5, held=2)
        x, y = 205, 206
        _recv(d1, x)
        _recv(d2, y)
        _serve(pre, x, pace_s=0.3, per_chunk=1)
        _serve(pre, y, pace_s=0.3, per_chunk=1)
        pre.events.wait("sent", 20, pre.stderr, room=x, chunk=1)
        d1.kill9()
        _wait_held(pre, 5, held=1)
        pre.events.wait("status", FAIL_BOUND_S + 2, pre.stderr, room=x, status="Failed")
        d2.events.wait("status", 20, d2.stderr, room=y, status="Success")
        _judge(pool2, 42, exact=(y,))
        _judge(pool1, 41, partial=(x,))
        _wait_events(d2, y, SETTLE_S)
        _audit_events(d2, (y,))
        pre.events.wait("cleared", SETTLE_S, pre.stderr, room=y)
        _audit_events(pre, (x, y), complete=False)
        assert pre.alive()

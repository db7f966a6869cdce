"""Version skew: this release and the previous one (protocol 5, commit 3dddad1) in one cluster.

The previous release is built from git history (``git archive 3dddad1 core plugins``) and runs as a separate
process (``tests/_skew_child.py``) with ``PYTHONPATH`` pointing at that tree (same venv; the child reports
which kvbridge it imported and its protocol version, and the test checks it is the old one). This release runs
in the test process. A request goes each way (old prefill -> new decode, new prefill -> old decode) over
loopback and NIXL, and the bytes that land are compared with an independent reference (NumPy's seeded
generator, ``_skew_child.reference``). Versions older than the previous release are refused with both
versions named, whichever side is older. Skipped only where the repository has no history (a shallow
clone); CI clones fully.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _skew_child as kid

from kvbridge import wire
from kvbridge.agent import TransferAgent
from kvbridge.errors import KVBridgeError
from kvbridge.wire import KVPoll, Role
from kvbridge.zmq_link import BootstrapServer, ZmqLink

REPO = Path(__file__).resolve().parents[1]
PREVIOUS = "3dddad1"                  # the previous release: end of wave 2, protocol 5
PREVIOUS_VERSION = 5
CHILD = Path(kid.__file__).resolve()
TIMEOUT_S = 20.0


def _nixl_ok() -> bool:
    try:
        import kvbridge_nixl
    except ImportError:
        return False
    return bool(kvbridge_nixl.probe().available)


BACKENDS = ["loopback", pytest.param("nixl", marks=pytest.mark.skipif(not _nixl_ok(), reason="nixl not usable"))]


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's core and plugins, extracted from git history."""
    try:
        inside = _git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        pytest.skip("no git executable: the previous release cannot be built from history")
    if inside.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: the previous release cannot be built from history")
    if _git("cat-file", "-e", f"{PREVIOUS}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        if shallow:
            pytest.skip(f"shallow clone: commit {PREVIOUS} (the previous release) is not in its history "
                        "(CI clones fully)")
        pytest.fail(f"commit {PREVIOUS} (the previous release) is missing from a full clone")
    archive = _git("archive", PREVIOUS, "core", "plugins")
    assert archive.returncode == 0, archive.stderr.decode()
    root = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


class OldRank:
    """A rank of the previous release in its own process; its ``SKEW`` lines arrive on a queue."""

    def __init__(self, tree: Path, job: dict[str, Any]) -> None:
        paths = [tree / "core", *sorted((tree / "plugins").glob("*/src"))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths), PYTHONUNBUFFERED="1")
        self.tree = tree
        self.log = (tree / f"{job['name']}.log").open("w+b")
        self.proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode(errors="replace")
            if text.startswith("SKEW "):
                self.events.put(json.loads(text[5:]))
        self.events.put({"event": "eof"})

    def wait(self, event: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"old rank: no {event!r} within {timeout_s} s\n{self.stderr()}") from None
            if item["event"] in ("error", "eof"):
                raise AssertionError(f"old rank ended ({item}) before {event!r}\n{self.stderr()}")
            if item["event"] == event:
                return item

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def bootstrap() -> Iterator[str]:
    server = BootstrapServer().start()
    try:
        yield server.address
    finally:
        server.close()


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Closes what a test opened, last first (agents before the shared memory they registered)."""
    held: list[Any] = []
    yield held
    for item in reversed(held):
        if isinstance(item, str):
            os.unlink(item)
        else:
            item.close()


def _new_agent(role: Role, backend: str, bootstrap: str, instance: str, cleanup: list[Any]) -> tuple[
        TransferAgent, list[np.ndarray]]:
    buffers, segment = kid.shm_buffers(f"test-{role.value}-{uuid.uuid4().hex[:6]}")
    cleanup.append(segment)
    link = ZmqLink(bootstrap=bootstrap)
    agent = TransferAgent(layout=kid.layout(), buffers={"kv": buffers}, role=role, link=link, backend=backend,
                          instance=instance if role is Role.PREFILL else "", name=f"new-{role.value}-{instance}")
    cleanup.append(agent)
    agent.start(0.001)
    return agent, buffers


def _old(tree: Path, cleanup: list[Any], **job: Any) -> OldRank:
    """Start a rank of the previous release (it starts while the test builds its own agent: NIXL takes seconds)."""
    rank = OldRank(tree, {"timeout_s": TIMEOUT_S, **job})
    cleanup.append(rank)
    return rank


def _ready(rank: OldRank) -> dict[str, Any]:
    ready = rank.wait("ready", timeout_s=60)
    tree = rank.tree
    # the child runs the previous release, not this tree
    assert ready["version"] == PREVIOUS_VERSION, ready
    assert Path(ready["kvbridge"]).resolve().is_relative_to(tree.resolve()), ready
    return ready


SRC_PAGES, DST_PAGES = [3, 9, 4, 11, 5, 0], [14, 2, 7, 1, 8, 15]


def _expected(seed: int) -> list[np.ndarray]:
    return [kid.reference(seed, b, len(DST_PAGES)) for b in range(2 * kid.LAYERS)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_prefill_new_decode(previous_release: Path, bootstrap: str, cleanup: list[Any], backend: str) -> None:
    instance, seed, room = f"skew-{uuid.uuid4().hex[:8]}", 11, 77
    old = _old(previous_release, cleanup, role="prefill", backend=backend, bootstrap=bootstrap, instance=instance,
               name=f"old-prefill-{instance}", room=room, seed=seed, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
    decode, buffers = _new_agent(Role.DECODE, backend, bootstrap, instance, cleanup)
    ready = _ready(old)
    decode.connect(instance, timeout_s=TIMEOUT_S)
    # the old prefill refused our 6 naming its 5; we said Hello again in 5, and speak 5 to it from now on
    assert decode.peer_versions() == {ready["name"]: PREVIOUS_VERSION}
    receiver = decode.receiver(room, instance)
    receiver.send_metadata({"kv": np.asarray(DST_PAGES)})
    deadline = time.monotonic() + TIMEOUT_S
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert receiver.poll() is KVPoll.Success, receiver.failure_reason()
    done = old.wait("done")
    assert done["status"] == "Success", done
    for b, (buf, want) in enumerate(zip(buffers, _expected(seed))):
        assert np.array_equal(buf[DST_PAGES], want), f"buffer {b}: bytes from the old prefill differ"
    # a v6 feature is off for this peer: no liveness watch of a writer that named no listener
    watch = decode.peers.liveness
    assert watch is None or not watch._keys


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_prefill_old_decode(previous_release: Path, bootstrap: str, cleanup: list[Any], backend: str) -> None:
    instance, seed, room = f"skew-{uuid.uuid4().hex[:8]}", 23, 78
    old = _old(previous_release, cleanup, role="decode", backend=backend, bootstrap=bootstrap, instance=instance,
               name=f"old-decode-{instance}", room=room, seed=seed, src_pages=SRC_PAGES, dst_pages=DST_PAGES)
    prefill, buffers = _new_agent(Role.PREFILL, backend, bootstrap, instance, cleanup)
    for b, buf in enumerate(buffers):
        buf[SRC_PAGES] = kid.reference(seed, b, len(SRC_PAGES))
    sender = prefill.sender(room)
    ready = _ready(old)
    deadline = time.monotonic() + TIMEOUT_S
    while sender.poll() < KVPoll.WaitingForInput and time.monotonic() < deadline:
        time.sleep(0.002)
    assert sender.poll() is KVPoll.WaitingForInput, sender.failure_reason()
    assert prefill.peer_versions() == {ready["name"]: PREVIOUS_VERSION}
    sender.send(np.asarray(SRC_PAGES), last=True)
    done = old.wait("done")
    assert done["status"] == "Success", done
    assert done["exact"], done
    want = [hashlib.sha256(pages.tobytes()).hexdigest() for pages in _expected(seed)]
    assert done["digests"] == want, "the old decode's pages differ from the reference"
    while sender.poll() is not KVPoll.Success and time.monotonic() < deadline:
        time.sleep(0.002)
    assert sender.poll() is KVPoll.Success, sender.failure_reason()


def _hello_frame(version: int, agent: str, address: str) -> bytes:
    """A Hello as a decode of protocol ``version`` would send it: this release's Hello, renumbered."""
    hello = wire.Hello(version=wire.PROTOCOL_VERSION, agent=agent, address=address, role=Role.DECODE,
                       layout=kid.layout(), backend="loopback", endpoint=b"", buffers=())
    raw = msgspec.msgpack.decode(wire.Codec(sender=agent, address=address, incarnation=3).encode(hello, to="x"))
    raw[0] = version
    raw[-1]["version"] = version
    return msgspec.msgpack.encode(raw)


def test_version_4_hello_is_refused_naming_both_versions(bootstrap: str, cleanup: list[Any]) -> None:
    instance = f"skew-{uuid.uuid4().hex[:8]}"
    prefill, _ = _new_agent(Role.PREFILL, "loopback", bootstrap, instance, cleanup)
    probe = ZmqLink(bootstrap=bootstrap)
    cleanup.append(probe)
    info = probe.lookup(instance)
    assert info is not None
    probe.send(info.addresses[0], _hello_frame(4, "ancient", probe.address))
    deadline, answers = time.monotonic() + TIMEOUT_S, []
    while not answers and time.monotonic() < deadline:
        answers = probe.recv(0.05)
    assert answers, "no answer to a version 4 Hello"
    raw = msgspec.msgpack.decode(answers[0])
    assert raw[0] == wire.PROTOCOL_VERSION
    refusal = wire.Codec(address=probe.address).decode(answers[0])
    assert isinstance(refusal, wire.Welcome) and not refusal.accepted
    assert refusal.reason == ("protocol version differs: prefill speaks 6 (and the previous release's 5), "
                              "decode 4"), refusal.reason
    assert prefill.peer_versions() == {}


def test_decode_refuses_a_version_4_prefill_naming_both_versions(bootstrap: str, cleanup: list[Any]) -> None:
    """A prefill of protocol 4 answers our Hello with its refusal in 4: the handshake ends with both versions
    named, and no Hello in 4 is ever sent (4 is not a version this release speaks)."""
    instance = f"skew-{uuid.uuid4().hex[:8]}"
    ancient = ZmqLink(bootstrap=bootstrap)
    cleanup.append(ancient)
    ancient.publish(instance, 1, 0)
    decode, _ = _new_agent(Role.DECODE, "loopback", bootstrap, instance, cleanup)
    stop, seen = threading.Event(), []

    def answer() -> None:
        while not stop.is_set():
            for frame in ancient.recv(0.02):
                raw = msgspec.msgpack.decode(frame)
                seen.append(raw[0])
                body = {"type": "welcome", "version": 4, "agent": "ancient", "address": ancient.address,
                        "accepted": False, "reason": f"protocol version differs: prefill speaks 4, decode {raw[0]}"}
                reply = [4, "ancient", ancient.address, 5, 0, len(seen), body]
                ancient.send(raw[2], msgspec.msgpack.encode(reply))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(KVBridgeError, match="prefill speaks 4, decode 6"):
            decode.connect(instance, timeout_s=5)
    finally:
        stop.set()
        thread.join(5)
    assert seen and set(seen) == {wire.PROTOCOL_VERSION}, seen

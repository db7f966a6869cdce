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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _skew_child as kid

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.errors import KVBridgeError
from kvbridge.links import LocalHub
from kvbridge.protocol import wire
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.zmq_link import BootstrapServer, ZmqLink

REPO = Path(__file__).resolve().parents[1]
PREVIOUS = "3dddad1"                  # the oldest release spoken: end of wave 2, protocol 5
PREVIOUS_VERSION = 5                  # its PROTOCOL_VERSION: this release's MIN_PROTOCOL_VERSION
RELEASES = {5: PREVIOUS, 6: "0d4eb88", 7: "5a536b5", 8: "5af126c"}   # every older protocol this release speaks
                                      # -> a release that spoke it (0d4eb88: 0.2.0, protocol 6, whose Abort names no
                                      # request; 5a536b5: wave 3 session 9, protocol 7, whose request carries no
                                      # trace; 5af126c: wave 3 session 12, protocol 8, whose request has no length)
CHILD = Path(kid.__file__).resolve()
TIMEOUT_S = 20.0


def _nixl_ok() -> bool:
    try:
        import kvbridge_nixl
    except ImportError:
        return False
    return bool(kvbridge_nixl.probe().available)


# loopback with a shared secret (the MAC covers the version), NIXL without
BACKENDS = [pytest.param("loopback", b"skew-secret", id="loopback-secret"),
            pytest.param("nixl", None, id="nixl", marks=pytest.mark.skipif(not _nixl_ok(), reason="nixl not usable"))]
# short timeouts: the test outlives the peer timeout, so heartbeats must be understood both ways
#: bootstrap 90 s: the new prefill opens its room before the old release's processes have imported their engine
#: (NIXL with torch); on a slow clean-clone run that took the room past the default 30 s before the old decode
#: asked. The skew, not the bootstrap bound, is under test here.
CONFIG = {"peer_timeout_s": 1.0, "heartbeat_interval_s": 0.1, "bootstrap_timeout_s": 90.0}


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def previous_release(release_tree: Callable[[str], Path]) -> Path:
    """The oldest release spoken (protocol 5)'s core and plugins, extracted from git history."""
    return release_tree(PREVIOUS)


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """commit -> that release's core and plugins, extracted from git history once."""
    trees: dict[str, Path] = {}

    def tree(commit: str) -> Path:
        if commit not in trees:
            trees[commit] = _extract(commit, tmp_path_factory)
        return trees[commit]

    return tree


def _extract(commit: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        inside = _git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        pytest.skip("no git executable: the previous release cannot be built from history")
    if inside.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: the previous release cannot be built from history")
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        if shallow:
            pytest.skip(f"shallow clone: commit {commit} (a previous release) is not in its history "
                        "(CI clones fully)")
        pytest.fail(f"commit {commit} (a previous release) is missing from a full clone")
    archive = _git("archive", commit, "core", "plugins")
    assert archive.returncode == 0, archive.stderr.decode()
    root = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter="data")
        else:                   # a Python without extraction filters; the archive is our own history
            tar.extractall(root)
    return root


def _plugins_newer_than(tree: Path) -> list[str]:
    """Entry points of this venv's kvbridge plugins whose package the release at ``tree`` does not have (e.g.
    kvbridge-fp8 for a release before it): the old release must not load this tree's code through them."""
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group="kvbridge"):
        package = ep.value.split(":")[0].split(".")[0]
        if package.startswith("kvbridge_") and not any((tree / "plugins").glob(f"*/src/{package}")):
            names.append(ep.name)
    return sorted(names)


class OldRelease:
    """Ranks of the previous release in one process of their own; their ``SKEW`` lines arrive on a queue."""

    def __init__(self, tree: Path, job: dict[str, Any], version: int = PREVIOUS_VERSION) -> None:
        paths = [tree / "core", *sorted((tree / "plugins").glob("*/src"))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths), PYTHONUNBUFFERED="1")
        newer = _plugins_newer_than(tree)       # installed from this tree, absent from that release: not loaded
        if newer:
            env["KVBRIDGE_DISABLE_PLUGINS"] = ",".join(filter(None, [env.get("KVBRIDGE_DISABLE_PLUGINS", ""), *newer]))
        self.tree, self.version = tree, version
        self.log = (tree / f"old-{uuid.uuid4().hex[:8]}.log").open("w+b")
        self.proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode(errors="replace")
            if text.startswith("SKEW "):
                self.events.put(json.loads(text[5:]))
        self.events.put({"event": "eof"})

    def wait(self, event: str, name: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for item in self._seen:
                if item["event"] == event and item.get("name") == name:
                    return item
            try:
                item = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"old release: no {event!r} of {name} within {timeout_s} s\n"
                                     f"{self.stderr()}") from None
            if item["event"] in ("error", "eof"):
                raise AssertionError(f"old release: {item} before {event!r} of {name}\n{self.stderr()}")
            self._seen.append(item)

    def ready(self, name: str) -> dict[str, Any]:
        """The rank's ``ready``, checked: it runs the previous release, not this tree."""
        ready = self.wait("ready", name, timeout_s=60)
        assert ready["version"] == self.version, ready
        for path in [ready["kvbridge"], *ready["plugins"]]:
            assert Path(path).resolve().is_relative_to(self.tree.resolve()), ready
        return ready

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def finish(self, *names: str) -> dict[str, dict[str, Any]]:
        """Close its stdin: each rank says whom it still counts alive and how many frames it rejected, then
        closes."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return {name: self.wait("final", name) for name in names}

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
        for leftover in Path("/dev/shm").glob(f"kvbridge-skew-{self.proc.pid}-*"):   # a killed child's pools
            leftover.unlink(missing_ok=True)


@pytest.fixture
def secret(request: pytest.FixtureRequest) -> bytes | None:
    return getattr(request, "param", None)


@pytest.fixture
def bootstrap(secret: bytes | None) -> Iterator[str]:
    server = BootstrapServer(secret=secret).start()
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


def _new_agent(role: Role, backend: str, bootstrap: str, instance: str, cleanup: list[Any],
               secret: bytes | None = None) -> tuple[TransferAgent, list[np.ndarray]]:
    buffers, segment = kid.shm_buffers(f"test-{role.value}-{uuid.uuid4().hex[:6]}")
    cleanup.append(segment)
    link = ZmqLink(bootstrap=bootstrap, secret=secret)
    agent = TransferAgent(layout=kid.layout(), buffers={"kv": buffers}, role=role, link=link, backend=backend,
                          instance=instance if role is Role.PREFILL else "", name=f"new-{role.value}-{instance}",
                          config=AgentConfig(secret=secret, **CONFIG))
    cleanup.append(agent)
    agent.start()
    return agent, buffers


def _old(tree: Path, cleanup: list[Any], backend: str, bootstrap: str, *ranks: dict[str, Any],
         secret: bytes | None = None, version: int = PREVIOUS_VERSION) -> OldRelease:
    """Start ranks of the previous release (they start while the test builds its own agents: NIXL takes seconds)."""
    release = OldRelease(tree, {"timeout_s": TIMEOUT_S, "backend": backend, "bootstrap": bootstrap,
                                "ranks": list(ranks), "secret": secret.hex() if secret else "", "config": CONFIG},
                         version)
    cleanup.append(release)
    return release


SRC_PAGES, DST_PAGES = [3, 9, 4, 11, 5, 0], [14, 2, 7, 1, 8, 15]


def _expected(seed: int) -> list[np.ndarray]:
    return [kid.reference(seed, b, len(DST_PAGES)) for b in range(2 * kid.LAYERS)]


def _until(predicate: Any, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.002)


# protocol 5 (wave 2) over loopback with a secret and over NIXL; protocols 6 (0.2.0), 7 and 8 over loopback with a
# secret
@pytest.mark.parametrize("version, backend, secret",
                         [pytest.param(5, *p.values, id=f"5-{p.id}", marks=p.marks) for p in BACKENDS]
                         + [pytest.param(6, "loopback", b"skew-secret", id="6-loopback-secret"),
                            pytest.param(7, "loopback", b"skew-secret", id="7-loopback-secret"),
                            pytest.param(8, "loopback", b"skew-secret", id="8-loopback-secret")],
                         indirect=["secret"])
def test_requests_both_ways_with_the_previous_release(release_tree: Callable[[str], Path], bootstrap: str,
                                                      cleanup: list[Any], version: int, backend: str,
                                                      secret: bytes | None) -> None:
    """Old prefill -> new decode (instance A) and new prefill -> old decode (instance B) at once: both
    handshakes negotiate the old release's version (recorded on our side), both rooms succeed, every landed byte
    is the reference's, and past the peer timeout every pair still counts the other alive (heartbeats understood
    both ways)."""
    tag = uuid.uuid4().hex[:8]
    a, b, old_prefill, old_decode = f"skew-a-{tag}", f"skew-b-{tag}", f"old-prefill-{tag}", f"old-decode-{tag}"
    old = _old(release_tree(RELEASES[version]), cleanup, backend, bootstrap,
               {"role": "prefill", "name": old_prefill, "instance": a, "room": 77, "seed": 11,
                "src_pages": SRC_PAGES, "dst_pages": DST_PAGES},
               {"role": "decode", "name": old_decode, "instance": b, "room": 78, "seed": 23,
                "src_pages": SRC_PAGES, "dst_pages": DST_PAGES}, secret=secret, version=version)
    prefill, src = _new_agent(Role.PREFILL, backend, bootstrap, b, cleanup, secret)
    for i, buf in enumerate(src):
        buf[SRC_PAGES] = kid.reference(23, i, len(SRC_PAGES))
    sender = prefill.sender(78)
    decode, dst = _new_agent(Role.DECODE, backend, bootstrap, a, cleanup, secret)
    old.ready(old_prefill)
    ready = old.ready(old_decode)
    if backend == "nixl":
        assert any("kvbridge_nixl" in path for path in ready["plugins"]), ready

    # old prefill -> new decode: the old prefill refused our Hello in 7 naming its version, we said it again in that
    decode.connect(a, timeout_s=TIMEOUT_S)
    assert decode.peer_versions() == {old_prefill: version}
    receiver = decode.receiver(77, a)
    # the request's length (protocol 9) is left out of what an older prefill reads
    receiver.send_metadata({"kv": np.asarray(DST_PAGES)}, tokens=len(DST_PAGES) * kid.TOKENS)
    _until(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), "the new decode's room ended")
    assert receiver.poll() is KVPoll.Success, receiver.failure_reason
    assert old.wait("done", old_prefill)["status"] == "Success"
    for i, (buf, want) in enumerate(zip(dst, _expected(11))):
        assert np.array_equal(buf[DST_PAGES], want), f"buffer {i}: bytes from the old prefill differ"
    if version < 6:     # 6's liveness proof is off for this peer: no listener was named, none is watched
        assert decode.peers.liveness is None or not decode.peers.liveness._keys

    # new prefill -> old decode: its Hello in its version is answered in that version
    _until(lambda: sender.poll() in (KVPoll.WaitingForInput, KVPoll.Failed), "the old decode's request came")
    assert sender.poll() is KVPoll.WaitingForInput, sender.failure_reason
    assert prefill.peer_versions() == {old_decode: version}
    sender.send(np.asarray(SRC_PAGES), last=True)
    done = old.wait("done", old_decode)
    assert done["status"] == "Success" and done["exact"], done
    want = [hashlib.sha256(pages.tobytes()).hexdigest() for pages in _expected(23)]
    assert done["digests"] == want, "the old decode's pages differ from the reference"
    _until(lambda: sender.poll() is KVPoll.Success, "the new prefill's room succeeded")

    time.sleep(1.5 * CONFIG["peer_timeout_s"])
    assert decode.peer_versions() == {old_prefill: version}
    assert prefill.peer_versions() == {old_decode: version}
    final = old.finish(old_prefill, old_decode)
    assert final[old_prefill]["alive"] == [decode.name] and final[old_decode]["alive"] == [prefill.name], final
    if backend == "loopback":     # (over NIXL a notice comes twice by design: with the data and over the link)
        rejected = [decode.rejected_frames, prefill.rejected_frames, final[old_prefill]["rejected"],
                    final[old_decode]["rejected"]]
        # the old prefill rejects our Hello in 6 (it cannot read it; a resend may come before its refusal
        # arrives), nothing else is rejected on either side
        assert rejected[:2] == [0, 0] and rejected[2] >= 1 and rejected[3] == 0, f"{rejected}\n{old.stderr()}"


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
    want = f"protocol version differs: prefill speaks 5 to {wire.PROTOCOL_VERSION}, decode 4"
    assert refusal.reason == want, refusal.reason
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
        with pytest.raises(KVBridgeError, match=f"prefill speaks 4, decode {wire.PROTOCOL_VERSION}"):
            decode.connect(instance, timeout_s=5)
    finally:
        stop.set()
        thread.join(5)
    assert seen and set(seen) == {wire.PROTOCOL_VERSION}, seen


# ---------------------------------------------------------------------------------------------- in one process


def _handshake_at(version: int, prefill_config: AgentConfig | None = None,
                  decode_config: AgentConfig | None = None) -> tuple[TransferAgent, TransferAgent, Any,
                                                                       list[np.ndarray], list[np.ndarray]]:
    """A prefill and a decode of this release over an in-process link, the decode's Hello in ``version``: what a
    peer of that version would send. Driven by hand (``progress()``) until the handshake ends; the caller closes
    both."""
    from test_agent import kv_buffers, kv_layout

    hub = LocalHub()
    src, dst = kv_buffers(kv_layout(1, 0)), kv_buffers(kv_layout(1, 0))
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": src}, role=Role.PREFILL, link=hub.link("p0"),
                        instance="inst", name="p0", config=prefill_config or AgentConfig())
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": dst}, role=Role.DECODE, link=hub.link("d0"), name="d0",
                        config=decode_config or AgentConfig())
    with dec.context.lock:
        shake = dec.peers.begin("inst", {0: "p0"}, [0])
        shake.targets["p0"].version = version
    for _ in range(2000):
        pre.progress()
        dec.progress()
        if shake.done or shake.refused is not None:
            break
    return pre, dec, shake, src, dst


def _pair_at(version: int) -> tuple[TransferAgent, TransferAgent, list[np.ndarray], list[np.ndarray]]:
    """:func:`_handshake_at`, accepted."""
    pre, dec, shake, src, dst = _handshake_at(version)
    assert shake.done, shake.refused
    return pre, dec, src, dst


def test_a_prefill_whose_minimum_is_6_refuses_a_hello_in_5_naming_the_setting() -> None:
    """``min_protocol_version=6`` (a fully upgraded cluster): a decode speaking the previous release's protocol
    is refused at the handshake with both versions and the setting named; no peer is added on either side."""
    pre, dec, shake, _, _ = _handshake_at(PREVIOUS_VERSION, prefill_config=AgentConfig(min_protocol_version=6))
    try:
        assert not shake.done and shake.refused is not None
        assert "protocol 5 is below this prefill's min_protocol_version 6" in str(shake.refused), shake.refused
        assert pre.peer_versions() == {} and dec.peer_versions() == {}
    finally:
        pre.close()
        dec.close()


def test_a_decode_whose_minimum_is_6_does_not_fall_back_on_a_refusal_in_5() -> None:
    """Without a secret anyone can send a refusal in 5 (what an old prefill answers); a decode at the default
    minimum says Hello again in 5, one at ``min_protocol_version=6`` does not: its handshake ends with the
    reason, its Hello stays in 6, and no peer of version 5 is ever added."""
    for minimum, falls_back in ((PREVIOUS_VERSION, True), (6, False)):
        hub = LocalHub()
        from test_agent import kv_buffers, kv_layout

        dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                            link=hub.link("d0"), name="d0", config=AgentConfig(min_protocol_version=minimum))
        try:
            with dec.context.lock:
                shake = dec.peers.begin("inst", {0: "p0"}, [0])
            forger = wire.Codec(sender="p0", address="p0", incarnation=7)
            refusal = wire.Welcome(version=6, agent="p0", address="p0", accepted=False, reason="speaks 5 only")
            dec.handle_frame(forger.encode(refusal, to="d0", to_incarnation=dec.incarnation, version=5))
            dec.progress()
            assert (shake.targets["p0"].version == PREVIOUS_VERSION) is falls_back
            if falls_back:
                assert shake.refused is None
            else:
                assert shake.refused is not None and "below this agent's min_protocol_version 6" in str(
                    shake.refused), shake.refused
            assert dec.peer_versions() == {}
        finally:
            dec.close()


def test_min_protocol_version_is_validated_on_every_path() -> None:
    from kvbridge.settings import SettingsError, load_settings

    for bad in (4, wire.PROTOCOL_VERSION + 1, 5.5, True, "6"):
        with pytest.raises(ValueError, match="min_protocol_version"):
            AgentConfig(min_protocol_version=bad)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="min_protocol_version"):
        load_settings(env={"KVBRIDGE_MIN_PROTOCOL_VERSION": "4"})
    assert load_settings(env={"KVBRIDGE_MIN_PROTOCOL_VERSION": "6"}).agent_config().min_protocol_version == 6


def test_a_pair_at_5_moves_bytes_without_6s_features() -> None:
    """Both sides record 5 and speak it; the Welcome in 5 names no liveness listener (the prefill has one), so
    the decode holds no liveness connection; a whole room completes byte-exact."""
    pre, dec, src, dst = _pair_at(PREVIOUS_VERSION)
    try:
        assert pre.peer_versions() == {"d0": 5} and dec.peer_versions() == {"p0": 5}
        assert pre.peers.liveness_address, "the prefill of this release has a liveness listener"
        assert dec.peers.liveness is None or not dec.peers.liveness._keys
        rng = np.random.default_rng(5)
        for buf in src:
            buf[:] = rng.integers(0, 256, size=buf.shape, dtype=np.uint8)
        receiver = dec.receiver(9, "inst")
        receiver.send_metadata({"kv": np.array([4, 1, 7])})
        sender = pre.sender(9)
        for _ in range(2000):
            pre.progress()
            dec.progress()
            if sender.poll() is KVPoll.WaitingForInput:
                break
        sender.send(np.array([2, 3, 5]), last=True)
        for _ in range(4000):
            pre.progress()
            dec.progress()
            if receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success:
                break
        assert receiver.poll() is KVPoll.Success, receiver.failure_reason
        for s, d in zip(src, dst):
            assert np.array_equal(d[[4, 1, 7]], s[[2, 3, 5]])
    finally:
        pre.close()
        dec.close()


def test_a_frame_in_another_version_than_negotiated_is_dropped() -> None:
    """A peer that negotiated 5 and then sends 6 (a forger, or a bug) is not heard: dropped and counted."""
    pre, dec, _, _ = _pair_at(PREVIOUS_VERSION)
    try:
        before = dec.rejected_frames
        beat = wire.Heartbeat(agent="p0", address="p0", seq=99)
        frame = pre.context.codec.encode(beat, to="d0", to_incarnation=dec.incarnation, version=6)
        dec.handle_frame(frame)
        assert dec.rejected_frames == before + 1
        frame = pre.context.codec.encode(beat, to="d0", to_incarnation=dec.incarnation)      # negotiated: 5
        dec.handle_frame(frame)
        assert dec.rejected_frames == before + 1
    finally:
        pre.close()
        dec.close()


def test_the_codec_speaks_only_the_versions_it_knows() -> None:
    codec = wire.Codec(sender="p0", address="p0", incarnation=3)
    welcome = wire.Welcome(version=6, agent="p0", address="p0", accepted=True, reason="", liveness="127.0.0.1:9")
    raw = msgspec.msgpack.decode(codec.encode(welcome, to="d0", version=5))
    assert raw[0] == 5 and raw[-1]["version"] == 5 and "liveness" not in raw[-1]
    for bad in (4, wire.PROTOCOL_VERSION + 1):
        with pytest.raises(KVBridgeError, match=f"cannot speak protocol version {bad}"):
            codec.encode(welcome, to="d0", version=bad)
        with pytest.raises(KVBridgeError):
            codec.speak("d0", 1, bad)
    reader = wire.Codec(address="d0")
    # a Welcome in 5 that names a liveness listener (a field 5 does not have) is malformed
    raw = msgspec.msgpack.decode(codec.encode(welcome, to="d0"))
    raw[0] = raw[-1]["version"] = 5
    with pytest.raises(KVBridgeError, match="names a liveness listener"):
        reader.open(msgspec.msgpack.encode(raw))
    # a Hello whose own version differs from its frame's
    raw = msgspec.msgpack.decode(_hello_frame(6, "d9", "d9"))
    raw[-1]["version"] = 5
    with pytest.raises(KVBridgeError, match="says version 5 in a frame of version 6"):
        reader.open(msgspec.msgpack.encode(raw))
    # older and newer than what this release speaks: refused naming both
    speaks = f"this side speaks 5 to {wire.PROTOCOL_VERSION}"
    with pytest.raises(wire.VersionMismatch, match=f"unknown protocol version 4 \\({speaks}\\)"):
        reader.open(_hello_frame(4, "d9", "d9"))


def test_an_old_prefill_that_refuses_our_5_hello_too_ends_the_handshake(previous_release: Path, bootstrap: str,
                                                                        cleanup: list[Any]) -> None:
    """The retry in 5 happens once: a prefill of the previous release that refuses the Hello in 5 as well (here:
    another model) ends the handshake with its own reason, no third Hello."""
    instance = f"skew-{uuid.uuid4().hex[:8]}"
    name = f"old-prefill-{instance}"
    old = _old(previous_release, cleanup, "loopback", bootstrap,
               {"role": "prefill", "name": name, "instance": instance, "room": None, "seed": 1,
                "src_pages": SRC_PAGES, "dst_pages": DST_PAGES, "model": "other-model"})
    decode, _ = _new_agent(Role.DECODE, "loopback", bootstrap, instance, cleanup)
    old.ready(name)
    with pytest.raises(KVBridgeError, match="refused the handshake: .*model") as refused:
        decode.connect(instance, timeout_s=TIMEOUT_S)
    assert "protocol version" not in str(refused.value)
    assert decode.peer_versions() == {}


def test_an_abort_names_its_request_only_to_a_peer_of_this_release() -> None:
    """7 added the request's nonce to the Abort; the decoders of 5 and 6 refuse unknown fields, so a peer that
    negotiated either gets the Abort without it (and an acknowledgement from one, which names no request,
    is judged by the room alone: tests/test_adversary_wave3b.py)."""
    codec = wire.Codec(sender="d0", address="d0", incarnation=3)
    abort = wire.Abort(room=4, agent="d0", reason="gave up", quiesced=True, nonce=99)
    for version in range(wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1):
        raw = msgspec.msgpack.decode(codec.encode(abort, to="p0", version=version))
        assert raw[0] == version
        assert ("nonce" in raw[-1]) is (version >= 7), (version, raw[-1])
        assert raw[-1]["room"] == 4 and raw[-1]["quiesced"] is True


def test_a_request_carries_its_length_only_to_a_peer_of_protocol_9() -> None:
    """9 added the request's length in tokens to the TransferRequest; a prefill that negotiated 5 to 8 gets the
    request without it, and a frame of 8 that names one is refused, as is a length shorter than the prefix."""
    codec = wire.Codec(sender="d0", address="d0", incarnation=3)
    request = wire.TransferRequest(room=4, agent="d0", dst_rank=0, dst_size=1, indices={}, nonce=5, prefix_len=16,
                                   tokens=176)
    for version in range(wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1):
        raw = msgspec.msgpack.decode(codec.encode(request, to="p0", version=version))
        assert raw[-1].get("tokens") == (176 if version >= 9 else None), (version, raw[-1])
        assert raw[-1]["room"] == 4 and raw[-1]["prefix_len"] == 16
    reader = wire.Codec(sender="p0", address="p0", incarnation=1)
    assert reader.decode(codec.encode(request, to="p0")).tokens == 176
    frame = msgspec.msgpack.decode(wire.Codec(sender="d0", address="d0", incarnation=3).encode(request, to="p0"))
    frame[0] = 8
    with pytest.raises(KVBridgeError, match="names its length"):
        reader.decode(msgspec.msgpack.encode(frame))
    short = msgspec.structs.replace(request, tokens=8)
    with pytest.raises(KVBridgeError, match="a 8-token request with a prefix of 16 tokens"):
        reader.decode(wire.Codec(sender="d0", address="d0", incarnation=3).encode(short, to="p0"))


def test_a_request_carries_its_trace_only_to_a_peer_of_this_release() -> None:
    """8 added the decode room's trace context to the TransferRequest; a prefill that negotiated 5 to 7 gets the
    request without it, and a frame of 7 that names one is refused."""
    codec = wire.Codec(sender="d0", address="d0", incarnation=3)
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    request = wire.TransferRequest(room=4, agent="d0", dst_rank=0, dst_size=1, indices={}, nonce=5, trace=parent)
    for version in range(wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1):
        raw = msgspec.msgpack.decode(codec.encode(request, to="p0", version=version))
        assert raw[0] == version
        assert raw[-1].get("trace") == (parent if version >= 8 else None), (version, raw[-1])
        assert raw[-1]["room"] == 4 and raw[-1]["nonce"] == 5
    forged = wire.Codec(sender="d0", address="d0", incarnation=3)
    frame = msgspec.msgpack.decode(forged.encode(request, to="p0", version=8))
    frame[0] = 7
    reader = wire.Codec(sender="p0", address="p0", incarnation=1)
    with pytest.raises(KVBridgeError, match="names a trace"):
        reader.decode(msgspec.msgpack.encode(frame))

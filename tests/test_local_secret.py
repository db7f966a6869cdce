"""Secure by default on one host (issue 26 item 6): with no secret configured and every address on loopback,
this user's ranks share a secret from a file only this user can read (``kvbridge.local_secret``), so a frame
forged by another local user (holding another secret, or none) has no effect.

Attacked here: 8 processes creating the file at once (with and without hard links), a file others may read or
write, one owned by another user, a symbolic link or a FIFO planted at the path, a directory others may write,
a short secret; and forged Notice/Abort/Goodbye frames sealed with another user's secret."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge import local_secret as ls
from kvbridge.errors import InsecureSetup
from kvbridge.local_secret import LocalSecretError, all_local, read_or_create
from kvbridge.settings import load_settings
from kvbridge.zmq_link import BootstrapServer, ZmqLink

RACERS = 8


def settings_for(path: Path, **more: Any) -> Any:
    return load_settings(env={}, secret_file=str(path), **more)


# ---------------------------------------------------------------------------------------------- the race
def _race(path: str, barrier: Any, results: Any, no_link: bool) -> None:
    if no_link:                                     # a filesystem without hard links: exclusive create in place
        def refuse(*_a: Any, **_k: Any) -> None:
            raise PermissionError(1, "Operation not permitted")
        os.link = refuse  # type: ignore[assignment]
    try:
        barrier.wait(10)
        results.put(("ok", read_or_create(Path(path))))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("no_link", [False, True], ids=["link", "no-hard-links"])
def test_eight_processes_creating_it_at_once_all_get_one_secret(tmp_path: Path, no_link: bool) -> None:
    ctx = mp.get_context("fork")
    for round_ in range(5):
        path = tmp_path / f"round{round_}" / "kvbridge" / "secret"
        barrier = ctx.Barrier(RACERS)
        results = ctx.Queue()
        procs = [ctx.Process(target=_race, args=(str(path), barrier, results, no_link)) for _ in range(RACERS)]
        for p in procs:
            p.start()
        got = [results.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert [kind for kind, _ in got] == ["ok"] * RACERS, got
        secrets_seen = {text for _, text in got}
        assert len(secrets_seen) == 1, f"round {round_}: {len(secrets_seen)} different secrets"
        assert secrets_seen == {path.read_text().strip()} and len(secrets_seen.pop()) == 64
        assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        assert os.listdir(path.parent) == ["secret"], "temporary files left behind"


# ---------------------------------------------------------------------------------------------- unsafe files
def _file(tmp_path: Path, mode: int, text: str = "s" * 64) -> Path:
    path = tmp_path / "kvbridge" / "secret"
    path.parent.mkdir(mode=0o700)
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o666])
def test_a_file_others_may_read_or_write_is_refused_and_left_alone(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, mode)
    with pytest.raises(LocalSecretError, match=rf"{path} has mode 0{mode:o}: group or others may read or change"):
        settings_for(path).with_local_secret("127.0.0.1")
    assert path.stat().st_mode & 0o777 == mode and path.read_text() == "s" * 64     # never repaired or replaced


def test_a_file_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, 0o600)
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)                 # really another user's
    else:
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)   # the file's owner is "another" user
    with pytest.raises(LocalSecretError, match=rf"{path} is owned by uid \d+, not by this user"):
        read_or_create(path)


def test_a_symbolic_link_planted_at_the_path_is_not_followed(tmp_path: Path) -> None:
    """Another user plants a link to their own file (we would use their secret), or a dangling one to a
    place they can read (we would create our secret there): both are refused, nothing is read or created."""
    theirs = tmp_path / "theirs"
    theirs.write_text("m" * 64)
    theirs.chmod(0o600)
    path = tmp_path / "kvbridge" / "secret"
    path.parent.mkdir(mode=0o700)
    path.symlink_to(theirs)
    with pytest.raises(LocalSecretError, match=rf"{path} is a symbolic link: refused \(never followed\)"):
        read_or_create(path)
    path.unlink()
    trap = tmp_path / "readable-by-them"
    path.symlink_to(trap)                                            # dangling
    with pytest.raises(LocalSecretError, match="symbolic link"):
        read_or_create(path)
    assert not trap.exists()
    assert sorted(os.listdir(path.parent)) == ["secret"], "temporary files left behind"


def test_a_fifo_planted_at_the_path_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "kvbridge" / "secret"
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path, 0o600)
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            read_or_create(path)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():                            # unblock it (a writer end), then fail
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("opening a FIFO at the secret path blocked")
    assert isinstance(outcome[0], LocalSecretError) and "not a regular file" in str(outcome[0])


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                              # no sticky bit: anyone could replace the file
    with pytest.raises(LocalSecretError, match=rf"directory {shared} has mode 0777: group or others may replace"):
        read_or_create(shared / "secret")
    assert not (shared / "secret").exists()
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)                             # like /tmp: others cannot replace our file
    assert len(read_or_create(sticky / "secret")) == 64


@pytest.mark.parametrize("text", ["short", "x" * 31, "\u00e9" * 10])
def test_a_weak_secret_is_refused(tmp_path: Path, text: str) -> None:
    path = _file(tmp_path, 0o600, text)
    with pytest.raises(LocalSecretError, match="too weak"):
        read_or_create(path)


def test_a_relative_secret_file_is_refused() -> None:
    with pytest.raises(LocalSecretError, match="must be an absolute path"):
        load_settings(env={"KVBRIDGE_SECRET_FILE": "kvbridge-secret"}).with_local_secret("127.0.0.1")


def test_a_secret_of_the_users_own_making_is_used(tmp_path: Path) -> None:
    path = _file(tmp_path, 0o400, "my own secret, 32 characters or more")
    assert settings_for(path).with_local_secret("::1").secret == "my own secret, 32 characters or more"


# ---------------------------------------------------------------------------------------------- when it applies
@pytest.mark.parametrize("addresses", [("127.0.0.1",), ("tcp://127.0.0.1:17600", "localhost"), ("[::1]:8998",),
                                       ("ipc:///tmp/x", "127.9.9.9"), ("tcp://[::1]:1",)])
def test_loopback_addresses_are_local(addresses: tuple[str, ...]) -> None:
    assert all_local(addresses)


@pytest.mark.parametrize("addresses", [(), ("0.0.0.0",), ("127.0.0.1", "tcp://0.0.0.0:17600"), ("10.0.0.5:8998",),
                                       ("etcd://198.18.0.1:2379/x",), ("tcp://[::]:1",), ("example.com",),
                                       ("tcp://[::1",)])
def test_other_addresses_are_not(addresses: tuple[str, ...]) -> None:
    assert not all_local(addresses)


def test_a_configured_secret_wins_and_the_file_is_not_made(tmp_path: Path) -> None:
    path = tmp_path / "kvbridge" / "secret"
    s = settings_for(path, secret="configured-secret-0123456789abcdef").with_local_secret("127.0.0.1")
    assert s.agent_config().secret == b"configured-secret-0123456789abcdef"
    assert not path.parent.exists()
    assert settings_for(path, allow_insecure=True).with_local_secret("127.0.0.1").secret == ""   # opted out
    assert not path.parent.exists()


def test_not_loopback_without_a_secret_is_still_refused_unless_allow_insecure(tmp_path: Path) -> None:
    path = tmp_path / "kvbridge" / "secret"
    s = settings_for(path).with_local_secret("0.0.0.0", "tcp://127.0.0.1:17600")
    assert s.secret == "" and not path.parent.exists()
    server = BootstrapServer(secret=None).start()
    try:
        with pytest.raises(InsecureSetup, match="no shared secret"):
            ZmqLink(bootstrap=server.address, host="0.0.0.0", secret=s.agent_config().secret,
                    allow_insecure=s.allow_insecure)
        ZmqLink(bootstrap=server.address, host="0.0.0.0", allow_insecure=True).close()
    finally:
        server.close()


def test_the_log_names_the_file_once_and_never_the_secret(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ls, "_logged", set())
    path = tmp_path / "kvbridge" / "secret"
    with caplog.at_level(logging.INFO, logger="kvbridge"):
        first = settings_for(path).with_local_secret("127.0.0.1")
        second = settings_for(path).with_local_secret("tcp://127.0.0.1:1")
    assert first.secret == second.secret
    said = [r.getMessage() for r in caplog.records if "local secret file" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0]
    assert not [r for r in caplog.records if first.secret in r.getMessage()]


def test_the_default_file_is_per_user(tmp_path: Path) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    assert ls.default_path({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "kvbridge" / "secret"
    assert ls.default_path({"XDG_RUNTIME_DIR": "relative"}).parts[-3:] == (".cache", "kvbridge", "secret")
    assert ls.default_path({}).parts[-3:] == (".cache", "kvbridge", "secret")


# ---------------------------------------------------------------------------------------------- the adapters
def test_the_vllm_connectors_prefill_and_decode_share_it_with_no_configuration(tmp_path: Path) -> None:
    from kvbridge_vllm.settings import Settings as VllmSettings

    env = {"KVBRIDGE_SECRET_FILE": str(tmp_path / "kvbridge" / "secret")}
    prefill = VllmSettings.from_extra({"backend": "loopback"}, env=env).with_local_secret()
    decode = VllmSettings.from_extra({"backend": "loopback", "serve_bootstrap": False}, env=env).with_local_secret()
    assert prefill.secret_bytes is not None and prefill.secret_bytes == decode.secret_bytes
    assert prefill.agent_config().secret == prefill.secret_bytes
    exposed = VllmSettings.from_extra({"host": "0.0.0.0"}, env=env).with_local_secret()
    assert exposed.secret_bytes is None                       # and its link is refused (InsecureSetup) as before
    mine = VllmSettings.from_extra({"secret": "configured-secret-0123456789abcdef"}, env=env).with_local_secret()
    assert mine.secret_bytes == b"configured-secret-0123456789abcdef"


def test_the_sglang_adapter_decides_alike_on_both_roles(tmp_path: Path) -> None:
    pytest.importorskip("kvbridge_sglang")
    from kvbridge_sglang.settings import Settings as SGLangSettings

    env = {"KVBRIDGE_SECRET_FILE": str(tmp_path / "kvbridge" / "secret"), "KVBRIDGE_BACKEND": "loopback"}
    manager = SGLangSettings.from_env(env=env).with_local_secret("127.0.0.1")
    server = SGLangSettings.from_env(env=env).with_local_secret("127.0.0.1")
    assert manager.secret is not None and manager.secret == server.secret
    every_interface = SGLangSettings.from_env(env=env).with_local_secret("0.0.0.0")
    assert every_interface.secret is None      # --host 0.0.0.0: the HTTP bootstrap is exposed, needs a real secret


# ---------------------------------------------------------------------------------------------- forgeries
def test_frames_sealed_with_another_local_users_secret_have_no_effect(tmp_path: Path) -> None:
    """Issue 26: without a secret a forged Notice completed a room with its bytes missing and a forged Goodbye
    failed rooms. With nothing configured, the pair now runs under this user's local secret; another local
    user (their own local secret, or none) forges Notice, quiesced Abort, StatusPush and Goodbye in the prefill's
    exact identity: every frame is refused and counted, the room completes byte-exact."""
    from test_adversary import ZWorld, forge, wait

    from kvbridge.protocol.wire import Abort, Goodbye, KVPoll, Notice, StatusPush

    mine = settings_for(tmp_path / "me" / "secret").with_local_secret("127.0.0.1")
    theirs = settings_for(tmp_path / "other-user" / "secret").with_local_secret("127.0.0.1")
    key, other = mine.agent_config().secret, theirs.agent_config().secret
    assert key is not None and other is not None and key != other
    w = ZWorld(key)
    try:
        w.start()
        granted = np.array([6, 7, 8, 9])
        sender, receiver = w.open(30, w.da, w.p1, granted)
        before = w.rejected()
        sock = w.attacker(w.da)
        bodies = [Notice(room=30, sender=0, component="kv", chunk=0, last=True, count=4),
                  StatusPush(room=30, agent="p1", status=KVPoll.Failed, reason="forged"),
                  Abort(room=30, agent="p1", reason="forged", quiesced=True), Goodbye(agent="p1")]
        forged = [forge(body, sender="p1", address=w.p1.link.address, incarnation=w.p1.incarnation,
                        to=w.da.link.address, to_incarnation=w.da.incarnation, seq=10**6 + i, key=k)
                  for k in (other, None) for i, body in enumerate(bodies)]
        for frame in forged:
            sock.send(frame)
        wait(lambda: w.rejected()["da"] >= before["da"] + len(forged), 10, "forgeries refused")
        time.sleep(0.2)
        assert receiver.poll() == KVPoll.WaitingForInput and not receiver.safe_to_reuse
        assert w.da.peers["p1"].alive
        w.finish(30, sender, receiver, w.da, w.p1, granted)
        w.room(31)
    finally:
        w.close()


def test_a_home_it_cannot_write_says_what_to_do(tmp_path: Path) -> None:
    """A container with a read-only home and no XDG_RUNTIME_DIR: the engine is refused with the ways out."""
    home = tmp_path / "ro-home"
    home.mkdir()
    blocker = home / ".cache"
    blocker.write_text("a file where the directory would be")
    with pytest.raises(LocalSecretError, match=r"local secret directory .*ro-home/\.cache/kvbridge: .*"
                                               r"KVBRIDGE_SECRET_FILE.*KVBRIDGE_SECRET.*KVBRIDGE_ALLOW_INSECURE=1"):
        load_settings(env={}).with_local_secret("127.0.0.1", env={"HOME": str(home)})


def test_an_empty_file_left_by_a_crashed_creator_is_refused_in_bounded_time(tmp_path: Path) -> None:
    path = _file(tmp_path, 0o600, "")
    started = time.monotonic()
    with pytest.raises(LocalSecretError, match="stays empty: delete it"):
        read_or_create(path)
    assert time.monotonic() - started < ls._WAIT_S + 2


def test_bootstrap_requests_sealed_with_another_local_users_secret_are_refused(tmp_path: Path) -> None:
    from kvbridge.discovery import DiscoveryError
    from kvbridge.zmq_link import ZmqBootstrap

    mine = settings_for(tmp_path / "me" / "secret").with_local_secret("127.0.0.1").agent_config().secret
    theirs = settings_for(tmp_path / "them" / "secret").with_local_secret("127.0.0.1").agent_config().secret
    server = BootstrapServer(secret=mine).start()
    own = ZmqBootstrap(server.address, secret=mine, timeout_s=2.0)
    forgers = [ZmqBootstrap(server.address, secret=key, timeout_s=1.0) for key in (theirs, None)]
    try:
        own.publish("inst", 1, 0, "tcp://127.0.0.1:5555")
        for forger in forgers:
            with pytest.raises((DiscoveryError, TimeoutError, OSError)):
                forger.publish("inst", 1, 0, "tcp://127.0.0.1:1")
            assert forger.lookup("inst") is None             # the answer is not theirs to read
        info = own.lookup("inst")
        assert info is not None and info.addresses == {0: "tcp://127.0.0.1:5555"}
    finally:
        for client in (own, *forgers):
            client.close()
        server.close()

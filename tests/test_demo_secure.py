"""Secure by default (issue 26 item 6): the demo, with no secret configured, runs its bootstrap server, links
and agents under one secret that only its own processes hold, so another local user's forged bootstrap
requests change nothing while it runs; a configured secret is used for all three parts."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest

import kvbridge.demo.run as demo_run
from kvbridge.demo.worker import INSTANCE
from kvbridge.discovery import DiscoveryError
from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap


class Recording(BootstrapServer):
    servers: list[BootstrapServer] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Recording.servers.append(self)


def attack(stop: threading.Event, outcomes: list[str]) -> None:
    """Another local user, without the secret: redirect the demo's prefill, and read its addresses."""
    while not Recording.servers and not stop.is_set():
        time.sleep(0.01)
    if stop.is_set():
        return
    forger = ZmqBootstrap(Recording.servers[0].address, secret=None, timeout_s=1.0)
    try:
        while not stop.is_set():
            try:
                forger.publish(INSTANCE, 1, 0, "tcp://127.0.0.1:1")
                outcomes.append("published")
            except (DiscoveryError, TimeoutError, OSError) as exc:
                outcomes.append(f"refused: {exc}")
            if forger.lookup(INSTANCE) is not None:
                outcomes.append("looked up")
            time.sleep(0.05)
    finally:
        forger.close()


def test_a_forged_publish_during_the_demo_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.setattr(demo_run, "BootstrapServer", Recording)
    Recording.servers = []
    stop, outcomes = threading.Event(), []
    attacker = threading.Thread(target=attack, args=(stop, outcomes))
    attacker.start()
    out = io.StringIO()
    try:
        summary = demo_run.run_demo(backend="loopback", preset="dense-gqa", prefill_tp=1, decode_tp=1, requests=4,
                                    seed=5, window=2, region_pages=4, timeout_s=60, out=out)
    finally:
        stop.set()
        attacker.join()
    assert summary.ok, out.getvalue()
    server = Recording.servers[0]
    assert server._secret is not None and len(server._secret) >= 32
    assert outcomes and "published" not in outcomes and "looked up" not in outcomes, outcomes
    assert server.rejected >= len(outcomes) // 2


class Stop(Exception):
    pass


def test_a_configured_secret_is_the_one_the_run_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked where the launcher hands it out (a full run with a configured secret is the first test's path)."""
    monkeypatch.setenv("KVBRIDGE_SECRET", "configured-demo-secret-0123456789")
    seen: dict[str, Any] = {}

    def server(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(demo_run, "BootstrapServer", server)
    with pytest.raises(Stop):
        demo_run.run_demo(backend="loopback", preset="dense-gqa", prefill_tp=1, decode_tp=1, requests=1, seed=0,
                          out=io.StringIO())
    assert seen["secret"] == b"configured-demo-secret-0123456789"

"""Clock skew against the authenticated bootstrap window (issue 26 item 8): a node whose clock is outside
``clock_window_s`` is refused, and each side says so ONCE a minute per address with the measured offset and
the setting's name (not once per refused request: a decode 120 s ahead used to log 590 warnings in 8 s);
the refusals are counted; a wider window makes the same pair work."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.clockskew import (
    CLOCK_WINDOW_ENV,
    DEFAULT_CLOCK_WINDOW_S,
    clock_window_from_env,
    skew_log_budget,
)
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.sealing import seal, unseal
from kvbridge.settings import Settings, SettingsError, load_settings
from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap, ZmqLink, _Answer, _Lookup

SECRET = b"clock-skew-suite-shared-secret-0"
PAGES, ITEM = 16, 64
AHEAD_S = 120.0
LOGGER = "kvbridge.zmq_link"


def ahead(offset_s: float) -> Callable[[], float]:
    return lambda: time.time() + offset_s


def layout() -> PoolLayout:
    buf = BufferGeometry(name="k.0", num_items=PAGES, item_shape=(ITEM,), dtype=DType.UINT8)
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=(buf,)),), tp_size=1, tp_rank=0,
                      page_size=1, model="m")


def wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def skew_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and "clock" in r.getMessage()]


def offset_named(message: str) -> float:
    match = re.search(r"([+-]\d+\.\d) s off", message)
    assert match, message
    return float(match.group(1))


class Pair:
    """A prefill (instance ``inst``) and a decode on real ZMQ links, one bootstrap server, one secret; the
    decode's discovery client uses ``decode_clock``."""

    def __init__(self, server: BootstrapServer, decode_clock: Callable[[], float]) -> None:
        self.server = server
        config = AgentConfig(secret=SECRET, peer_timeout_s=3.0, heartbeat_interval_s=0.1, staging_bytes=0)
        self.src = np.random.default_rng(7).integers(0, 256, (PAGES, ITEM), dtype=np.uint8)
        self.dst = np.zeros((PAGES, ITEM), np.uint8)
        self.client = ZmqBootstrap(server.address, secret=SECRET, republish_s=0, clock=decode_clock)
        self.pre = TransferAgent(layout=layout(), buffers={"kv": [self.src]}, role=Role.PREFILL, instance="inst",
                                 name="pre", config=config, link=ZmqLink(bootstrap=server.address, secret=SECRET))
        self.dec = TransferAgent(layout=layout(), buffers={"kv": [self.dst]}, role=Role.DECODE, name="dec",
                                 config=config, link=ZmqLink(discovery=self.client, secret=SECRET))
        self.pre.start()
        self.dec.start()

    def room(self, room: int) -> None:
        """One room to Success, byte-exact."""
        sender = self.pre.sender(room)
        receiver = self.dec.receiver(room, "inst")
        dst_pages, src_pages = np.array([3, 9, 1]), np.array([10, 2, 7])
        receiver.send_metadata({"kv": dst_pages})
        wait(lambda: sender.poll() >= KVPoll.WaitingForInput, 10, "the sender")
        sender.send(src_pages, last=True)
        wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 10, "the room to end")
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        assert np.array_equal(self.dst[dst_pages], self.src[src_pages])

    def close(self) -> None:
        self.dec.close()
        self.pre.close()
        self.client.close()


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    made: list[tuple[Pair, BootstrapServer]] = []

    def make(decode_clock: Callable[[], float], **server: float) -> Pair:
        srv = BootstrapServer(secret=SECRET, **server).start()     # type: ignore[arg-type]
        pair = Pair(srv, decode_clock)
        made.append((pair, srv))
        return pair

    yield make
    for pair, srv in made:
        pair.close()
        srv.close()


def test_a_decode_120s_ahead_is_refused_with_one_warning_per_side_not_hundreds(
        pairs: Callable[..., Pair], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    pair = pairs(ahead(AHEAD_S))
    with pytest.raises(TimeoutError, match="publish all its ranks"):
        pair.dec.connect("inst", timeout_s=2.0)       # looks the instance up every 10 ms meanwhile
    time.sleep(0.1)                                   # the lookup thread's last request
    refused = pair.server.rejected_skew
    assert refused >= 20, f"only {refused} lookups were refused"
    assert pair.client.skew_rejections == refused
    warnings = skew_warnings(caplog)
    server_side = [m for m in warnings if m.startswith("bootstrap: requests from 127.0.0.1")]
    client_side = [m for m in warnings if m.startswith(f"bootstrap server {pair.server.address} refuses")]
    assert len(server_side) == 1 and len(client_side) == 1, warnings
    assert len(warnings) == 2, warnings
    for message in warnings:
        assert "clock_window_s=60" in message and CLOCK_WINDOW_ENV in message, message
        assert abs(offset_named(message) - AHEAD_S) < 5, message
    lookups = [r for r in caplog.records if "lookup of" in r.getMessage()]
    assert lookups == [], "a refused lookup is logged again per request"


def test_with_the_window_raised_to_300s_the_same_pair_works(pairs: Callable[..., Pair],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    pair = pairs(ahead(AHEAD_S), clock_window_s=300.0)
    pair.dec.connect("inst", timeout_s=10)
    pair.room(1)
    assert pair.server.rejected_skew == 0 and pair.client.skew_rejections == 0
    assert skew_warnings(caplog) == []


def test_the_window_comes_from_the_environment_for_a_server_built_without_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLOCK_WINDOW_ENV, "300")
    server = BootstrapServer(secret=SECRET).start()
    client = ZmqBootstrap(server.address, secret=SECRET, republish_s=0, clock=ahead(AHEAD_S))
    try:
        assert server.clock_window_s == 300.0
        client.publish("inst", 1, 0, "tcp://127.0.0.1:7001")
        assert client.lookup("inst") is not None
        assert server.rejected_skew == 0
    finally:
        client.close()
        server.close()
    monkeypatch.delenv(CLOCK_WINDOW_ENV)
    assert clock_window_from_env() == DEFAULT_CLOCK_WINDOW_S


@pytest.mark.parametrize("bad", ["nan", "inf", "0", "-5", "soon"])
def test_a_bad_window_is_refused_with_its_name(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLOCK_WINDOW_ENV, bad)
    with pytest.raises(SettingsError, match=f"clock_window_s={bad!r} \\(from {CLOCK_WINDOW_ENV}\\)"):
        BootstrapServer(secret=SECRET)
    with pytest.raises(SettingsError, match="clock_window_s"):
        load_settings(env={CLOCK_WINDOW_ENV: bad})
    monkeypatch.delenv(CLOCK_WINDOW_ENV)
    with pytest.raises(ValueError, match=r"BootstrapServer\.clock_window_s=.* finite number of seconds > 0"):
        BootstrapServer(secret=SECRET, clock_window_s=float(bad) if bad != "soon" else math.nan)


def test_the_setting_is_documented_with_its_default() -> None:
    assert Settings().clock_window_s == DEFAULT_CLOCK_WINDOW_S
    assert load_settings(env={CLOCK_WINDOW_ENV: "300"}).clock_window_s == 300.0
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    assert f"| `clock_window_s` | `{CLOCK_WINDOW_ENV}` | `60.0` |" in readme


def test_a_prefill_whose_clock_steps_120s_forward_says_so_once_before_it_vanishes(
        caplog: pytest.LogCaptureFixture) -> None:
    """The republications of a prefill whose clock stepped are refused; its lease ends (it vanishes from
    discovery, as before) but both sides now say why, once."""
    caplog.set_level(logging.WARNING)
    step = [0.0]
    server = BootstrapServer(secret=SECRET).start()
    prefill = ZmqBootstrap(server.address, secret=SECRET, republish_s=0.1, lease_s=0.6,
                           clock=lambda: time.time() + step[0])
    reader = ZmqBootstrap(server.address, secret=SECRET, republish_s=0)
    try:
        prefill.publish("inst", 1, 0, "tcp://127.0.0.1:7002")
        assert reader.lookup("inst") is not None
        step[0] = AHEAD_S
        wait(lambda: reader.lookup("inst") is None, 5, "the lease to end")
        wait(lambda: prefill.skew_rejections >= 8, 5, "several refused republications")
        warnings = skew_warnings(caplog)
        assert len(warnings) == 2, warnings
        assert all(abs(offset_named(m) - AHEAD_S) < 5 and "clock_window_s" in m for m in warnings), warnings
        step[0] = 0.0                                  # the clock is fixed: it is found again
        wait(lambda: reader.lookup("inst") is not None, 5, "the rank to be republished")
    finally:
        reader.close()
        prefill.close()
        server.close()


def test_a_request_with_a_nan_or_infinite_time_is_refused() -> None:
    """``abs(now - nan) > window`` is False: a NaN timestamp used to pass the freshness check."""
    server = BootstrapServer(secret=SECRET).start()
    client = ZmqBootstrap(server.address, secret=SECRET, republish_s=0)
    try:
        for when in (math.nan, math.inf, -math.inf):
            request = _Lookup(instance="x", nonce=os.urandom(16), time=when)
            import zmq

            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 2000)
            sock.connect(server.address)
            try:
                sock.send(seal(SECRET, b"bootstrap-request", msgspec.msgpack.encode(request)))
                answer = msgspec.msgpack.decode(unseal(SECRET, b"bootstrap-answer", sock.recv()), type=_Answer)
            finally:
                sock.close(0)
            assert "clock skew" in answer.error, answer
        assert server.rejected_skew == 3
        assert client.lookup("x") is None and server.rejected_skew == 3      # a fresh request still served
    finally:
        client.close()
        server.close()


def test_the_skew_budget_says_once_a_minute_per_address_and_counts_what_it_held_back() -> None:
    now = [0.0]
    budget = skew_log_budget(clock=lambda: now[0])
    assert budget.take("10.0.0.1") and budget.take("10.0.0.2")
    assert not any(budget.take("10.0.0.1") for _ in range(500))
    now[0] = 59.9
    assert not budget.take("10.0.0.1")
    now[0] = 60.0
    assert budget.take("10.0.0.1") and "501 more" in budget.suppressed_note("10.0.0.1")
    assert budget.suppressed_note("10.0.0.1") == ""

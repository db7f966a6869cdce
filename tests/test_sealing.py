"""The one sealing scheme (``kvbridge.sealing``): tags equal the constructions every earlier release put on the
wire (computed here with ``hmac`` directly), bytes sealed for one purpose or key are refused for another, and
the freshness guard refuses replays, stale and numberless requests."""

from __future__ import annotations

import hashlib
import hmac
import math

import pytest

from kvbridge.discovery import DiscoveryError, RankRecord, open_record, seal_record
from kvbridge.protocol.wire import Codec, Heartbeat
from kvbridge.sealing import (
    TAG_BYTES,
    BadTag,
    Busy,
    FreshnessGuard,
    Replayed,
    Stale,
    matches,
    seal,
    tag,
    unseal,
)

SECRET = b"sealing-test-secret-0123456789ab"


def reference(purpose: bytes, *parts: bytes) -> bytes:
    return hmac.new(SECRET, b"\0".join((purpose, *parts)), hashlib.sha256).digest()


def test_tags_are_the_constructions_on_the_wire() -> None:
    assert tag(SECRET, b"bootstrap-request", b"body") == reference(b"bootstrap-request", b"body")
    assert tag(SECRET, b"kvbridge-discovery-record", b"key", b"body") == reference(b"kvbridge-discovery-record",
                                                                                   b"key", b"body")
    assert len(tag(SECRET, b"p")) == TAG_BYTES


def test_an_agent_frame_is_tagged_for_its_recipient_as_protocol_5_did() -> None:
    codec = Codec(SECRET, sender="p0", address="tcp://127.0.0.1:1")
    frame = codec.encode(Heartbeat(agent="p0", address="tcp://127.0.0.1:1", seq=1), to="tcp://127.0.0.1:2")
    assert frame[:TAG_BYTES] == reference(b"tcp://127.0.0.1:2", frame[TAG_BYTES:])
    other = Codec(SECRET, sender="d0", address="tcp://127.0.0.1:3")
    with pytest.raises(Exception, match="HMAC"):
        other.open(frame)                       # sealed for another recipient


def test_a_record_is_bound_to_its_key() -> None:
    record = RankRecord(instance="inst", tp_size=1, rank=0, address="tcp://127.0.0.1:5000")
    blob = seal_record(SECRET, "/kvbridge/inst/0", record)
    assert blob[:TAG_BYTES] == reference(b"kvbridge-discovery-record", b"/kvbridge/inst/0", blob[TAG_BYTES:])
    assert open_record(SECRET, "/kvbridge/inst/0", blob) == record
    with pytest.raises(DiscoveryError, match="HMAC"):
        open_record(SECRET, "/kvbridge/inst/1", blob)


@pytest.mark.parametrize("change", ["purpose", "bound", "body", "secret", "truncated", "empty"])
def test_sealed_bytes_are_refused_anywhere_else(change: str) -> None:
    sealed = seal(SECRET, b"purpose-a", b"payload", b"bound-a")
    assert unseal(SECRET, b"purpose-a", sealed, b"bound-a") == b"payload"
    secret, purpose, bound = SECRET, b"purpose-a", b"bound-a"
    if change == "purpose":
        purpose = b"purpose-b"
    elif change == "bound":
        bound = b"bound-b"
    elif change == "body":
        sealed = sealed[:-1] + b"X"
    elif change == "secret":
        secret = b"another-secret-0123456789abcdefg"
    elif change == "truncated":
        sealed = sealed[:TAG_BYTES - 1]
    else:
        sealed = b""
    with pytest.raises(BadTag):
        unseal(secret, purpose, sealed, bound)


def test_without_a_secret_bytes_pass_unchanged_and_matches_refuses_short_tags() -> None:
    assert seal(None, b"p", b"body") == b"body" == unseal(None, b"p", b"body")
    assert not matches(SECRET, b"p", b"", b"body")
    assert matches(SECRET, b"p", tag(SECRET, b"p", b"body"), b"body")


def test_the_guard_refuses_replays_stale_and_numberless_requests() -> None:
    guard = FreshnessGuard(window_s=60.0)
    guard.admit(b"a" * 16, sent_at=100.0, now=100.0)
    with pytest.raises(Replayed):
        guard.admit(b"a" * 16, sent_at=100.0, now=101.0)
    with pytest.raises(Replayed, match="unnumbered"):
        guard.admit(b"short", sent_at=100.0, now=100.0)
    for sent_at in (30.0, 170.0, math.nan, math.inf):
        with pytest.raises(Stale) as caught:
            guard.admit(b"b" * 16, sent_at=sent_at, now=100.0)
        assert caught.value.window_s == 60.0
    guard.admit(b"b" * 16, sent_at=150.0, now=100.0)      # inside the window: once
    with pytest.raises(ValueError):
        FreshnessGuard(window_s=0.0)


def test_a_full_guard_refuses_new_requests_instead_of_forgetting_live_nonces() -> None:
    """A flood of authentic requests must not push a nonce out while its request could still be replayed."""
    guard = FreshnessGuard(window_s=10.0, capacity=100)
    for i in range(100):
        guard.admit(i.to_bytes(16, "big"), sent_at=1000.0, now=1000.0 + i * 0.001)
    with pytest.raises(Busy):
        guard.admit(b"x" * 16, sent_at=1000.0, now=1001.0)
    with pytest.raises(Replayed):                          # the first nonce is still remembered
        guard.admit((0).to_bytes(16, "big"), sent_at=1000.0, now=1009.0)
    guard.admit(b"x" * 16, sent_at=1011.0, now=1011.0)     # the window passed: the old ones expired
    assert len(guard) == 1


def test_a_nonce_is_forgotten_only_once_its_request_is_stale() -> None:
    guard = FreshnessGuard(window_s=10.0)
    guard.admit(b"n" * 16, sent_at=5.0, now=0.0)           # a client 5 s ahead: replayable until 15.0
    guard.admit(b"m" * 16, sent_at=14.0, now=14.0)
    with pytest.raises(Replayed):
        guard.admit(b"n" * 16, sent_at=5.0, now=14.9)
    guard.admit(b"k" * 16, sent_at=25.0, now=25.0)         # n and m expired
    assert len(guard) == 1
    with pytest.raises(Stale):
        guard.admit(b"n" * 16, sent_at=5.0, now=25.0)

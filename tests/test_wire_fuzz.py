"""Hypothesis-generated malformed frames: rejected with a clear error, and the agent keeps working."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_agent import kv_buffers, kv_layout

from kvbridge.agent import TransferAgent
from kvbridge.errors import ProtocolError
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import PROTOCOL_VERSION, Codec, KVPoll, Notice, Role


def _envelope(body: object) -> list[object]:
    """A protocol-2 envelope around a raw body: version, sender, address, incarnations, sequence."""
    return [PROTOCOL_VERSION, "fuzz", "fuzz-address", 1, 0, 1, body]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


def _encode(value: object) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError):
        return b"\xc1"


frames = st.one_of(
    st.binary(max_size=200),
    msgpack_values.map(_encode),
    st.tuples(st.just(PROTOCOL_VERSION), msgpack_values).map(lambda t: _encode(list(t))),
    st.fixed_dictionaries({"type": st.sampled_from(["hello", "welcome", "request", "notice", "status", "abort",
                                                    "heartbeat", "goodbye"])}, optional={
        "room": st.integers(-2**64, 2**64), "agent": st.text(max_size=8), "sender": st.integers(-5, 5),
        "chunk": st.integers(-5, 5), "component": st.text(max_size=4), "last": st.booleans(),
        "dst_rank": st.integers(-3, 3), "dst_size": st.integers(-3, 3), "indices": msgpack_values,
    }).map(lambda body: _encode(_envelope(body))),
)


@given(frames)
@settings(max_examples=400, deadline=None)
def test_codec_rejects_or_returns_a_valid_message(frame: bytes) -> None:
    try:
        message = Codec().decode(frame)
    except ProtocolError:
        return
    assert Codec().decode(Codec().encode(message)) == message   # anything accepted is well-formed


@pytest.fixture(scope="module")
def pair():  # type: ignore[no-untyped-def]
    hub = LocalHub()
    pl, dl = kv_layout(1, 0), kv_layout(1, 0)
    pre = TransferAgent(layout=pl, buffers={"kv": kv_buffers(pl)}, role=Role.PREFILL, link=hub.link("p"), instance="i")
    dec = TransferAgent(layout=dl, buffers={"kv": kv_buffers(dl)}, role=Role.DECODE, link=hub.link("d"))
    pre.start()
    dec.connect("i", timeout_s=5)
    yield pre, dec
    pre.close()
    dec.close()


@given(st.lists(frames, min_size=1, max_size=8))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_agents_survive_garbage_and_still_transfer(pair, garbage: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    pre, dec = pair
    for frame in garbage:
        dec.handle_frame(frame)
        with pre.context.lock:
            pre.handle_frame(frame)
    room = int(np.random.default_rng().integers(1, 2**62))
    receiver = dec.receiver(room, "i")
    receiver.send_metadata({"kv": np.array([1, 2])})
    sender = pre.sender(room)
    while sender.poll() < KVPoll.WaitingForInput:
        pass
    sender.send(np.array([3, 4]), last=True)
    while receiver.poll() < KVPoll.Success:
        assert receiver.poll() != KVPoll.Failed, receiver.failure_reason
    receiver.clear()
    while not sender.safe_to_reuse:
        pass
    sender.clear()


def test_oversize_frame_is_rejected_before_decoding() -> None:
    codec = Codec(max_bytes=1024)
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte limit"):
        codec.decode(b"\x00" * 2000)
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.encode(Notice(room=1, sender=0, component="x" * 5000, chunk=0, last=True))


def test_room_outside_63_bits_is_rejected() -> None:
    frame = _encode(_envelope({"type": "notice", "room": 2**63, "sender": 0, "component": "kv", "chunk": 0,
                                        "last": True}))
    with pytest.raises(ProtocolError, match="63-bit"):
        Codec().decode(frame)

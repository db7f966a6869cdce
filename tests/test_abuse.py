"""Availability under abuse (issue 26 item 9): huge Hellos, impossible geometry, heavy early requests.

Every test here tries to break one promise of docs/integrity.md's "Availability under abuse" section:
a Hello is bounded before it is decoded and decoded outside the agent lock, impossible geometry is refused
with an answer naming the problem, and the early-request queue is bounded in bytes and released on abort.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import numpy as np
import pytest
from test_agent import check as check_bytes
from test_agent import fill, hand_pair, kv_buffers, kv_layout, wait

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.geometry import (
    MAX_ITEMS,
    MAX_LAYOUT_BUFFERS,
    BufferGeometry,
    Component,
    DType,
    PoolLayout,
    ShardAxis,
)
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import (
    MAX_HANDSHAKE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Codec,
    Envelope,
    KVPoll,
    PackedIndices,
    Role,
    TransferRequest,
    Welcome,
)


def raw_layout(buffers: list[dict[str, Any]], *, page_size: int = 4) -> dict[str, Any]:
    """A layout as plain msgpack-able data: what an attacker can put on the wire without our validation."""
    return {"components": [{"name": "kv", "state_type": "kv", "buffers": buffers}], "tp_size": 1, "tp_rank": 0,
            "page_size": page_size, "model": "m"}


def raw_buffer(name: str, *, num_items: int = 16, item_shape: tuple[int, ...] = (4, 4, 8)) -> dict[str, Any]:
    return {"name": name, "num_items": num_items, "item_shape": list(item_shape), "dtype": "bfloat16",
            "shard": {"axis": 1, "total": 4}}


def raw_hello(agent: str, layout: dict[str, Any], regions: list[list[int]] | None, *, to_incarnation: int = 0,
              incarnation: int = 7, seq: int = 1) -> bytes:
    """A Hello frame built from raw data (no secret), from ``agent`` whose reply address is its name."""
    body = {"type": "hello", "version": PROTOCOL_VERSION, "agent": agent, "address": agent, "role": "decode",
            "layout": layout, "backend": "loopback", "endpoint": b"",
            "buffers": [] if regions is None else [{"component": "kv", "regions": regions, "descriptor": b""}]}
    return msgspec.msgpack.encode([PROTOCOL_VERSION, agent, agent, incarnation, to_incarnation, seq, body])


def answers(link: Any) -> list[Welcome]:
    """The Welcomes (refusals) an attacker's link received."""
    out = []
    for frame in link.recv(0.0):
        env = msgspec.msgpack.decode(frame, type=Envelope)
        if isinstance(env.body, Welcome):
            out.append(env.body)
    return out


# ------------------------------------------------------------------------------------------ 1: huge Hellos
class LockSpy(Codec):
    """The prefill's codec, recording whether the agent lock was held while a Hello was decoded."""

    def __init__(self, real: Codec, lock: Any) -> None:
        self.__dict__.update(real.__dict__)
        self._agent_lock = lock
        self.hello_decodes: list[bool] = []

    def _record(self, frame: bytes) -> None:
        if b"\xa5hello" in frame[:4096]:
            self.hello_decodes.append(self._agent_lock.held_here())

    def open(self, frame: bytes) -> Envelope:
        self._record(frame)
        return super().open(frame)

    def unseal(self, sealed: Any) -> Envelope:
        self._record(sealed.frame)
        return super().unseal(sealed)


def test_huge_hellos_are_refused_before_decoding_and_never_decoded_under_the_lock() -> None:
    """5 Hellos naming a 100,000-buffer layout (8.4 MB each) stalled a healthy pair up to 11.8 s: each was
    decoded under the agent lock before any rate limit. Now they are refused by size with the bound named,
    Hellos within the bounds are decoded outside the lock, and a healthy room keeps completing byte-exact."""
    hub = LocalHub()
    layout = kv_layout(1, 0)
    src, dst = kv_buffers(layout), kv_buffers(layout)
    pre = TransferAgent(layout=layout, buffers={"kv": src}, role=Role.PREFILL, link=hub.link("p0"), instance="inst",
                        name="p0")
    dec = TransferAgent(layout=layout, buffers={"kv": dst}, role=Role.DECODE, link=hub.link("d0"), name="d0")
    spy = LockSpy(pre.context.codec, pre.context.lock)
    pre.context.codec = spy
    mallory = [hub.link(f"mallory{i}") for i in range(10)]
    try:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=10)
        huge = raw_layout([raw_buffer(f"k.{i}") for i in range(100_000)])
        big = [raw_hello(f"mallory{i}", huge, None, incarnation=i + 1) for i in range(5)]
        many = raw_layout([raw_buffer(f"k.{i}") for i in range(MAX_LAYOUT_BUFFERS + 1)])
        wide = [raw_hello(f"mallory{i}", many, None, incarnation=i + 1) for i in range(5, 10)]
        assert len(big[0]) > MAX_HANDSHAKE_BYTES > len(wide[0])
        timings = []
        for room in range(1, 6):
            pages, dst_pages = np.array([1, 5, 9]), np.array([2, 3, 14])
            fill_pair = type("P", (), {"src": [src], "dst": [dst]})
            fill(fill_pair, 1, room, pages, np.arange(3))
            started = time.monotonic()
            hub._deliver("p0", big[room - 1])          # one of each kind per room
            hub._deliver("p0", wide[room - 1])
            receiver = dec.receiver(room, "inst")
            receiver.send_metadata({"kv": dst_pages})
            sender = pre.sender(room)
            wait(lambda sender=sender: sender.poll() >= KVPoll.WaitingForInput, 30)
            sender.send(pages, last=True)
            wait(lambda receiver=receiver: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 30)
            assert receiver.poll() == KVPoll.Success, receiver.failure_reason
            timings.append(time.monotonic() - started)
            check_bytes(fill_pair, 1, room, dst_pages, np.arange(3))
            wait(lambda sender=sender: sender.safe_to_reuse, 10)
            receiver.clear()
            sender.clear()
        print(f"healthy rooms during huge Hellos: {', '.join(f'{t * 1000:.0f} ms' for t in timings)}")
        wait(lambda: not pre.link._inbox, 10)          # type: ignore[attr-defined]
        time.sleep(0.1)
        refusals = [w for link in mallory for w in answers(link)]
        assert not any(w.accepted for w in refusals)
        reasons = " | ".join(w.reason for w in refusals)
        assert reasons.count(f"{MAX_HANDSHAKE_BYTES}-byte") >= 5, reasons       # the size bound, named
        assert reasons.count(f"at most {MAX_LAYOUT_BUFFERS} buffers") >= 5, reasons   # the layout bound, named
        assert spy.hello_decodes, "no Hello was decoded at all"
        assert not any(spy.hello_decodes), f"{sum(spy.hello_decodes)} Hellos decoded under the agent lock"
        assert set(pre.peers.peers) == {"d0"}
    finally:
        pre.close()
        dec.close()


# ------------------------------------------------------------------------------------------ 2: impossible geometry
def good_layout(**change: Any) -> dict[str, Any]:
    """The prefill's own layout as plain data, ``change`` applied to every buffer (or, for ``page_size``, the
    layout): a Hello that is compatible except for the impossible field."""
    layout = msgspec.to_builtins(kv_layout(1, 0))
    if "page_size" in change:
        layout["page_size"] = change.pop("page_size")
    for buf in layout["components"][0]["buffers"]:
        buf.update(change)
    return layout


def regions(nbytes: int = 16 * 256, count: int = 4) -> list[list[int]]:
    return [[0x10000 + i * (1 << 50), nbytes] for i in range(count)]


@pytest.mark.parametrize("case, layout, regs, reason", [
    ("2^40 pages", good_layout(num_items=2**40), regions(2**40 * 256), f"{MAX_ITEMS}"),
    ("no buffers registered", good_layout(), None, "registered no buffers for 'kv'"),
    ("negative items", good_layout(num_items=-5), regions(), "num_items"),
    ("absurd item", good_layout(item_shape=[2**30, 4, 2**30]), regions(), "-byte bound of one buffer"),
    ("regions short", good_layout(), regions(8), "region of k.0 is 8 B"),
    ("region count", good_layout(), regions(count=3), "3 regions"),
    ("zero page size", good_layout(page_size=0), regions(), "page_size"),
])
def test_impossible_geometry_is_refused_with_an_answer_naming_it(case: str, layout: dict[str, Any],
                                                                 regs: list[list[int]] | None, reason: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    pre, dec = hand_pair()
    mallory = pre.link._hub.link("mallory")     # type: ignore[attr-defined]
    try:
        with caplog.at_level(logging.DEBUG, logger="kvbridge"):
            pre.handle_frame(raw_hello("mallory", layout, regs))
        refusals = answers(mallory)
        assert len(refusals) == 1 and not refusals[0].accepted, f"{case}: no refusal sent ({refusals})"
        assert reason in refusals[0].reason, refusals[0].reason
        assert not [r for r in caplog.records if r.exc_info], f"{case}: a traceback was logged"
        assert "mallory" not in pre.peers.peers
    finally:
        pre.close()
        dec.close()


def test_a_bad_layout_is_refused_locally_with_the_bound() -> None:
    with pytest.raises(Exception, match=str(MAX_ITEMS)):
        BufferGeometry(name="k", num_items=MAX_ITEMS + 1, item_shape=(1,), dtype=DType.UINT8)
    bufs = tuple(BufferGeometry(name=f"k.{i}", num_items=1, item_shape=(1,), dtype=DType.UINT8)
                 for i in range(MAX_LAYOUT_BUFFERS + 1))
    with pytest.raises(Exception, match=f"at most {MAX_LAYOUT_BUFFERS} buffers"):
        PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1, tp_rank=0,
                   page_size=1)
    with pytest.raises(Exception, match="item_shape"):
        BufferGeometry(name="k", num_items=1, item_shape=(1,) * 40, dtype=DType.UINT8, shard=ShardAxis(0, 1))


# ------------------------------------------------------------------------------------------ 3: early queue in bytes
def heavy_request(dec: TransferAgent, pre: TransferAgent, room: int, pages: int) -> bytes:
    idx = {"kv": PackedIndices.pack(np.zeros(pages, np.int64))}
    return dec.context.codec.encode(TransferRequest(room=room, agent=dec.name, dst_rank=0, dst_size=1, indices=idx),
                                    to=pre.link.address, to_incarnation=pre.incarnation)


def early_bytes(pre: TransferAgent) -> int:
    assert pre.prefill is not None
    return sum(len(p.data) for _, queued in pre.prefill._early.values() for q in queued for p in q.indices.values())


def test_early_requests_are_bounded_in_bytes_and_released_on_abort(caplog: pytest.LogCaptureFixture) -> None:
    """48 authenticated early requests of 1.9 M page ids each raised a prefill's RSS 103 -> 886 MB, which stayed
    after the aborts (the queue was bounded by count only). Here: 12 requests of 250,000 page ids (2 MB each)
    against a 8 MiB bound: the oldest go, each with a logged reason and an answer to the decode (its room
    fails, safe at once); aborting the rest empties the queue."""
    pre, dec = hand_pair(AgentConfig(secret=b"shared"))
    assert pre.prefill is not None
    pre.prefill.early_bytes_limit = 8 << 20
    told: list[Abort] = []
    real = dec.handle_frame

    def spy(frame: bytes) -> None:
        try:
            env = dec.context.codec.open(frame)
        except Exception:  # noqa: BLE001 - the agent's own check says why
            env = None
        if env is not None and isinstance(env.body, Abort) and env.sender == "p0":
            told.append(env.body)
        real(frame)

    dec.handle_frame = spy  # type: ignore[method-assign]
    try:
        receivers = []
        for room in range(100, 112):
            receiver = dec.receiver(room, "inst")
            receiver.send_metadata({"kv": np.zeros(250_000, np.int64)})
            receivers.append(receiver)
        with caplog.at_level(logging.WARNING, logger="kvbridge"):
            for _ in range(20):
                pre.progress()
                dec.progress()
        held = early_bytes(pre)
        print(f"early queue: {len(pre.prefill._early)} rooms, {held / 2**20:.1f} MiB held")
        assert held <= 8 << 20, f"{held} bytes of early page ids held"
        assert len(pre.prefill._early) == 4
        dropped = [r for r in receivers if r.poll() == KVPoll.Failed]
        assert len(dropped) == 8 and {a.room for a in told} == set(range(100, 108))
        assert all("8388608 bytes" in r.failure_reason for r in dropped), dropped[0].failure_reason
        assert all(r.safe_to_reuse for r in dropped)
        logged = [r.getMessage() for r in caplog.records if "before their sender()" in r.getMessage()]
        assert len(logged) >= 1 and "8388608 bytes" in logged[0], logged
        # a single request above the bound is refused at once, never queued
        big = dec.receiver(200, "inst")
        big.send_metadata({"kv": np.zeros(1_100_000, np.int64)})
        for _ in range(20):
            pre.progress()
            dec.progress()
        assert big.poll() == KVPoll.Failed and "8388608 bytes" in big.failure_reason
        assert 200 not in pre.prefill._early
        # aborting the rest releases every byte
        for receiver in receivers[8:]:
            receiver.abort("the engine gave up")
        for _ in range(20):
            pre.progress()
            dec.progress()
        assert not pre.prefill._early and not pre.prefill._early_by_agent
        assert pre.prefill.early_bytes == 0
    finally:
        pre.close()
        dec.close()


def test_handshake_bytes_beyond_the_budget_are_dropped_undecoded() -> None:
    """The budget is taken before decoding: once spent, a Hello is counted and dropped, never decoded."""
    from kvbridge.agent.handshake import HelloBudget

    pre, dec = hand_pair()
    mallory = pre.link._hub.link("mallory")     # type: ignore[attr-defined]
    spy = LockSpy(pre.context.codec, pre.context.lock)
    pre.context.codec = spy
    pre._handshake_bytes = HelloBudget(0.0, 1000.0)
    try:
        hello = raw_hello("mallory", good_layout(num_items=-1), regions())
        assert 500 < len(hello) < 1000
        before = pre.rejected_frames
        pre.handle_frame(hello)                        # within the budget: decoded, refused with an answer
        pre.handle_frame(raw_hello("mallory", good_layout(num_items=-1), regions(), seq=2))
        assert len(spy.hello_decodes) == 1 and pre.rejected_frames == before + 2
        assert len(answers(mallory)) == 1
    finally:
        pre.close()
        dec.close()


def test_a_welcome_the_decode_cannot_use_ends_its_handshake_with_the_reason() -> None:
    hub = LocalHub()
    layout = kv_layout(1, 0)
    dec = TransferAgent(layout=layout, buffers={"kv": kv_buffers(layout)}, role=Role.DECODE, link=hub.link("d0"),
                        name="d0")
    fake = hub.link("p0")
    fake.publish("inst", 1, 0)
    try:
        shake = dec.connect_async("inst", timeout_s=5)
        wait(lambda: bool(fake.recv(0.0)) or (dec.progress() and False), 5)     # our Hello reached "p0"
        body = {"type": "welcome", "version": PROTOCOL_VERSION, "agent": "p0", "address": "p0", "accepted": True,
                "reason": "", "layout": good_layout(num_items=2**40)}
        dec.handle_frame(msgspec.msgpack.encode([PROTOCOL_VERSION, "p0", "p0", 9, dec.incarnation, 1, body]))
        refused = shake.refused
        assert refused is not None and str(MAX_ITEMS) in refused.reason, refused
        assert "sent a Welcome we cannot use" in refused.reason
    finally:
        dec.close()

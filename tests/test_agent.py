"""Sender/Receiver over the in-process hub: completion, chunking, abort quiescence, bad input, handshake."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, Receiver, Sender, TransferAgent
from kvbridge.agent.peers import HandshakeState
from kvbridge.errors import GeometryError, IncompatiblePeer, KVBridgeError, TransferError
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Codec,
    KVPoll,
    Notice,
    PackedIndices,
    Role,
    TransferRequest,
)
from kvbridge.testkit import reference as ref

H, D, P, LAYERS, NUM_PAGES = 4, 8, 4, 2, 16
SPEC = ref.KVSpec(ref.TOKEN_MAJOR, total_heads=H, page_size=P, head_bytes=D * 2)


def kv_layout(tp: int, rank: int, *, page_size: int = P, heads: int = H, model: str = "m") -> PoolLayout:
    local = len(ref.units_held(heads, tp, rank))
    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=NUM_PAGES, item_shape=(page_size, local, D),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, heads))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp,
                      tp_rank=rank, page_size=page_size, model=model)


def kv_buffers(layout: PoolLayout) -> list[np.ndarray]:
    return [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]


@dataclass
class Pair:
    hub: LocalHub
    prefill: list[TransferAgent]
    decode: list[TransferAgent]
    src: list[list[np.ndarray]]
    dst: list[list[np.ndarray]]

    def close(self) -> None:
        for agent in self.prefill + self.decode:
            agent.close()


def spin(*agents: TransferAgent, steps: int = 50) -> None:
    """``steps`` rounds of one ``progress()`` per agent, in order (hand-driven pairs, no threads)."""
    for _ in range(steps):
        for agent in agents:
            agent.progress()


def hand_pair(config: AgentConfig | None = None, *, threads: bool = False) -> tuple[TransferAgent, TransferAgent]:
    """One prefill rank ("p0", instance "inst") and one decode rank ("d0") over an in-process link, connected;
    driven by hand (``progress()``) unless ``threads``. The caller closes both."""
    hub = LocalHub()
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=config, name="p0")
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                        link=hub.link("d0"), config=config, name="d0")
    if threads:
        pre.start()
        dec.start()
        dec.connect("inst", timeout_s=10)
        return pre, dec
    shake = dec.connect_async("inst")
    for _ in range(2000):
        pre.progress()
        dec.progress()
        if shake.done:
            break
    assert shake.done, "the in-process handshake did not complete"
    return pre, dec


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(pt: int, dt: int, *, config: AgentConfig | None = None, connect: bool = True) -> Pair:
        hub = LocalHub()
        src = [kv_buffers(kv_layout(pt, r)) for r in range(pt)]
        dst = [kv_buffers(kv_layout(dt, r)) for r in range(dt)]
        pre = [TransferAgent(layout=kv_layout(pt, r), buffers={"kv": src[r]}, role=Role.PREFILL,
                             link=hub.link(f"p{r}"), instance="inst", config=config) for r in range(pt)]
        dec = [TransferAgent(layout=kv_layout(dt, r), buffers={"kv": dst[r]}, role=Role.DECODE,
                             link=hub.link(f"d{r}"), config=config) for r in range(dt)]
        for a in pre:
            a.start()
        if connect:
            for d in dec:
                d.connect("inst", timeout_s=5)
        pair = Pair(hub, pre, dec, src, dst)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def wait(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def fill(pair: Pair, pt: int, seed: int, pages: np.ndarray, positions: np.ndarray) -> None:
    for r in range(pt):
        for b, buf in enumerate(pair.src[r]):
            ref.fill_source(buf, SPEC, seed, b % LAYERS, b // LAYERS, pt, r, pages, positions)


def check(pair: Pair, dt: int, seed: int, pages: np.ndarray, positions: np.ndarray) -> None:
    for r in range(dt):
        for b, buf in enumerate(pair.dst[r]):
            want = ref.expected_pages(SPEC, seed, b % LAYERS, b // LAYERS, dt, r, positions)
            got = buf.reshape(NUM_PAGES, *SPEC.local_page_shape(dt))[pages]
            assert np.array_equal(got, want), f"decode rank {r} buffer {b} differs"


def start_room(pair: Pair, room: int, dst_pages: np.ndarray, **kw: object) -> tuple[list[Sender], list[Receiver]]:
    receivers = [d.receiver(room, "inst") for d in pair.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages}, **kw)  # type: ignore[arg-type]
    senders = [a.sender(room) for a in pair.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    return senders, receivers


@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 4), (8, 2), (1, 8)])
def test_chunked_transfer_is_byte_exact_and_completes_once(make_pair: Callable[..., Pair], pt: int, dt: int) -> None:
    pair = make_pair(pt, dt)
    src_pages, dst_pages = np.array([3, 9, 4, 11, 5]), np.array([14, 2, 7, 1, 8])
    positions = np.arange(5)
    fill(pair, pt, 42, src_pages, positions)
    senders, receivers = start_room(pair, 77, dst_pages)
    assert all(r.poll() == KVPoll.WaitingForInput for r in receivers)
    for s in senders:
        s.send(src_pages[:2])
    assert all(r.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring) for r in receivers)
    for s in senders:
        s.send(src_pages[2:], last=True)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))
    wait(lambda: all(s.poll() == KVPoll.Success for s in senders))
    check(pair, dt, 42, dst_pages, positions)
    assert all(s.safe_to_reuse for s in senders) and all(r.safe_to_reuse for r in receivers)
    assert sum(r.nbytes for r in receivers) == sum(s.stats[0] for s in senders)


def test_empty_last_chunk_completes_a_full_prefix_hit(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(2, 2)
    senders, receivers = start_room(pair, 5, np.zeros(0, np.int64), prefix_len=3 * P)
    assert senders[0].decode_prefix_len == 3 * P
    for s in senders:
        s.send(np.zeros(0, np.int64), last=True)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))


def _as_peer(sender: TransferAgent, recipient: TransferAgent, message: object) -> bytes:
    """A frame exactly as ``sender`` would encode it for ``recipient`` (a participant's own words)."""
    return sender.context.codec.encode(message, to=recipient.link.address,  # type: ignore[arg-type]
                                       to_incarnation=recipient.incarnation)


def test_duplicate_late_and_short_notices_never_make_success(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    senders, receivers = start_room(pair, 9, np.array([1, 2]))
    pre, dec = pair.prefill[0], pair.decode[0]
    # a "last" notice for chunk 1 that names no items must not complete the room: chunk 0 is missing
    dec.handle_frame(_as_peer(pre, dec, Notice(room=9, sender=0, component="kv", chunk=1, last=True)))
    assert receivers[0].poll() == KVPoll.Transferring
    senders[0].send(np.array([3]))
    # every chunk 0..last arrived, but item 1 was never named: coverage, not counting, decides
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "prefill rank 0 sent 1 of 2 kv items" in receivers[0].failure_reason
    receivers[0].clear()
    dec.handle_frame(_as_peer(pre, dec, Notice(room=9, sender=0, component="kv", chunk=0, last=True)))  # late
    with pytest.raises(KVBridgeError, match="cleared"):
        receivers[0].poll()


def test_a_duplicate_notice_is_counted_once(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    senders, receivers = start_room(pair, 8, np.array([1, 2]))
    pre, dec = pair.prefill[0], pair.decode[0]
    senders[0].send(np.array([3]))
    wait(lambda: receivers[0].poll() == KVPoll.Transferring)
    again = Notice(room=8, sender=0, component="kv", chunk=0, last=False, first=0, count=1)
    dec.handle_frame(_as_peer(pre, dec, again))
    assert receivers[0].poll() == KVPoll.Transferring
    senders[0].send(np.array([4]), last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success)


def test_decode_abort_waits_for_sender_quiescence(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(2, 1)
    senders, receivers = start_room(pair, 11, np.array([1, 2, 3]))
    senders[0].send(np.array([4]))
    receivers[0].abort("client went away")
    assert receivers[0].poll() == KVPoll.Failed
    assert "client went away" in receivers[0].failure_reason
    wait(lambda: receivers[0].safe_to_reuse)      # both prefill ranks confirmed: nothing in flight
    wait(lambda: all(s.poll() == KVPoll.Failed for s in senders))
    with pytest.raises(TransferError, match="aborted by decode"):
        senders[1].send(np.array([5]), last=True)
    assert all(s.safe_to_reuse for s in senders)


def test_prefill_abort_fails_the_receiver_and_confirms(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 2)
    senders, receivers = start_room(pair, 12, np.array([1, 2]))
    senders[0].abort("prefill OOM")
    wait(lambda: all(r.poll() == KVPoll.Failed for r in receivers))
    assert all("prefill OOM" in r.failure_reason for r in receivers)
    wait(lambda: all(r.safe_to_reuse for r in receivers))
    assert senders[0].poll() == KVPoll.Failed       # sticky
    with pytest.raises(TransferError):
        senders[0].send(np.array([1]), last=True)


def test_abort_before_the_sender_exists_fails_it_on_arrival(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    receiver = pair.decode[0].receiver(13, "inst")
    receiver.send_metadata({"kv": np.array([1])})
    receiver.abort("cancelled early")
    wait(lambda: receiver.safe_to_reuse)
    sender = pair.prefill[0].sender(13)
    assert sender.poll() == KVPoll.Failed
    assert "cancelled early" in sender.failure_reason


def test_out_of_range_destination_from_peer_is_refused_before_any_write(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    pre, dec = pair.prefill[0], pair.decode[0]
    sender = pre.sender(21)
    forged = TransferRequest(room=21, agent=dec.name, dst_rank=0, dst_size=1,
                             indices={"kv": PackedIndices.pack(np.array([1, NUM_PAGES + 5]))})
    pre.handle_frame(_as_peer(dec, pre, forged))
    assert sender.poll() == KVPoll.Failed            # the bad request fails the room, with the reason
    assert "outside [0, 16)" in sender.failure_reason
    with pytest.raises(TransferError):
        sender.send(np.array([1, 2]), last=True)
    assert all(not np.any(b) for b in pair.dst[0])    # nothing written


def test_bad_source_indices_raise_and_fail_the_room(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    senders, receivers = start_room(pair, 22, np.array([1, 2]))
    with pytest.raises(GeometryError, match="outside"):
        senders[0].send(np.array([1, NUM_PAGES]), last=True)
    assert senders[0].poll() == KVPoll.Failed
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    with pytest.raises(GeometryError, match="prefill sends items up to 3"):
        pair2 = make_pair(1, 1)
        s2, _ = start_room(pair2, 23, np.array([1, 2]))
        s2[0].send(np.array([1, 2, 3]), last=True)


def test_receiver_validates_its_own_indices(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    receiver = pair.decode[0].receiver(30, "inst")
    with pytest.raises(GeometryError, match="outside"):
        receiver.send_metadata({"kv": np.array([-1])})
    with pytest.raises(GeometryError, match="no destination indices"):
        receiver.send_metadata({})


@pytest.mark.parametrize("change, reason", [
    (dict(heads=8), "sharding"),
    (dict(model="other"), "model differs"),
])
def test_incompatible_peer_is_refused_with_the_reason(change: dict, reason: str) -> None:
    hub = LocalHub()
    p_layout, d_layout = kv_layout(1, 0), kv_layout(1, 0, **change)
    with TransferAgent(layout=p_layout, buffers={"kv": kv_buffers(p_layout)}, role=Role.PREFILL,
                       link=hub.link("p"), instance="i") as pre, \
         TransferAgent(layout=d_layout, buffers={"kv": kv_buffers(d_layout)}, role=Role.DECODE,
                       link=hub.link("d")) as dec:
        pre.start()
        with pytest.raises(IncompatiblePeer, match=reason):
            dec.connect("i", timeout_s=5)


def test_hmac_rejects_unauthenticated_frames(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1, config=AgentConfig(secret=b"s3cret"))
    senders, receivers = start_room(pair, 40, np.array([1]))
    dec = pair.decode[0]
    before = dec.rejected_frames
    notice = Notice(room=40, sender=0, component="kv", chunk=0, last=True, count=1)
    dec.handle_frame(Codec().encode(notice, to=dec.link.address, to_incarnation=dec.incarnation))     # no MAC
    dec.handle_frame(Codec(b"wrong").encode(notice, to=dec.link.address, to_incarnation=dec.incarnation))
    assert dec.rejected_frames == before + 2
    assert receivers[0].poll() == KVPoll.WaitingForInput
    senders[0].send(np.array([2]), last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success)


def test_malformed_frames_are_rejected_and_the_agent_keeps_working(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1)
    dec = pair.decode[0]
    for junk in (b"", b"\x00\x01", b"\x92\x07\xc0", b"\x92\x01\x81\xa4type\xa6nosuch", b"\xff" * 100):
        dec.handle_frame(junk)
    assert dec.rejected_frames == 5
    senders, receivers = start_room(pair, 41, np.array([1]))
    senders[0].send(np.array([2]), last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success)


def test_waiting_timeout_fails_and_asks_the_sender_to_stop(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1, config=AgentConfig(waiting_timeout_s=0.2))
    senders, receivers = start_room(pair, 50, np.array([1, 2]))
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "waiting timeout" in receivers[0].failure_reason
    wait(lambda: senders[0].poll() == KVPoll.Failed)
    wait(lambda: receivers[0].safe_to_reuse)


def test_bootstrap_timeout_fails_a_sender_nobody_asked_for(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1, config=AgentConfig(bootstrap_timeout_s=0.2))
    sender = pair.prefill[0].sender(60)
    wait(lambda: sender.poll() == KVPoll.Failed)
    assert "bootstrap timeout" in sender.failure_reason


def test_silent_peer_fails_its_rooms_within_the_bound(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1, config=AgentConfig(peer_timeout_s=0.3, heartbeat_interval_s=0.05))
    senders, receivers = start_room(pair, 70, np.array([1, 2]))
    pair.prefill[0]._stop.set()                     # the prefill stops answering (its thread ends)
    pair.prefill[0].link.close()
    started = time.monotonic()
    wait(lambda: receivers[0].poll() == KVPoll.Failed, timeout_s=3)
    assert time.monotonic() - started < 1.5
    assert "no message" in receivers[0].failure_reason
    # silence proves nothing (a stopped process resumes and writes): not reusable until the writer is gone
    for _ in range(20):
        assert not receivers[0].safe_to_reuse
        time.sleep(0.01)
    pair.prefill[0].backend.close()                 # now the engine can prove it: no writer is left
    wait(lambda: receivers[0].safe_to_reuse, timeout_s=3)


def test_status_order_supports_min_reduction() -> None:
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput < KVPoll.Transferring < KVPoll.Success
    assert min(KVPoll.Success, KVPoll.Failed) is KVPoll.Failed


# a newer decode; an older one than the oldest release this one speaks (4)
@pytest.mark.parametrize("delta", [1, MIN_PROTOCOL_VERSION - 1 - PROTOCOL_VERSION])
def test_peer_of_another_protocol_version_is_refused_with_both_versions(make_pair: Callable[..., Pair],
                                                                        delta: int) -> None:
    import msgspec

    from kvbridge.protocol import wire

    pair = make_pair(1, 1, connect=False)
    dec = pair.decode[0]
    hello = dec.peers.hello()
    raw = msgspec.msgpack.decode(dec.context.codec.encode(hello, to=""))
    raw[0] = wire.PROTOCOL_VERSION + delta
    future_hello = msgspec.msgpack.encode(raw)
    info = dec.link.lookup("inst")
    assert info is not None
    with dec.context.lock:
        shake = dec.peers.begin("inst", dict(info.addresses), [0])
    target = shake.targets[info.addresses[0]]
    dec.link.send(info.addresses[0], future_hello)
    wait(lambda: (dec.progress(), target.state)[1] is not HandshakeState.WAITING)
    assert target.state is HandshakeState.REFUSED
    assert target.reason == (
        f"prefill {pair.prefill[0].name} refused the handshake: protocol version differs: "
        f"prefill speaks {wire.MIN_PROTOCOL_VERSION} to {wire.PROTOCOL_VERSION}, "
        f"decode {wire.PROTOCOL_VERSION + delta}")


@pytest.mark.parametrize("staging_bytes", [0, 1 << 20])
def test_staging_collapses_token_rows_into_one_write_per_chunk(make_pair: Callable[..., Pair],
                                                                staging_bytes: int) -> None:
    pair = make_pair(2, 1, config=AgentConfig(staging_bytes=staging_bytes))
    src_pages, dst_pages = np.array([3, 9, 4, 11]), np.array([14, 2, 7, 1])
    fill(pair, 2, 5, src_pages, np.arange(4))
    senders, receivers = start_room(pair, 90, dst_pages)
    for s in senders:
        s.send(src_pages[:3])
        s.send(src_pages[3:], last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success)
    check(pair, 1, 5, dst_pages, np.arange(4))
    descriptors = [s.stats[1] for s in senders]
    if staging_bytes:
        assert descriptors == [2, 2]                     # one write per chunk per sender
        assert pair.decode[0].staging is not None
        receivers[0].clear()
        assert pair.decode[0].staging.free_bytes == staging_bytes   # reservations handed back
    else:
        assert descriptors == [4 * P * 2 * LAYERS] * 2   # one run per token row per buffer


def test_a_long_send_does_not_make_a_live_rank_look_dead(make_pair: Callable[..., Pair]) -> None:
    """Heartbeats do not queue behind the agent lock (seen on GPU: a send of 1.4M descriptors held it for
    seconds and the decode declared a live prefill dead)."""
    pair = make_pair(1, 1, config=AgentConfig(peer_timeout_s=0.5, heartbeat_interval_s=0.05))
    senders, receivers = start_room(pair, 95, np.array([1, 2]))
    pre = pair.prefill[0]
    with pre.context.lock:                      # what a multi-second send_component looks like from outside
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert receivers[0].poll() != KVPoll.Failed, receivers[0].failure_reason
            time.sleep(0.01)
    senders[0].send(np.array([3, 4]), last=True)
    wait(lambda: receivers[0].poll() == KVPoll.Success)


def test_notices_the_engine_could_not_deliver_go_over_the_link() -> None:
    from dataclasses import dataclass

    from kvbridge.backends.loopback import LoopbackBackend
    from kvbridge.plugin import hookimpl
    from kvbridge.registry import Registry
    from kvbridge.specs import BackendSpec, Capability

    @dataclass(frozen=True)
    class Failure:
        peer: str
        notice: bytes

    class Lossy(LoopbackBackend):
        """Accepts every notice, delivers none, and reports them as undeliverable."""

        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)  # type: ignore[arg-type]
            self.failed: list[Failure] = []

        def notify_completion(self, peer_id: str, notice: bytes) -> bool:
            self.failed.append(Failure(peer_id, notice))
            return True

        def drain_notify_failures(self) -> list[Failure]:
            out, self.failed = self.failed, []
            return out

    class Plugin:
        @hookimpl
        def kvbridge_transfer_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="lossy", factory=Lossy, capabilities=frozenset(
                {Capability.HOST_MEMORY, Capability.WRITER_GONE, Capability.NOTIFY_FAILURES}))]

    import kvbridge.state.kv

    registry = Registry.build(entry_points=False, plugins=[kvbridge.state.kv, Plugin()])
    hub = LocalHub()
    pl, dl = kv_layout(1, 0), kv_layout(1, 0)
    with TransferAgent(layout=pl, buffers={"kv": kv_buffers(pl)}, role=Role.PREFILL, link=hub.link("p"),
                       instance="i", backend="lossy", registry=registry) as pre, \
         TransferAgent(layout=dl, buffers={"kv": kv_buffers(dl)}, role=Role.DECODE, link=hub.link("d"),
                       backend="lossy", registry=registry) as dec:
        pre.start()
        dec.connect("i", timeout_s=5)
        receiver = dec.receiver(7, "i")
        receiver.send_metadata({"kv": np.array([1, 2])})
        sender = pre.sender(7)
        wait(lambda: sender.poll() >= KVPoll.WaitingForInput)
        sender.send(np.array([3, 4]), last=True)
        wait(lambda: receiver.poll() == KVPoll.Success)


def test_declare_gone_fences_a_silent_writer_the_backend_cannot_prove_dead(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(1, 1, config=AgentConfig(peer_timeout_s=0.3, heartbeat_interval_s=0.05))
    senders, receivers = start_room(pair, 71, np.array([1, 2]))
    pre, dec = pair.prefill[0], pair.decode[0]
    pre._stop.set()                                 # silent, but its backend (and process) still exist
    pre.link.close()
    wait(lambda: receivers[0].poll() == KVPoll.Failed, timeout_s=3)
    assert not receivers[0].safe_to_reuse
    dec.declare_gone(pre.name)                      # the orchestrator's word: that pod is gone
    wait(lambda: receivers[0].safe_to_reuse, timeout_s=3)


# ------------------------------------------------------------------ a request after its room ended
# A decode request that reaches a prefill rank after that rank's room ended without it (its bootstrap timeout ran
# out while the decode was still starting: the host NIXL demo's hang, TP 2 -> 2, ~1 in 10 runs under load) must
# fail the decode's room at once, with the reason, and leave it safe to reuse; it used to be dropped in silence,
# and the decode waited for data that never came (waiting_timeout_s, 120 s: longer than the demo's run timeout).
LATE_CONFIG = AgentConfig(bootstrap_timeout_s=0.2, waiting_timeout_s=60.0)


@pytest.mark.parametrize("cleared", [True, False], ids=["sender-cleared", "sender-failed"])
def test_a_request_after_the_prefill_room_timed_out_fails_the_decode_room(make_pair: Callable[..., Pair],
                                                                          cleared: bool) -> None:
    pair = make_pair(1, 1, config=LATE_CONFIG)
    sender = pair.prefill[0].sender(91)                  # the prefill rank is up first and opens its room ...
    wait(lambda: sender.poll() == KVPoll.Failed)          # ... whose bootstrap timeout runs out: nobody asked
    assert "bootstrap timeout" in sender.failure_reason
    if cleared:
        assert sender.safe_to_reuse
        sender.clear()                                    # what the demo does next (the room is tombstoned)
    receiver = pair.decode[0].receiver(91, "inst")       # the late decode asks for it now
    receiver.send_metadata({"kv": np.array([1, 2])})
    wait(lambda: receiver.poll() == KVPoll.Failed, timeout_s=5.0)   # before the fix: WaitingForInput for 60 s
    assert "after the room ended" in receiver.failure_reason
    wait(lambda: receiver.safe_to_reuse, timeout_s=5.0)   # nothing was written for it: reusable at once
    if not cleared:
        assert sender.poll() == KVPoll.Failed


def test_a_request_whose_sender_never_comes_fails_the_decode_room(make_pair: Callable[..., Pair]) -> None:
    """The prefill engine never opens the room (the router sent the decode a request the prefill dropped): after
    the bootstrap timeout the decode hears it, instead of waiting out its waiting timeout."""
    pair = make_pair(1, 1, config=LATE_CONFIG)
    receiver = pair.decode[0].receiver(92, "inst")
    receiver.send_metadata({"kv": np.array([1, 2])})
    wait(lambda: receiver.poll() == KVPoll.Failed, timeout_s=5.0)
    assert "no sender() for it" in receiver.failure_reason
    wait(lambda: receiver.safe_to_reuse, timeout_s=5.0)
    sender = pair.prefill[0].sender(92)                  # the engine opens it after all: it fails at once
    assert sender.poll() == KVPoll.Failed and "bootstrap timeout" in sender.failure_reason

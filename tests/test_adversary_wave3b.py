"""Adversarial review, wave 3 (second pass): fault combinations against the fence, the retry of a room
number, and the protocol-version handshake (issue 26 item 10). Each test reproduces what broke before its fix."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from test_agent import hand_pair, kv_buffers, kv_layout, spin  # the agent tests' small dense-KV pool

from kvbridge import local_secret
from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.links import LocalHub
from kvbridge.protocol import wire
from kvbridge.protocol.wire import Abort, Codec, KVPoll, Role, Welcome

PAGES = np.array([1, 2, 3], np.int64)


class Held:
    """Frames to one address of an in-process hub, held while ``on`` and handed over one by one."""

    def __init__(self, hub: LocalHub, address: str) -> None:
        self.on, self.frames, self._address = False, [], address
        self._deliver: Callable[[str, bytes], None] = hub._deliver
        hub._deliver = self._intercept         # type: ignore[method-assign]

    def _intercept(self, address: str, frame: bytes) -> None:
        if self.on and address == self._address:
            self.frames.append(frame)
        else:
            self._deliver(address, frame)

    def release(self, count: int | None = None) -> None:
        take = self.frames if count is None else self.frames[:count]
        self.frames = [] if count is None else self.frames[count:]
        for frame in take:
            self._deliver(self._address, frame)


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    # writes straight into the KV pages (no staging), so a late write shows in the pages themselves
    pre, dec = hand_pair(AgentConfig(peer_timeout_s=30.0, heartbeat_interval_s=0.02, staging="never"))
    yield pre, dec
    pre.close()
    dec.close()


def _spin(*agents: TransferAgent, steps: int = 20) -> None:
    spin(*agents, steps=steps)


def test_a_late_acknowledgement_of_a_failed_request_does_not_fence_its_retry(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    """A request that fails and is retried under the same room number (a router's retry keeps its
    kv_transfer_params). The decode asks its writer to acknowledge the abort more than once (at the failure,
    then every heartbeat interval); the prefill, its room already cleared, answers each. The first answer fences
    the first request; one still on its way when the retry's request went out used to fail the retry and fence it
    at once: the decode reported safe_to_reuse (and sent the prefill no abort) while the prefill, holding the
    retry's request, wrote all of it into the decode's pages."""
    pre, dec = pair
    held = Held(dec.context.link._hub, "d0")   # type: ignore[attr-defined]
    first_send, first_recv = pre.sender(1), dec.receiver(1, "inst")
    first_recv.send_metadata({"kv": PAGES})
    _spin(pre, dec)
    assert first_send.poll() is KVPoll.WaitingForInput

    held.on = True                              # the prefill's answers to the decode are slow
    first_recv.abort("the engine gave up on it")
    for _ in range(4):                          # the decode asks again every heartbeat interval
        dec.progress()
        time.sleep(0.03)
        dec.progress()
        pre.progress()
        if pre.prefill is not None and 1 in pre.prefill.rooms and first_send.safe_to_reuse:
            first_send.clear()                  # the prefill engine is done with it: later aborts get answers at once
    pre.progress()
    while held.frames and not first_recv.safe_to_reuse:
        held.release(1)
        dec.progress()
    assert first_recv.safe_to_reuse and held.frames, "the scenario needs an acknowledgement still on its way"
    first_recv.clear()

    retry_send, retry_recv = pre.sender(1), dec.receiver(1, "inst")   # the retry, same room number
    retry_recv.send_metadata({"kv": PAGES})
    pre.progress()
    assert retry_send.poll() is KVPoll.WaitingForInput
    held.release()                              # the late acknowledgements of the first request arrive
    held.on = False
    dec.progress()
    assert retry_recv.poll() is not KVPoll.Failed, retry_recv.failure_reason
    assert not retry_recv.safe_to_reuse

    for buf in pre.context.buffers.views["kv"]:
        buf[PAGES] = 0xAB
    retry_send.send(PAGES, last=True)
    _spin(pre, dec)
    assert retry_send.poll() is KVPoll.Success
    assert retry_recv.poll() is KVPoll.Success
    assert all((buf[PAGES] == 0xAB).all() for buf in dec.context.buffers.views["kv"])


def test_a_late_notice_of_a_failed_request_does_not_count_for_its_retry(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    """The backend carries a notice and is slow to deliver it (NIXL: with the write; the control link may
    overtake it). The decode gives up on the request, the prefill acknowledges the abort (its write is done), and
    the engine retries the room number with the same prefill. The first request's notice, delivered now, named
    every item with ``last``: it used to complete the retry at once, Success over the first request's bytes,
    while the prefill had not written a byte of the retry (it was still WaitingForInput)."""
    pre, dec = pair
    late: list[bytes] = []
    calls = pre.context.calls
    carry = calls.notify_completion
    calls.notify_completion = lambda agent, frame: late.append(frame) is None    # type: ignore[method-assign]
    first_send, first_recv = pre.sender(1), dec.receiver(1, "inst")
    first_recv.send_metadata({"kv": PAGES})
    _spin(pre, dec)
    for buf in pre.context.buffers.views["kv"]:
        buf[PAGES] = 0xAA
    first_send.send(PAGES, last=True)
    _spin(pre, dec)
    assert first_send.poll() is KVPoll.Success and late, "the backend took the notice"
    first_recv.abort("no notice within the engine's patience")
    _spin(pre, dec)
    assert first_recv.poll() is KVPoll.Failed and first_recv.safe_to_reuse
    first_recv.clear()
    first_send.clear()
    calls.notify_completion = carry             # type: ignore[method-assign]

    retry_send, retry_recv = pre.sender(1), dec.receiver(1, "inst")
    retry_recv.send_metadata({"kv": PAGES})
    _spin(pre, dec)
    assert retry_send.poll() is KVPoll.WaitingForInput
    for frame in late:                          # the backend delivers the first request's notice now
        dec.handle_frame(frame)
    _spin(pre, dec)
    assert retry_recv.poll() is KVPoll.WaitingForInput, "a notice of the earlier request counted for the retry"

    for buf in pre.context.buffers.views["kv"]:
        buf[PAGES] = 0xBB
    retry_send.send(PAGES, last=True)
    _spin(pre, dec)
    assert retry_send.poll() is KVPoll.Success and retry_recv.poll() is KVPoll.Success
    assert all((buf[PAGES] == 0xBB).all() for buf in dec.context.buffers.views["kv"])


def test_a_replayed_refusal_of_the_previous_release_does_not_downgrade_two_new_agents() -> None:
    """With a secret, a forged refusal in 5 is impossible, but a genuine one can be replayed: a prefill of the
    previous release refused a decode's Hello in 6 (to incarnation 0, as it cannot read the Hello); both are
    upgraded and restarted at the same addresses (fresh replay windows), and the captured refusal reaches the new
    decode while its first Hello is lost. It used to fall back to 5 for good: no liveness proof for that pair.
    Now the prefill's accepted Welcome in 5 says it speaks 6, and the decode says Hello again in 6."""
    secret = b"s" * 32
    cfg = AgentConfig(secret=secret, peer_timeout_s=30.0)
    old_p0 = Codec(secret, sender="p0", address="p0", incarnation=0x1234567)
    captured = old_p0.encode(Welcome(version=5, agent="p0", address="p0", accepted=False,
                                     reason="protocol version differs: prefill speaks 5, decode 6"), to="d0", version=5)
    hub = LocalHub()
    pre = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.PREFILL,
                        link=hub.link("p0"), instance="inst", config=cfg, name="p0")
    dec = TransferAgent(layout=kv_layout(1, 0), buffers={"kv": kv_buffers(kv_layout(1, 0))}, role=Role.DECODE,
                        link=hub.link("d0"), config=cfg, name="d0")
    deliver, lost = hub._deliver, []

    def replay_instead_of_the_first_hello(address: str, frame: bytes) -> None:
        if address == "p0" and not lost:
            lost.append(frame)
            dec.handle_frame(captured)
            return
        deliver(address, frame)

    hub._deliver = replay_instead_of_the_first_hello     # type: ignore[method-assign]
    try:
        shake = dec.connect_async("inst")
        for _ in range(3000):
            pre.progress()
            dec.progress()
            if shake.done or shake.refused is not None:
                break
            time.sleep(0.001)
        assert lost and shake.done, shake.refused
        newest = wire.PROTOCOL_VERSION
        assert dec.peer_versions() == {"p0": newest} and pre.peer_versions() == {"d0": newest}, "the pair fell back"
        assert dec.peers.liveness is not None and dec.peers.liveness._keys, "no liveness connection to the writer"
    finally:
        pre.close()
        dec.close()


def test_a_prefill_of_this_release_notes_its_version_only_where_it_answers_in_an_older_one() -> None:
    """The note rides in the reason of an accepted Welcome, which protocol 5 leaves unread; a Welcome in 6 has
    none, and a refusal's reason is never taken for one."""
    assert wire.noted_version(wire.speaks_note()) == wire.PROTOCOL_VERSION
    assert wire.noted_version("") == 0 and wire.noted_version("this prefill speaks protocol x") == 0
    assert wire.noted_version("this prefill speaks protocol 99999999999") == 0


def test_a_local_secret_file_with_a_nul_byte_is_refused_naming_that(tmp_path: Path) -> None:
    """A corrupt file of 41 characters, one of them NUL, used to be refused as holding "41 characters, fewer than
    32": a message naming the wrong problem."""
    path = tmp_path / "kv" / "secret"
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"a" * 40 + b"\0")
    path.chmod(0o600)
    with pytest.raises(local_secret.LocalSecretError, match="holds a NUL byte") as err:
        local_secret.read_or_create(path)
    assert "fewer than" not in str(err.value)


def test_a_replayed_hello_of_an_earlier_decode_incarnation_retires_the_live_one() -> None:
    """DOCUMENTS (docs/integrity.md, Version skew): a Hello names recipient incarnation 0, so with a secret one
    captured from an earlier incarnation of a decode is accepted by a prefill that never saw it (restarted: replay
    windows are per process). The prefill takes it for a restart, retires the live incarnation and fails its
    rooms; the live decode drops the Welcome meant for its predecessor and hears of it only at its peer timeout.
    Availability only: nothing is written anywhere."""
    secret = b"s" * 32
    pre, dec = hand_pair(AgentConfig(secret=secret, peer_timeout_s=30.0))
    try:
        captured = Codec(secret, sender="d0", address="d0", incarnation=0xABCDEF).encode(dec.peers.hello(), to="p0")
        sender, receiver = pre.sender(5), dec.receiver(5, "inst")
        receiver.send_metadata({"kv": PAGES})
        _spin(pre, dec)
        assert sender.poll() is KVPoll.WaitingForInput
        pre.handle_frame(captured)
        _spin(pre, dec)
        assert sender.poll() is KVPoll.Failed and "restarted as incarnation 0xabcdef" in sender.failure_reason
        assert pre.peers.peers["d0"].incarnation == 0xABCDEF != dec.incarnation
        assert receiver.poll() is KVPoll.WaitingForInput       # not told: it waits for its peer timeout
    finally:
        pre.close()
        dec.close()


def test_an_abort_naming_another_request_of_the_room_is_acknowledged_and_fails_nothing(
        pair: tuple[TransferAgent, TransferAgent]) -> None:
    """An abort of another request of this room number (an earlier one; a restarted decode's) is answered
    at once with an acknowledgement naming that request, which is true (nothing of it is in flight here), and
    the room's own request goes on."""
    pre, dec = pair
    sender, receiver = pre.sender(3), dec.receiver(3, "inst")
    receiver.send_metadata({"kv": PAGES})
    _spin(pre, dec)
    assert dec.decode is not None
    nonce = dec.decode.rooms[3].nonce
    seen: list[Abort] = []
    on_abort = dec.decode.on_abort
    dec.decode.on_abort = lambda abort, env: (seen.append(abort), on_abort(abort, env))[1]   # type: ignore[method-assign]
    stale = Abort(room=3, agent="d0", reason="an earlier request", nonce=nonce ^ 1)
    pre.handle_frame(dec.context.codec.encode(stale, to="p0", to_incarnation=pre.incarnation))
    _spin(pre, dec)
    assert sender.poll() is KVPoll.WaitingForInput and receiver.poll() is KVPoll.WaitingForInput
    assert [(a.quiesced, a.nonce) for a in seen] == [(True, nonce ^ 1)]

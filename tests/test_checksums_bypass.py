"""Adversarial: checksums cannot be bypassed, old prefills are refused, device buffers are refused, and a
failed verification harms nothing else.

2. A prefill whose notices carry empty, truncated, extra, odd-length or wrong digests while the decode asked
   for them: the room fails at once with a reason naming the digests (not at the waiting timeout).
4. A prefill of the protocol before digests speaks version 4 and is refused at the handshake with both
   versions (``tests/test_agent.py::test_peer_of_another_protocol_version_is_refused_with_both_versions``).
5. A decode with checksums and device buffers: refused at start with a clear error.
6. After a room fails verification, the agents' threads live and the next room succeeds byte-exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_checksums_paths import (
    PLAIN,
    PRE_NO,
    PRE_ST,
    STAGED,
    Planted,
    plant_dst,
    send_all,
    settle,
    start_room,
)
from test_staging_paths import World, check, fill, layout_of, wait, worlds

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent import posting as posting_module
from kvbridge.errors import KVBridgeError
from kvbridge.geometry import DeviceKind, MemoryRegion
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(worlds, name="make_world")
WAITING_S = 5.0      # the decode's waiting timeout, shortened (default 120 s) so its reason shows

FORGERIES: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda d: b"",
    "truncated": lambda d: d[:-4],
    "extra": lambda d: d + b"\1\2\3\4",
    "odd-length": lambda d: d + b"\0",
    "zeros": lambda d: bytes(len(d)),
    "rotated": lambda d: d[4:] + d[:4],
}


@pytest.mark.parametrize("path", ["plain", "staged"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_digests_fail_the_room_at_once(make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch,
                                              forgery: str, path: str) -> None:
    real = posting_module.Poster._digests
    forged: list[bool] = []

    def bent(self: Any, peer: Any, comp_index: int, src_items: np.ndarray, layers: range) -> bytes:
        d = real(self, peer, comp_index, src_items, layers)
        if forged:
            return d
        forged.append(True)
        return FORGERIES[forgery](d)

    monkeypatch.setattr(posting_module.Poster, "_digests", bent)
    pre, dec = (PRE_NO, PLAIN) if path == "plain" else (PRE_ST, STAGED)
    dec = dataclasses.replace(dec, waiting_timeout_s=WAITING_S)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=pre, decode=dec)
    senders, receivers, src_pages, _ = start_room(world, 60, 9)
    send_all(senders, src_pages, "chunks", world.layers)
    states = settle(receivers, 15.0)
    assert forged and states == [KVPoll.Failed], states
    why = receivers[0].failure_reason
    assert ("digests" in why or "checksum mismatch" in why) and "waiting timeout" not in why, why


def test_a_prefill_without_checksums_still_sends_digests(make_world: Callable[..., World]) -> None:
    """Checksums are the decode's option: a prefill that did not turn them on digests every notice."""
    world = make_world("loopback", ref.HEAD_MAJOR, 2, 1, prefill=PRE_NO, decode=PLAIN)
    seen: list[int] = []
    real = world.decode[0].decode.on_notice

    def spy(notice: Any, env: Any) -> None:
        seen.append(len(notice.digests))
        real(notice, env)

    world.decode[0].decode.on_notice = spy      # type: ignore[method-assign]
    senders, receivers, src_pages, dst_pages = start_room(world, 61, 9)
    send_all(senders, src_pages, "chunks", world.layers)
    assert settle(receivers) == [KVPoll.Success], receivers[0].failure_reason
    assert seen and all(n > 0 for n in seen), seen
    check(world, 5, dst_pages)


# ------------------------------------------------------------------------------------------- 5: device buffers
class _FakeCuda:
    """Looks like a CUDA tensor to region_of(); nothing ever reads its (bogus) address."""

    class _Device:
        type, index = "cuda", 0

    device = _Device()

    def __init__(self, nbytes: int) -> None:
        self._n = nbytes

    def data_ptr(self) -> int:
        return 1 << 40

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 1

    def view(self, *shape: Any) -> _FakeCuda:
        return self


def _standin_registry() -> Any:
    from kvbridge.plugin import BackendSpec, hookimpl
    from kvbridge.registry import Registry
    from kvbridge_mori.testing import STANDIN_SPEC

    class _StandIn:
        @hookimpl
        def kvbridge_transfer_backends(self) -> list[BackendSpec]:
            return [STANDIN_SPEC]

    return Registry.build(plugins=[_StandIn()])


@pytest.mark.parametrize("given", ["region", "tensor-like"])
def test_device_buffers_are_refused_with_checksums(given: str) -> None:
    if given == "tensor-like":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("a tensor-like CUDA buffer makes the agent build a CUDA stream: needs CUDA")
    """MoRI stand-in (accepts GPU regions, never touches them at registration): a decode whose buffers are
    CUDA memory, given as MemoryRegion (register() accepts them) or as a tensor-like object."""
    lay = layout_of(ref.TOKEN_MAJOR, 1, 0)
    bufs = [MemoryRegion((1 << 40) + i * (1 << 24), g.num_items * g.item_nbytes, DeviceKind.CUDA, 0)
            if given == "region" else _FakeCuda(g.num_items * g.item_nbytes)
            for i, g in enumerate(lay.components[0].buffers)]
    hub = LocalHub()
    agent = None
    try:
        with pytest.raises(Exception) as caught:
            agent = TransferAgent(layout=lay, buffers={"kv": bufs}, role=Role.DECODE, backend="mori-standin",
                                  registry=_standin_registry(), link=hub.link("d0"),
                                  config=AgentConfig(checksums=True, staging_bytes=0))
        assert isinstance(caught.value, KVBridgeError) and "checksums" in str(caught.value), caught.value
    finally:
        if agent is not None:
            agent.close()


# ------------------------------------------------------------------------------------------- 6: isolation
@pytest.mark.parametrize("path", ["plain", "staged"])
def test_a_failed_verification_harms_no_other_room(make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch,
                                                   path: str) -> None:
    pre, dec = (PRE_NO, PLAIN) if path == "plain" else (PRE_ST, STAGED)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=pre, decode=dec)
    # room 70 is in flight when room 71 fails verification; room 72 starts after it
    s70, r70, p70, d70 = start_room(world, 70, 6, seed=9)
    planted = Planted(71)
    plant_dst(monkeypatch, planted)
    s71, r71, p71, _ = start_room(world, 71, 6, seed=9)
    send_all(s71, p71, "chunks", world.layers)
    assert settle(r71) == [KVPoll.Failed] and "checksum mismatch" in r71[0].failure_reason
    fill(world, 9, p70)                        # room 71 shared some source pages: room 70's bytes again
    send_all(s70, p70, "chunks", world.layers)
    assert settle(r70) == [KVPoll.Success], r70[0].failure_reason
    _check_pages(world, 9, d70)
    s72, r72, p72, d72 = start_room(world, 72, 7, seed=9)
    send_all(s72, p72, "chunks", world.layers)
    assert settle(r72) == [KVPoll.Success], r72[0].failure_reason
    _check_pages(world, 9, d72)
    for agent in world.prefill + world.decode:
        assert agent._thread is not None and agent._thread.is_alive(), agent.name
    assert all(a.rejected_frames == 0 for a in world.prefill + world.decode), \
        [a.rejected_frames for a in world.prefill + world.decode]
    wait(lambda: r71[0].safe_to_reuse, 15)     # the failed room's writers acknowledged the abort


def _check_pages(world: World, seed: int, pages: np.ndarray) -> None:
    """The requested pages hold the reference bytes (other rooms' pages are not looked at)."""
    check(world, seed, pages, others_untouched=False)

"""Checksums on device memory (issue 24 item 4; skipped without CUDA and NIXL): the per-destination digests of
kvbridge.digests computed by torch where the pages live, on the prefill's GPU over exactly the bytes each decode
rank receives and on the decode's GPU over where they landed, staged and plain, across TP sizes; a byte planted
into a landed page on the decode's GPU fails exactly its room (another room in flight succeeds), naming the
buffer and the page. Prefill on cuda:0, decode on cuda:1 when there are two GPUs.

    python scripts/gpu_checksum_cost.py      # what they cost on a 1 GiB request, against raw NIXL
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_gpu_staging
from test_gpu_staging import World, _run, torch, wait

from kvbridge.agent import AgentConfig
from kvbridge.agent import decode as decode_module
from kvbridge.errors import KVBridgeError
from kvbridge.protocol.wire import KVPoll
from kvbridge.testkit import reference as ref

world_fixture = test_gpu_staging.make_world      # the fixture ``make_world`` (prefill cuda:0, decode cuda:1)


def _configs(mode: str) -> tuple[AgentConfig, AgentConfig]:
    prefill = AgentConfig(staging=mode, staging_bytes=64 << 20, staging_piece_bytes=1 << 20)
    decode = AgentConfig(staging=mode, staging_bytes=64 << 20, staging_piece_bytes=1 << 20, checksums=True)
    return prefill, decode


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 2, 1), (ref.TOKEN_MAJOR, 1, 2), (ref.HEAD_MAJOR, 2, 1)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_gpu_pages_verify_by_their_digests(world_fixture: Callable[..., World], kind: str, pt: int, dt: int,
                                           mode: str) -> None:
    prefill, decode = _configs(mode)
    world = world_fixture(kind, pt, dt, prefill, decode)
    receivers = _run(world, 5)
    assert all(r.poll() is KVPoll.Success for r in receivers)


def test_a_byte_planted_on_the_decode_gpu_fails_exactly_its_room(world_fixture: Callable[..., World],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain descriptors, TP 2 -> 1: one byte of a landed page flipped on the decode's GPU before its notice is
    counted; that room fails with a checksum mismatch naming the page, the next room succeeds byte-exact."""
    prefill, decode = _configs("never")
    world = world_fixture(ref.TOKEN_MAJOR, 2, 1, prefill, decode)
    dec = world.decode[0]
    planted: list[int] = []
    real = decode_module.DecodeSide.on_notice

    def corrupt(self: Any, notice: Any, env: Any) -> None:
        if not planted and notice.room == 6 and notice.count:
            room = dec.decode.rooms[notice.room]
            page = int(room.indices["kv"][notice.first])
            peer = dec.peers.get(room.targets[notice.sender])
            layers = range(notice.layer_first, notice.layer_first + max(1, notice.layer_count))
            buffer = next(b for b in dec.decode._plans.sliced_buffers(peer, 0, layers))
            byte = int(dec.decode._plans.run_bytes(peer, 0, buffer, "dst").index[0])
            world.dst[0][buffer].view(torch.uint8).view(world.dst[0][buffer].shape[0], -1)[page, byte] ^= 0x5A
            planted.append(page)
        real(self, notice, env)

    monkeypatch.setattr(decode_module.DecodeSide, "on_notice", corrupt)
    with pytest.raises((AssertionError, KVBridgeError)):
        _run(world, 6)                         # never succeeds: the room fails (a later send() raises its reason)
    receiver = dec.decode.rooms[6]
    wait(lambda: receiver.status is KVPoll.Failed)
    assert "checksum mismatch" in receiver.reason and f"page {planted[0]} " in receiver.reason, receiver.reason
    monkeypatch.undo()
    wait(lambda: dec.decode.safe_to_reuse(6))        # nothing more of room 6 can land: clear what did
    for tensor in world.dst[0]:
        tensor.zero_()
    ok = _run(world, 7)
    assert ok[0].poll() is KVPoll.Success


def test_digests_of_a_gpu_tensor_equal_the_host_ones() -> None:
    from kvbridge.digests import digest_items, run_bytes
    from kvbridge.slicing import Segments

    rng = np.random.default_rng(9)
    host = rng.integers(0, 256, (64, 8192), dtype=np.uint8)
    segs = Segments(np.arange(16, dtype=np.int64) * 512 + 128, np.arange(16, dtype=np.int64) * 256,
                    np.full(16, 256, np.int64))
    runs = run_bytes(segs, "src")
    items = rng.permutation(64)[:40]
    np.testing.assert_array_equal(digest_items(torch.from_numpy(host).to("cuda:0"), items, runs),
                                  digest_items(host, items, runs))

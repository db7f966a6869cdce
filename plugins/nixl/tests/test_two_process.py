"""A prefill process writes into decode ranks of this process over NIXL/UCX (127.0.0.1 only).

The parent registers decode pools, ships their ``PeerInfo`` bytes through a pipe, and checks every byte
against the reference reshard as soon as each rank's notices arrived. The child is always killed.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import time
from collections.abc import Callable

import msgspec
import pytest

from kvbridge.backends.base import PeerInfo
from kvbridge.geometry import Rank

from kvbridge_nixl.backend import NixlBackend
from kvbridge_nixl.testing import (PEER_DEADLINE_S, PeerOrder, Side, decode_pool, expected_decode, full_kv,
                                   prefill_pool, prefill_peer, regions, request_pages, same_bytes)

pytestmark = pytest.mark.multiprocess
Factory = Callable[[str], NixlBackend]
_SECCOMP = platform.system() == "Linux" and platform.machine() == "x86_64"

SCENARIOS = {
    # name: (prefill TP, decode TP, options of the writer, block CMA in the writer)
    "default-ucx": (2, 1, {}, False),
    "cma-blocked": (1, 2, {}, True),                  # UCX 1.23 self-tests CMA and falls back to TCP
    "tcp-pinned": (2, 2, {"ucx_tls": "tcp"}, True),   # the documented fallback
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prefill_process_writes_decode_ranks(backends: Factory, scenario: str) -> None:
    pt, dt, options, block = SCENARIOS[scenario]
    if block and not _SECCOMP:
        pytest.skip("the CMA-blocking seccomp filter needs x86-64 Linux")
    heads, seed, room = 4, 40 + pt * 4 + dt, 77
    full = full_kv(seed, heads)
    dec = [Side(Rank(d, dt), decode_pool(heads, dt, d), heads) for d in range(dt)]
    db = [backends(f"decode-{d}") for d in range(dt)]
    regs = [b.register_buffers("kv", regions(s.pool)) for b, s in zip(db, dec)]
    src_idx, dst_idx = request_pages(seed, 8)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_peer, args=(child, options, block), daemon=True)
    try:
        proc.start()
        infos = [msgspec.msgpack.encode(PeerInfo(f"decode-{d}", db[d].endpoint, (regs[d].remote(),)))
                 for d in range(dt)]
        parent.send_bytes(msgspec.msgpack.encode(PeerOrder(infos, pt, heads, seed, src_idx.tolist(),
                                                           dst_idx.tolist(), room)))
        expected = {d: {(f"prefill-{p}", f"room{room}:{p}->{d}".encode()) for p in writers(pt, dt, d)}
                    for d in range(dt)}
        got: dict[int, set[tuple[str, bytes]]] = {d: set() for d in range(dt)}
        report = None
        end = time.monotonic() + PEER_DEADLINE_S
        while any(not expected[d] <= got[d] for d in range(dt)):
            assert time.monotonic() < end, f"notices missing: {expected} vs {got}; child: {report}"
            if report is None and parent.poll(0):
                report = parent.recv()
                assert report[0] == "sent", report[1]
            for d in range(dt):
                got[d] |= set(db[d].drain_notifications())
            time.sleep(0.001)
        for d in range(dt):   # every notice is in: every byte must be too
            assert same_bytes(dec[d].pool, expected_decode(full, dt, d, src_idx, dst_idx)), (scenario, d)
        if report is None:
            assert parent.poll(PEER_DEADLINE_S), "the prefill process never reported"
            report = parent.recv()
        assert report == ("sent", ["DONE"] * sum(len(e) for e in expected.values())), report
        parent.send("bye")
        assert parent.poll(PEER_DEADLINE_S), "the prefill process did not close its backends"
        status, close_s = parent.recv()
        assert status == "closed", (status, close_s)
    finally:
        proc.join(PEER_DEADLINE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()
        child.close()
        for b, reg in zip(db, regs):
            b.deregister_buffers(reg)
    assert proc.exitcode == 0


def writers(pt: int, dt: int, d: int) -> set[int]:
    """Prefill ranks that write decode rank ``d`` (heads >= both TP sizes, so no replica election)."""
    if pt >= dt:
        return {p for p in range(pt) if p // (pt // dt) == d}
    return {d // (dt // pt)}

"""Hybrid pools (KV + SWA + Mamba) over the MoRI and Ascend stand-ins: byte-exact for hetero TP, and the
fence holds when the engine stalls a write (the seeds' own scenarios, issue 12).

The stand-ins are honest in-process fakes of ``mori.io`` and ``memfabric_hybrid`` (no ROCm or NPU here): they
move bytes with the CPU and keep the engines' completion and failure semantics. Every byte is compared with
the independent reference of ``tests/test_hybrid.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_hybrid as th

from kvbridge.agent import TransferAgent
from kvbridge.plugin import BackendSpec, hookimpl
from kvbridge.protocol.wire import KVPoll
from kvbridge.registry import Registry
from kvbridge_ascend import standin as ascend_standin
from kvbridge_ascend.testing import STANDIN_SPEC as ASCEND_STANDIN
from kvbridge_mori import standin as mori_standin
from kvbridge_mori.testing import STANDIN_SPEC as MORI_STANDIN


class _StandIns:
    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return [MORI_STANDIN, ASCEND_STANDIN]


BACKENDS = ["mori-standin", "ascend-standin"]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.build(plugins=[_StandIns()])


@pytest.fixture
def make_pool(registry: Registry) -> Iterator[Callable[..., th.Hybrid]]:
    made: list[th.Hybrid] = []

    def make(backend: str, pt: int, dt: int) -> th.Hybrid:
        made.append(th.build_hybrid(registry, th.GQA_POOL, pt, dt, backend=backend))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_kv_swa_mamba_pool_over_a_stand_in_is_byte_exact(make_pool: Callable[..., th.Hybrid], backend: str,
                                                         pt: int, dt: int) -> None:
    h = make_pool(backend, pt, dt)
    th.transfer(h, th.request(0, 23, 0, th.P))          # fresh: KV pages 0..5, SWA window 3..5, the Mamba slot
    th.transfer(h, th.request(1, 30, 7, th.P))          # prefix hit: one KV page, the window reaches the prefix
    th.transfer(h, th.request(2, 17, 5, th.P))          # full hit: an empty last chunk, window and slot travel


def _pause(backend: str, agent: TransferAgent) -> Callable[[], None]:
    """Stall every write the engine of ``agent`` posts; return the function that lets them go."""
    engine: Any = agent.backend
    if backend == "mori-standin":
        mori_standin.pause(engine.engine_key)
        return lambda: mori_standin.resume(engine.engine_key)
    ascend_standin.hold(engine.session_id)
    return lambda: ascend_standin.release(engine.session_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_abort_during_a_stalled_write_is_fenced(make_pool: Callable[..., th.Hybrid], backend: str) -> None:
    """The decode gives up on a room whose write the engine stalls: Failed at once, but not safe to reuse
    until the prefill's write ended and it acknowledged; no byte lands after safe_to_reuse."""
    h = make_pool(backend, 1, 1)
    req = th.request(0, 23, 0, th.P)
    src, dst = th.allocate(h, req, 1), th.allocate(h, req, 2)
    for m in h.models:
        m.fill(h.src[0][m.name], 1, 0, req, src[m.name])
    state = {m.name: (src[m.name], m.span(req)[0]) for m in h.models if not m.chunked}
    senders, receivers = th.start(h, req, dst)
    let_go = _pause(backend, h.prefill[0])
    try:
        senders[0].send(src["kv"], last=True, state=state)
        receivers[0].abort("client went away")
        assert receivers[0].poll() is KVPoll.Failed
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:              # the stalled write may still land: not safe
            assert not receivers[0].safe_to_reuse
            time.sleep(0.01)
    finally:
        let_go()
    th.wait(lambda: receivers[0].safe_to_reuse)
    after = {k: [b.copy() for b in v] for k, v in h.dst[0].items()}
    time.sleep(0.3)
    for name, bufs in h.dst[0].items():
        for b, buf in enumerate(bufs):
            assert np.array_equal(buf, after[name][b]), f"{name} buffer {b} changed after safe_to_reuse"
    assert senders[0].poll() is KVPoll.Failed and senders[0].safe_to_reuse

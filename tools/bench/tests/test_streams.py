"""The request streams of ``kvbridge bench transfer --concurrency`` (kvbridge_bench.streams) on an in-process pair:
every request ends, a destination slot is handed out again only after its room is safe to reuse, and the bytes
of the last request of each slot are the source's."""

from __future__ import annotations

import time

import numpy as np

from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis
from kvbridge.links import LocalHub
from kvbridge_bench.streams import DecodeStream, EngineLoop, NoStream, PrefillStream

PAGES, PAGE = 24, 4


def _layout() -> PoolLayout:
    bufs = tuple(BufferGeometry(name=f"{t}.0", num_items=PAGES, item_shape=(PAGE, 2, 8), dtype=DType.BFLOAT16,
                                shard=ShardAxis(1, 2)) for t in "kv")
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1, tp_rank=0,
                      page_size=PAGE, model="m")


def _pair() -> tuple[TransferAgent, TransferAgent, list[np.ndarray], list[np.ndarray]]:
    hub, layout = LocalHub(), _layout()
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 255, (g.num_items, g.item_nbytes), dtype=np.uint8) for g in layout.components[0].buffers]
    dst = [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]
    config = AgentConfig(peer_timeout_s=30)
    pre = TransferAgent(layout=layout, buffers={"kv": src}, role=Role.PREFILL, link=hub.link("p0"), instance="inst",
                        config=config, name="p0")
    dec = TransferAgent(layout=layout, buffers={"kv": dst}, role=Role.DECODE, link=hub.link("d0"), config=config,
                        name="d0")
    pre.start(0.001)              # as in an engine (and the bench): kvbridge's own progress threads
    dec.start(0.001)
    dec.connect("inst", timeout_s=10)
    return pre, dec, src, dst


def _run(*drivers: DecodeStream | PrefillStream, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(d.done for d in drivers) and time.monotonic() < deadline:
        for driver in drivers:
            driver.step()
        time.sleep(0.0005)


def test_every_request_ends_and_a_slot_is_reused_only_when_safe() -> None:
    pre, dec, src, dst = _pair()
    try:
        src_pages = np.array([1, 5, 7], dtype=np.int64)
        slots = [np.array([0, 2, 4]), np.array([10, 11, 12]), np.array([20, 21, 22])]
        rooms = list(range(100, 112))
        decode = DecodeStream(agent=dec, instance="inst", rooms=rooms, dst_slots=slots, concurrency=3)
        prefill = PrefillStream(agent=pre, rooms=rooms, src=src_pages, window=8)
        seen_open: list[set[int]] = []
        deadline = time.monotonic() + 20
        while not (decode.done and prefill.done) and time.monotonic() < deadline:
            decode.step()
            prefill.step()
            in_use = [slot for _, _, slot in decode._open.values()]
            assert len(in_use) == len(set(in_use)), f"a slot handed out twice: {in_use}"
            seen_open.append(set(in_use))
            time.sleep(0.0005)
        assert decode.done and prefill.done
        assert not decode.failed and not prefill.failed
        assert len(decode.latencies) == len(rooms) and prefill.finished == len(rooms)
        assert max(len(s) for s in seen_open) == 3           # the concurrency was reached, never passed
        for slot in slots:
            for buf_src, buf_dst in zip(src, dst):
                assert np.array_equal(buf_dst[slot], buf_src[src_pages])
    finally:
        pre.close()
        dec.close()


def test_a_paced_stream_asks_no_faster_than_its_rate() -> None:
    pre, dec, _, _ = _pair()
    try:
        rooms = list(range(200, 206))
        decode = DecodeStream(agent=dec, instance="inst", rooms=rooms, dst_slots=[np.array([k]) for k in range(6)],
                              concurrency=6, rate=50.0)
        prefill = PrefillStream(agent=pre, rooms=rooms, src=np.array([9]), window=8)
        _run(decode, prefill)
        assert decode.done and not decode.failed
        assert decode.started_at is not None and decode.ended_at is not None
        assert decode.ended_at - decode.started_at >= (len(rooms) - 1) / 50.0
    finally:
        pre.close()
        dec.close()


def test_the_engine_loop_counts_steps_and_times_the_driver() -> None:
    loop = EngineLoop(work_us=50)
    result = loop.run(NoStream(), seconds=0.2)
    assert result.steps > 10 and 0.15 < result.seconds < 1.0 and result.steps_per_s > 0
    assert result.driver_cpu_s >= 0 and result.other_threads_cpu_s >= 0

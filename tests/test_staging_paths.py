"""Staging for any TP ratio: byte-exact against the independent reference over loopback and NIXL, with the
staged path and the descriptor path each forced (``AgentConfig.staging``), pieces and a staging area
smaller than the request; and the cost model's choice (many small runs staged, few large ones not)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent import decode as decode_module
from kvbridge.geometry import BufferGeometry, Component, DeviceKind, DType, PoolLayout, Rank, ShardAxis
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.slicing import buffer_segments
from kvbridge.staging import StagingArea, regular_rows, should_stage, stage_threshold
from kvbridge.testkit import reference as ref

HEADS, HEAD_BYTES, PAGE, LAYERS, POOL = 8, 32, 16, 3, 48


def _nixl_ok() -> bool:
    try:
        import kvbridge_nixl
    except ImportError:
        return False
    return bool(kvbridge_nixl.probe().available)


NIXL = pytest.mark.skipif(not _nixl_ok(), reason="nixl not usable")
BACKENDS = ["loopback", pytest.param("nixl", marks=NIXL)]


def spec(layout: str) -> ref.KVSpec:
    return ref.KVSpec(layout, total_heads=HEADS, page_size=PAGE, head_bytes=HEAD_BYTES)


def layout_of(kind: str, tp: int, rank: int, layers: int = LAYERS) -> PoolLayout:
    local = len(ref.units_held(HEADS, tp, rank))
    shape = (PAGE, local, HEAD_BYTES // 2) if kind == ref.TOKEN_MAJOR else (local, PAGE, HEAD_BYTES // 2)
    axis = 1 if kind == ref.TOKEN_MAJOR else 0
    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=POOL, item_shape=shape, dtype=DType.BFLOAT16,
                                shard=ShardAxis(axis, HEADS)) for t in "kv" for layer in range(layers))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp, tp_rank=rank,
                      page_size=PAGE, model="staging-paths")


@dataclass
class World:
    kind: str
    pt: int
    dt: int
    prefill: list[TransferAgent]
    decode: list[TransferAgent]
    src: list[list[np.ndarray]]
    dst: list[list[np.ndarray]]
    layers: int = LAYERS
    extra: list[TransferAgent] = field(default_factory=list)

    def close(self) -> None:
        for agent in self.prefill + self.decode:
            agent.close()


# This module checks bytes on the staging paths, not liveness: six agents with their threads share one process
# and its GIL, and at load ~11 a heartbeat thread starved past the default 3 s peer timeout failed a room
# ("no message for 3.2 s") in a clean-clone run.
PATIENT = {"peer_timeout_s": 30.0}


def wait(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def worlds() -> Iterator[Callable[..., World]]:
    """The ``make_world`` fixture: ``make(backend, kind, pt, dt, prefill=config, decode=config)``."""
    made: list[World] = []

    def make(backend: str, kind: str, pt: int, dt: int, *, prefill: AgentConfig, decode: AgentConfig,
             layers: int = LAYERS) -> World:
        hub = LocalHub()
        registry = Registry.build()
        src = [[np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout_of(kind, pt, r, layers)
                .components[0].buffers] for r in range(pt)]
        dst = [[np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in layout_of(kind, dt, r, layers)
                .components[0].buffers] for r in range(dt)]
        pre = [TransferAgent(layout=layout_of(kind, pt, r, layers), buffers={"kv": src[r]}, role=Role.PREFILL,
                             backend=backend, registry=registry, link=hub.link(f"p{r}"), instance="inst",
                             config=prefill) for r in range(pt)]
        dec = [TransferAgent(layout=layout_of(kind, dt, r, layers), buffers={"kv": dst[r]}, role=Role.DECODE,
                             backend=backend, registry=registry, link=hub.link(f"d{r}"), config=decode)
               for r in range(dt)]
        world = World(kind, pt, dt, pre, dec, src, dst, layers)
        made.append(world)
        for a in pre:
            a.start()
        for d in dec:
            d.start()
            d.connect("inst", timeout_s=30)
        return world

    yield make
    for world in made:
        world.close()


make_world = pytest.fixture(worlds, name="make_world")


def fill(world: World, seed: int, pages: np.ndarray) -> None:
    for r in range(world.pt):
        for b, buf in enumerate(world.src[r]):
            ref.fill_source(buf, spec(world.kind), seed, b % world.layers, b // world.layers, world.pt, r, pages,
                            np.arange(len(pages)))


def check(world: World, seed: int, pages: np.ndarray, *, others_untouched: bool = True) -> None:
    """The requested pages hold the reference bytes and (unless told otherwise) no other page changed."""
    untouched = np.setdiff1d(np.arange(POOL), pages) if others_untouched else np.zeros(0, np.int64)
    for r in range(world.dt):
        for b, buf in enumerate(world.dst[r]):
            want = ref.expected_pages(spec(world.kind), seed, b % world.layers, b // world.layers, world.dt, r,
                                      np.arange(len(pages)))
            got = buf.reshape(POOL, *spec(world.kind).local_page_shape(world.dt))[pages]
            assert np.array_equal(got, want), f"decode rank {r} buffer {b} differs"
            assert not buf[untouched].any(), f"decode rank {r} buffer {b}: bytes outside the request changed"


def open_room(world: World, room: int, src_pages: np.ndarray, dst_pages: np.ndarray,
              seed: int = 7) -> tuple[list, list]:
    """Fill the source pages, ask for ``dst_pages`` on every decode rank, wait until every prefill rank is
    asked: (senders, receivers)."""
    fill(world, seed, src_pages)
    receivers = [d.receiver(room, "inst") for d in world.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages})
    senders = [a.sender(room) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    return senders, receivers


def run_room(world: World, room: int, src_pages: np.ndarray, dst_pages: np.ndarray, splits: list[int],
             seed: int = 7) -> tuple[list, list, list[dict]]:
    senders, receivers = open_room(world, room, src_pages, dst_pages, seed)
    reservations = [dict(d.decode.rooms[room].staged) for d in world.decode]
    bounds = [0, *splits, len(src_pages)]
    for s in senders:
        for i in range(len(bounds) - 1):
            s.send(src_pages[bounds[i]: bounds[i + 1]], last=i == len(bounds) - 2)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers), 60)
    wait(lambda: all(s.safe_to_reuse for s in senders), 60)
    check(world, seed, dst_pages)
    assert sum(r.nbytes for r in receivers) == sum(s.stats[0] for s in senders)
    return senders, receivers, reservations


PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2)]


def _cases() -> list[object]:
    """Every (layout, TP pair, mode) over loopback and, but for 2 -> 2 (each NIXL agent costs ~0.6 s), NIXL."""
    return [pytest.param(b, kind, pt, dt, mode, marks=NIXL if b == "nixl" else ())
            for b in ("loopback", "nixl") for kind in (ref.TOKEN_MAJOR, ref.HEAD_MAJOR) for pt, dt in PAIRS
            for mode in ("always", "never") if not (b == "nixl" and (pt, dt) == (2, 2))]


@pytest.mark.parametrize("backend, kind, pt, dt, mode", _cases())
def test_scattered_pages_are_byte_exact_on_both_paths(make_world: Callable[..., World], backend: str, kind: str,
                                                      pt: int, dt: int, mode: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # pieces of at most 12 KiB: a 4-page chunk of one layer (K and V) is 2 x 4 x 4 KiB at TP 1, so layers
    # are split by items there and grouped elsewhere
    config = AgentConfig(**PATIENT, staging=mode, staging_bytes=1 << 20, staging_piece_bytes=12 << 10)
    world = make_world(backend, kind, pt, dt, prefill=config, decode=config)
    scattered: list[int] = []
    real = decode_module.scatter_rows

    def counting(*args: object, **kwargs: object) -> None:
        scattered.append(len(args[2]))  # type: ignore[arg-type]
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_module, "scatter_rows", counting)
    rng = np.random.default_rng(pt * 10 + dt)
    src_pages, dst_pages = rng.permutation(POOL)[:11], rng.permutation(POOL)[:11]
    senders, receivers, reserved = run_room(world, 5, src_pages, dst_pages, [4, 5])
    # every (item, buffer) of every decode rank went through a scatter exactly once, or never
    assert sum(scattered) == (11 * 2 * LAYERS * max(1, pt // dt) * dt if mode == "always" else 0)
    if mode == "always":
        assert all(len(r) == pt // dt if pt >= dt else len(r) == 1 for r in reserved), reserved
        pieces = [s.stats[1] for s in senders]
        assert all(0 < p <= 3 * LAYERS * 11 for p in pieces), pieces       # pieces, not a descriptor per run
    else:
        assert all(not r for r in reserved), reserved
    for rc in receivers:
        rc.clear()
    for agent in world.decode + world.prefill:
        assert agent.staging is not None and agent.staging.free_bytes == 1 << 20   # everything handed back


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_staging_area_smaller_than_the_request_pipelines_pieces(make_world: Callable[..., World],
                                                                   backend: str) -> None:
    """The prefill's area holds three 8 KiB pieces at a time: the others wait for a write to complete."""
    pre = AgentConfig(**PATIENT, staging="always", staging_bytes=24 << 10, staging_piece_bytes=8 << 10)
    dec = AgentConfig(**PATIENT, staging="always", staging_bytes=1 << 20)
    world = make_world(backend, ref.TOKEN_MAJOR, 2, 1, prefill=pre, decode=dec, layers=4)
    rng = np.random.default_rng(3)
    src_pages, dst_pages = rng.permutation(POOL)[:20], rng.permutation(POOL)[:20]
    senders, _, reserved = run_room(world, 9, src_pages, dst_pages, [])
    assert reserved[0] and all(s.stats[1] >= 10 for s in senders)      # 20 pages x 4 KiB x 4 layers / 8 KiB
    assert all(a.staging is not None and a.staging.free_bytes == 24 << 10 for a in world.prefill)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_prefill_staging_area_falls_back_to_descriptors(make_world: Callable[..., World], backend: str) -> None:
    """The decode reserved space, the prefill has none free: the chunk goes as descriptors (the notice says
    it is not staged) and the result is the same."""
    config = AgentConfig(**PATIENT, staging="always", staging_bytes=1 << 20)
    world = make_world(backend, ref.TOKEN_MAJOR, 1, 2, prefill=config, decode=config)
    staging = world.prefill[0].staging
    assert staging is not None
    hog = staging.alloc(staging.free_bytes)
    assert hog is not None
    rng = np.random.default_rng(4)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    senders, _, reserved = run_room(world, 11, src_pages, dst_pages, [3])
    assert all(reserved)
    assert senders[0].stats[1] == 2 * LAYERS * 6 * PAGE * 2     # one run per token row, both decode ranks
    staging.free(hog, 1 << 20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_area_the_size_of_one_slice_still_stages_for_both_decode_ranks(
        make_world: Callable[..., World], backend: str) -> None:
    """TP 1 -> 2, the prefill's area exactly one decode rank's slice (6 pages x 6 buffers x 2 KiB): a piece takes
    at most half the area, so both writes are staged (before, the first took it all and the second went as 576
    per-token-row descriptors; on 2x H100, 64 MiB requests over the default area ran at 0.25 GB/s)."""
    decode = AgentConfig(**PATIENT, staging="always", staging_bytes=1 << 20)
    prefill = AgentConfig(**PATIENT, staging="always", staging_bytes=72 << 10)
    world = make_world(backend, ref.TOKEN_MAJOR, 1, 2, prefill=prefill, decode=decode)
    rng = np.random.default_rng(8)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    senders, _, reserved = run_room(world, 13, src_pages, dst_pages, [])
    assert all(reserved)
    assert senders[0].stats[1] < 50, f"{senders[0].stats[1]} descriptors: a decode rank's write was not staged"


def test_a_full_decode_staging_area_reserves_nothing(make_world: Callable[..., World]) -> None:
    config = AgentConfig(**PATIENT, staging="always", staging_bytes=1 << 20)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=config, decode=config)
    staging = world.decode[0].staging
    assert staging is not None
    hog = staging.alloc(staging.free_bytes)
    rng = np.random.default_rng(5)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    _, _, reserved = run_room(world, 12, src_pages, dst_pages, [])
    assert reserved == [{}]
    assert hog is not None
    staging.free(hog, 1 << 20)


def test_a_request_of_two_slices_shares_the_area_instead_of_the_first_taking_it_all() -> None:
    """TP 2 -> 1 with each prefill rank's slice as large as the decode's area: before, the first slice took all
    of it and the second went as per-token descriptors (64 MiB requests, default 32 MiB area: 0.21 GB/s on 2x
    H200); now each gets a ring in its share."""
    plan = SimpleNamespace(layer_bytes=[1 << 20])
    area = StagingArea(np.zeros(32 << 20, np.uint8))
    first = decode_module._reserve(area, 32 << 20, plan, 256 << 20, share=2)
    second = decode_module._reserve(area, 32 << 20, plan, 256 << 20, share=1)
    assert first is not None and second is not None, (first, second)
    assert first[1] == second[1] == 16 << 20 and first[0] != second[0]
    alone = StagingArea(np.zeros(32 << 20, np.uint8))
    assert decode_module._reserve(alone, 32 << 20, plan, 256 << 20, share=1) == (0, 32 << 20)   # alone: all of it
    big_items = SimpleNamespace(layer_bytes=[300 << 10])     # no ring of two items fits the share: whole, if free
    small = StagingArea(np.zeros(1 << 20, np.uint8))
    assert decode_module._reserve(small, 400 << 10, big_items, 256 << 20, share=4) == (0, 400 << 10)


# ------------------------------------------------------------------------------------------- cost model
def _rows(kind: str, pt: int, dt: int, heads: int = 8, head_bytes: int = 256, page: int = 16) -> list:
    def geom(tp: int) -> BufferGeometry:
        local = len(ref.units_held(heads, tp, 0))
        shape = (page, local, head_bytes // 2) if kind == ref.TOKEN_MAJOR else (local, page, head_bytes // 2)
        return BufferGeometry(name="k.0", num_items=1, item_shape=shape, dtype=DType.BFLOAT16,
                              shard=ShardAxis(1 if kind == ref.TOKEN_MAJOR else 0, heads))
    s, d = geom(pt), geom(dt)
    r = regular_rows(buffer_segments(s, d, Rank(0, pt), Rank(0, dt)), s.item_nbytes, d.item_nbytes)
    assert r is not None
    return [r] * 64


def test_the_cost_model_stages_many_small_runs_and_not_few_large_ones() -> None:
    rng = np.random.default_rng(0)
    scattered = rng.permutation(40960)[:2048]
    contiguous = np.arange(100, 2148)
    nixl_gpu = stage_threshold(6.0, DeviceKind.CUDA)
    nixl_host = stage_threshold(6.0, DeviceKind.CPU)
    loopback = stage_threshold(0.5, DeviceKind.CPU)
    same_tp = _rows(ref.TOKEN_MAJOR, 1, 1)                     # one 32 KiB run per page
    # GPU, UCX-like engine: 2048 scattered 32 KiB pages are 131,072 descriptors -> staged; contiguous pages
    # merge into 64 descriptors of 64 MiB -> plain
    assert should_stage(same_tp, scattered, mode="auto", below_bytes=nixl_gpu)
    assert not should_stage(same_tp, contiguous, mode="auto", below_bytes=nixl_gpu)
    # host: a 32 KiB descriptor costs less than gathering and scattering it
    assert not should_stage(same_tp, scattered, mode="auto", below_bytes=nixl_host)
    # token-major 2 -> 1: one 1 KiB run per token row -> staged on the host too, even for contiguous pages,
    # and even for loopback's cheap descriptors
    hetero = _rows(ref.TOKEN_MAJOR, 2, 1)
    assert should_stage(hetero, contiguous, mode="auto", below_bytes=nixl_host)
    assert should_stage(hetero, contiguous, mode="auto", below_bytes=loopback)
    # head-major 2 -> 1: one 16 KiB run per page (half a decode page: runs never merge): staged for a UCX-like
    # engine (16 KiB < 18 KB on the host), not for loopback's cheap descriptors
    head_major = _rows(ref.HEAD_MAJOR, 2, 1)
    assert should_stage(head_major, contiguous, mode="auto", below_bytes=nixl_gpu)
    assert should_stage(head_major, scattered, mode="auto", below_bytes=nixl_host)
    assert not should_stage(head_major, scattered, mode="auto", below_bytes=loopback)
    # forced
    assert should_stage(same_tp, contiguous, mode="always", below_bytes=0)
    assert not should_stage(hetero, scattered, mode="never", below_bytes=1e12)


def test_auto_follows_the_backends_descriptor_cost(make_world: Callable[..., World]) -> None:
    """Over loopback (0.5 us a descriptor) the test pool's 32-byte token-row runs of TP 2 -> 1 are staged
    and its 4 KiB same-TP pages are not."""
    config = AgentConfig(**PATIENT, staging_bytes=1 << 20)
    rng = np.random.default_rng(6)
    hetero = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=config, decode=config)
    _, _, reserved = run_room(hetero, 21, rng.permutation(POOL)[:5], rng.permutation(POOL)[:5], [])
    assert reserved[0]
    same = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=config, decode=config)
    _, _, reserved = run_room(same, 22, rng.permutation(POOL)[:5], rng.permutation(POOL)[:5], [])
    assert reserved == [{}]
    below = AgentConfig(**PATIENT, staging_bytes=1 << 20, staging_below_bytes=1 << 20)    # the threshold, set by hand
    same = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=below, decode=below)
    _, _, reserved = run_room(same, 23, rng.permutation(POOL)[:5], rng.permutation(POOL)[:5], [])
    assert reserved[0]

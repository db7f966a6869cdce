"""GPU staging over NIXL with CUDA tensors (skipped without CUDA and NIXL): byte-exact against the reference
for scattered pages at equal and different TP sizes, token-major and head-major, staged and plain; gathers and
scatters run on the agents' own streams, ordered after the engine's stream by events, and nothing calls
``torch.cuda.synchronize`` while kvbridge works. Prefill on ``cuda:0``, decode on ``cuda:1`` when there are
two GPUs (else both on ``cuda:0``).

    PYTHONPATH=core:plugins/nixl/src python -m pytest tests/test_gpu_staging.py -q
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
kvbridge_nixl = pytest.importorskip("kvbridge_nixl")
if not kvbridge_nixl.probe().available:
    pytest.skip("nixl unavailable", allow_module_level=True)

from kvbridge.agent import AgentConfig, TransferAgent  # noqa: E402
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis  # noqa: E402
from kvbridge.links import LocalHub  # noqa: E402
from kvbridge.protocol.wire import KVPoll, Role  # noqa: E402
from kvbridge.registry import Registry  # noqa: E402
from kvbridge.testkit import reference as ref  # noqa: E402

HEADS, HEAD_BYTES, PAGE, LAYERS, POOL = 8, 256, 16, 4, 256
PREFILL_DEV = "cuda:0"
DECODE_DEV = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def spec(kind: str) -> ref.KVSpec:
    return ref.KVSpec(kind, total_heads=HEADS, page_size=PAGE, head_bytes=HEAD_BYTES)


def layout_of(kind: str, tp: int, rank: int) -> PoolLayout:
    local = len(ref.units_held(HEADS, tp, rank))
    shape = (PAGE, local, HEAD_BYTES // 2) if kind == ref.TOKEN_MAJOR else (local, PAGE, HEAD_BYTES // 2)
    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=POOL, item_shape=shape, dtype=DType.BFLOAT16,
                                shard=ShardAxis(1 if kind == ref.TOKEN_MAJOR else 0, HEADS))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp, tp_rank=rank,
                      page_size=PAGE, model="gpu-staging")


def tensors(kind: str, tp: int, rank: int, device: str) -> list[Any]:
    shape = (POOL, *layout_of(kind, tp, rank).components[0].buffers[0].item_shape)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]


@dataclass
class World:
    kind: str
    pt: int
    dt: int
    prefill: list[TransferAgent]
    decode: list[TransferAgent]
    src: list[list[Any]]
    dst: list[list[Any]]


@pytest.fixture
def make_world() -> Iterator[Callable[..., World]]:
    made: list[TransferAgent] = []

    def make(kind: str, pt: int, dt: int, config: AgentConfig, decode_config: AgentConfig | None = None) -> World:
        hub, registry = LocalHub(), Registry.build(plugins=[kvbridge_nixl])
        src = [tensors(kind, pt, r, PREFILL_DEV) for r in range(pt)]
        dst = [tensors(kind, dt, r, DECODE_DEV) for r in range(dt)]
        pre = [TransferAgent(layout=layout_of(kind, pt, r), buffers={"kv": src[r]}, role=Role.PREFILL, backend="nixl",
                             registry=registry, link=hub.link(f"p{r}"), instance="gpu", config=config)
               for r in range(pt)]
        dec = [TransferAgent(layout=layout_of(kind, dt, r), buffers={"kv": dst[r]}, role=Role.DECODE, backend="nixl",
                             registry=registry, link=hub.link(f"d{r}"), config=decode_config or config)
               for r in range(dt)]
        made.extend(pre + dec)
        for a in pre + dec:
            a.start(0.0005)
        for d in dec:
            d.connect("gpu", timeout_s=60)
        return World(kind, pt, dt, pre, dec, src, dst)

    yield make
    for agent in made:
        agent.close()


def wait(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.0005)


@pytest.fixture
def no_device_sync(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any torch.cuda.synchronize call (kvbridge must never make one)."""
    calls: list[str] = []
    real = torch.cuda.synchronize

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append("torch.cuda.synchronize")
        real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", spy)
    return calls


def _fill_async(world: World, seed: int, pages: np.ndarray) -> list[Any]:
    """Write the request's pages from pinned host memory with non-blocking copies on the current stream and
    return at once: the send that follows must be ordered after them by its event, not by a synchronize."""
    keep = []
    for r in range(world.pt):
        for b, t in enumerate(world.src[r]):
            share = ref.expected_pages(spec(world.kind), seed, b % LAYERS, b // LAYERS, world.pt, r,
                                       np.arange(len(pages)))
            host = torch.from_numpy(share).pin_memory()
            keep.append(host)
            view = t.view(torch.uint8).view(POOL, -1)
            view[torch.as_tensor(pages, device=t.device)] = host.view(len(pages), -1).to(t.device, non_blocking=True)
    return keep


def _check(world: World, seed: int, pages: np.ndarray) -> None:
    for r in range(world.dt):
        for b, t in enumerate(world.dst[r]):
            got = t.view(torch.uint8).cpu().numpy().reshape(POOL, *spec(world.kind).local_page_shape(world.dt))
            want = ref.expected_pages(spec(world.kind), seed, b % LAYERS, b // LAYERS, world.dt, r,
                                      np.arange(len(pages)))
            assert np.array_equal(got[pages], want), f"decode rank {r} buffer {b} differs"
            rest = np.setdiff1d(np.arange(POOL), pages)
            assert not got[rest].any(), f"decode rank {r} buffer {b}: bytes outside the request changed"


def _run(world: World, room: int, layerwise: bool = False) -> list[Any]:
    rng = np.random.default_rng(room)
    src_pages, dst_pages = rng.permutation(POOL)[:40], rng.permutation(POOL)[:40]
    receivers = [d.receiver(room, "gpu") for d in world.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages})
    senders = [a.sender(room) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    keep = _fill_async(world, room, src_pages)
    for s in senders:
        for lo, hi in ((0, 16), (16, 40)):
            if layerwise:
                for g in range(LAYERS):
                    s.send(src_pages[lo:hi], last=hi == 40 and g == LAYERS - 1, layers=range(g, g + 1))
            else:
                s.send(src_pages[lo:hi], last=hi == 40)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))
    wait(lambda: all(s.safe_to_reuse for s in senders))
    del keep
    _check(world, room, dst_pages)
    return receivers


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.TOKEN_MAJOR, 1, 2),
                                          (ref.TOKEN_MAJOR, 4, 2), (ref.HEAD_MAJOR, 2, 1), (ref.HEAD_MAJOR, 1, 2)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_cuda_pages_are_byte_exact_without_a_device_synchronize(make_world: Callable[..., World], kind: str, pt: int,
                                                                dt: int, mode: str, no_device_sync: list[str]) -> None:
    config = AgentConfig(staging=mode, staging_bytes=64 << 20, staging_piece_bytes=1 << 20)
    world = make_world(kind, pt, dt, config)
    _run(world, 3)
    assert no_device_sync == []
    if mode == "always":
        assert all(a.staging is not None and a.staging.free_bytes == 64 << 20 for a in world.prefill)
        for a in world.prefill + world.decode:        # one kernel per piece, not one per buffer
            assert _batched(a), f"{a.name} gathered or scattered buffer by buffer"


def _batched(agent: TransferAgent) -> bool:
    span = agent.buffers.span("kv")
    return span is not None and any(index is not None for index in span._index.values())


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.HEAD_MAJOR, 1, 2)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_cuda_layerwise_sends_are_byte_exact(make_world: Callable[..., World], kind: str, pt: int, dt: int, mode: str,
                                             no_device_sync: list[str]) -> None:
    config = AgentConfig(staging=mode, staging_bytes=64 << 20, staging_piece_bytes=1 << 20)
    world = make_world(kind, pt, dt, config)
    _run(world, 4, layerwise=True)
    assert no_device_sync == []
    if mode == "always":
        assert all(_batched(a) for a in world.prefill + world.decode)


def test_span_over_separate_cuda_allocations_matches_the_per_buffer_path() -> None:
    """The CUDA view over several torch allocations (with gaps between them) gathers and scatters exactly what
    the per-buffer kernels do, and never writes the gaps."""
    from kvbridge.spans import BufferSpan
    from kvbridge.staging import Rows, gather_rows, scatter_rows

    item = 4096
    bufs = [torch.randint(0, 256, (64, item), dtype=torch.uint8, device=PREFILL_DEV) for _ in range(6)]
    spacer = [torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=PREFILL_DEV) for _ in range(3)]
    guard = [s.clone() for s in spacer]
    items = torch.tensor([5, 1, 63, 20], dtype=torch.int64, device=PREFILL_DEV)
    for rows in (Rows(rows=1, cols=item, src_stride=item, dst_stride=item, src_col=0, dst_col=0),
                 Rows(rows=16, cols=128, src_stride=256, dst_stride=256, src_col=128, dst_col=128)):
        span = BufferSpan(bufs)
        order = [3, 0, 5, 1]
        index = span.run_index(buffers=order, rows=rows, side="src")
        assert index is not None
        staged = torch.zeros(len(order) * 4 * rows.nbytes, dtype=torch.uint8, device=PREFILL_DEV)
        index.gather(items, staged)
        want = torch.zeros_like(staged)
        cursor = 0
        for b in order:
            gather_rows(bufs[b], rows, items.cpu().numpy(), want[cursor: cursor + 4 * rows.nbytes].view(4, -1))
            cursor += 4 * rows.nbytes
        assert torch.equal(staged, want)
        before = [b.clone() for b in bufs]
        noise = torch.randint(0, 256, staged.shape, dtype=torch.uint8, device=PREFILL_DEV)
        back = span.run_index(buffers=order, rows=rows, side="dst")
        assert back is not None
        back.scatter(items, noise)
        cursor = 0
        for b in order:
            scatter_rows(before[b], rows, items.cpu().numpy(), noise[cursor: cursor + 4 * rows.nbytes].view(4, -1))
            cursor += 4 * rows.nbytes
        assert all(torch.equal(x, y) for x, y in zip(bufs, before))
    assert all(torch.equal(s, g) for s, g in zip(spacer, guard))


@pytest.mark.parametrize("kind, pt, dt", [(ref.TOKEN_MAJOR, 1, 1), (ref.TOKEN_MAJOR, 2, 1), (ref.HEAD_MAJOR, 1, 2)])
def test_cuda_staging_ring_is_byte_exact(make_world: Callable[..., World], kind: str, pt: int, dt: int,
                                         no_device_sync: list[str]) -> None:
    """The decode's 4 MiB area cannot hold the request's slice: a ring of 1 MiB slots, reused on credits
    sent when each scatter's event completed."""
    pre = AgentConfig(staging="always", staging_bytes=64 << 20, staging_piece_bytes=1 << 20)
    dec = AgentConfig(staging="always", staging_bytes=4 << 20, staging_piece_bytes=1 << 20)
    world = make_world(kind, pt, dt, pre, dec)
    receivers = _run(world, 5)
    assert no_device_sync == []
    assert all(r.nbytes > (4 << 20) for r in receivers) or pt > dt
    assert all(_batched(a) for a in world.prefill + world.decode)


def test_auto_stages_scattered_cuda_pages(make_world: Callable[..., World]) -> None:
    """Default cost model, NIXL (6 us a descriptor) on CUDA: scattered 8 KiB page runs are staged."""
    world = make_world(ref.TOKEN_MAJOR, 1, 1, AgentConfig(staging_bytes=64 << 20))
    rng = np.random.default_rng(1)
    dst_pages = rng.permutation(POOL)[:8]
    receiver = world.decode[0].receiver(9, "gpu")
    receiver.send_metadata({"kv": dst_pages})
    wait(lambda: bool(world.decode[0].decode.rooms[9].metadata_at))
    assert world.decode[0].decode.rooms[9].staged
    receiver.abort("done looking")

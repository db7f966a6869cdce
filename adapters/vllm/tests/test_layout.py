"""vLLM's KV layouts mapped to kvbridge (no vLLM needed): shapes, refusals, and real transfers between
agents in one process (LocalHub, loopback) checked against an independent logical KV, resharded by heads.

The logical KV of a request is ``K[layer, position, head, token, dim]`` and ``V[...]`` (float32, distinct
values); each test lays it out the way vLLM's attention backend does (CPU: ``[blocks, heads, block_size,
2*head]`` with K rows then V rows per (block, head); NHD: ``[2, blocks, block_size, heads, head]``; HND:
head-major memory under the same logical shape), moves it with ``WorkerSide`` and reads it back the same
way on the decode side.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbridge.errors import GeometryError  # noqa: E402
from kvbridge.geometry import owned_range  # noqa: E402
from kvbridge.links import LocalHub  # noqa: E402
from kvbridge.protocol.wire import KVPoll  # noqa: E402
from kvbridge_vllm.layout import layer_order, pool_layout  # noqa: E402
from kvbridge_vllm.settings import Settings  # noqa: E402
from kvbridge_vllm.worker import LoadSpec, SaveSpec, WorkerSide  # noqa: E402

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 2, 4, 4, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def allocate(kind: str, heads: int, dtype: torch.dtype = torch.float32, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """Per-layer caches as vLLM hands them to register_kv_caches (views into one allocation)."""
    if kind == "cpu":
        whole = torch.zeros(LAYERS, BLOCKS, heads, block, 2 * DIM, dtype=dtype)
    elif kind == "nhd":
        whole = torch.zeros(LAYERS, 2, BLOCKS, block, heads, DIM, dtype=dtype)
    elif kind == "hnd":   # memory [2, B, H, N, D], exposed as the logical [2, B, N, H, D]
        whole = torch.zeros(LAYERS, 2, BLOCKS, heads, block, DIM, dtype=dtype).permute(0, 1, 2, 4, 3, 5)
    elif kind == "flashinfer":
        whole = torch.zeros(LAYERS, BLOCKS, 2, block, heads, DIM, dtype=dtype)
    elif kind == "flashinfer_hnd":   # memory [B, 2, H, N, D], exposed as the logical [B, 2, N, H, D]
        whole = torch.zeros(LAYERS, BLOCKS, 2, heads, block, DIM, dtype=dtype).permute(0, 1, 2, 4, 3, 5)
    else:   # mla: [B, N, latent], the same on every rank (the latent here: DIM values per token)
        whole = torch.zeros(LAYERS, BLOCKS, block, DIM, dtype=dtype)
    return {name: whole[i] for i, name in enumerate(NAMES)}


def write(kind: str, cache: torch.Tensor, block: int, head: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Put one (block, local head)'s K and V ``[block_size, head]`` where vLLM's kernels would."""
    if kind == "cpu":
        rows = cache.view(cache.shape[0], cache.shape[1], 2 * BLOCK, DIM)
        rows[block, head, :BLOCK] = k
        rows[block, head, BLOCK:] = v
    elif kind in ("flashinfer", "flashinfer_hnd"):
        cache[block, 0, :, head] = k
        cache[block, 1, :, head] = v
    elif kind == "mla":
        cache[block] = k            # one latent per token (head 0's K stands for it); no V
    else:
        cache[0, block, :, head] = k
        cache[1, block, :, head] = v


def read(kind: str, cache: torch.Tensor, block: int, head: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "cpu":
        rows = cache.view(cache.shape[0], cache.shape[1], 2 * BLOCK, DIM)
        return rows[block, head, :BLOCK], rows[block, head, BLOCK:]
    if kind in ("flashinfer", "flashinfer_hnd"):
        return cache[block, 0, :, head], cache[block, 1, :, head]
    if kind == "mla":
        return cache[block], None
    return cache[0, block, :, head], cache[1, block, :, head]


def held(kind: str, tp: int, rank: int) -> tuple[int, int]:
    """The heads ``rank`` of ``tp`` holds (MLA: the one latent, on every rank)."""
    return (0, 1) if kind == "mla" else owned_range(HEADS, tp, rank)


def logical(seed: int, positions: int) -> torch.Tensor:
    """``[layer, K/V, position, head, token, dim]``, every value distinct."""
    n = LAYERS * 2 * positions * HEADS * BLOCK * DIM
    return (torch.arange(n, dtype=torch.float32) + seed * n).reshape(LAYERS, 2, positions, HEADS, BLOCK, DIM)


@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd"])
def test_geometry(kind: str) -> None:
    pool = pool_layout(allocate(kind, 2), kind=kind, total_kv_heads=HEADS, tp_size=2, tp_rank=1, block_size=BLOCK)
    comp = pool.layout.components[0]
    if kind == "cpu":
        assert [b.name for b in comp.buffers] == ["kv.0", "kv.1"]
        assert comp.buffers[0].item_shape == (2, 2 * BLOCK, DIM) and comp.buffers[0].shard.axis == 0
    else:
        assert [b.name for b in comp.buffers] == ["k.0", "k.1", "v.0", "v.1"]
        want = (BLOCK, 2, DIM) if kind == "nhd" else (2, BLOCK, DIM)
        assert comp.buffers[0].item_shape == want
        assert comp.buffers[0].shard.axis == (1 if kind == "nhd" else 0)
    assert all(b.shard.total == HEADS and b.num_items == BLOCKS for b in comp.buffers)
    for geom, tensor in zip(comp.buffers, pool.buffers["kv"]):
        assert tensor.is_contiguous() and tensor.numel() * tensor.element_size() == geom.nbytes


@pytest.mark.parametrize(("kind", "item", "axis"), [("flashinfer", (2, BLOCK, 2, DIM), 2),
                                                    ("flashinfer_hnd", (2, 2, BLOCK, DIM), 1),
                                                    ("mla", (BLOCK, DIM), None)])
def test_block_major_geometry(kind: str, item: tuple[int, ...], axis: int | None) -> None:
    """FlashInfer keeps a block's K and V together (one buffer per layer, heads sharded inside the item); MLA's
    latent is replicated (no shard axis)."""
    pool = pool_layout(allocate(kind, 2), kind=kind, total_kv_heads=HEADS, tp_size=2, tp_rank=1, block_size=BLOCK)
    comp = pool.layout.components[0]
    assert len(comp.buffers) == LAYERS and comp.buffers[0].item_shape == item
    assert (comp.buffers[0].shard.axis if comp.buffers[0].shard else None) == axis
    for geom, tensor in zip(comp.buffers, pool.buffers["kv"]):
        assert tensor.is_contiguous() and tensor.numel() * tensor.element_size() == geom.nbytes
    with pytest.raises(GeometryError, match="must be"):
        pool_layout(allocate("nhd", 2), kind=kind, total_kv_heads=HEADS, tp_size=2, tp_rank=1, block_size=BLOCK)


def test_refusals() -> None:
    with pytest.raises(GeometryError, match="block size"):
        pool_layout(allocate("cpu", 2), kind="cpu", total_kv_heads=HEADS, tp_size=2, tp_rank=0, block_size=8)
    with pytest.raises(GeometryError, match="not head-major"):
        pool_layout(allocate("nhd", 2), kind="hnd", total_kv_heads=HEADS, tp_size=2, tp_rank=0, block_size=BLOCK)
    with pytest.raises(GeometryError, match="holds 2 units"):
        pool_layout(allocate("cpu", 2), kind="cpu", total_kv_heads=HEADS, tp_size=1, tp_rank=0, block_size=BLOCK)
    with pytest.raises(GeometryError, match="unknown vLLM KV layout"):
        pool_layout(allocate("cpu", 2), kind="tnd", total_kv_heads=HEADS, tp_size=2, tp_rank=0, block_size=BLOCK)
    assert layer_order(["m.layers.10.a", "m.layers.2.a"]) == ["m.layers.2.a", "m.layers.10.a"]


def _cuda_pair() -> bool:
    """Two CUDA devices and a usable NIXL: the GPU variants of the transfer tests run (prefill on cuda:0, decode
    on cuda:1, over NIXL), as vLLM's GPU workers would."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    try:
        import kvbridge_nixl
    except ImportError:
        return False
    return bool(kvbridge_nixl.probe().available)


GPU = pytest.mark.skipif(not _cuda_pair(), reason="needs two CUDA devices and NIXL")
TRANSFER_CASES = ([pytest.param(k, p, d, "cpu", id=f"{k}-{p}-{d}") for k in ("cpu", "nhd", "hnd")
                   for p, d in ((1, 1), (2, 1), (1, 2), (4, 2))]
                  + [pytest.param(k, p, d, "cpu", id=f"{k}-{p}-{d}") for k in ("flashinfer", "flashinfer_hnd", "mla")
                     for p, d in ((2, 1), (1, 2))]
                  + [pytest.param(k, p, d, "cuda", id=f"{k}-{p}-{d}-2gpu", marks=GPU)
                     for k in ("nhd", "hnd", "flashinfer", "flashinfer_hnd", "mla")
                     for p, d in ((1, 1), (2, 1), (1, 2))])


def reshard(kind: str, pt: int, dt: int, device: str, p_block: int, d_block: int, tokens: int) -> None:
    """Prefill TP ``pt`` (blocks of ``p_block`` tokens) -> decode TP ``dt`` (``d_block``): a ``tokens``-token request
    whose first decode block is in the decode's prefix cache. Every token after it on every decode rank holds the
    logical KV of its heads (MLA: the latent, on every rank); the prefix block is untouched. ``cuda``: prefill
    ranks on cuda:0, decode ranks on cuda:1, over NIXL."""
    hub = LocalHub()
    counter = itertools.count()
    gpu = device == "cuda"
    settings = Settings.defaults(backend="nixl" if gpu else "loopback", shm_remap=False)
    src_dev, dst_dev = ("cuda:0", "cuda:1") if gpu else ("cpu", "cpu")
    padded = -(-tokens // p_block) * p_block + d_block
    n = LAYERS * 2 * padded * HEADS * DIM
    kv = torch.arange(n, dtype=torch.float32).reshape(LAYERS, 2, padded, HEADS, DIM)    # [layer, K/V, token, head]
    rng = np.random.default_rng(1)
    workers: list[WorkerSide] = []

    def side(tp: int, r: int, block: int, dev: str, produce: bool) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
        lo, hi = held(kind, tp, r)
        caches = _on(allocate(kind, hi - lo, block=block), dev)
        pool = pool_layout(caches, kind=kind, total_kv_heads=HEADS, tp_size=tp, tp_rank=r, block_size=block)
        w = WorkerSide(settings=settings, pool=pool, produce=produce, consume=not produce,
                       instance="p" if produce else "", link_factory=lambda: hub.link(f"a{next(counter)}"))
        workers.append(w)
        return w, caches

    try:
        prefill, src_blocks = [], []
        for r in range(pt):
            w, caches = side(pt, r, p_block, src_dev, True)
            lo, hi = held(kind, pt, r)
            blocks = rng.permutation(BLOCKS)[: -(-tokens // p_block)]
            for layer, name in enumerate(NAMES):
                for pos, b in enumerate(blocks):
                    span = slice(pos * p_block, (pos + 1) * p_block)
                    for h in range(lo, hi):
                        write(kind, caches[name], int(b), h - lo, kv[layer, 0, span, h].to(src_dev),
                              kv[layer, 1, span, h].to(src_dev))
            prefill.append(w)
            src_blocks.append(blocks)
        decode, dst_caches, dst_blocks = [], [], []
        for r in range(dt):
            w, caches = side(dt, r, d_block, dst_dev, False)
            decode.append(w)
            dst_caches.append(caches)
            dst_blocks.append(rng.permutation(BLOCKS)[: -(-tokens // d_block)])
        if gpu:
            torch.cuda.synchronize()
        for r, w in enumerate(prefill):
            w.save("req", SaveSpec(room=7, block_ids=tuple(int(b) for b in src_blocks[r])))
        for r, w in enumerate(decode):
            w.load("req", LoadSpec(room=7, instance="p", block_ids=tuple(int(b) for b in dst_blocks[r][1:]),
                                   prefix_len=d_block))
        sent: set[int] = set()
        recv: set[int] = set()
        for _ in range(8000):
            for r, w in enumerate(prefill):
                if w.finished(["req"])[0]:
                    sent.add(r)
            for r, w in enumerate(decode):
                if w.finished([])[1]:
                    recv.add(r)
            if len(sent) == pt and len(recv) == dt:
                break
            time.sleep(0.005)
        assert len(sent) == pt and len(recv) == dt, (sent, recv)
        for w in decode:
            assert w.load_errors() == set()
        if gpu:
            torch.cuda.synchronize()
        for r in range(dt):
            lo, hi = held(kind, dt, r)
            for layer, name in enumerate(NAMES):
                cache = dst_caches[r][name].cpu()
                for pos, b in enumerate(dst_blocks[r]):
                    valid = min(tokens - pos * d_block, d_block)       # the last block's tail is padding
                    span = slice(pos * d_block, pos * d_block + valid)
                    for h in range(lo, hi):
                        k, v = read(kind, cache, int(b), h - lo)
                        if pos == 0:
                            assert not k.any() and (v is None or not v.any()), "a prefix block was written"
                            continue
                        torch.testing.assert_close(k[:valid], kv[layer, 0, span, h], rtol=0, atol=0)
                        if v is not None:
                            torch.testing.assert_close(v[:valid], kv[layer, 1, span, h], rtol=0, atol=0)
    finally:
        for w in workers:
            w.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "pt", "dt", "device"), TRANSFER_CASES)
def test_transfer_reshards_by_heads(kind: str, pt: int, dt: int, device: str) -> None:
    """Prefill TP ``pt`` -> decode TP ``dt``, one block size: a 5-block request (:func:`reshard`)."""
    reshard(kind, pt, dt, device, BLOCK, BLOCK, 5 * BLOCK)


def _on(caches: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The same per-layer views of one allocation, moved to ``device`` as a whole (layouts keep their strides)."""
    if device == "cpu":
        return caches
    first = next(iter(caches.values()))
    base = first._base if first._base is not None else first
    moved = base.to(device)
    offset = {n: (t.storage_offset() - base.storage_offset()) for n, t in caches.items()}
    return {n: moved.as_strided(t.shape, t.stride(), moved.storage_offset() + offset[n]) for n, t in caches.items()}


BLOCK_CASES = ([pytest.param(k, p, d, pb, db, "cpu", id=f"{k}-{p}-{d}-B{pb}-B{db}")
                for k in ("nhd", "hnd", "flashinfer", "flashinfer_hnd", "mla")
                for p, d in ((2, 1), (1, 2)) for pb, db in ((4, 8), (8, 4))]
               + [pytest.param(k, 2, 1, 4, 8, "cuda", id=f"{k}-2-1-B4-B8-2gpu", marks=GPU)
                  for k in ("nhd", "hnd", "flashinfer", "flashinfer_hnd", "mla")])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "pt", "dt", "p_block", "d_block", "device"), BLOCK_CASES)
def test_blocks_of_another_size_reshard_byte_exact(kind: str, pt: int, dt: int, p_block: int, d_block: int,
                                                     device: str) -> None:
    """Prefill and decode with different vLLM block sizes (#24 item 1): a 19-token request (:func:`reshard`), the
    last block of each side partly padding."""
    reshard(kind, pt, dt, device, p_block, d_block, 19)


def test_cpu_blocks_of_another_size_are_refused_naming_why() -> None:
    """vLLM's CPU cache interleaves K and V rows per head ([blocks, heads, block_size, 2*head]): a block of another
    size cannot be cut into sub-blocks there; the handshake refuses it with the reason."""
    from kvbridge.errors import IncompatiblePeer
    from kvbridge.handshake import check_compatible

    prefill = pool_layout(allocate("cpu", 2, block=4), kind="cpu", total_kv_heads=HEADS, tp_size=2, tp_rank=0,
                          block_size=4)
    decode = pool_layout(allocate("cpu", 2, block=8), kind="cpu", total_kv_heads=HEADS, tp_size=2, tp_rank=0,
                         block_size=8)
    with pytest.raises(IncompatiblePeer, match="no token planes"):
        check_compatible(prefill.layout, decode.layout)


@pytest.mark.timeout(60)
def test_failed_load_reports_blocks() -> None:
    """A decode whose prefill instance never appears reports every block of the request as a load error, once
    the handshake's time is up, without ever blocking the step that asked for the load."""
    hub = LocalHub()
    pool = pool_layout(allocate("cpu", HEADS), kind="cpu", total_kv_heads=HEADS, tp_size=1, tp_rank=0,
                       block_size=BLOCK)
    settings = Settings.defaults(connect_timeout_s=0.3)
    w = WorkerSide(settings=settings, pool=pool, produce=False, consume=True, instance="",
                   link_factory=lambda: hub.link("d"))
    try:
        started = time.monotonic()
        w.load("req", LoadSpec(room=1, instance="nobody", block_ids=(3, 5), prefix_len=0))
        assert time.monotonic() - started < 0.2, "load() blocked the engine's step on the handshake"
        done: set[str] = set()
        while not done and time.monotonic() - started < 10:
            done = w.finished([])[1]
            time.sleep(0.02)
        assert done == {"req"}
        assert 0.3 <= time.monotonic() - started < 5, "the load did not fail when the handshake timed out"
        assert w.load_errors() == {3, 5}
        assert w.load_errors() == set()
    finally:
        w.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "uint8"])
@pytest.mark.parametrize(("kind", "pt", "dt"), [("nhd", 2, 1), ("hnd", 1, 2), ("cpu", 2, 1)])
def test_fp8_kv_caches_reshard_byte_exact(kind: str, pt: int, dt: int, dtype: str) -> None:
    """FP8 KV caches (``--kv-cache-dtype fp8``: float8 tensors, or uint8 as some attention backends keep them;
    vLLM's per-tensor k/v scales come from the checkpoint on both sides and do not travel): every byte of every
    (block, head) lands on the decode rank holding that head. Random bytes, NaN and infinity patterns included."""
    hub = LocalHub()
    counter = itertools.count()
    settings = Settings.defaults(backend="loopback", shm_remap=False)
    kind_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(11)
    truth = torch.randint(0, 256, (LAYERS, 2, BLOCKS, HEADS, BLOCK, DIM), dtype=torch.uint8, generator=gen)
    blocks = [3, 9, 0, 14]
    workers: list[WorkerSide] = []
    try:
        prefill, decode, dst = [], [], []
        for r in range(pt):
            lo, hi = owned_range(HEADS, pt, r)
            caches = allocate(kind, hi - lo, kind_dtype)
            for layer, name in enumerate(NAMES):
                raw = caches[name].view(torch.uint8)
                for b in blocks:
                    for h in range(lo, hi):
                        write(kind, raw, b, h - lo, truth[layer, 0, b, h], truth[layer, 1, b, h])
            pool = pool_layout(caches, kind=kind, total_kv_heads=HEADS, tp_size=pt, tp_rank=r, block_size=BLOCK)
            assert pool.layout.components[0].buffers[0].dtype.value == dtype
            prefill.append(WorkerSide(settings=settings, pool=pool, produce=True, consume=False, instance="p",
                                      link_factory=lambda: hub.link(f"a{next(counter)}")))
        workers += prefill
        for r in range(dt):
            lo, hi = owned_range(HEADS, dt, r)
            caches = allocate(kind, hi - lo, kind_dtype)
            pool = pool_layout(caches, kind=kind, total_kv_heads=HEADS, tp_size=dt, tp_rank=r, block_size=BLOCK)
            decode.append(WorkerSide(settings=settings, pool=pool, produce=False, consume=True, instance="",
                                     link_factory=lambda: hub.link(f"a{next(counter)}")))
            dst.append(caches)
        workers += decode
        landing = [5, 1, 12, 7]
        for w in prefill:
            w.save("req", SaveSpec(room=9, block_ids=tuple(blocks)))
        for w in decode:
            w.load("req", LoadSpec(room=9, instance="p", block_ids=tuple(landing), prefix_len=0))
        sent: set[int] = set()
        recv: set[int] = set()

        def done() -> bool:
            sent.update(r for r, w in enumerate(prefill) if w.finished(["req"])[0])
            recv.update(r for r, w in enumerate(decode) if w.finished([])[1])
            return len(sent) == pt and len(recv) == dt

        _wait(done, "every rank to finish")
        assert all(w.load_errors() == set() for w in decode)
        for r in range(dt):
            lo, hi = owned_range(HEADS, dt, r)
            for layer, name in enumerate(NAMES):
                raw = dst[r][name].view(torch.uint8)
                for b, d in zip(blocks, landing):
                    for h in range(lo, hi):
                        k, v = read(kind, raw, d, h - lo)
                        assert torch.equal(k, truth[layer, 0, b, h]) and torch.equal(v, truth[layer, 1, b, h])
    finally:
        for w in workers:
            w.close()


def _pair(kind: str, pt: int, dt: int, dump_dir: str = "") -> tuple[list[WorkerSide], list[WorkerSide],
                                                                     list[dict[str, torch.Tensor]], torch.Tensor]:
    """Prefill ranks (holding a 5-block request's logical KV in blocks 0..4) and decode ranks, on one hub."""
    hub = LocalHub()
    counter = itertools.count()
    settings = Settings.defaults(backend="loopback", shm_remap=False, dump_dir=dump_dir)
    kv = logical(seed=5, positions=5)
    prefill, decode, dst = [], [], []
    for r in range(pt):
        lo, hi = owned_range(HEADS, pt, r)
        caches = allocate(kind, hi - lo)
        for layer, name in enumerate(NAMES):
            for pos in range(5):
                for h in range(lo, hi):
                    write(kind, caches[name], pos, h - lo, kv[layer, 0, pos, h], kv[layer, 1, pos, h])
        pool = pool_layout(caches, kind=kind, total_kv_heads=HEADS, tp_size=pt, tp_rank=r, block_size=BLOCK)
        prefill.append(WorkerSide(settings=settings, pool=pool, produce=True, consume=False, instance="p",
                                  link_factory=lambda: hub.link(f"a{next(counter)}")))
    for r in range(dt):
        lo, hi = owned_range(HEADS, dt, r)
        caches = allocate(kind, hi - lo)
        pool = pool_layout(caches, kind=kind, total_kv_heads=HEADS, tp_size=dt, tp_rank=r, block_size=BLOCK)
        decode.append(WorkerSide(settings=settings, pool=pool, produce=False, consume=True, instance="",
                                 link_factory=lambda: hub.link(f"a{next(counter)}")))
        dst.append(caches)
    return prefill, decode, dst, kv


def _wait(done: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("pt", "dt", "late"), [(1, 1, False), (2, 1, False), (1, 2, True)])
def test_layer_wise_posts_each_layer_during_the_forward(tmp_path: Path, pt: int, dt: int, late: bool) -> None:
    """The decode asked first: each layer goes from save_layer() as soon as it is written, before the forward
    pass ends (save()); with ``late``, the decode's request arrives after layer 0 was written, and the first
    post carries layers 0-1 at once. Decode's blocks then hold the logical KV of their heads, byte for byte."""
    prefill, decode, dst, kv = _pair("nhd", pt, dt, str(tmp_path))
    blocks = tuple(range(5))
    dst_blocks = (7, 3, 9, 1, 12)
    try:
        for w in prefill:
            w.begin_save("req", SaveSpec(room=11, block_ids=blocks))
        if late:
            for w in prefill:
                w.save_layer("req", 0)           # written before the decode asked: nothing can go yet
        for w in decode:
            w.load("req", LoadSpec(room=11, instance="p", block_ids=dst_blocks, prefix_len=0))
        _wait(lambda: all(w._sending["req"].sender.poll() >= KVPoll.WaitingForInput for w in prefill),
              "the decode's request")
        for layer in range(1 if late else 0, LAYERS):
            for w in prefill:
                w.save_layer("req", layer)
                assert w._sending["req"].layers_posted == layer + 1, "a written layer was not posted at once"
        for w in prefill:
            assert w._sending["req"].sent, "every layer went during the forward pass"
            w.save("req", SaveSpec(room=11, block_ids=blocks))      # wait_for_save: nothing left to post
        _wait(lambda: all(w.finished([])[1] or w.busy["receiving"] == 0 for w in decode), "decode's load")
        _wait(lambda: all(w.finished(["req"])[0] or w.busy["sending"] == 0 for w in prefill), "prefill's release")
        for w in decode:
            assert w.load_errors() == set()
        for r in range(dt):
            lo, hi = owned_range(HEADS, dt, r)
            for layer, name in enumerate(NAMES):
                for pos, b in enumerate(dst_blocks):
                    for h in range(lo, hi):
                        k, v = read("nhd", dst[r][name], b, h - lo)
                        torch.testing.assert_close(k, kv[layer, 0, pos, h], rtol=0, atol=0)
                        torch.testing.assert_close(v, kv[layer, 1, pos, h], rtol=0, atol=0)
        want = [[0, 2]] if late else [[0, 1], [1, 2]]
        for r in range(pt):
            groups = json.loads((tmp_path / f"prefill-room11-rank{r}.json").read_text())["layer_groups"]
            assert groups == want, groups
    finally:
        for w in prefill + decode:
            w.close()


@pytest.mark.timeout(60)
def test_layer_wise_never_posts_before_the_forward_pass_wrote_the_layer() -> None:
    """No decode request during the forward pass: nothing is posted until save() (the whole request then goes
    once the decode asks); a decode that asks between layers gets only the layers written so far."""
    prefill, decode, _, _ = _pair("cpu", 1, 1)
    (p,), (d,) = prefill, decode
    try:
        p.begin_save("req", SaveSpec(room=12, block_ids=(0, 1)))
        p.save_layer("req", 0)
        assert p._sending["req"].layers_posted == 0
        d.load("req", LoadSpec(room=12, instance="p", block_ids=(4, 5), prefix_len=0))
        _wait(lambda: p._sending["req"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        time.sleep(0.05)        # the send loop runs meanwhile: it must not send what the forward pass has not written
        assert p._sending["req"].layers_posted == 0 and not p._sending["req"].sent
        p.save_layer("req", 0)  # layer 0 again (vLLM calls once per layer; a repeat is harmless)
        assert p._sending["req"].layers_posted == 1
        p.save("req", SaveSpec(room=12, block_ids=(0, 1)))     # the rest goes from wait_for_save
        assert p._sending["req"].sent and p._sending["req"].groups == [(0, 1), (1, 2)]
        _wait(lambda: bool(d.finished([])[1]), "decode's load")
        assert d.load_errors() == set()
    finally:
        for w in prefill + decode:
            w.close()

"""digest_buffers, the batched digests the agent computes where the pages live, against the numpy digests of the
same bytes (an independent path: host words, ``X @ lo``), for every run shape the slicers produce: whole pages, a
head slice of a head-major page, a head slice of every token row, runs of odd lengths, irregular runs, sub-pages
of a repaged view, rows with padding between them. CPU tensors here (torch's path, one wait); on a CUDA machine
the same cases on the GPU, where Triton is importable by the fused kernel (asserted taken), and a planted byte
changes exactly its item's digest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvbridge.device_digests import _kernel, digest_buffers, fused
from kvbridge.digests import Runs, digest_items, run_bytes
from kvbridge.repaging import repaged_view
from kvbridge.slicing import Segments

torch = pytest.importorskip("torch")

PAGE = 4096                         # bytes of one item: 16 token rows of 256 bytes (or 8 head planes of 512)


def _segments(kind: str) -> Segments:
    rows = np.arange(16, dtype=np.int64)
    if kind == "whole":
        return Segments.whole(PAGE)
    if kind == "head-plane":        # head-major: heads 2-3 of 8, one run
        return Segments(np.array([1024], np.int64), np.array([0], np.int64), np.array([1024], np.int64))
    if kind == "token-rows":        # token-major: the second half of every token row
        return Segments(rows * 256 + 128, rows * 128, np.full(16, 128, np.int64))
    if kind == "odd":               # runs of 100 bytes every 256 (not whole words)
        return Segments(rows * 256 + 4, rows * 100, np.full(16, 100, np.int64))
    if kind == "irregular":         # runs of different lengths
        return Segments(np.array([0, 300, 2000], np.int64), np.array([0, 64, 200], np.int64),
                        np.array([64, 136, 1000], np.int64))
    raise AssertionError(kind)


KINDS = ["whole", "head-plane", "token-rows", "odd", "irregular"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pool(device: str, buffers: int, items: int, pad: int = 0, seed: int = 0) -> tuple[list[Any], list[np.ndarray]]:
    """``buffers`` views ``[items, PAGE]`` (rows ``PAGE + pad`` bytes apart) on ``device``, and their host copies."""
    g = torch.Generator().manual_seed(seed)
    views, hosts = [], []
    for _ in range(buffers):
        full = torch.randint(0, 256, (items, PAGE + pad), dtype=torch.uint8, generator=g).to(device)
        view = full[:, :PAGE]
        views.append(view)
        hosts.append(np.ascontiguousarray(view.cpu().numpy()))
    return views, hosts


def _expected(hosts: list[np.ndarray], items: np.ndarray, runs: list[Runs]) -> np.ndarray:
    return np.concatenate([digest_items(h, items, r) for h, r in zip(hosts, runs)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pad", [0, 64])
def test_batched_digests_equal_numpy_digests(device: str, kind: str, pad: int) -> None:
    views, hosts = _pool(device, 6, 40, pad)
    runs = [run_bytes(_segments(kind), "src")] * len(views)
    items = np.random.default_rng(1).permutation(40)[:25]
    got = digest_buffers(views, items, runs)
    assert got.dtype == np.uint64 and got.shape == (6 * 25,)
    assert np.array_equal(got, _expected(hosts, items, runs))
    if device == "cuda" and _kernel() is not None:
        assert fused(views[0], runs[0]) == (kind in ("whole", "head-plane", "token-rows"))


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_with_different_runs_in_one_call(device: str) -> None:
    """K and V of a layer may be sliced differently (MLA, a partial peer): each buffer keeps its own runs, groups
    of equal runs share a launch, and the order stays buffer-major."""
    views, hosts = _pool(device, 5, 12)
    runs = [run_bytes(_segments(k), "src") for k in ("whole", "token-rows", "whole", "odd", "token-rows")]
    items = np.array([11, 0, 5, 5, 7])
    assert np.array_equal(digest_buffers(views, items, runs), _expected(hosts, items, runs))


@pytest.mark.parametrize("device", DEVICES)
def test_sub_pages_of_a_repaged_view(device: str) -> None:
    """Page sizes differ (prefill 64 -> decode 16 tokens): items are quarter pages of the same memory."""
    views, hosts = _pool(device, 3, 8)
    sub = [repaged_view(v, 4) for v in views]
    sub_hosts = [repaged_view(h, 4) for h in hosts]
    runs = [run_bytes(Segments.whole(PAGE // 4), "src")] * 3
    items = np.array([31, 2, 17, 16])
    assert np.array_equal(digest_buffers(sub, items, runs), _expected(sub_hosts, items, runs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["whole", "token-rows", "odd"])
def test_a_planted_byte_changes_exactly_its_items_digest(device: str, kind: str) -> None:
    views, _ = _pool(device, 4, 16)
    runs = [run_bytes(_segments(kind), "src")] * 4
    items = np.arange(16)
    before = digest_buffers(views, items, runs)
    offset = int(runs[0].index[len(runs[0].index) // 2])     # a byte inside the runs
    views[2][9, offset] ^= 0x01
    after = digest_buffers(views, items, runs)
    changed = np.flatnonzero(before != after)
    assert changed.tolist() == [2 * 16 + 9]


def test_nothing_to_digest() -> None:
    views, _ = _pool("cpu", 2, 4)
    runs = [run_bytes(Segments.whole(PAGE), "src")] * 2
    assert digest_buffers(views, np.zeros(0, np.int64), runs).shape == (0,)
    assert digest_buffers([], np.arange(3), []).shape == (0,)
    empty = [run_bytes(Segments.empty(), "src")] * 2
    assert np.array_equal(digest_buffers(views, np.arange(3), empty), np.zeros(6, np.uint64))


def test_numpy_views_take_the_host_path() -> None:
    _, hosts = _pool("cpu", 3, 10)
    runs = [run_bytes(_segments("token-rows"), "src")] * 3
    items = np.arange(10)[::-1].copy()
    assert np.array_equal(digest_buffers(hosts, items, runs), _expected(hosts, items, runs))


def test_one_runs_per_view_or_a_clear_error() -> None:
    views, _ = _pool("cpu", 2, 4)
    with pytest.raises(ValueError, match="2 views but 1 runs"):
        digest_buffers(views, np.arange(3), [run_bytes(Segments.whole(PAGE), "src")])

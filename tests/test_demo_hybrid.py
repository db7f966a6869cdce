"""The hybrid demo presets across processes: qwen3-next, swa and deepseek-v32, byte-exact, and refusals.

Every decode rank verifies each received byte of every component against the independent reference
(the state-type plugins' demo models for the state components); seeds are picked so that each run has a
decode prefix hit (SWA still sends its whole window, NSA its pages from position 0).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbridge.demo.presets import get_preset
from kvbridge.demo.run import run_demo
from kvbridge.demo.worker import SEGMENT_PREFIX, make_requests
from kvbridge.errors import UnsupportedTopology

pytestmark = pytest.mark.kvbridge_multiprocess

for _plugin in ("kvbridge_mamba", "kvbridge_swa", "kvbridge_nsa"):
    pytest.importorskip(_plugin)

REQUESTS, WINDOW, REGION = 4, 2, 6


def _orphan_segments() -> set[str]:
    """Demo segments in /dev/shm whose creating process is gone."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)
            and not os.path.exists(f"/proc/{n[len(SEGMENT_PREFIX):].split('-')[0]}")}


@pytest.fixture(scope="module", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = _orphan_segments()
    yield
    assert not _orphan_segments() - before


def seed_with_prefix_hit(preset: str, base: int) -> int:
    """The first seed from ``base`` whose requests include a decode prefix hit."""
    page_size = get_preset(preset).page_size
    return next(s for s in range(base, base + 200)
                if any(r.prefix_pages for r in make_requests(s, REQUESTS, page_size, REGION)))


@pytest.mark.parametrize("preset, pt, dt", [
    ("qwen3-next", 2, 4), ("qwen3-next", 4, 1),
    ("swa", 1, 4), ("swa", 4, 2),
    ("deepseek-v32", 4, 2), ("deepseek-v32", 1, 8),
])
def test_hybrid_preset_across_processes_is_byte_exact(preset: str, pt: int, dt: int) -> None:
    out = io.StringIO()
    seed = seed_with_prefix_hit(preset, 10 * pt + dt)
    summary = run_demo(backend="loopback", preset=preset, prefill_tp=pt, decode_tp=dt, requests=REQUESTS, seed=seed,
                       window=WINDOW, region_pages=REGION, timeout_s=90, out=out)
    assert summary.ok, out.getvalue()
    assert f"verified: {REQUESTS}/{REQUESTS} byte-exact" in out.getvalue()
    assert not mp.active_children()


@pytest.mark.parametrize("preset, pt, dt, reason", [
    ("qwen3-next", 3, 1, r"prefill TP 3: component 'kv': 2 KV heads cannot be sharded over TP 3"),
    ("qwen3-next", 2, 6, r"decode TP 6: component 'mamba': GDN conv groups \[q\|k\|v\] = \[32, 32, 64\]"),
    ("swa", 1, 3, r"decode TP 3: component 'kv': 8 KV heads cannot be sharded over TP 3"),
    ("deepseek-v32", 4, 6, r"prefill TP 4 and decode TP 6 do not divide each other"),
])
def test_hybrid_preset_refuses_a_topology_its_shapes_forbid(preset: str, pt: int, dt: int, reason: str) -> None:
    with pytest.raises(UnsupportedTopology, match=rf"preset '{preset}' cannot run prefill TP {pt} -> decode TP {dt}: "
                                                  rf"{reason}"):
        run_demo(backend="loopback", preset=preset, prefill_tp=pt, decode_tp=dt, requests=1, seed=0)
    assert not mp.active_children()


def test_swa_dump_lists_window_pages_and_holds_the_reference(tmp_path: Path) -> None:
    """The dump names each state item by absolute position; its bytes are what the reference says."""
    seed = seed_with_prefix_hit("swa", 3)
    summary = run_demo(backend="loopback", preset="swa", prefill_tp=2, decode_tp=1, requests=REQUESTS, seed=seed,
                       window=WINDOW, region_pages=REGION, timeout_s=90, dump=str(tmp_path), out=io.StringIO())
    assert summary.ok
    model = get_preset("swa").components[1]
    table = np.load(tmp_path / "decode-rank0" / "swa.requests.npy")
    requests = {r.index: r for r in make_requests(seed, REQUESTS, 16, REGION)}
    assert sorted(set(table["request"].tolist())) == sorted(requests)
    for index, req in requests.items():
        first, count = model.span(req)
        rows = table[table["request"] == index]
        assert rows["position"].tolist() == list(range(first, first + count))   # the window only, by position
    expected = {i: model.expected(1, 0, r) for i, r in requests.items()}          # per buffer [pages, bytes]
    owner = {int(row["page"]): (int(row["request"]), int(row["position"])) for row in table}   # the last one wins
    for b in range(2 * len(model.layers)):
        buf = np.load(tmp_path / "decode-rank0" / f"swa.{b}.npy")
        for page, (index, position) in owner.items():
            assert np.array_equal(buf[page], expected[index][b][position - model.span(requests[index])[0]])

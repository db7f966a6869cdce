"""`kvbridge demo --dump`: the dump can be checked with nothing but the README's description of the pattern."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from kvbridge.demo.run import run_demo
from kvbridge.testkit import reference as ref


def test_dump_is_checkable_from_the_documented_pattern(tmp_path: Path) -> None:
    out = io.StringIO()
    summary = run_demo(backend="loopback", preset="dense-gqa", prefill_tp=2, decode_tp=1, requests=5, seed=3,
                       window=2, region_pages=4, timeout_s=60, dump=str(tmp_path), out=out)
    assert summary.ok, out.getvalue()
    rank_dir = tmp_path / "decode-rank0"
    table = np.load(rank_dir / "requests.npy")
    assert len(table) and set(table.dtype.names) >= {"request", "seed", "position", "page"}
    # README: 8 KV heads x 128 bf16, 16-token pages, 4 layers; buffer i = tensor * layers + layer
    spec = ref.KVSpec(ref.TOKEN_MAJOR, total_heads=8, page_size=16, head_bytes=256)
    last_owner = {}
    for row in np.sort(table, order="request"):
        last_owner[int(row["page"])] = row
    checked = 0
    for i in range(8):
        buf = np.load(rank_dir / f"kv.{i}.npy").reshape(-1, *spec.local_page_shape(1))
        layer, tensor = i % 4, i // 4
        for page, row in last_owner.items():
            want = ref.expected_pages(spec, int(row["seed"]), layer, tensor, 1, 0, [int(row["position"])])[0]
            assert np.array_equal(buf[page], want), (i, page)
            checked += 1
    assert checked == 8 * len(last_owner)

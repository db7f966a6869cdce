"""SGLang 0.5.23's own classes (from its wheel) driving kvbridge-sglang in separate prefill and decode rank
processes, in the call order of its prefill and decode event loops; every byte checked on decode.

Each test starts a scenario's ranks (``sglang_driver.py`` under .venv-sglang, loopback backend through
/dev/shm) and reads their results. A decode rank checks, for each request, every byte it owns of the KV
pages after the decode's prefix (the prefix pages must keep decode's own bytes), the aux (metadata) rows
and each state component, against a hash of the coordinates computed in the driver, independently of
kvbridge's slicing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _rig import Run, check_clean, need_sglang

AUX = [64, 64, 512, 128]          # SGLang-like metadata rows: output ids, cached tokens, top logprobs, topk index


def scenario(**kw: Any) -> dict[str, Any]:
    base = {"seed": 7, "page": 4, "layers": 2, "heads": 4, "head_bytes": 8, "pool_pages": 256, "requests": 6,
            "max_len": 37, "prefix_prob": 0.5, "aux_slots": 16, "aux_bytes": AUX, "timeout": 150}
    base.update(kw)
    return base


def run(sc: dict[str, Any], tmp: Path, **kw: Any) -> tuple[Run, dict[Any, dict[str, Any]]]:
    need_sglang()
    r = Run(sc, tmp, **kw)
    try:
        return r, r.wait()
    finally:
        r.kill()


def decode_results(results: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    return [res for key, res in results.items() if key[0] == "decode"]


def test_gqa_tp4_to_tp2_chunked_prefix_aux(tmp_path: Path) -> None:
    """GQA, 4 KV heads, prefill TP 4 -> decode TP 2: chunked prefill at random boundaries, decode prefix hits
    (full hits included), aux rows; every request verified on both decode ranks."""
    sc = scenario(prefill={"tp": 4}, decode={"tp": 2}, requests=8)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    for res in decode_results(results):
        assert len(res["verified"]) == 8 and not res["failed"], res
        assert res["prefill_info"] == {"tp": 4, "dp": 1, "pp": 1}
    assert all(len(res["sent"]) == 8 for key, res in results.items() if key[0] == "prefill")

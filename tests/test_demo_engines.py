"""The demo across processes over the real engines: NIXL (UCX) and Mooncake (TCP), byte-checked.

NIXL: dense GQA and MLA, Mooncake: dense GQA and the qwen3-next hybrid (GQA KV + GDN Mamba state), over every
Pt, Dt in {1, 2, 4} (in CI each pair once, the presets taking turns; every combination under
``KVBRIDGE_LONG_TESTS=1``: tests/_tpmatrix.py). Each run verifies every received byte against
the reference pattern (see the README) and fails on any mismatch, failure or hang.
"""

from __future__ import annotations

import io

import pytest
from _tpmatrix import pair_cases

from kvbridge.demo.run import run_demo
from kvbridge.registry import Registry

pytestmark = pytest.mark.kvbridge_multiprocess

_AVAILABLE = Registry.build().backend_names()


def _run(backend: str, preset: str, pt: int, dt: int) -> None:
    if backend not in _AVAILABLE:
        pytest.skip(f"{backend} is not usable here")
    out = io.StringIO()
    summary = run_demo(backend=backend, preset=preset, prefill_tp=pt, decode_tp=dt, requests=4, seed=pt * 7 + dt,
                       window=2, region_pages=4, timeout_s=120, out=out)
    assert summary.ok, out.getvalue()
    assert "verified: 4/4 byte-exact" in out.getvalue()


@pytest.mark.parametrize("preset, pt, dt", pair_cases(("dense-gqa", "mla")))
def test_nixl_demo(preset: str, pt: int, dt: int) -> None:
    _run("nixl", preset, pt, dt)


@pytest.mark.parametrize("preset, pt, dt", pair_cases(("dense-gqa", "qwen3-next")))
def test_mooncake_demo(preset: str, pt: int, dt: int) -> None:
    _run("mooncake", preset, pt, dt)

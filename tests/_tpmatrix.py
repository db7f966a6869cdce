"""The (prefill TP, decode TP) matrix of the multi-process demo tests, and how much of it a run covers.

``.ci/run`` (CI) runs every pair of {1, 2, 4} once, the presets taking turns, so each pair and each preset
crosses processes; ``KVBRIDGE_LONG_TESTS=1`` (``.ci/long``) runs every pair with every preset. Every pair
with every preset is also checked byte for byte in one process by the conformance kit and tests/test_matrix.py.
"""

from __future__ import annotations

import os

import pytest

LONG = os.environ.get("KVBRIDGE_LONG_TESTS") == "1"
PAIRS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]


def pair_cases(presets: tuple[str, ...]) -> list[object]:
    """``pytest.param(preset, pt, dt)`` for the run's share of the matrix (see the module docstring)."""
    if LONG:
        chosen = [(preset, p, d) for preset in presets for p, d in PAIRS]
    else:
        chosen = [(presets[i % len(presets)], p, d) for i, (p, d) in enumerate(PAIRS)]
    return [pytest.param(preset, p, d, id=f"{p}to{d}-{preset}") for preset, p, d in chosen]

"""GPU memory (VRAM) through NIXL/UCX: same reshard checks as on the host, pools as CUDA tensors.

Skipped without torch and a CUDA device; run on a GPU host (see README.md for what was verified where).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbridge_nixl.backend import NixlBackend
from kvbridge_nixl.testing import run_reshard, run_two_process

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.kvbridge_hardware("cuda")
Factory = Callable[[str], NixlBackend]


@pytest.mark.parametrize(("pt", "dt"), [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_vram_reshard_in_process(backends: Factory, pt: int, dt: int) -> None:
    run_reshard(backends, pt, dt, heads=4, seed=200 + 10 * pt + dt, device="cuda")


@pytest.mark.kvbridge_multiprocess
@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2)])
def test_vram_two_process(backends: Factory, pt: int, dt: int) -> None:
    """The prefill process writes from the last GPU (another GPU when there are several)."""
    peer = f"cuda:{torch.cuda.device_count() - 1}"
    run_two_process(backends, pt, dt, {}, False, seed=300 + pt + dt, device="cuda:0", peer_device=peer)

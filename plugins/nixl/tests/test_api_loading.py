"""kvbridge_nixl.api loads the same NIXL module ``import nixl`` picks, without importing a CPU build of torch
(~4.5 CPU-s in every process that touches NIXL on a 2-core host)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge_nixl.api import torch_build_has_cuda

pytest.importorskip("nixl_meta_utils", reason="NIXL is not installed")

_PROBE = r"""
import json, sys
if sys.argv[1] == "kvbridge":
    from kvbridge_nixl import api
    module = api.load()
else:
    from nixl import _api as module
print(json.dumps({"module": module.__name__, "agent": hasattr(module, "nixl_agent"),
                  "torch": "torch" in sys.modules}))
"""


def _load(how: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _PROBE, how], capture_output=True, text=True, timeout=120,
                          check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_same_module_as_nixl_picks_and_torch_only_where_it_decides() -> None:
    ours, theirs = _load("kvbridge"), _load("nixl")
    assert ours["module"] == theirs["module"] and ours["agent"], (ours, theirs)
    if torch_build_has_cuda() is False:
        assert not ours["torch"], "a CPU build of torch was imported to load NIXL"
    else:
        assert ours["torch"] == theirs["torch"]


def test_a_cuda_stack_already_imported_leaves_the_choice_to_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch (or another CUDA stack) in the process, nixl's own detection decides: never second-guessed."""
    import types

    from kvbridge_nixl import api
    api.load.cache_clear()
    calls: list[str] = []
    fake_nixl = types.ModuleType("nixl")
    fake_api = types.ModuleType("nixl._api")
    fake_nixl._api = fake_api  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.delitem(sys.modules, "nixl._api", raising=False)
    monkeypatch.setitem(sys.modules, "nixl", fake_nixl)
    monkeypatch.setattr(api.importlib, "import_module", lambda name: calls.append(name))
    try:
        assert api.load() is fake_api and calls == []
    finally:
        api.load.cache_clear()

"""What core finds through the specs instead of plugin names: the demo's state models
(``StateTypeSpec.demo_model``). A backend's benchmark (``BackendSpec.bench``) is kvbridge-bench's to find:
tools/bench/tests/test_backend_bench.py."""

from __future__ import annotations

import pytest

from kvbridge.demo.presets import get_preset
from kvbridge.errors import UnknownPluginError
from kvbridge.registry import Registry


@pytest.mark.parametrize("preset, state_type", [("qwen3-next", "mamba"), ("swa", "swa"), ("deepseek-v32", "nsa")])
def test_a_hybrid_preset_without_its_state_type_names_the_distribution(preset: str, state_type: str) -> None:
    with pytest.raises(UnknownPluginError, match=rf"^preset {preset} needs the state type '{state_type}': "
                                                 rf"pip install kvbridge-{state_type} "):
        get_preset(preset, Registry.build(entry_points=False))


def test_a_dense_preset_needs_no_registry() -> None:
    assert get_preset("dense-gqa", Registry.build(entry_points=False)).components[0].name == "kv"


@pytest.mark.parametrize("preset, module", [("qwen3-next", "kvbridge_mamba"), ("swa", "kvbridge_swa"),
                                            ("deepseek-v32", "kvbridge_nsa")])
def test_a_hybrid_preset_takes_its_state_model_from_the_plugin(preset: str, module: str) -> None:
    pytest.importorskip(module)
    state = get_preset(preset).components[1]
    assert type(state).__module__ == f"{module}.demo"
    assert not state.chunked


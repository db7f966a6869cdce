"""What core finds through the specs instead of plugin names: the demo's state models
(``StateTypeSpec.demo_model``) and a backend's benchmark (``BackendSpec.bench``)."""

from __future__ import annotations

import pytest

from kvbridge import bench
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.demo.presets import get_preset
from kvbridge.errors import UnknownPluginError
from kvbridge.plugin import hookimpl
from kvbridge.registry import Registry
from kvbridge.specs import BackendSpec


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


class _Benched:
    ran: list[str] = []

    @staticmethod
    @hookimpl
    def kvbridge_transfer_backends() -> list[BackendSpec]:
        return [BackendSpec(name="benched", factory=LoopbackBackend, bench=lambda: _Benched.ran.append("x") or 7),
                BackendSpec(name="plain", factory=LoopbackBackend)]


def test_a_backend_benchmark_is_found_through_its_spec(capsys: pytest.CaptureFixture[str]) -> None:
    registry = Registry.build(entry_points=False, plugins=[_Benched])
    assert bench.main_backend("benched", registry) == 7 and _Benched.ran == ["x"]
    assert bench.main_backend("plain", registry) == 2
    assert "ships no benchmark" in capsys.readouterr().out
    assert bench.main_backend("absent", registry) == 2

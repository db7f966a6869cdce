"""State models of the hybrid presets, obtained from the installed state-type plugins.

A hybrid preset names the state type of each state component and gives its dimensions; the model
itself (geometry, items a request moves, fill and verify: see :mod:`kvbridge.demo.model`) comes from
that state type's plugin, through the ``demo_model`` of its ``StateTypeSpec`` in the registry. Core
never imports a plugin package::

    models = StateModels("qwen3-next")
    gdn = models.build("mamba", name="mamba", layers=(0, 1, 2), key_dim=32, value_dim=64, kernel=4,
                       heads=8, head_k_dim=8, head_v_dim=8)
    # without kvbridge-mamba: UnknownPluginError
    #   "preset qwen3-next needs the state type 'mamba': pip install kvbridge-mamba (...)"
"""

from __future__ import annotations

from typing import Any

from kvbridge.demo.model import ComponentModel
from kvbridge.errors import PluginError, UnknownPluginError
from kvbridge.registry import Registry
from kvbridge.specs import resolve

__all__ = ["DISTRIBUTIONS", "StateModels"]

#: The distribution that provides each state type the built-in presets use (named in the install hint).
DISTRIBUTIONS = {"mamba": "kvbridge-mamba", "swa": "kvbridge-swa", "nsa": "kvbridge-nsa"}


class StateModels:
    """Builds one preset's state models; the registry is built on first use unless one is given."""

    def __init__(self, preset: str, registry: Registry | None = None) -> None:
        self.preset = preset
        self._registry = registry

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry.build()
        return self._registry

    def build(self, state_type: str, /, **dims: Any) -> ComponentModel:
        """The model of one component of ``state_type`` (``name`` and the dimensions as keywords); raises
        UnknownPluginError naming the distribution to install when the state type is missing."""
        try:
            spec = self.registry.state_type_spec(state_type)
        except PluginError as exc:
            install = DISTRIBUTIONS.get(state_type)
            hint = f"pip install {install}" if install else "install the plugin that provides it"
            raise UnknownPluginError(f"preset {self.preset} needs the state type {state_type!r}: {hint} "
                                     f"({exc})") from None
        if spec.demo_model is None:
            raise PluginError(f"preset {self.preset} needs a demo model of the state type {state_type!r}, and its "
                              "plugin provides none (StateTypeSpec.demo_model)")
        model: ComponentModel = resolve(spec.demo_model)(**dims)
        return model

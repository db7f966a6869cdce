"""Layers of a component, for layer-wise sends: which buffers hold which model layer.

A buffer's layer is the integer its name ends with (``k.3``, ``kv.v.3``, ``kv.12``, ``c.0``): the naming of
``kv_component``, the demo presets and the vLLM adapter. The component's layers are those ids in the order
they first appear in the layout (wire order), and ``layers=range(a, b)`` of ``Sender.send`` indexes that
list: for ``kv_component(layers=4)`` (buffers ``k.0 .. k.3, v.0 .. v.3``) layer 1 is ``k.1`` and ``v.1``.
A component with a buffer whose name ends in no integer has one layer holding every buffer. Both sides
compute the same map: the handshake refuses a peer whose buffer names differ.

    lm = layer_map(component)
    lm.num_layers, lm.buffers(range(0, 2))      # -> 4, (0, 4, 1, 5) for k.0 k.1 k.2 k.3 v.0 v.1 v.2 v.3
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import GeometryError
from kvbridge.geometry import Component, buffer_layer


@dataclass(frozen=True, slots=True)
class LayerMap:
    """``order``: buffer indices grouped by layer (layer 0's buffers first, each layer's in wire order);
    ``starts[l]``: where layer ``l`` begins in ``order`` (``starts[-1] == len(order)``); ``ids``: the model's
    id of each layer."""

    ids: tuple[int, ...]
    order: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.ids)

    def buffers(self, layers: range) -> tuple[int, ...]:
        """Buffer indices of ``layers`` (a range of layer indices), in layer order."""
        return self.order[self.starts[layers.start]: self.starts[layers.stop]]

    def layer_buffers(self, layer: int) -> tuple[int, ...]:
        return self.order[self.starts[layer]: self.starts[layer + 1]]

    @property
    def all(self) -> range:
        return range(0, self.num_layers)

    def check(self, layers: range, what: str) -> range:
        """``layers`` if it is a non-empty step-1 range inside this component's layers, else GeometryError."""
        if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
            raise GeometryError(f"{what}: layers={layers!r} must be a non-empty range with step 1")
        if layers.start < 0 or layers.stop > self.num_layers:
            raise GeometryError(f"{what}: layers {layers.start}..{layers.stop - 1} are outside the "
                                f"{self.num_layers} layers of the component")
        return layers


def layer_map(component: Component) -> LayerMap:
    """The layers of ``component`` (see the module docstring)."""
    ids = [buffer_layer(b.name) for b in component.buffers]
    if any(i is None for i in ids):
        n = len(component.buffers)
        return LayerMap(ids=(0,), order=tuple(range(n)), starts=(0, n))
    seen: dict[int, list[int]] = {}
    for index, layer in enumerate(ids):
        seen.setdefault(layer, []).append(index)  # type: ignore[arg-type]
    order: list[int] = []
    starts = [0]
    for members in seen.values():
        order.extend(members)
        starts.append(len(order))
    return LayerMap(ids=tuple(seen), order=tuple(order), starts=tuple(starts))

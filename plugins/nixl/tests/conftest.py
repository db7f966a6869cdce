"""Shared fixtures: skip everything when NIXL is not installed; build backends and always close them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import kvbridge_nixl

_AVAILABLE = kvbridge_nixl.probe()
if not _AVAILABLE.available:
    pytest.skip(f"nixl unavailable: {_AVAILABLE.reason} ({_AVAILABLE.hint})", allow_module_level=True)

from kvbridge_nixl.backend import NixlBackend  # noqa: E402


@pytest.fixture(scope="module")
def backends() -> Iterator[Callable[[str], NixlBackend]]:
    """``backends(name)``: a NixlBackend of that endpoint name, shared within the module, closed at its end."""
    made: dict[str, NixlBackend] = {}

    def get(name: str) -> NixlBackend:
        if name not in made:
            made[name] = NixlBackend(name=name)
        return made[name]

    yield get
    for backend in made.values():
        backend.close()

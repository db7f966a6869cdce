"""Discovery: the entry point, the availability probe and lazy import of mori."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest

import kvbridge_mori
from kvbridge.backends.base import TransferBackend
from kvbridge.specs import Capability
from kvbridge_mori import standin
from kvbridge_mori.testing import STANDIN_SPEC


def test_entry_point_names_the_package() -> None:
    eps = [ep for ep in md.entry_points(group="kvbridge") if ep.name == "mori"]
    assert [ep.value for ep in eps] == ["kvbridge_mori"]
    assert kvbridge_mori.kvbridge_transfer_backends() == [kvbridge_mori.SPEC]


def test_importing_the_plugin_does_not_import_mori() -> None:
    code = "import kvbridge_mori, kvbridge_mori.backend, sys; print('mori' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.skipif(sys.version_info[:2] in ((3, 10), (3, 12)), reason="amd-mori may be installable here")
def test_probe_explains_why_mori_is_unavailable() -> None:
    result = kvbridge_mori.probe()
    assert not result.available
    assert "amd-mori is not installed" in result.reason and "no wheel for CPython" in result.reason
    assert "ROCm" in result.hint and "pip install amd-mori" in result.hint


def test_spec_declares_what_the_backend_does() -> None:
    caps = kvbridge_mori.SPEC.capabilities
    assert Capability.NOTIFICATIONS not in caps and Capability.ABORT not in caps
    assert {Capability.HOST_MEMORY, Capability.ASYNC, Capability.MULTI_PROCESS} <= caps


def test_standin_spec_builds_a_transfer_backend() -> None:
    backend = STANDIN_SPEC.factory(name="kit-0", options=None)  # type: ignore[operator]
    assert isinstance(backend, TransferBackend) and backend.name == "mori"
    backend.close()
    standin.reset()


def test_registry_lists_mori_as_unavailable_with_the_reason() -> None:
    from kvbridge.registry import Registry
    from kvbridge.specs import PluginStatus

    record = next(r for r in Registry.build().records() if r.name == "mori")
    assert record.distribution == "kvbridge-mori"
    if not kvbridge_mori.probe().available:
        assert record.status is PluginStatus.UNAVAILABLE and "amd-mori" in record.reason

"""Discovery: the entry point, the availability probe and lazy import of memfabric."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

import kvbridge_ascend
from kvbridge.backends.base import TransferBackend
from kvbridge.specs import Capability
from kvbridge_ascend import standin
from kvbridge_ascend.testing import STANDIN_SPEC


def test_entry_point_names_the_package() -> None:
    eps = [ep for ep in md.entry_points(group="kvbridge") if ep.name == "ascend"]
    assert [ep.value for ep in eps] == ["kvbridge_ascend"]
    assert kvbridge_ascend.kvbridge_transfer_backends() == [kvbridge_ascend.SPEC]


def test_importing_the_plugin_does_not_import_memfabric() -> None:
    code = "import kvbridge_ascend, kvbridge_ascend.backend, sys; print('memfabric_hybrid' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_probe_without_the_npu_driver_is_unavailable_with_a_clear_reason(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(kvbridge_ascend, "DRIVER_DIR", tmp_path / "Ascend" / "driver")
    result = kvbridge_ascend.probe()
    assert not result.available
    assert "memfabric_hybrid imports, but the Ascend NPU driver is missing" in result.reason
    assert str(tmp_path / "Ascend" / "driver") in result.reason and "NPU host" in result.hint


def test_probe_with_a_driver_directory_is_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kvbridge_ascend, "DRIVER_DIR", tmp_path)
    assert kvbridge_ascend.probe().available


def test_probe_without_memfabric_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)   # makes the import fail
    result = kvbridge_ascend.probe()
    assert not result.available and "cannot import memfabric_hybrid" in result.reason
    assert result.hint == "pip install memfabric-hybrid"


@pytest.mark.skipif(Path("/usr/local/Ascend/driver").is_dir(), reason="an NPU driver is installed here")
def test_registry_lists_ascend_as_unavailable_here() -> None:
    from kvbridge.registry import Registry
    from kvbridge.specs import PluginStatus

    record = next(r for r in Registry.build().records() if r.name == "ascend")
    assert record.distribution == "kvbridge-ascend" and record.status is PluginStatus.UNAVAILABLE
    assert "/usr/local/Ascend/driver" in record.reason


def test_spec_declares_what_the_backend_does() -> None:
    caps = kvbridge_ascend.SPEC.capabilities
    assert Capability.NOTIFICATIONS not in caps and Capability.ABORT not in caps
    assert {Capability.HOST_MEMORY, Capability.ASYNC, Capability.MULTI_PROCESS} <= caps


def test_standin_spec_builds_a_transfer_backend() -> None:
    backend = STANDIN_SPEC.factory(name="kit-0", options=None)  # type: ignore[operator]
    assert isinstance(backend, TransferBackend) and backend.name == "ascend"
    backend.close()
    standin.reset()

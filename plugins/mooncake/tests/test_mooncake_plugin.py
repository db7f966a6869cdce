"""Discovery, the availability probe, option parsing and the engine guards (cheap; no transfers)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util

import pytest

import kvbridge_mooncake
from kvbridge.backends.base import TransferBackend
from kvbridge.errors import PluginUnavailableError
from kvbridge.registry import Registry
from kvbridge.specs import Capability
from kvbridge_mooncake import availability as probe_mod
from kvbridge_mooncake.backend import MooncakeBackend
from kvbridge_mooncake.engine import DEFAULT_CHUNK, DEFAULT_WINDOW, MooncakeOptions, create_engine, has_hca
from kvbridge_mooncake.testing import unavailable_reason

NEEDS_MOONCAKE = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_entry_point_declares_the_backend() -> None:
    registry = Registry.build(allow=["mooncake"])
    spec = registry.backend_spec("mooncake")
    assert spec.capabilities >= {Capability.HOST_MEMORY, Capability.MULTI_PROCESS, Capability.NOTIFICATIONS}
    assert Capability.CUDA_MEMORY not in spec.capabilities
    assert [r.distribution for r in registry.records() if r.name == "mooncake"] == ["kvbridge-mooncake"]


def test_importing_the_plugin_does_not_import_mooncake() -> None:
    import subprocess
    import sys

    code = "import sys, kvbridge_mooncake, kvbridge_mooncake.backend; print('mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@NEEDS_MOONCAKE
def test_registry_builds_a_working_backend() -> None:
    registry = Registry.build(allow=["mooncake"])
    backend = registry.create_backend("mooncake", name="via-registry", options={"protocol": "tcp"})
    try:
        assert isinstance(backend, TransferBackend) and isinstance(backend, MooncakeBackend)
        assert backend.session.startswith("127.0.0.1:")
    finally:
        backend.close()


def test_probe_names_the_missing_system_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)

    def no_lib(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    result = kvbridge_mooncake.probe()
    assert not result.available and "libibverbs.so.1" in result.reason
    assert result.hint == "apt-get install -y --no-install-recommends libibverbs1"


def test_probe_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    result = kvbridge_mooncake.probe()
    assert not result.available and "not installed" in result.reason
    assert result.hint.endswith("pip install mooncake-transfer-engine-non-cuda")


def test_import_error_hints() -> None:
    assert probe_mod.hint_for(ImportError("libibverbs.so.1: cannot open")) == probe_mod.APT_HINT
    assert "non-cuda" in probe_mod.hint_for(ImportError("libcudart.so.12: cannot open shared object file"))
    assert probe_mod.hint_for(ImportError("No module named 'mooncake'")) == probe_mod.PIP_HINT


def test_options() -> None:
    opts = MooncakeOptions.parse(None, env={})
    assert (opts.protocol, opts.host) == ("tcp", "127.0.0.1")
    assert (opts.chunk, opts.window) == (DEFAULT_CHUNK, DEFAULT_WINDOW)
    assert DEFAULT_CHUNK * DEFAULT_WINDOW < 2048
    rdma = MooncakeOptions.parse({"protocol": "RDMA", "device": "mlx5_0,mlx5_1"}, env={})
    assert (rdma.protocol, rdma.device) == ("rdma", "mlx5_0,mlx5_1")
    assert MooncakeOptions.parse({"window": "4"}, env={}).chunk == (2048 - 128) // 4
    bigger_queue = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"}
    assert MooncakeOptions.parse(None, env=bigger_queue).chunk == (8192 - 128) // 2
    with pytest.raises(ValueError, match="unknown mooncake option"):
        MooncakeOptions.parse({"protocl": "tcp"}, env={})
    with pytest.raises(ValueError, match="not one of"):
        MooncakeOptions.parse({"protocol": "udp"}, env={})
    with pytest.raises(ValueError, match="exceeds"):
        MooncakeOptions.parse({"chunk": "2048", "window": "2"}, env={})
    with pytest.raises(ValueError, match="positive"):
        MooncakeOptions.parse({"workers": "0"}, env={})


def test_legacy_tcp_framing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(PluginUnavailableError, match="unacknowledged"):
        create_engine(MooncakeOptions.parse(None))


@NEEDS_MOONCAKE
@pytest.mark.skipif(bool(glob.glob("/sys/class/infiniband/*")), reason="this host has an RDMA device")
def test_rdma_without_a_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with pytest.raises(PluginUnavailableError, match="RDMA device"):
        create_engine(MooncakeOptions.parse({"protocol": "rdma"}))


def test_topology_parsing() -> None:
    assert not has_hca('{"cpu:0": [[], []]}')
    assert has_hca('{"cpu:0": [["mlx5_0"], []], "cpu:1": [[], ["mlx5_1"]]}')
    assert not has_hca("not json")


@NEEDS_MOONCAKE
def test_the_engine_leaves_the_process_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_FORCE_TCP (read by initialize) and MC_LOG_LEVEL (read when the module loads) are set only around
    those calls and only when the user has not set them; a value the user set is never overwritten."""
    import os

    for key in ("MC_FORCE_TCP", "MC_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    engine, session = create_engine(MooncakeOptions.parse(None))
    assert session.startswith("127.0.0.1:") and dict(os.environ) == before
    del engine
    monkeypatch.setenv("MC_FORCE_TCP", "yes-mine")
    engine, _ = create_engine(MooncakeOptions.parse(None))
    assert os.environ["MC_FORCE_TCP"] == "yes-mine"
    del engine


def test_option_errors_name_the_key_and_the_closest_one() -> None:
    with pytest.raises(ValueError, match=r"unknown mooncake option 'protocl' \(did you mean 'protocol'\?\)"):
        MooncakeOptions.parse({"protocl": "tcp"}, env={})
    with pytest.raises(ValueError, match=r"mooncake option window='many'"):
        MooncakeOptions.parse({"window": "many"}, env={})
    assert MooncakeBackend.options_schema.__name__ == "MooncakeOptionsSchema"

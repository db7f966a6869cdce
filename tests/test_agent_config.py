"""AgentConfig refuses timeouts that would break liveness (nan, inf, negative, zero, a heartbeat not below the
peer timeout), naming the field; so do the SGLang adapter's environment variables, which build one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbridge.agent import AgentConfig
from kvbridge.errors import KVBridgeError

FIELDS = ("heartbeat_interval_s", "peer_timeout_s", "bootstrap_timeout_s", "waiting_timeout_s")
BAD: list[Any] = [float("nan"), float("inf"), -1.0, 0.0, 0, "3", True, None]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_a_bad_timeout_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"AgentConfig.{field}="):
        AgentConfig(**{field: value})


def test_a_heartbeat_not_below_the_peer_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s=3.0 must be below peer_timeout_s=3.0"):
        AgentConfig(heartbeat_interval_s=3.0, peer_timeout_s=3.0)
    with pytest.raises(ValueError, match="writer_exit_grace_s"):
        AgentConfig(writer_exit_grace_s=float("nan"))
    AgentConfig(heartbeat_interval_s=0.05, peer_timeout_s=0.3)      # tight but valid


def _sglang_settings() -> Any:
    path = Path(__file__).resolve().parents[1] / "adapters" / "sglang" / "src" / "kvbridge_sglang" / "settings.py"
    spec = importlib.util.spec_from_file_location("_kvbridge_sglang_settings", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up there
        spec.loader.exec_module(module)
    return module.Settings


@pytest.mark.parametrize("variable", ["KVBRIDGE_PEER_TIMEOUT_S", "KVBRIDGE_HEARTBEAT_S", "KVBRIDGE_BOOTSTRAP_TIMEOUT_S",
                                      "KVBRIDGE_WAITING_TIMEOUT_S", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                                      "KVBRIDGE_DRAIN_TIMEOUT_S"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "soon"])
def test_the_sglang_environment_refuses_bad_timeouts_naming_the_variable(variable: str, value: str) -> None:
    settings = _sglang_settings()
    with pytest.raises(KVBridgeError, match=variable):
        settings.from_env(env={variable: value, "KVBRIDGE_BACKEND": "loopback"}).agent_config()


def test_a_zero_sglang_heartbeat_is_refused_naming_the_variable() -> None:
    """0 would busy-loop: kvbridge's one schema (which the adapter's variables feed) refuses it."""
    settings = _sglang_settings()
    with pytest.raises(ValueError, match="heartbeat_interval_s='0' \\(from KVBRIDGE_HEARTBEAT_S\\)"):
        settings.from_env(env={"KVBRIDGE_HEARTBEAT_S": "0", "KVBRIDGE_BACKEND": "loopback"}).agent_config()

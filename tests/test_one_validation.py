"""One validation of every setting, whichever way it arrives (issue 26, item 7): a keyword of ``load_settings``,
a ``KVBRIDGE_*`` variable, a TOML file, vLLM's ``kv_connector_extra_config`` and the SGLang adapter's
environment all feed kvbridge's one schema (``kvbridge.settings.Settings``), and ``AgentConfig`` refuses the
same values; each refusal names the key (and where it came from). Before, 21 of 36 bad timeouts were accepted
through AgentConfig, the SGLang environment and vLLM's extra config; a peer timeout of nan left a killed
prefill's rooms Transferring."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbridge.agent import AgentConfig
from kvbridge.settings import SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("heartbeat_interval_s", "peer_timeout_s", "bootstrap_timeout_s", "waiting_timeout_s")
BAD_TEXT = ["nan", "NaN", "inf", "-inf", "1e999", "-1", "0", "soon", " "]
BAD_VALUES: list[Any] = [float("nan"), float("inf"), -1.0, 0, 0.0, "soon", None, [1], {"s": 1}]


def _adapter_settings(adapter: str) -> Any:
    """The adapter's settings module, loaded by path (its package __init__ imports the engine)."""
    path = ROOT / "adapters" / adapter / "src" / f"kvbridge_{adapter}" / "settings.py"
    name = f"_one_validation_{adapter}_settings"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.Settings


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_a_keyword_and_the_agent_config_refuse_it_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(SettingsError, match=f"setting {key}="):
        load_settings(env={}, check_backend=False, **{key: value})
    if value is not None:
        with pytest.raises(ValueError, match=f"AgentConfig.{key}="):
            AgentConfig(**{key: value})


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("text", BAD_TEXT)
def test_the_environment_and_a_file_refuse_it_naming_the_source(key: str, text: str, tmp_path: Path) -> None:
    variable = "KVBRIDGE_" + key.upper()
    with pytest.raises(SettingsError, match=f"from {variable}"):
        load_settings(env={variable: text}, check_backend=False)
    if text.strip():
        file = tmp_path / "kvbridge.toml"
        file.write_text(f"{key} = {text if text[-1].isdigit() or text in ('nan', 'inf', '-inf') else repr(text)}\n")
        with pytest.raises(SettingsError, match=f"{key}=.*from {file}"):
            load_settings(file, env={}, check_backend=False)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", BAD_VALUES + BAD_TEXT, ids=repr)
def test_vllms_extra_config_refuses_it_naming_the_key(key: str, value: Any) -> None:
    settings = _adapter_settings("vllm")
    with pytest.raises(ValueError, match=key):
        settings.from_extra({key: value}, env={})


SGLANG_VARIABLES = ["KVBRIDGE_PEER_TIMEOUT_S", "KVBRIDGE_HEARTBEAT_S", "KVBRIDGE_HEARTBEAT_INTERVAL_S",
                    "KVBRIDGE_BOOTSTRAP_TIMEOUT_S", "KVBRIDGE_WAITING_TIMEOUT_S",
                    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                    "KVBRIDGE_DRAIN_TIMEOUT_S"]


@pytest.mark.parametrize("variable", SGLANG_VARIABLES)
@pytest.mark.parametrize("text", [t for t in BAD_TEXT if t != "0"])
def test_the_sglang_environment_refuses_it_naming_the_variable(variable: str, text: str) -> None:
    settings = _adapter_settings("sglang")
    with pytest.raises(ValueError, match=variable):
        settings.from_env(env={variable: text, "KVBRIDGE_BACKEND": "loopback"})


def test_a_heartbeat_not_below_the_peer_timeout_is_refused_on_every_path() -> None:
    with pytest.raises(SettingsError, match="heartbeat_interval_s=3.0 must be below peer_timeout_s=3.0"):
        load_settings(env={"KVBRIDGE_HEARTBEAT_INTERVAL_S": "3"}, check_backend=False)
    with pytest.raises(ValueError, match="must be below peer_timeout_s"):
        _adapter_settings("vllm").from_extra({"heartbeat_interval_s": 5, "peer_timeout_s": 4}, env={})
    with pytest.raises(ValueError, match="must be below peer_timeout_s=10.0"):      # SGLang's default peer timeout
        _adapter_settings("sglang").from_env(env={"KVBRIDGE_HEARTBEAT_S": "10", "KVBRIDGE_BACKEND": "loopback"})


def test_the_adapters_read_the_same_keys_with_their_engines_defaults() -> None:
    """Every agent option reaches the adapters through the one schema (checksums, staging, grace...), with the
    precedence the schema documents; SGLang's own timeouts stay its defaults."""
    vllm = _adapter_settings("vllm").from_extra({"peer_timeout_s": 7, "checksums": True},
                                                env={"KVBRIDGE_PEER_TIMEOUT_S": "9", "KVBRIDGE_STAGING_BYTES": "64MiB"})
    assert vllm.agent.peer_timeout_s == 7.0                      # the extra config wins over the environment
    assert vllm.agent_config().staging_bytes == 64 << 20 and vllm.agent_config().checksums
    sglang = _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_STAGING_MIB": "8",
                                                       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "42",
                                                       "KVBRIDGE_WRITER_EXIT_GRACE_S": "0.25"})
    config = sglang.agent_config()
    assert (config.staging_bytes, config.waiting_timeout_s, config.bootstrap_timeout_s) == (8 << 20, 42.0, 300.0)
    assert (config.peer_timeout_s, config.heartbeat_interval_s, config.writer_exit_grace_s) == (10.0, 1.0, 0.25)
    own = _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_WAITING_TIMEOUT_S": "5",
                                                    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "42"})
    assert own.agent_config().waiting_timeout_s == 5.0          # kvbridge's own variable wins over SGLang's


def test_adapter_only_keys_are_validated_by_the_same_machinery() -> None:
    with pytest.raises(ValueError, match="KVBRIDGE_SWA_WINDOW"):
        _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_SWA_WINDOW": "-4"})
    with pytest.raises(ValueError, match="KVBRIDGE_DEVICE"):
        _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_DEVICE": "tpu"})
    with pytest.raises(ValueError, match="KVBRIDGE_STAGING_MIB"):
        _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_STAGING_MIB": "nan"})
    for text in BAD_TEXT:
        with pytest.raises(ValueError, match="KVBRIDGE_TOPOLOGY_RECHECK_S"):
            _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback",
                                                      "KVBRIDGE_TOPOLOGY_RECHECK_S": text})
    ok = _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback",
                                                   "KVBRIDGE_TOPOLOGY_RECHECK_S": "0.5"})
    assert ok.topology_recheck_s == 0.5
    assert _adapter_settings("sglang").from_env(env={"KVBRIDGE_BACKEND": "loopback"}).topology_recheck_s == 2.0
    with pytest.raises(ValueError, match="connect_timeout_s"):
        _adapter_settings("vllm").from_extra({"connect_timeout_s": float("nan")}, env={})
    with pytest.raises(ValueError, match="kv_layout"):
        _adapter_settings("vllm").from_extra({"kv_layout": "xyz"}, env={})

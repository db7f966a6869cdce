"""One configuration (issue 15 item 4): the msgspec schema of kvbridge.settings, filled from keyword arguments,
KVBRIDGE_* variables and a TOML file; unknown keys and wrong types refused by name; AgentConfig and the backends'
options built from it; the README's table generated from the schema; KVBRIDGE_LOG in every process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.agent import AgentConfig
from kvbridge.registry import Registry
from kvbridge.settings import (
    AGENT_KEYS,
    Settings,
    SettingsError,
    env_defaults,
    installed_backend_schemas,
    load_settings,
    options_table,
    parse_size,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- settings table: begin -->", "<!-- settings table: end -->"


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvbridge.toml"
    path.write_text(text)
    return path


def test_defaults_are_agent_configs_defaults() -> None:
    assert load_settings(env={}).agent_config() == AgentConfig()


def test_the_schema_covers_every_agent_config_field() -> None:
    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    assert set(AGENT_KEYS) == fields, "kvbridge.settings.Settings must name every AgentConfig field"
    defaults = load_settings(env={})
    for name in fields - {"secret", "backend_options"}:
        assert getattr(defaults, name) == getattr(AgentConfig(), name), name


def test_keywords_over_environment_over_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'backend = "loopback"\npeer_timeout_s = 10\nwaiting_timeout_s = 50\n'
                           'heartbeat_interval_s = 0.2\nstaging_bytes = "8MiB"\n')
    env = {"KVBRIDGE_WAITING_TIMEOUT_S": "60", "KVBRIDGE_HEARTBEAT_INTERVAL_S": "0.3"}
    s = load_settings(path, env=env, heartbeat_interval_s=0.4)
    assert (s.peer_timeout_s, s.waiting_timeout_s, s.heartbeat_interval_s) == (10.0, 60.0, 0.4)
    assert s.staging_bytes == 8 << 20
    config = s.agent_config()
    assert isinstance(config, AgentConfig)
    assert (config.peer_timeout_s, config.waiting_timeout_s, config.heartbeat_interval_s) == (10.0, 60.0, 0.4)


def test_the_file_may_come_from_kvbridge_config(tmp_path: Path) -> None:
    path = _toml(tmp_path, "peer_timeout_s = 7\n")
    assert load_settings(env={"KVBRIDGE_CONFIG": str(path)}).peer_timeout_s == 7.0


def test_environment_values_are_typed() -> None:
    env = {"KVBRIDGE_SECRET": "s3cret", "KVBRIDGE_STAGING": "NEVER", "KVBRIDGE_STAGING_BELOW_BYTES": "64KiB",
           "KVBRIDGE_STAGING_BYTES": "0", "KVBRIDGE_METRICS_PORT": "9400",
           "KVBRIDGE_BACKEND_OPTIONS": "a=1, b = two"}
    s = load_settings(env=env, check_backend=False)
    assert (s.secret, s.staging, s.staging_below_bytes, s.staging_bytes, s.metrics_port) == \
        ("s3cret", "never", 64 << 10, 0, 9400)
    assert s.backend_options == {"a": "1", "b": "two"}
    assert s.agent_config().secret == b"s3cret"
    assert load_settings(env={"KVBRIDGE_STAGING_BELOW_BYTES": "none"}).staging_below_bytes is None


@pytest.mark.parametrize("source, message", [
    ("keyword", r"unknown setting 'peer_timout_s' \(from keyword argument\) \(did you mean 'peer_timeout_s'\?\)"),
    ("file", r"unknown setting 'peer_timout_s' \(from .*kvbridge.toml\) \(did you mean 'peer_timeout_s'\?\)"),
    ("env", r"unknown setting KVBRIDGE_PEER_TIMOUT_S in the environment \(did you mean KVBRIDGE_PEER_TIMEOUT_S\?\)"),
])
def test_unknown_keys_are_refused_by_name(tmp_path: Path, source: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        if source == "keyword":
            load_settings(env={}, peer_timout_s=1)
        elif source == "file":
            load_settings(_toml(tmp_path, "peer_timout_s = 1\n"), env={})
        else:
            load_settings(env={"KVBRIDGE_PEER_TIMOUT_S": "1"})


def test_other_kvbridge_variables_are_left_alone() -> None:
    env = {"KVBRIDGE_LONG_TESTS": "1", "KVBRIDGE_PLUGINS": "kv", "KVBRIDGE_SHM_RUN": "x", "KVBRIDGE_REV": "abc",
           "KVBRIDGE_STAGING_MIB": "16", "KVBRIDGE_HEARTBEAT_S": "1", "KVBRIDGE_SOMETHING_ELSE": "1"}
    assert load_settings(env=env) == Settings()


@pytest.mark.parametrize("kwargs, message", [
    ({"peer_timeout_s": "soon"}, r"setting peer_timeout_s='soon' \(from keyword argument\): expected float > 0"),
    ({"peer_timeout_s": -1}, r"peer_timeout_s=-1 .*expected float > 0"),
    ({"staging": "sometimes"}, r"staging='sometimes' .*expected one of 'auto', 'always', 'never'"),
    ({"staging_bytes": "12 furlongs"}, r"staging_bytes='12 furlongs' .*expected int >= 0"),
    ({"metrics_port": 70000}, r"metrics_port=70000 .*expected int >= 0 and <= 65535"),
])
def test_wrong_types_are_refused_with_the_key(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(env={}, **kwargs)


def test_a_wrong_type_in_the_environment_names_the_variable() -> None:
    with pytest.raises(SettingsError, match=r"peer_timeout_s='x' \(from KVBRIDGE_PEER_TIMEOUT_S\)"):
        load_settings(env={"KVBRIDGE_PEER_TIMEOUT_S": "x"})


def test_a_bad_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(_toml(tmp_path, "peer_timeout_s = = 1\n"), env={})
    with pytest.raises(SettingsError, match="cannot read the configuration file"):
        load_settings(tmp_path / "missing.toml", env={})


def test_sizes() -> None:
    assert [parse_size(t) for t in ("4096", "4KiB", "4k", "32MiB", "1GiB", "2 MB")] == \
        [4096, 4096, 4096, 32 << 20, 1 << 30, 2 << 20]
    with pytest.raises(ValueError):
        parse_size("lots")


def _installed(name: str) -> bool:
    return name in Registry.build().backend_names(available_only=False)


@pytest.mark.skipif(not _installed("nixl"), reason="kvbridge-nixl is not installed")
def test_backend_options_are_checked_by_the_backends_schema(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'backend = "nixl"\n[backend_options]\nucx_tls = "tcp"\nnum_threads = 2\n'
                           "progress_thread = false\n")
    s = load_settings(path, env={})
    assert s.agent_config().backend_options == {"ucx_tls": "tcp", "num_threads": "2", "progress_thread": "false"}
    from kvbridge_nixl.options import NixlOptions

    assert NixlOptions.parse(s.agent_config().backend_options).progress_thread is False
    with pytest.raises(SettingsError, match=r"unknown nixl option 'ucx_tsl' \(did you mean 'ucx_tls'\?\)"):
        load_settings(env={"KVBRIDGE_BACKEND": "nixl", "KVBRIDGE_BACKEND_OPTIONS": "ucx_tsl=tcp"})
    with pytest.raises(SettingsError, match=r"nixl option num_threads='two': expected int >= 0"):
        load_settings(env={}, backend="nixl", backend_options={"num_threads": "two"})


@pytest.mark.skipif(not _installed("mooncake"), reason="kvbridge-mooncake is not installed")
def test_mooncake_options_are_checked_too() -> None:
    with pytest.raises(SettingsError, match=r"mooncake option protocol='udp'"):
        load_settings(env={}, backend="mooncake", backend_options={"protocol": "udp"})


def test_readme_table_is_generated_from_the_schema() -> None:
    """README "Configuration" holds options_table() verbatim (regenerate: python -c 'from kvbridge.settings
    import options_table; print(options_table())')."""
    text = README.read_text()
    assert BEGIN in text and END in text, "README.md lacks the settings table markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    schemas = installed_backend_schemas()
    for name in ("nixl", "mooncake"):
        if name not in schemas:
            pytest.skip(f"kvbridge-{name} is not installed: its table cannot be generated here")
    assert table == options_table(schemas), "README.md's settings table is stale: regenerate it"


def test_env_defaults_never_overwrite_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_TEST_A", raising=False)
    monkeypatch.setenv("KVBRIDGE_TEST_B", "mine")
    with env_defaults({"KVBRIDGE_TEST_A": "1", "KVBRIDGE_TEST_B": "theirs"}) as added:
        assert added == {"KVBRIDGE_TEST_A": "1"}
        assert (os.environ["KVBRIDGE_TEST_A"], os.environ["KVBRIDGE_TEST_B"]) == ("1", "mine")
    assert "KVBRIDGE_TEST_A" not in os.environ and os.environ["KVBRIDGE_TEST_B"] == "mine"


@pytest.mark.parametrize("entry", [
    "import kvbridge.agent",                                          # a library user
    "from kvbridge.cli import main",                                  # the command line
    "import kvbridge_nixl",                                           # a plugin's own tool
])
def test_kvbridge_log_is_honoured_by_every_entry_point(entry: str) -> None:
    code = f"{entry}\nimport logging\nlogging.getLogger('kvbridge.probe').info('visible at INFO')\n" \
           "logging.getLogger('kvbridge.probe').debug('hidden at INFO')\n"
    env = {**os.environ, "KVBRIDGE_LOG": "info"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "kvbridge.probe INFO visible at INFO" in done.stderr
    assert "hidden" not in done.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                           env={k: v for k, v in os.environ.items() if k != "KVBRIDGE_LOG"})
    assert "visible" not in quiet.stderr


def test_a_bad_log_level_is_reported_not_fatal() -> None:
    done = subprocess.run([sys.executable, "-c", "import kvbridge"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVBRIDGE_LOG": "loud"}, check=False)
    assert done.returncode == 0 and "KVBRIDGE_LOG='loud'" in done.stderr

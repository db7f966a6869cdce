"""kvbridge-sglang's options: environment variables (SGLang's command line has no room for them).

One configuration: every agent option is a key of kvbridge's own schema (:class:`kvbridge.settings.Settings`),
read from its ``KVBRIDGE_<KEY>`` variable (``KVBRIDGE_PEER_TIMEOUT_S``, ``KVBRIDGE_SECRET``,
``KVBRIDGE_CHECKSUMS``, ``KVBRIDGE_STAGING_BYTES``, ...) or ``$KVBRIDGE_CONFIG``'s file, and validated by it;
this adapter only changes some defaults to SGLang's and adds the keys SGLang needs:

| variable | default | meaning |
|---|---|---|
| ``KVBRIDGE_BACKEND`` | ``nixl`` when usable here, else ``loopback`` | the kvbridge transfer backend |
| ``KVBRIDGE_BOOTSTRAP_TIMEOUT_S`` | SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, else 300 | |
| ``KVBRIDGE_WAITING_TIMEOUT_S`` | SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, else 300 | |
| ``KVBRIDGE_PEER_TIMEOUT_S`` | 10 | a silent peer is dead after this long |
| ``KVBRIDGE_HEARTBEAT_S`` | 1 | heartbeat interval (``KVBRIDGE_HEARTBEAT_INTERVAL_S`` too) |
| ``KVBRIDGE_STAGING_MIB`` | 32 | staging area per agent in MiB, 0: off (``KVBRIDGE_STAGING_BYTES`` too) |
| ``KVBRIDGE_HOST`` | SGLang's ``--host``, else 127.0.0.1 | address the ranks' control links bind |
| ``KVBRIDGE_SWA_WINDOW`` | unset (no bound) | the model's sliding window in tokens (both sides must agree) |
| ``KVBRIDGE_DEVICE`` | ``auto`` | ``cpu`` or ``cuda``: where KV and state pointers live (auto: cuda if available) |
| ``KVBRIDGE_TOPOLOGY_RECHECK_S`` | 2 | decode: how often each prefill server's topology is fetched again (a server |
| | | restarted at the same address is found within this long); SGLang's heartbeat to that server |
| ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` | 2 (floor 1, as SGLang) | decode: after this many failed fetches |
| | | in a row the server is gone, as SGLang judges it: its ranks that are also silent past their write |
| | | lease are declared gone (``declare_gone``: their rooms become safe to reuse) |

Every other agent option keeps kvbridge's default (the table in kvbridge's README, "Configuration").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from kvbridge.settings import AdapterSettings, SettingsError, load_settings, parse_options

__all__ = ["SGLangOptions", "Settings", "default_backend"]

#: SGLang's own defaults where they differ from kvbridge's (its bootstrap and waiting timeouts are 300 s)
SGLANG_DEFAULTS: dict[str, Any] = {"bootstrap_timeout_s": 300.0, "waiting_timeout_s": 300.0,
                                   "peer_timeout_s": 10.0, "heartbeat_interval_s": 1.0}
#: adapter variables that set a key of kvbridge's schema (used when that key's own variable is unset)
_ALIASES = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "bootstrap_timeout_s",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "waiting_timeout_s",
            "KVBRIDGE_HEARTBEAT_S": "heartbeat_interval_s", "KVBRIDGE_STAGING_MIB": "staging_bytes"}


class SGLangOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What only this adapter reads (``KVBRIDGE_HOST``, ``KVBRIDGE_SWA_WINDOW``, ``KVBRIDGE_DEVICE``,
    ``KVBRIDGE_TOPOLOGY_RECHECK_S``, SGLang's ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE``)."""

    host: str = "127.0.0.1"
    swa_window: Annotated[int, msgspec.Meta(gt=0)] | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    topology_recheck_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 2.0
    health_failures: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2


def default_backend() -> str:
    """``nixl`` when its plugin loads and its engine imports here, else ``loopback``."""
    try:
        from kvbridge.registry import Registry

        if "nixl" in Registry.build().backend_names(available_only=True):
            return "nixl"
    except Exception:   # noqa: BLE001 - discovery problems mean: use the built-in backend
        pass
    return "loopback"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings(AdapterSettings):
    """The agent's settings (kvbridge's one schema, ``agent``) and this adapter's own options."""

    options: SGLangOptions

    @classmethod
    def from_env(cls, server_args: Any = None, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        defaults: dict[str, Any] = dict(SGLANG_DEFAULTS)
        aliased: dict[str, Any] = {}           # an alias counts as its key's own variable, when that is unset
        sources: dict[str, str] = {}
        for variable, key in _ALIASES.items():
            text = env.get(variable)
            if text and not env.get("KVBRIDGE_" + key.upper()):
                aliased[key] = _mib(variable, text) if variable == "KVBRIDGE_STAGING_MIB" else text
                sources[key] = variable
        if not env.get("KVBRIDGE_BACKEND"):
            defaults["backend"] = default_backend()
        host = env.get("KVBRIDGE_HOST") or getattr(server_args, "host", None) or "127.0.0.1"
        own = {"host": "127.0.0.1" if host in ("0.0.0.0", "::") else str(host),
               "swa_window": env.get("KVBRIDGE_SWA_WINDOW") or None, "device": env.get("KVBRIDGE_DEVICE") or "auto"}
        if env.get("KVBRIDGE_TOPOLOGY_RECHECK_S"):
            own["topology_recheck_s"] = env["KVBRIDGE_TOPOLOGY_RECHECK_S"]
        failures = env.get("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")
        if failures:                               # SGLang floors it at 1
            own["health_failures"] = str(max(1, int(failures))) if failures.strip().lstrip("-").isdigit() \
                else failures
        try:
            agent = load_settings(env=env, check_backend=False, defaults=defaults, sources=sources, **aliased)
            options = parse_options(SGLangOptions, own, "kvbridge-sglang setting",
                                    {"swa_window": "KVBRIDGE_SWA_WINDOW", "device": "KVBRIDGE_DEVICE",
                                     "host": "KVBRIDGE_HOST", "topology_recheck_s": "KVBRIDGE_TOPOLOGY_RECHECK_S",
                                     "health_failures": "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"})
        except SettingsError as exc:
            raise SettingsError(f"kvbridge-sglang: {exc}") from None
        return cls(agent=agent, options=options)

    def local_addresses(self) -> tuple[str, ...]:
        """What the ranks' links bind; the adapter adds SGLang's ``--host`` (where the prefill's bootstrap
        server binds) with ``with_local_secret(host)``, on both roles so that they decide alike."""
        return (self.options.host,)

    # -- what the connector reads besides AdapterSettings' ---------------------------------------------------
    @property
    def secret(self) -> bytes | None:
        return self.secret_bytes

    @property
    def host(self) -> str:
        return self.options.host

    @property
    def swa_window(self) -> int | None:
        return self.options.swa_window

    @property
    def device(self) -> str:
        return self.options.device

    @property
    def topology_recheck_s(self) -> float:
        return self.options.topology_recheck_s

    @property
    def health_failures(self) -> int:
        return self.options.health_failures

    @property
    def staging_bytes(self) -> int:
        return self.agent.staging_bytes


def _mib(variable: str, text: str) -> int:
    try:
        mib = float(text)
    except ValueError:
        raise SettingsError(f"kvbridge-sglang: {variable}={text!r:.60} is not a number of MiB") from None
    if not 0 <= mib < (1 << 28):           # NaN fails both comparisons
        raise SettingsError(f"kvbridge-sglang: {variable}={text!r:.60} must be a number of MiB >= 0")
    return int(mib * (1 << 20))

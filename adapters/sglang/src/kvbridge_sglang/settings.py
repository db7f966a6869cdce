"""kvbridge-sglang's options: environment variables (SGLang's command line has no room for them).

| variable | default | meaning |
|---|---|---|
| ``KVBRIDGE_BACKEND`` | ``nixl`` when usable here, else ``loopback`` | the kvbridge transfer backend |
| ``KVBRIDGE_SECRET`` | unset | shared secret: HMAC on control frames, bootstrap and topology requests |
| ``KVBRIDGE_HOST`` | SGLang's ``--host``, else 127.0.0.1 | address the ranks' control links bind |
| ``KVBRIDGE_ALLOW_INSECURE`` | unset | ``1``: bind a non-loopback address without a secret (else refused) |
| ``KVBRIDGE_SWA_WINDOW`` | unset (no bound) | the model's sliding window in tokens (both sides must agree) |
| ``KVBRIDGE_DEVICE`` | ``auto`` | ``cpu`` or ``cuda``: where KV and state pointers live (auto: cuda if available) |
| ``KVBRIDGE_STAGING_MIB`` | 32 | staging area per agent (0: off) |
| ``KVBRIDGE_BOOTSTRAP_TIMEOUT_S`` | SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, else 300 | |
| ``KVBRIDGE_WAITING_TIMEOUT_S`` | SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, else 300 | |
| ``KVBRIDGE_PEER_TIMEOUT_S`` | 10 | a silent peer is dead after this long |
| ``KVBRIDGE_HEARTBEAT_S`` | 1 | heartbeat interval |
| ``KVBRIDGE_BACKEND_OPTIONS`` | unset | ``key=value,key=value`` passed to the backend |
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.agent import AgentConfig
from kvbridge.errors import KVBridgeError


def _float(env: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    """The first of ``names`` set in ``env``, as a finite number >= 0 of seconds; an error naming the variable."""
    for name in names:
        value = env.get(name)
        if value:
            try:
                number = float(value)
            except ValueError:
                raise KVBridgeError(f"{name}={value!r:.60} is not a number of seconds") from None
            if not math.isfinite(number) or number < 0:
                raise KVBridgeError(f"{name}={value!r:.60} must be a finite number of seconds >= 0")
            return number
    return default


def default_backend() -> str:
    """``nixl`` when its plugin loads and its engine imports here, else ``loopback``."""
    try:
        from kvbridge.registry import Registry

        if "nixl" in Registry.build().backend_names(available_only=True):
            return "nixl"
    except Exception:   # noqa: BLE001 - discovery problems mean: use the built-in backend
        pass
    return "loopback"


def _flag(env: Mapping[str, str], name: str) -> bool:
    return (env.get(name) or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    backend: str = "loopback"
    secret: bytes | None = None
    host: str = "127.0.0.1"
    allow_insecure: bool = False    # bind a non-loopback address without a secret (refused otherwise)
    swa_window: int | None = None
    device: str = "auto"
    staging_bytes: int = 32 << 20
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    peer_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    drain_timeout_s: float = 10.0   # shutdown: rooms in flight get this long to finish, then fail cleanly
    checksums: bool = False         # decode: per-destination digests of every write, verified on arrival
    backend_options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, server_args: Any = None, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        host = env.get("KVBRIDGE_HOST") or getattr(server_args, "host", None) or "127.0.0.1"
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        options = {}
        for pair in (env.get("KVBRIDGE_BACKEND_OPTIONS") or "").split(","):
            if "=" in pair:
                key, value = pair.split("=", 1)
                options[key.strip()] = value.strip()
        window = env.get("KVBRIDGE_SWA_WINDOW")
        secret = env.get("KVBRIDGE_SECRET")
        return cls(backend=env.get("KVBRIDGE_BACKEND") or default_backend(),
                   secret=secret.encode() if secret else None, host=str(host),
                   allow_insecure=_flag(env, "KVBRIDGE_ALLOW_INSECURE"),
                   swa_window=int(window) if window else None, device=env.get("KVBRIDGE_DEVICE", "auto"),
                   staging_bytes=int(float(env.get("KVBRIDGE_STAGING_MIB", "32")) * (1 << 20)),
                   bootstrap_timeout_s=_float(env, ("KVBRIDGE_BOOTSTRAP_TIMEOUT_S",
                                                    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"), 300.0),
                   waiting_timeout_s=_float(env, ("KVBRIDGE_WAITING_TIMEOUT_S",
                                                  "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"), 300.0),
                   peer_timeout_s=_float(env, ("KVBRIDGE_PEER_TIMEOUT_S",), 10.0),
                   heartbeat_interval_s=_float(env, ("KVBRIDGE_HEARTBEAT_S",), 1.0),
                   drain_timeout_s=_float(env, ("KVBRIDGE_DRAIN_TIMEOUT_S",), 10.0),
                   checksums=_flag(env, "KVBRIDGE_CHECKSUMS"),
                   backend_options=options)

    def agent_config(self) -> AgentConfig:
        return AgentConfig(heartbeat_interval_s=self.heartbeat_interval_s, peer_timeout_s=self.peer_timeout_s,
                           bootstrap_timeout_s=self.bootstrap_timeout_s, waiting_timeout_s=self.waiting_timeout_s,
                           secret=self.secret, staging_bytes=self.staging_bytes, checksums=self.checksums,
                           backend_options=dict(self.backend_options))

"""The connector's settings, read from vLLM's ``kv_connector_extra_config``; defaults work on one host.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge_vllm.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"backend": "nixl",
                                                         "bootstrap": "tcp://10.0.0.5:17600"}}'

Unknown keys are refused with the list of known ones (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvbridge.agent import AgentConfig
from kvbridge.errors import KVBridgeError

__all__ = ["DEFAULT_BOOTSTRAP", "Settings"]

DEFAULT_BOOTSTRAP = "tcp://127.0.0.1:17600"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every key of ``kv_connector_extra_config`` (all optional)."""

    backend: str = "loopback"            # kvbridge transfer backend: loopback (one host), nixl, mooncake, ...
    bootstrap: str = DEFAULT_BOOTSTRAP   # ZMQ bootstrap server every instance of the deployment uses
    serve_bootstrap: bool | None = None  # run the bootstrap server here (default: on prefill instances)
    instance: str = ""                   # this prefill instance's name (default: vllm-<engine_id>)
    host: str = "127.0.0.1"              # address the ranks' control links bind
    secret: str = ""                     # shared secret (HMAC on every control frame); also KVBRIDGE_SECRET
    allow_insecure: bool = False         # bind a non-loopback host without a secret (refused otherwise); also
                                         # KVBRIDGE_ALLOW_INSECURE=1
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 3.0
    bootstrap_timeout_s: float = 30.0    # prefill: how long finished blocks wait for the decode's request
    waiting_timeout_s: float = 120.0     # decode: how long a request waits for its KV
    connect_timeout_s: float = 30.0      # decode: handshake with a prefill instance
    drain_timeout_s: float = 10.0        # shutdown: rooms in flight get this long to finish (0: fail them)
    kv_layout: str = ""                  # cpu | nhd | hnd (default: cpu on CPU, nhd on GPU)
    shm_remap: bool | None = None        # move the decode's KV cache into /dev/shm (default: on for loopback)
    backend_options: dict[str, str] = field(default_factory=dict)
    test_hooks: bool = False             # TESTS ONLY: obey kv_transfer_params "kvbridge_flip_layer" (decode
                                         # corrupts that layer of the arrived blocks) and "kvbridge_delay_send_s"
    dump_dir: str = ""                   # TESTS ONLY: write each request's sent/received blocks here (.npy)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise KVBridgeError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in extra.items():
            default = known[key].default
            if isinstance(default, bool) or key in ("serve_bootstrap", "shm_remap"):
                values[key] = value if value is None else _bool(key, value)
            elif isinstance(default, (int, float)):
                values[key] = _number(key, value, type(default))
            elif key == "backend_options":
                if not isinstance(value, Mapping):
                    raise KVBridgeError(f"kv_connector_extra_config: backend_options={value!r} is not a mapping")
                values[key] = {str(k): str(v) for k, v in value.items()}
            elif not isinstance(value, str):
                raise KVBridgeError(f"kv_connector_extra_config: {key}={value!r:.60} is not a string")
            else:
                values[key] = value
        if "allow_insecure" not in values and os.environ.get("KVBRIDGE_ALLOW_INSECURE"):
            values["allow_insecure"] = _bool("KVBRIDGE_ALLOW_INSECURE", os.environ["KVBRIDGE_ALLOW_INSECURE"])
        if not values.get("secret") and os.environ.get("KVBRIDGE_SECRET"):
            values["secret"] = os.environ["KVBRIDGE_SECRET"]
        return cls(**values)

    def agent_config(self) -> AgentConfig:
        return AgentConfig(heartbeat_interval_s=self.heartbeat_interval_s, peer_timeout_s=self.peer_timeout_s,
                           bootstrap_timeout_s=self.bootstrap_timeout_s, waiting_timeout_s=self.waiting_timeout_s,
                           secret=self.secret_bytes, backend_options=dict(self.backend_options))

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode() if self.secret else None

    def remap_to_shm(self) -> bool:
        return self.backend == "loopback" if self.shm_remap is None else self.shm_remap


def _number(key: str, value: object, kind: type) -> Any:
    """``value`` as ``kind`` (int or float), finite and not negative, or an error naming the key."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = kind(value)
    except (TypeError, ValueError):
        raise KVBridgeError(f"kv_connector_extra_config: {key}={value!r:.60} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise KVBridgeError(f"kv_connector_extra_config: {key}={value!r:.60} must be a finite number >= 0")
    return number


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise KVBridgeError(f"kv_connector_extra_config: {key}={value!r} is not a boolean")

"""The connector's settings, read from vLLM's ``kv_connector_extra_config``; defaults work on one host.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge_vllm.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"backend": "nixl",
                                                         "bootstrap": "tcp://10.0.0.5:17600",
                                                         "peer_timeout_s": 10}}'

One configuration: every agent option is a key of kvbridge's own schema (:class:`kvbridge.settings.Settings`:
timeouts, secret, staging, checksums, backend options...), validated by it; the extra config's keys win over
``KVBRIDGE_*`` variables, which win over ``$KVBRIDGE_CONFIG``'s file. The keys only the connector has are in
:class:`ConnectorOptions`. An unknown key is refused with the list of known ones (a typo must not silently fall
back to a default); a bad value is refused naming its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from kvbridge.settings import AdapterSettings, SettingsError, load_settings, parse_options
from kvbridge.settings import Settings as AgentSettings

__all__ = ["DEFAULT_BOOTSTRAP", "ConnectorOptions", "Settings"]

DEFAULT_BOOTSTRAP = "tcp://127.0.0.1:17600"
_WHERE = "kv_connector_extra_config"


class ConnectorOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The keys of ``kv_connector_extra_config`` that are the connector's own (not agent options)."""

    bootstrap: str = DEFAULT_BOOTSTRAP   # ZMQ bootstrap server every instance of the deployment uses
    serve_bootstrap: bool | None = None  # run the bootstrap server here (default: on prefill instances)
    instance: str = ""                   # this prefill instance's name (default: vllm-<engine_id>)
    host: str = "127.0.0.1"              # address the ranks' control links bind
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=10 * 365 * 86400.0)] = 30.0   # decode: handshake
    # default: cpu on CPU; on a GPU mla for [blocks, block_size, latent] caches, else nhd (FlashAttention);
    # flashinfer / flashinfer_hnd for FlashInfer's [blocks, 2, block_size, heads, head_size]
    kv_layout: Literal["", "cpu", "nhd", "hnd", "flashinfer", "flashinfer_hnd", "mla"] = ""
    shm_remap: bool | None = None        # move the decode's KV cache into /dev/shm (default: on for loopback)
    test_hooks: bool = False             # TESTS ONLY: obey kv_transfer_params "kvbridge_flip_layer" (decode
    #                                      corrupts that layer of the arrived blocks) and "kvbridge_delay_send_s"
    dump_dir: str = ""                   # TESTS ONLY: write each request's sent/received blocks here (.npy)


_CONNECTOR_KEYS = frozenset(f.name for f in msgspec.structs.fields(ConnectorOptions))
_AGENT_KEYS = frozenset(f.name for f in msgspec.structs.fields(AgentSettings))


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings(AdapterSettings):
    """The agent's settings (kvbridge's one schema, ``agent``) and the connector's own options."""

    options: ConnectorOptions

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> Settings:
        """``kv_connector_extra_config`` over the ``KVBRIDGE_*`` environment (``env``, default os.environ)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _CONNECTOR_KEYS - _AGENT_KEYS)
        if unknown:
            raise SettingsError(f"{_WHERE}: unknown keys {unknown}; known: {sorted(_CONNECTOR_KEYS | _AGENT_KEYS)}")
        own = {key: value for key, value in extra.items() if key in _CONNECTOR_KEYS}
        agent_keys = {key: value for key, value in extra.items() if key in _AGENT_KEYS}
        for key, value in agent_keys.items():
            if key == "backend_options" and not isinstance(value, Mapping):
                raise SettingsError(f"{_WHERE}: backend_options={value!r:.60} is not a mapping")
            if key != "backend_options" and not isinstance(value, (str, int, float, bool)):
                raise SettingsError(f"{_WHERE}: {key}={value!r:.60} is not a {_kind(key)}")
        try:
            options = parse_options(ConnectorOptions, _strings_checked(own), f"{_WHERE} key")
            agent = load_settings(env=env, check_backend=False, sources={key: _WHERE for key in agent_keys},
                                  **agent_keys)
        except SettingsError as exc:
            raise SettingsError(f"{_WHERE}: {exc}") from None
        return cls(agent=agent, options=options)

    @classmethod
    def defaults(cls, **extra: Any) -> Settings:
        """Settings of these keys alone, ignoring the environment (tests, examples)."""
        return cls.from_extra(extra, env={})

    # -- what the connector reads besides AdapterSettings' ---------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return self.options.bootstrap

    @property
    def serve_bootstrap(self) -> bool | None:
        return self.options.serve_bootstrap

    @property
    def instance(self) -> str:
        return self.options.instance

    @property
    def host(self) -> str:
        return self.options.host

    @property
    def connect_timeout_s(self) -> float:
        return self.options.connect_timeout_s

    @property
    def kv_layout(self) -> str:
        return self.options.kv_layout

    @property
    def test_hooks(self) -> bool:
        return self.options.test_hooks

    @property
    def dump_dir(self) -> str:
        return self.options.dump_dir

    def local_addresses(self) -> tuple[str, ...]:
        """What the ranks' links bind and the bootstrap server they use: all loopback, with no secret set,
        means one host, and the connector takes the host-local secret (``with_local_secret``)."""
        return (self.options.host, self.options.bootstrap)

    def remap_to_shm(self) -> bool:
        return self.backend == "loopback" if self.options.shm_remap is None else self.options.shm_remap


def _kind(key: str) -> str:
    return "number" if key.endswith(("_s", "_bytes", "_port")) else "string, number or boolean"


def _strings_checked(own: dict[str, Any]) -> dict[str, Any]:
    """The connector's string keys take strings only: ``None`` or a list is never str()-ed into a value."""
    for key in ("bootstrap", "instance", "host", "dump_dir", "kv_layout"):
        if key in own and not isinstance(own[key], str):
            raise SettingsError(f"{_WHERE}: {key}={own[key]!r:.60} is not a string")
    return own

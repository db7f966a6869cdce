"""One configuration: a typed schema (msgspec) of the agent's and the backends' options, filled from keyword
arguments, ``KVBRIDGE_*`` environment variables or a TOML file.

    settings = load_settings(file="kvbridge.toml", peer_timeout_s=10)   # keywords > environment > file
    agent = TransferAgent(..., backend=settings.backend or "loopback", config=settings.agent_config(),
                          registry=settings.registry())                # metrics when metrics_port is set

Precedence, highest first: keyword arguments, the environment (``KVBRIDGE_<KEY>``: ``KVBRIDGE_PEER_TIMEOUT_S=10``,
``KVBRIDGE_BACKEND_OPTIONS="ucx_tls=tcp,num_threads=2"``), the TOML file (``file=``, else ``$KVBRIDGE_CONFIG``),
the defaults. A TOML file holds the same keys at its top level, ``backend_options`` as a table::

    backend = "nixl"
    peer_timeout_s = 10.0
    staging_bytes = "64MiB"
    [backend_options]
    ucx_tls = "tcp"

Unknown keys are refused by name, with the closest known key when there is one; a value of the wrong type is
refused with its key (and where it came from). Sizes (keys ending in ``_bytes``) take ``KiB``/``MiB``/``GiB``
suffixes. ``backend_options`` are checked against the selected backend's own schema (``options_schema`` of
its factory, e.g. ``NixlOptions``) when that backend is installed, and again when the backend is created.

The environment: every ``KVBRIDGE_<KEY>`` of a schema key is read. Other ``KVBRIDGE_*`` variables belong to
other parts of kvbridge (``KVBRIDGE_PLUGINS``, the tests' knobs...) and are left alone, except one that
misspells a key (``KVBRIDGE_PEER_TIMOUT_S``), which is refused with the key it resembles.

:func:`options_table` renders every option with its default as the README's Markdown table.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from kvbridge.errors import KVBridgeError
from kvbridge.protocol.wire import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "AdapterSettings", "Settings", "SettingsError", "env_defaults", "load_settings",
           "options_rows", "options_table", "parse_options", "parse_size"]

ENV_PREFIX = "KVBRIDGE_"
CONFIG_ENV = "KVBRIDGE_CONFIG"
#: KVBRIDGE_* variables of other parts of kvbridge (the registry, the kit, the tests, the adapters): never taken
#: for a misspelt setting, however close their names are.
OTHER_ENV = frozenset({
    "KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS", "KVBRIDGE_SHM_RUN", "KVBRIDGE_KIT_NO_SHRINK",
    "KVBRIDGE_LONG_TESTS", "KVBRIDGE_SOAK_REQUESTS", "KVBRIDGE_CHURN_RESTARTS", "KVBRIDGE_FAULT_MATRIX",
    "KVBRIDGE_BENCH_TORCH", "KVBRIDGE_REV", "KVBRIDGE_GPU_CHECK_ON_CPU", "KVBRIDGE_HOST", "KVBRIDGE_DEVICE",
    "KVBRIDGE_SWA_WINDOW", "KVBRIDGE_STAGING_MIB", "KVBRIDGE_HEARTBEAT_S", "KVBRIDGE_TOPOLOGY_RECHECK_S",
})
T = TypeVar("T")
_A = TypeVar("_A", bound="AdapterSettings")


class SettingsError(KVBridgeError, ValueError):
    """An option is unknown or its value is invalid (the message names the key and where it came from)."""


_MAX_S = 10 * 365 * 86400.0     # timeouts are finite: ten years at most
_MAX_BYTES = 1 << 48            # sizes: 256 TiB at most


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Every option of an agent (and its backend). Defaults suit one host; raise the timeouts across a cluster."""

    backend: Annotated[str, _doc(
        "transfer backend by name (`kvbridge plugins` lists them); empty: the caller's default (`loopback`; "
        "`kvbridge demo`: `nixl` when usable)")] = ""
    backend_options: Annotated[dict[str, Any], _doc(
        "options of the selected backend (tables below); environment: `k=v,k=v`")] = {}
    heartbeat_interval_s: Annotated[float, _doc("how often an agent tells each peer it is alive (s)", gt=0,
                                                le=_MAX_S)] = 0.5
    peer_timeout_s: Annotated[float, _doc("a peer silent this long is dead and its rooms fail (s)", gt=0,
                                          le=_MAX_S)] = 3.0
    bootstrap_timeout_s: Annotated[float, _doc(
        "connect(), and a prefill room waiting for its decode's request (s)", gt=0, le=_MAX_S)] = 30.0
    waiting_timeout_s: Annotated[float, _doc("a decode room waiting for data after send_metadata (s)", gt=0,
                                             le=_MAX_S)] = 120.0
    secret: Annotated[str, _doc("shared secret: HMAC on every control frame (empty: none; see Security)")] = ""
    allow_insecure: Annotated[bool, _doc(
        "ZmqLink/BootstrapServer: bind a non-loopback address without a secret (refused otherwise; logged); "
        "on one host: no local secret file either")] = False
    secret_file: Annotated[str, _doc(
        "no secret set and every address loopback: the secret file this user's ranks on this host share, made "
        "if absent (mode 0600); empty: `$XDG_RUNTIME_DIR/kvbridge/secret`, else `~/.cache/kvbridge/secret`")] = ""
    staging_bytes: Annotated[int, _doc(
        "staging area (host, or on the GPU of CUDA buffers); 0: off", ge=0, le=_MAX_BYTES)] = 32 << 20
    staging: Annotated[Literal["auto", "always", "never"], _doc(
        "when a slice is gathered into the staging area: `auto` (cost model), `always`, `never`")] = "auto"
    staging_below_bytes: Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, _doc(
        "`auto` stages when the average descriptor is smaller than this; unset: the backend's descriptor cost "
        "x the staging throughput")] = None
    staging_piece_bytes: Annotated[int, _doc(
        "a staged write is cut into pieces of at most this much (gather, write and scatter overlap)",
        gt=0, le=_MAX_BYTES)] = 256 << 20
    engine_progress_s: Annotated[Annotated[float, msgspec.Meta(ge=0, le=_MAX_S)] | None, _doc(
        "beside the progress thread, the engine's own calls (handle polls, events()) run a progress step at most "
        "this often: completions are handled as the engine calls instead of when the progress thread next gets "
        "the GIL (lower latency, more of kvbridge's CPU in the engine's thread); unset: never (s)")] = None
    checksums: Annotated[bool, _doc(
        "decode: ask for per-destination digests of every write and verify them on arrival, where the pages live "
        "(host or GPU)")] = False
    prove_writer_death: Annotated[bool, _doc(
        "decode: hold a TCP connection to each prefill rank; its kernel closes it when the process ends, which "
        "makes a killed writer's rooms safe to reuse without declare_gone")] = True
    writer_exit_grace_s: Annotated[float, _doc(
        "after that connection's EOF, how long writes the dead process posted may still land (s)", ge=0,
        le=_MAX_S)] = 0.5
    write_flight_bound_s: Annotated[Annotated[float, msgspec.Meta(ge=0, le=_MAX_S)] | None, _doc(
        "decode: the longest a posted write can stay in flight on this fabric, retransmissions across a partition "
        "included (RDMA: the transport's retry timeout x retry count); set, a prefill silent past its write lease "
        "(twice its peer timeout) plus this bound is fenced without its acknowledgement; unset: only an "
        "acknowledgement, the kernel's proof of its exit or declare_gone fence it (s)")] = None
    min_protocol_version: Annotated[int, _doc(
        "refuse peers that speak an older protocol than this, at the handshake, with both versions named; the "
        "default accepts the oldest release spoken (a rolling upgrade); set it to the current version (7) once "
        "every instance runs this release, so nothing (a forged refusal without a secret included) can make a pair "
        "fall back", ge=MIN_PROTOCOL_VERSION, le=PROTOCOL_VERSION)] = MIN_PROTOCOL_VERSION
    clock_window_s: Annotated[float, _doc(
        "with a secret: a bootstrap request (publish, lookup, watch) whose timestamp is further than this from "
        "the bootstrap server's clock is refused as stale (a replay); both sides log the measured offset once a "
        "minute per address (s)", gt=0, le=_MAX_S)] = 60.0
    drain_timeout_s: Annotated[float, _doc(
        "shutdown (`agent.drain`, the adapters' engine shutdown): rooms in flight get this long to finish, then "
        "fail cleanly; 0: fail them at once (s)", ge=0, le=_MAX_S)] = 10.0
    metrics_port: Annotated[int, _doc(
        "serve Prometheus metrics on this port (needs `kvbridge[metrics]`); 0: no exporter", ge=0,
        le=65535)] = 0
    metrics_host: Annotated[str, _doc(
        "the address the Prometheus exporter binds: 127.0.0.1 (this host only), 0.0.0.0 or a host address for a "
        "scraper on another host")] = "127.0.0.1"
    log: Annotated[str, _doc("log level of kvbridge's loggers on stderr (DEBUG, INFO...); empty: unchanged")] = ""

    def agent_config(self) -> Any:
        """The ``AgentConfig`` these settings describe (``backend_options`` as strings, the secret as bytes)."""
        from kvbridge.agent.config import AgentConfig

        known = {f.name for f in dataclass_fields(AgentConfig)}
        values: dict[str, Any] = {name: getattr(self, name) for name in AGENT_KEYS if name in known}
        values["secret"] = self.secret.encode() if self.secret else None
        values["backend_options"] = {k: _as_text(v) for k, v in self.backend_options.items()}
        return AgentConfig(**values)

    def with_local_secret(self, *addresses: str, env: Mapping[str, str] | None = None) -> Settings:
        """These settings, with the host-local secret (:mod:`kvbridge.local_secret`) as ``secret`` when none is
        set, ``allow_insecure`` is off and every one of ``addresses`` (what the caller binds and advertises:
        hosts, ``host:port``, ``tcp://`` or ``ipc://`` endpoints) is this host's own; else unchanged. Raises
        ``LocalSecretError`` (an ``InsecureSetup``) when that file is unsafe (another owner, mode, symlink)."""
        from kvbridge.local_secret import local_secret

        text = local_secret(configured=self.secret, allow_insecure=self.allow_insecure,
                            secret_file=self.secret_file, addresses=addresses, env=env)
        return self if text is None else msgspec.structs.replace(self, secret=text)

    def registry(self, **build: Any) -> Any:
        """A plugin registry for the agent: with the metrics plugin and the exporter on ``metrics_port`` when
        it is set (``kvbridge.metrics``), else a plain one (no monitor on the hot path)."""
        if self.metrics_port:
            from kvbridge import metrics

            return metrics.instrumented_registry(port=self.metrics_port, addr=self.metrics_host, **build)
        from kvbridge.registry import Registry

        return Registry.build(**build)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSettings:
    """The base of an engine adapter's settings: kvbridge's one schema (``agent``, filled by
    :func:`load_settings` from the engine's configuration) and what every adapter reads of it. An adapter adds
    its own typed options beside it::

        @dataclass(frozen=True, slots=True, kw_only=True)
        class MySettings(AdapterSettings):
            options: MyOptions          # a msgspec Struct, checked with parse_options()
    """

    agent: Settings

    @property
    def backend(self) -> str:
        return self.agent.backend or "loopback"

    @property
    def allow_insecure(self) -> bool:
        return self.agent.allow_insecure

    @property
    def secret_bytes(self) -> bytes | None:
        return self.agent.secret.encode() if self.agent.secret else None

    @property
    def bootstrap_timeout_s(self) -> float:
        return self.agent.bootstrap_timeout_s

    @property
    def drain_timeout_s(self) -> float:
        return self.agent.drain_timeout_s

    def agent_config(self) -> Any:
        """The ``AgentConfig`` of ``agent``."""
        return self.agent.agent_config()

    def local_addresses(self) -> tuple[str, ...]:
        """Every address this engine's parts bind or advertise (an adapter's own keys); none here."""
        return ()

    def with_local_secret(self: _A, *more: str) -> _A:
        """These settings with the host-local secret when no secret is set and :meth:`local_addresses` (and
        ``more``) are all this host's own (:meth:`Settings.with_local_secret`); else unchanged."""
        import dataclasses

        addresses = (*self.local_addresses(), *more)
        agent = self.agent.with_local_secret(*addresses)
        return self if agent is self.agent else dataclasses.replace(self, agent=agent)


#: Settings keys that are AgentConfig fields (the others: which backend, the exporter, the log level).
AGENT_KEYS = ("heartbeat_interval_s", "peer_timeout_s", "bootstrap_timeout_s", "waiting_timeout_s", "secret",
              "staging_bytes", "staging", "staging_below_bytes", "staging_piece_bytes", "engine_progress_s",
              "checksums", "prove_writer_death", "writer_exit_grace_s", "write_flight_bound_s", "min_protocol_version",
              "backend_options")


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---------------------------------------------------------------------------------------------- parsing
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864 (binary units; ``K``, ``KiB``, ``KB`` alike); ValueError otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (e.g. 65536, 64KiB, 32MiB, 1GiB)")
    unit = (match.group(2) or "").upper()
    return int(match.group(1)) * _UNITS[unit[:1] if unit != "B" else "B"]


def _closest(key: str, known: Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _fields(schema: type) -> dict[str, Any]:
    return {f.name: f for f in msgspec.structs.fields(schema)}


def _unwrap(tp: Any) -> tuple[Any, list[Any], bool]:
    """(the type under Annotated and Optional, every Meta on the way, whether None is allowed)."""
    metas: list[Any] = []
    optional = False
    while True:
        if typing.get_origin(tp) is Annotated:
            args = typing.get_args(tp)
            metas += args[1:]
            tp = args[0]
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) == 1:
                optional, tp = True, rest[0]
                continue
        return tp, metas, optional


def _prepare(name: str, tp: Any, value: Any) -> Any:
    """Text from the environment or a file, made convertible: sizes, 'none' for optional keys, lower-case
    choices; anything else is left to msgspec (its non-strict mode reads numbers and booleans from text)."""
    if not isinstance(value, str):
        return value
    base, _, optional = _unwrap(tp)
    if optional and value.strip().lower() in ("", "none", "null", "unset"):
        return None
    if base is int and name.endswith("_bytes"):
        try:
            return parse_size(value)
        except ValueError:
            return value
    if typing.get_origin(base) is Literal:
        return value.strip().lower()
    if base is bool:
        return {"yes": "true", "on": "true", "no": "false", "off": "false"}.get(value.strip().lower(),
                                                                                 value.strip().lower())
    return value


def _expected(tp: Any) -> str:
    base, metas, optional = _unwrap(tp)
    if typing.get_origin(base) is Literal:
        text = "one of " + ", ".join(repr(a) for a in typing.get_args(base))
    else:
        bounds = [f"{op} {getattr(m, attr)}" for m in metas for attr, op in
                  (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if getattr(m, attr, None) is not None]
        text = getattr(base, "__name__", str(base)) + (f" {' and '.join(bounds)}" if bounds else "")
    return text + (" or unset" if optional else "")


def parse_options(schema: type[T], values: Mapping[str, Any] | None, what: str,
                  sources: Mapping[str, str] | None = None) -> T:
    """``values`` (text from the environment or a mapping of strings, or TOML's typed values) as an instance
    of the msgspec Struct ``schema``. SettingsError (a ValueError) names an unknown key (and the closest
    known one) or a key whose value does not fit, ``what`` saying whose options they are ("nixl option");
    ``sources`` tells where each key came from (``{"peer_timeout_s": "KVBRIDGE_PEER_TIMEOUT_S"}``)."""
    known = _fields(schema)
    sources = sources or {}
    prepared: dict[str, Any] = {}
    for key, value in (values or {}).items():
        field = known.get(key)
        if field is None:
            where = f" (from {sources[key]})" if key in sources else ""
            raise SettingsError(f"unknown {what} {key!r}{where}{_closest(key, known)}; known: {', '.join(known)}")
        prepared[key] = _prepare(key, field.type, value)
    try:
        return msgspec.convert(prepared, schema, strict=False)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.(\w+)", str(exc))
        key = match.group(1) if match else ""
        if key not in known:
            raise SettingsError(f"{what}s: {exc}") from None
        where = f" (from {sources[key]})" if key in sources else ""
        raise SettingsError(f"{what} {key}={(values or {})[key]!r}{where}: expected "
                            f"{_expected(known[key].type)}") from None


# ---------------------------------------------------------------------------------------------- sources
def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found]
        except ImportError:
            raise SettingsError(f"reading {path} needs Python 3.11 or `pip install tomli`") from None
    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = tomllib.load(f)
    except OSError as exc:
        raise SettingsError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return data


def _from_env(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    known = _fields(Settings)
    names = {ENV_PREFIX + key.upper(): key for key in known}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV or var in OTHER_ENV:
            continue
        key = names.get(var)
        if key is None and var.upper() in names:
            raise SettingsError(f"{var} in the environment: settings variables are upper case ({var.upper()})")
        if key is None:
            near = difflib.get_close_matches(var, list(names), n=1, cutoff=0.9)
            if near:
                raise SettingsError(f"unknown setting {var} in the environment (did you mean {near[0]}?)")
            continue
        sources[key] = var
        values[key] = _split_options(var, text) if key == "backend_options" else text
    return values, sources


def _split_options(var: str, text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"{var}={text!r}: expected key=value pairs separated by commas")
        out[key.strip()] = value.strip()
    return out


def load_settings(file: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                  check_backend: bool = True, defaults: Mapping[str, Any] | None = None,
                  sources: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from ``overrides`` over the environment (``env``, default ``os.environ``) over the TOML
    ``file`` (default ``$KVBRIDGE_CONFIG``, none when unset) over ``defaults`` (an engine adapter's own
    defaults, e.g. its engine's timeouts) over the schema's defaults. ``sources`` names where an override or
    default came from, for errors (``{"heartbeat_interval_s": "KVBRIDGE_HEARTBEAT_S"}``; else "keyword
    argument"). With ``check_backend``, ``backend_options`` are checked against the selected backend's schema
    when it is installed.

    Engine adapters map their engine's configuration onto this one schema, so every setting is validated the
    same way whichever way it arrives::

        settings = load_settings(check_backend=False, defaults={"peer_timeout_s": 10.0},
                                 peer_timeout_s=extra["peer_timeout_s"], sources={"peer_timeout_s": "extra"})
    """
    env = os.environ if env is None else env
    given = dict(sources or {})
    merged: dict[str, Any] = dict(defaults or {})
    where: dict[str, str] = {key: given.get(key, "the engine adapter's default") for key in merged}
    path = file if file is not None else (env.get(CONFIG_ENV) or None)
    if path is not None:
        data = _read_toml(Path(path))
        merged.update(data)
        where.update({key: str(path) for key in data})
    from_env, env_sources = _from_env(env)
    for key, value in from_env.items():
        if key == "backend_options" and isinstance(merged.get(key), dict):
            value = {**merged[key], **value}
        merged[key] = value
    where.update(env_sources)
    for key, value in overrides.items():
        if key == "backend_options" and isinstance(merged.get(key), dict) and value is not None:
            value = {**merged[key], **dict(value)}
        merged[key] = value
        where[key] = given.get(key, "keyword argument")
    settings = parse_options(Settings, merged, "setting", where)
    if settings.heartbeat_interval_s >= settings.peer_timeout_s:
        raise SettingsError(f"heartbeat_interval_s={settings.heartbeat_interval_s} must be below peer_timeout_s="
                            f"{settings.peer_timeout_s} (a live peer would be judged dead between two heartbeats)")
    if check_backend and settings.backend_options and settings.backend:
        check_backend_options(settings.backend, settings.backend_options)
    return settings


def backend_schema(backend: str, registry: Any = None) -> type | None:
    """The msgspec schema of a backend's options (``options_schema`` of its factory), or None when the
    backend is not installed or declares none."""
    from kvbridge.registry import Registry
    from kvbridge.specs import BackendSpec, resolve

    registry = registry or Registry.build()
    record = next((r for r in registry.records() if r.name == backend and isinstance(r.spec, BackendSpec)), None)
    if record is None:
        return None
    assert isinstance(record.spec, BackendSpec)
    try:
        factory = resolve(record.spec.factory)
    except Exception:  # noqa: BLE001 - a factory that cannot be imported declares nothing we can check
        return None
    schema = getattr(factory, "options_schema", None)
    return schema if isinstance(schema, type) and issubclass(schema, msgspec.Struct) else None


def check_backend_options(backend: str, options: Mapping[str, Any], registry: Any = None) -> None:
    """Refuse options the backend does not know or whose values do not fit (when it is installed)."""
    schema = backend_schema(backend, registry)
    if schema is not None:
        parse_options(schema, {k: _as_text(v) for k, v in options.items()}, f"{backend} option")


# ---------------------------------------------------------------------------------------------- the table
def _default_text(field: Any) -> str:
    default = field.default
    if default is msgspec.NODEFAULT and field.default_factory is not msgspec.NODEFAULT:
        default = field.default_factory()
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    if isinstance(default, int) and field.name.endswith("_bytes") and default >= 1 << 20 and default % (1 << 20) == 0:
        return f"`{default >> 20}MiB`"
    if default == "" or default == {}:
        return "empty"
    return f"`{default}`"


def options_rows(schema: type, env_prefix: str | None = ENV_PREFIX) -> list[tuple[str, str, str, str]]:
    """(key, environment variable or "", default, description) for every field of ``schema``."""
    rows = []
    for field in msgspec.structs.fields(schema):
        meta = typing.get_args(field.type)[1:] if typing.get_origin(field.type) is Annotated else ()
        text = " ".join(m.description for m in meta if getattr(m, "description", None))
        var = f"`{env_prefix}{field.name.upper()}`" if env_prefix else ""
        rows.append((f"`{field.name}`", var, _default_text(field), text))
    return rows


def options_table(backends: Mapping[str, type] | None = None) -> str:
    """The README's table: every setting with its environment variable and default, then one table per
    backend schema in ``backends`` (name -> schema; default: every installed backend that declares one)."""
    lines = ["| key | environment | default | meaning |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in options_rows(Settings)]
    if backends is None:
        backends = installed_backend_schemas()
    for name, schema in sorted(backends.items()):
        lines += ["", f"`backend_options` of `{name}`:", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| {key} | {default} | {text} |" for key, _, default, text in options_rows(schema, None)]
    return "\n".join(lines)


def installed_backend_schemas(registry: Any = None) -> dict[str, type]:
    """name -> options schema of every installed backend that declares one."""
    from kvbridge.registry import Registry

    registry = registry or Registry.build()
    out = {}
    for name in registry.backend_names(available_only=False):
        schema = backend_schema(name, registry)
        if schema is not None:
            out[name] = schema
    return out


# ---------------------------------------------------------------------------------------------- engines' environment
_ENV_LOCK = threading.RLock()


@contextlib.contextmanager
def env_defaults(defaults: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """For engines that read a setting only from the process environment (Mooncake's ``MC_FORCE_TCP``,
    glog's ``GLOG_minloglevel``): set each variable the user has *not* set, for the duration only, then
    remove it again; one the user set is never overwritten (their value wins). Serialised (the
    environment is process-wide). Yields what it set."""
    with _ENV_LOCK:
        added = {key: value for key, value in defaults.items() if key not in os.environ}
        os.environ.update(added)
        try:
            yield added
        finally:
            for key, value in added.items():
                if os.environ.get(key) == value:
                    del os.environ[key]

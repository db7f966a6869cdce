"""The registry: loads plugins, validates what they declare, and is the one typed facade over pm.hook.

    registry = Registry.build()                      # entry points of group "kvbridge"
    backend = registry.create_backend("loopback", name="prefill-0")
    kv = registry.state_type("kv")

Build it once per process; it is immutable afterwards. Environment:
``KVBRIDGE_PLUGINS=a,b`` loads only those entry points (allowlist); ``KVBRIDGE_DISABLE_PLUGINS=a,b`` skips
them (blocklist, ``*`` = all). A plugin that cannot run here is listed as ``unavailable`` with a reason
and an install hint; a plugin that raises while loading is listed as ``error`` with its traceback. Neither
stops the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgspec
import pluggy

from kvbridge import hookspecs
from kvbridge._markers import ENTRY_POINT_GROUP, PROJECT, hookimpl
from kvbridge.backends.base import ComponentTransfer, RegisteredBuffers, TransferBackend
from kvbridge.backends.calls import After, BackendCalls, Before, CallMonitors, Intercept
from kvbridge.errors import PluginConflictError, PluginError, PluginUnavailableError, UnknownPluginError
from kvbridge.geometry import Component, MemoryRegion, PoolLayout, Rank
from kvbridge.slicing import ComponentSlice
from kvbridge.specs import (
    OPTIONAL_METHODS,
    Availability,
    BackendSpec,
    DiscoverySpec,
    PluginKind,
    PluginStatus,
    StateTypeSpec,
    missing_methods,
    resolve,
)
from kvbridge.state.base import StateType

log = logging.getLogger("kvbridge.registry")

_BUILTINS = {"kv": "kvbridge.state.kv", "loopback": "kvbridge.backends.loopback", "zmq": "kvbridge.discovery"}


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginRecord:
    """One row of ``kvbridge plugins``: a declared backend, state type or discovery service, or a plugin
    that failed."""

    name: str
    kind: PluginKind | None
    distribution: str
    version: str
    status: PluginStatus
    reason: str = ""
    hint: str = ""
    capabilities: tuple[str, ...] = ()
    spec: BackendSpec | StateTypeSpec | DiscoverySpec | None = field(default=None, compare=False)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind.value if self.kind else None,
                "distribution": self.distribution, "version": self.version, "status": self.status.value,
                "reason": self.reason, "hint": self.hint, "capabilities": list(self.capabilities)}


class _Dispatcher:
    """The single answer to every operation hook: call the object the caller selected by name."""

    @hookimpl(trylast=True)
    def kvbridge_register_buffers(self, backend: TransferBackend, component: str,
                                  regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        return backend.register_buffers(component, regions)

    @hookimpl(trylast=True)
    def kvbridge_slice_state(self, state_type: StateType, src: Component, dst: Component, src_rank: Rank,
                             dst_rank: Rank) -> ComponentSlice:
        return state_type.slice(src, dst, src_rank, dst_rank)

    @hookimpl(trylast=True)
    def kvbridge_send_component(self, backend: TransferBackend, transfer: ComponentTransfer) -> Any:
        return backend.send_component(transfer)

    @hookimpl(trylast=True)
    def kvbridge_notify_completion(self, backend: TransferBackend, peer: str, notice: bytes) -> bool:
        return bool(backend.notify_completion(peer, notice))


@dataclass(frozen=True, slots=True)
class _Source:
    plugin: object
    name: str
    distribution: str
    version: str


def _split_env(value: str | None) -> frozenset[str] | None:
    if value is None or not value.strip():
        return None
    return frozenset(v.strip() for v in value.split(",") if v.strip())


def _dist_of(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


_SLICES_KEPT = 4096       # slice plans a registry keeps (see Registry.slice_state)
_KEY = msgspec.msgpack.Encoder()


#: classes whose instances passed the (slow, ~50 us) runtime Protocol check: their methods are the class's,
#: so a later instance needs only its own data attributes checked (an agent restart builds a backend each time)
_BACKEND_CLASSES: set[type] = set()
_BACKEND_DATA = tuple(TransferBackend.__annotations__)     # name, endpoint


def _is_backend(instance: object) -> bool:
    cls = type(instance)
    if cls in _BACKEND_CLASSES:
        return all(hasattr(instance, attr) for attr in _BACKEND_DATA)
    if not isinstance(instance, TransferBackend):
        return False
    if len(_BACKEND_CLASSES) < 256:
        _BACKEND_CLASSES.add(cls)
    return True


class Registry:
    """Immutable set of loaded plugins with typed access to their backends and state types; backend-call
    monitors and interceptors (:meth:`add_call_monitoring`, :meth:`add_call_interceptor`) are the one thing
    attached afterwards."""

    __slots__ = ("_pm", "_records", "_backends", "_states", "_discovery", "_state_cache", "_slices", "_monitors",
                 "_frozen")

    def __init__(self, pm: pluggy.PluginManager, records: Sequence[PluginRecord]) -> None:
        self._pm = pm
        self._records = tuple(sorted(records, key=lambda r: (r.kind.value if r.kind else "~", r.name)))
        self._backends = MappingProxyType({r.name: r for r in records if r.kind is PluginKind.BACKEND})
        self._states = MappingProxyType({r.name: r for r in records if r.kind is PluginKind.STATE})
        self._discovery = MappingProxyType({r.name: r for r in records if r.kind is PluginKind.DISCOVERY})
        self._state_cache: dict[str, StateType] = {}
        # slice plans by (state type, src, dst, ranks): the hook is pure, and every agent of a process asks
        # for the same few (a restart, a new peer of an already seen layout); bounded, cleared when full
        self._slices: dict[tuple[object, ...], ComponentSlice] = {}
        self._monitors = CallMonitors()
        self._frozen = True

    def __setattr__(self, key: str, value: object) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError("the registry is immutable once built; build a new one")
        object.__setattr__(self, key, value)

    # ---------------------------------------------------------------- building
    @classmethod
    def build(cls, *, entry_points: bool = True, plugins: Iterable[object] = (),
              allow: Iterable[str] | None = None, block: Iterable[str] | None = None,
              env: Mapping[str, str] | None = None) -> Registry:
        """Load plugins from entry points (filtered by allow/block lists) plus ``plugins`` given explicitly."""
        env = os.environ if env is None else env
        allow_set = frozenset(allow) if allow is not None else _split_env(env.get("KVBRIDGE_PLUGINS"))
        block_set = frozenset(block) if block is not None else (_split_env(env.get("KVBRIDGE_DISABLE_PLUGINS"))
                                                                or frozenset())

        def wanted(name: str, plugin: str | None = None) -> bool:
            """An entry point, or a spec declared by entry point ``plugin``, is loaded unless its own name
            is blocked; with an allowlist, its name or its plugin's name must be on the list."""
            if "*" in block_set or name in block_set:
                return False
            return allow_set is None or name in allow_set or (plugin is not None and plugin in allow_set)

        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(hookspecs.KVBridgeSpecs)
        pm.register(_Dispatcher(), name="kvbridge.dispatch")
        records: list[PluginRecord] = []
        sources: list[_Source] = []
        if entry_points:
            seen: set[str] = set()
            seen_in: set[tuple[str, str]] = set()
            for ep in md.entry_points(group=ENTRY_POINT_GROUP):
                if not wanted(ep.name):
                    continue
                dist, version = _dist_of(ep)
                # one distribution found twice on sys.path is loaded once; two distributions using one
                # entry-point name are both loaded, so a clash of what they declare is reported
                if (ep.name, dist) in seen_in:
                    continue
                seen.add(ep.name)
                seen_in.add((ep.name, dist))
                try:
                    sources.append(_Source(ep.load(), ep.name, dist, version))
                except Exception as exc:  # noqa: BLE001 - a broken plugin is listed, never fatal
                    records.append(PluginRecord(name=ep.name, kind=None, distribution=dist, version=version,
                                                status=PluginStatus.ERROR,
                                                reason=f"{type(exc).__name__}: {exc}",
                                                hint="".join(traceback.format_exception(exc))))
            for name, module in _BUILTINS.items():  # running from a source tree without an install
                if name not in seen and wanted(name):
                    sources.append(_Source(importlib.import_module(module), name, "kvbridge", _own_version()))
        for plugin in plugins:
            name = getattr(plugin, "__name__", type(plugin).__name__)
            sources.append(_Source(plugin, name, "<explicit>", "-"))
        claimed: dict[tuple[PluginKind, str], tuple[PluginRecord, _Source]] = {}
        for source in sources:
            records.extend(_load_source(pm, source, claimed, wanted))
        registry = cls(pm, records)
        for plugin in plugins:      # a plugin that monitors (metrics) or intercepts (fault injection) backend calls
            before, after = getattr(plugin, "before_backend_call", None), getattr(plugin, "after_backend_call", None)
            if callable(before) and callable(after):
                registry.add_call_monitoring(before, after)
            intercept = getattr(plugin, "intercept_backend_call", None)
            if callable(intercept):
                registry.add_call_interceptor(intercept)
        return registry

    def add_call_monitoring(self, before: Before, after: After) -> Callable[[], None]:
        """Run ``before(call)`` and ``after(call, outcome)`` around every call any agent of this registry makes
        to its backend (``kvbridge.backends.calls``); returns the function that detaches them."""
        return self._monitors.add(before, after)

    def add_call_interceptor(self, interceptor: Intercept) -> Callable[[], None]:
        """Run ``interceptor(call, proceed)`` around every call any agent of this registry makes to its backend,
        inside the interceptors attached before it (``kvbridge.backends.calls``); returns the function that
        detaches it."""
        return self._monitors.intercept(interceptor)

    def backend_calls(self, backend: TransferBackend, name: str, *, agent: str) -> BackendCalls:
        """The one object through which an agent calls ``backend`` (built by :meth:`create_backend` from spec
        ``name``): the operation hooks, the declared optional methods, this registry's call monitors."""
        return BackendCalls(backend, name=name, agent=agent, capabilities=self.backend_spec(name).capabilities,
                            hooks=self, monitors=self._monitors)

    # ---------------------------------------------------------------- listing
    def records(self) -> tuple[PluginRecord, ...]:
        return self._records

    def backend_names(self, *, available_only: bool = True) -> tuple[str, ...]:
        return tuple(n for n, r in self._backends.items() if not available_only or r.status is PluginStatus.AVAILABLE)

    def state_type_names(self) -> tuple[str, ...]:
        return tuple(self._states)

    def discovery_names(self, *, available_only: bool = True) -> tuple[str, ...]:
        return tuple(n for n, r in self._discovery.items()
                     if not available_only or r.status is PluginStatus.AVAILABLE)

    def discovery_spec(self, name: str) -> DiscoverySpec:
        """The spec of an available discovery service; raises UnknownPluginError / PluginUnavailableError."""
        record = self._lookup(self._discovery, name, "discovery service")
        assert isinstance(record.spec, DiscoverySpec)
        return record.spec

    def discovery_factory(self, scheme: str) -> Any:
        """The factory of the discovery service that opens ``scheme://`` URLs (see ``DiscoverySpec``)."""
        scheme = scheme.lower()
        for name, record in self._discovery.items():
            if isinstance(record.spec, DiscoverySpec) and scheme in record.spec.schemes:
                return resolve(self.discovery_spec(name).factory)
        known = sorted(s for r in self._discovery.values() if isinstance(r.spec, DiscoverySpec) for s in r.spec.schemes)
        raise UnknownPluginError(f"no discovery service opens {scheme}:// URLs (known schemes: "
                                 f"{', '.join(known) or 'none'}; kvbridge-etcd opens etcd://)")

    def backend_spec(self, name: str) -> BackendSpec:
        record = self._lookup(self._backends, name, "backend")
        assert isinstance(record.spec, BackendSpec)
        return record.spec

    def state_type_spec(self, name: str) -> StateTypeSpec:
        """The spec of an available state type; raises UnknownPluginError / PluginUnavailableError."""
        record = self._lookup(self._states, name, "state type")
        assert isinstance(record.spec, StateTypeSpec)
        return record.spec

    # ---------------------------------------------------------------- objects
    def create_backend(self, backend: str, **kwargs: Any) -> TransferBackend:
        """Build a backend instance by name; raises PluginUnavailableError with the install hint."""
        record = self._lookup(self._backends, backend, "backend")
        assert isinstance(record.spec, BackendSpec)
        instance = resolve(record.spec.factory)(**kwargs)
        if not _is_backend(instance):
            raise PluginError(f"backend {backend!r} factory returned {type(instance).__name__}, which does not "
                              "implement kvbridge.backends.base.TransferBackend")
        _check_declared(record.spec, instance)
        return instance

    def state_type(self, name: str) -> StateType:
        if name not in self._state_cache:
            record = self._lookup(self._states, name, "state type")
            assert isinstance(record.spec, StateTypeSpec)
            instance = resolve(record.spec.factory)()
            if not isinstance(instance, StateType):
                raise PluginError(f"state type {name!r} factory returned {type(instance).__name__}, not a StateType")
            self._state_cache[name] = instance
        return self._state_cache[name]

    def compose(self, layout: PoolLayout) -> tuple[StateType, ...]:
        """The state type of each component, in the order the pool declares them (checked)."""
        types = tuple(self.state_type(c.state_type) for c in layout.components)
        me = Rank(layout.tp_rank, layout.tp_size)
        for comp, st in zip(layout.components, types):
            st.check_component(comp, me)
        return types

    def _lookup(self, table: Mapping[str, PluginRecord], name: str, what: str) -> PluginRecord:
        record = table.get(name)
        if record is None:
            known = ", ".join(sorted(table)) or "none"
            raise UnknownPluginError(f"no {what} named {name!r} is registered (known: {known})")
        if record.status is not PluginStatus.AVAILABLE:
            raise PluginUnavailableError(name, record.reason, record.hint if record.status is
                                         PluginStatus.UNAVAILABLE else "")
        return record

    # ---------------------------------------------------------------- operation facade
    # The pluggy layer of the three operation hooks, below the call seam: agents reach these through their
    # BackendCalls (monitors and interceptors around them); a direct call sees the pluggy wrappers only.
    def register_buffers(self, backend: TransferBackend, component: str,
                         regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        return self._pm.hook.kvbridge_register_buffers(backend=backend, component=component, regions=regions)

    def slice_state(self, state_type: StateType, src: Component, dst: Component, src_rank: Rank,
                    dst_rank: Rank) -> ComponentSlice:
        """The hook's slice plan, computed once per (state type, components, ranks) and shared (read-only).
        A component is keyed by its wire encoding (its ``options`` dict makes it unhashable)."""
        try:
            key = (state_type, _KEY.encode(src), _KEY.encode(dst), src_rank, dst_rank)
            found = self._slices.get(key)
        except (TypeError, msgspec.EncodeError):     # a third-party field msgspec cannot encode: sliced every time
            key, found = None, None
        if found is None:
            found = self._pm.hook.kvbridge_slice_state(state_type=state_type, src=src, dst=dst, src_rank=src_rank,
                                                       dst_rank=dst_rank)
            if key is not None:
                if len(self._slices) >= _SLICES_KEPT:
                    self._slices.clear()
                self._slices[key] = found
        return found

    def send_component(self, backend: TransferBackend, transfer: ComponentTransfer) -> Any:
        return self._pm.hook.kvbridge_send_component(backend=backend, transfer=transfer)

    def notify_completion(self, backend: TransferBackend, peer: str, notice: bytes) -> bool:
        return bool(self._pm.hook.kvbridge_notify_completion(backend=backend, peer=peer, notice=notice))


def _check_declared(spec: BackendSpec, obj: object) -> None:
    """Refuse a backend (class or instance) that declares a capability without its method; warn about an
    optional method whose capability is not declared (the agent will not call it)."""
    missing = missing_methods(spec.capabilities, obj)
    if missing:
        what = "; ".join(f"capability {cap.value!r} needs method {method}()" for cap, method in missing)
        raise PluginError(f"backend {spec.name!r} ({_type_name(obj)}) declares what it does not implement: {what}")
    for cap, method in OPTIONAL_METHODS.items():
        if cap not in spec.capabilities and callable(getattr(obj, method, None)):
            log.warning("backend %r (%s) has method %s() but does not declare Capability.%s: the agent will not "
                        "call it", spec.name, _type_name(obj), method, cap.name)


def _type_name(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_version() -> str:
    try:
        return md.version("kvbridge")
    except md.PackageNotFoundError:
        return "0+source"


def _load_source(pm: pluggy.PluginManager, source: _Source,
                 claimed: dict[tuple[PluginKind, str], tuple[PluginRecord, _Source]],
                 wanted: Any) -> list[PluginRecord]:
    """Register one plugin object and collect what it declares; errors become records, not exceptions."""
    def failed(reason: str, detail: str) -> list[PluginRecord]:
        return [PluginRecord(name=source.name, kind=None, distribution=source.distribution,
                             version=source.version, status=PluginStatus.ERROR,
                             reason=reason, hint=detail)]

    if pm.is_registered(source.plugin):
        return []
    try:
        pm.register(source.plugin, name=f"{source.distribution}:{source.name}")
    except Exception as exc:  # noqa: BLE001
        return failed(f"{type(exc).__name__}: {exc}", traceback.format_exc())
    for hook_name in hookspecs.OPERATION_HOOKS:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is source.plugin and not impl.wrapper and not impl.hookwrapper:
                pm.unregister(source.plugin)
                reason = (f"plugin {source.name!r} ({source.distribution}) implements {hook_name} without "
                          "wrapper=True; operations are answered by the backend or state type selected by name, "
                          "plugins may only wrap them")
                if source.distribution == "<explicit>":
                    raise PluginError(reason)
                return failed(f"refused: {reason}", "")
    declared: list[PluginRecord] = []
    for hook_name, kind in (("kvbridge_transfer_backends", PluginKind.BACKEND),
                            ("kvbridge_state_types", PluginKind.STATE),
                            ("kvbridge_discovery_services", PluginKind.DISCOVERY)):
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not source.plugin:
                continue
            try:
                specs = list(impl.function() or ())
            except Exception as exc:  # noqa: BLE001
                return failed(f"{hook_name} raised {type(exc).__name__}: {exc}", traceback.format_exc())
            for spec in specs:
                if source.distribution == "<explicit>" or wanted(spec.name, source.name) or spec.name == source.name:
                    try:
                        record = _record_for(spec, kind, source)
                    except PluginError as exc:
                        if source.distribution == "<explicit>":
                            raise
                        return failed(str(exc), "")
                    if record is not None:
                        declared.append(record)
    return [record for record in declared if _claim(record, source, claimed)]


_SPEC_OF: dict[PluginKind, type] = {PluginKind.BACKEND: BackendSpec, PluginKind.STATE: StateTypeSpec,
                                    PluginKind.DISCOVERY: DiscoverySpec}


def _record_for(spec: BackendSpec | StateTypeSpec | DiscoverySpec, kind: PluginKind,
                source: _Source) -> PluginRecord | None:
    expected = _SPEC_OF[kind]
    if not isinstance(spec, expected):
        raise PluginError(f"plugin {source.name!r} ({source.distribution}) returned {type(spec).__name__} from "
                          f"its {kind.value} discovery hook; expected {expected.__name__}")
    status, reason, hint = PluginStatus.AVAILABLE, "", ""
    probe = getattr(spec, "probe", None)
    if probe is not None:
        try:
            result: Availability = probe()
        except Exception as exc:  # noqa: BLE001
            status, reason = PluginStatus.ERROR, f"probe raised {type(exc).__name__}: {exc}"
            hint = traceback.format_exc()
        else:
            if not result.available:
                status, reason, hint = PluginStatus.UNAVAILABLE, result.reason, result.hint
    if isinstance(spec, BackendSpec) and isinstance(spec.factory, type) and status is PluginStatus.AVAILABLE:
        try:        # a class is checked now; a "module:attr" factory when it is built (no native import here)
            _check_declared(spec, spec.factory)
        except PluginError as exc:
            status, reason, hint = PluginStatus.ERROR, str(exc), "declare only what the backend implements"
    caps = tuple(sorted(c.value if hasattr(c, "value") else str(c) for c in spec.capabilities))
    if isinstance(spec, DiscoverySpec):
        caps = tuple(f"{scheme}://" for scheme in spec.schemes) + caps
    return PluginRecord(name=spec.name, kind=kind, distribution=source.distribution, version=source.version,
                        status=status, reason=reason, hint=hint, capabilities=caps, spec=spec)


def _claim(record: PluginRecord, source: _Source,
           claimed: dict[tuple[PluginKind, str], tuple[PluginRecord, _Source]]) -> bool:
    assert record.kind is not None
    key = (record.kind, record.name)
    previous = claimed.get(key)
    if previous is None:
        claimed[key] = (record, source)
        return True
    if previous[0].spec == record.spec:
        return False  # the same declaration again (e.g. a plugin listed twice): accepted, kept once
    raise PluginConflictError(
        f"{record.kind.value} {record.name!r} is claimed by two plugins: {previous[1].distribution} "
        f"{previous[1].version} ({previous[1].name}) and {source.distribution} {source.version} ({source.name})")

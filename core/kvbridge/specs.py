"""Records that plugins return from the discovery hooks. Frozen, validated, compared by value.

Example, a backend plugin's whole discovery surface::

    @hookimpl
    def kvbridge_transfer_backends():
        yield BackendSpec(name="mybackend", factory="my_pkg.engine:MyBackend",
                          capabilities=frozenset({Capability.HOST_MEMORY}),
                          probe=lambda: Availability.ok(),
                          bench="my_pkg.bench:main")          # optional: ``kvbridge bench --backend mybackend``
"""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.errors import PluginError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvbridge.demo.model import ComponentModel
    from kvbridge.findings import Finding

#: Runs a backend's own benchmark (``kvbridge bench --backend NAME``); returns the exit status.
BenchEntry = Callable[[], "int | None"]
#: A backend's own host checks (``kvbridge doctor``): what on this host makes it slow or fail, with what to do;
#: called with ``peers=[address, ...]`` when the operator names other hosts' probe servers (``--probe-peer``).
DiagnoseEntry = Callable[..., "Iterable[Finding]"]
#: Answers other hosts' probes (``kvbridge doctor --serve-probe ADDRESS``): ``(address, seconds, say) -> answered``.
ServeProbeEntry = Callable[[str, float, Callable[[str], None]], int]
#: Builds the demo's model of one component of a state type: ``(component name, **dimensions) -> model``.
DemoModelFactory = Callable[..., "ComponentModel"]

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class Capability(str, enum.Enum):
    """What a backend can do. The conformance kit runs a test only when its capability is declared, and the
    agent calls an optional method only when its capability is declared (:data:`OPTIONAL_METHODS`): a backend
    that declares one without the method is refused when the registry loads it (or builds it)."""

    HOST_MEMORY = "host-memory"          # registers and moves CPU memory
    CUDA_MEMORY = "cuda-memory"          # registers and moves CUDA memory
    NPU_MEMORY = "npu-memory"            # registers and moves Ascend NPU memory
    MULTI_PROCESS = "multi-process"      # peers may live in other processes
    NOTIFICATIONS = "notifications"      # delivers completion notices itself, after the data landed
    ABORT = "abort"                      # can cancel an in-flight transfer
    ASYNC = "async"                      # send returns before the bytes moved; poll tells when
    WRITER_GONE = "writer-gone"          # writer_gone(endpoint) -> bool: proves a peer can no longer write here
    NOTIFY_FAILURES = "notify-failures"  # drain_notify_failures() -> [.peer, .notice]: notices it could not deliver


#: How long after a writer's process ended ``writer_gone`` may take to answer True, for a backend that declares
#: ``Capability.WRITER_GONE`` without stating its own ``BackendSpec.writer_gone_bound_s``.
DEFAULT_WRITER_GONE_BOUND_S = 5.0

#: The optional backend methods, each behind the capability that declares it (the agent calls no other).
OPTIONAL_METHODS: dict[Capability, str] = {
    Capability.WRITER_GONE: "writer_gone",
    Capability.NOTIFY_FAILURES: "drain_notify_failures",
}


def missing_methods(capabilities: frozenset[Capability], obj: object) -> list[tuple[Capability, str]]:
    """The (capability, method) pairs ``capabilities`` declares that ``obj`` (a class or an instance) lacks."""
    return [(cap, method) for cap, method in OPTIONAL_METHODS.items()
            if cap in capabilities and not callable(getattr(obj, method, None))]


class PluginKind(str, enum.Enum):
    BACKEND = "backend"
    STATE = "state"
    DISCOVERY = "discovery"


class PluginStatus(str, enum.Enum):
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Availability:
    """Result of a plugin's cheap availability probe."""

    available: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def ok(cls) -> Availability:
        return cls(True)

    @classmethod
    def missing(cls, reason: str, hint: str = "") -> Availability:
        return cls(False, reason, hint)


def probe_import(module: str, hint: str) -> Availability:
    """A probe that tries to import ``module`` (the native engine) and reports why it cannot."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable", with its text
        return Availability.missing(f"cannot import {module}: {type(exc).__name__}: {exc}", hint)
    return Availability.ok()


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise PluginError(f"plugin name {name!r} must match {_NAME.pattern}")


def resolve(factory: str | Callable[..., Any]) -> Callable[..., Any]:
    """Resolve a ``"module:attr"`` factory lazily (native imports happen here, not at discovery)."""
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendSpec:
    """A transfer backend: its name, how to build it, what it can do, and whether it runs here.

    ``bench`` (optional) is the backend's own benchmark, run by ``kvbridge bench --backend NAME`` (the
    kvbridge-bench distribution): a :data:`BenchEntry` or its ``"module:attr"`` (imported only when the benchmark
    runs), called without arguments; an int it returns is the exit status::

        BackendSpec(name="mybackend", factory="my_pkg.engine:MyBackend", bench="my_pkg.bench:main")

    ``descriptor_cost_us`` (optional) is what one more descriptor costs the engine beyond its bytes, in
    microseconds: the agent's cost model stages a slice when its average descriptor is smaller than this
    times the staging throughput. None: 6 us, measured for UCX-like engines (NIXL).

    ``diagnose`` (optional) is the backend's own host checks, run by ``kvbridge doctor`` when the backend is usable:
    a :data:`DiagnoseEntry` or its ``"module:attr"`` (imported only then), yielding
    :class:`kvbridge.findings.Finding` records (e.g. which transports the engine would pick here). Given
    ``peers``, it also probes the route to each: a ``serve_probe`` of the same backend on another host, which
    answers probes at an address for a bounded time (:data:`ServeProbeEntry`)::

        BackendSpec(name="mybackend", factory="my_pkg.engine:MyBackend", diagnose="my_pkg.checks:diagnose",
                    serve_probe="my_pkg.checks:serve")

    ``writer_gone_bound_s`` (optional, with ``Capability.WRITER_GONE``) is the backend's stated bound: at most
    this long after a writer's process ended, ``writer_gone(endpoint)`` answers True for its endpoint (the
    kit's fence tier holds it to that). None: :data:`DEFAULT_WRITER_GONE_BOUND_S`.
    """

    name: str
    factory: str | Callable[..., Any]
    capabilities: frozenset[Capability] = frozenset({Capability.HOST_MEMORY})
    probe: Callable[[], Availability] | None = field(default=None, compare=False)
    description: str = ""
    bench: str | BenchEntry | None = None
    descriptor_cost_us: float | None = None
    writer_gone_bound_s: float | None = None
    diagnose: str | DiagnoseEntry | None = field(default=None, compare=False)
    serve_probe: str | ServeProbeEntry | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.descriptor_cost_us is not None and not self.descriptor_cost_us >= 0:
            raise PluginError(f"backend {self.name!r}: descriptor_cost_us={self.descriptor_cost_us!r} must be >= 0")
        bound = self.writer_gone_bound_s
        if bound is not None and not 0 < bound < float("inf"):
            raise PluginError(f"backend {self.name!r}: writer_gone_bound_s={bound!r} must be a finite number of "
                              "seconds > 0")

    @property
    def kind(self) -> PluginKind:
        return PluginKind.BACKEND


@dataclass(frozen=True, slots=True, kw_only=True)
class StateTypeSpec:
    """A state type: its name and how to build it (see ``kvbridge.state.base.StateType``).

    ``demo_model`` (optional) lets ``kvbridge demo`` run hybrid presets with components of this type: a
    :data:`DemoModelFactory` or its ``"module:attr"`` (imported only when a preset needs it), called with
    the component's name and the preset's dimensions as keywords; it returns a
    :class:`kvbridge.demo.model.ComponentModel` (geometry, items a request moves, fill and verify)::

        StateTypeSpec(name="ring", factory=RingState, demo_model="my_pkg.demo:RingModel")
        # a preset with a ring component then builds it with
        #   StateModels(preset).build("ring", name="ring", slots=2)  ->  RingModel(name="ring", slots=2)
    """

    name: str
    factory: str | Callable[..., Any]
    capabilities: frozenset[str] = frozenset()
    description: str = ""
    demo_model: str | DemoModelFactory | None = None

    def __post_init__(self) -> None:
        _check_name(self.name)

    @property
    def kind(self) -> PluginKind:
        return PluginKind.STATE


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoverySpec:
    """A discovery service client (``kvbridge.discovery.Discovery``): its name, the URL schemes it opens,
    how to build it, and whether it runs here. ``factory`` (or its ``"module:attr"``, imported only when a
    client is opened) is called as ``factory(url, secret=..., timeout_s=..., lease_s=..., options=...)``::

        DiscoverySpec(name="mydisc", schemes=("mydisc",), factory="my_pkg.client:MyDiscovery",
                      probe=lambda: probe_import("my_client_lib", "pip install my-client-lib"))
    """

    name: str
    factory: str | Callable[..., Any]
    schemes: tuple[str, ...]
    probe: Callable[[], Availability] | None = field(default=None, compare=False)
    description: str = ""
    capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not self.schemes or not all(_NAME.match(s) for s in self.schemes):
            raise PluginError(f"discovery {self.name!r}: schemes={self.schemes!r} must be lowercase URL schemes")

    @property
    def kind(self) -> PluginKind:
        return PluginKind.DISCOVERY

"""Records that plugins return from the discovery hooks. Frozen, validated, compared by value.

Example, a backend plugin's whole discovery surface::

    @hookimpl
    def kvbridge_transfer_backends():
        yield BackendSpec(name="mybackend", factory="my_pkg.engine:MyBackend",
                          capabilities=frozenset({Capability.HOST_MEMORY}),
                          probe=lambda: Availability.ok())
"""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import PluginError

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class Capability(str, enum.Enum):
    """What a backend can do. The conformance kit runs a test only when its capability is declared."""

    HOST_MEMORY = "host-memory"          # registers and moves CPU memory
    CUDA_MEMORY = "cuda-memory"          # registers and moves CUDA memory
    NPU_MEMORY = "npu-memory"            # registers and moves Ascend NPU memory
    MULTI_PROCESS = "multi-process"      # peers may live in other processes
    NOTIFICATIONS = "notifications"      # delivers completion notices itself, after the data landed
    ABORT = "abort"                      # can cancel an in-flight transfer
    ASYNC = "async"                      # send returns before the bytes moved; poll tells when


class PluginKind(str, enum.Enum):
    BACKEND = "backend"
    STATE = "state"


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


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A transfer backend: its name, how to build it, what it can do, and whether it runs here."""

    name: str
    factory: str | Callable[..., Any]
    capabilities: frozenset[Capability] = frozenset({Capability.HOST_MEMORY})
    probe: Callable[[], Availability] | None = field(default=None, compare=False)
    description: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name)

    @property
    def kind(self) -> PluginKind:
        return PluginKind.BACKEND


@dataclass(frozen=True, slots=True)
class StateTypeSpec:
    """A state type: its name and how to build it (see ``kvbridge.state.base.StateType``)."""

    name: str
    factory: str | Callable[..., Any]
    capabilities: frozenset[str] = frozenset()
    description: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name)

    @property
    def kind(self) -> PluginKind:
        return PluginKind.STATE

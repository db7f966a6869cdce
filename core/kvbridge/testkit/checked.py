"""A validating proxy around the backend under test, and the registry the kit builds around it.

Every backend the kit creates is wrapped in :class:`CheckedBackend` (in the spirit of
``wsgiref.validate``): calls pass straight through, while the proxy records what a leak check and a
contract check need - registrations not yet deregistered, handles not yet released, handles whose
terminal state changed, calls after ``close()``. It validates: it changes nothing (fault injection is an
interceptor of the agents' call seam, :mod:`kvbridge.testkit.faults`), and it also checks the kit's tests that
call a backend directly, without an agent.

    tracker = Tracker()
    registry = kit_registry(spec, tracker=tracker)            # backend `spec.name`, wrapped; plus `kv`
    backend = registry.create_backend(spec.name, name="p0")   # a CheckedBackend
    ...
    assert not tracker.problems(), tracker.problems()
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvbridge._markers import hookimpl
from kvbridge.backends.base import ComponentTransfer, HandleState, Poll, RegisteredBuffers
from kvbridge.geometry import MemoryRegion
from kvbridge.protocol.records import PeerInfo
from kvbridge.registry import Registry
from kvbridge.specs import BackendSpec, StateTypeSpec, resolve

__all__ = ["CheckedBackend", "SpecPlugin", "Tracker", "find_spec_path", "kit_registry", "load_spec"]


class SpecPlugin:
    """A plugin object declaring the given specs (for ``Registry.build(plugins=[...])``)."""

    def __init__(self, backends: Iterable[BackendSpec] = (), states: Iterable[StateTypeSpec] = (),
                 name: str = "kvbridge-testkit") -> None:
        self._backends, self._states = list(backends), list(states)
        self.__name__ = name

    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return list(self._backends)

    @hookimpl
    def kvbridge_state_types(self) -> list[StateTypeSpec]:
        return list(self._states)


class Tracker:
    """Collects every CheckedBackend built through a kit registry, and their contract violations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.backends: list[CheckedBackend] = []
        self.violations: list[str] = []
        self._reported = 0

    def new_violations(self) -> list[str]:
        """Violations not returned by an earlier call (each is reported once)."""
        with self._lock:
            out, self._reported = self.violations[self._reported:], len(self.violations)
        return out

    def add(self, backend: CheckedBackend) -> None:
        with self._lock:
            self.backends.append(backend)

    def violation(self, text: str) -> None:
        with self._lock:
            self.violations.append(text)

    def open_backends(self) -> list[CheckedBackend]:
        with self._lock:
            return [b for b in self.backends if not b.closed]

    def problems(self, *, include_open: bool = True) -> list[str]:
        """Unreported violations, then leaks: open backends (optional), unreleased handles, live registrations."""
        out = self.new_violations()
        with self._lock:
            backends = list(self.backends)
        for backend in backends:
            if include_open and not backend.closed:
                out.append(f"{backend.label} was never closed")
            out.extend(backend.leaks())
        return out

    def forget_closed(self) -> None:
        """Drop closed backends that leaked nothing (keeps a long-lived tracker small)."""
        with self._lock:
            self.backends = [b for b in self.backends if not b.closed or b.leaks()]


class CheckedBackend:
    """Pass-through proxy of a TransferBackend that records its use (see the module docstring)."""

    def __init__(self, inner: Any, label: str, tracker: Tracker) -> None:
        self._inner = inner
        self.name: str = inner.name
        self.label = label
        self._tracker = tracker
        self._lock = threading.Lock()
        self._registrations: dict[int, RegisteredBuffers] = {}
        self._handles: dict[int, Any] = {}
        self._terminal: dict[int, Poll] = {}
        self.closed = False
        self.sends = 0

    @property
    def inner(self) -> Any:
        """The real backend object (for backend-specific introspection)."""
        return self._inner

    @property
    def endpoint(self) -> bytes:
        return self._inner.endpoint

    def __getattr__(self, item: str) -> Any:     # backend-specific extras (resources(), registered_regions...)
        return getattr(self._inner, item)

    def _after_close(self, what: str) -> None:
        if self.closed:
            self._tracker.violation(f"{self.label}: {what} called after close()")

    # -- memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        self._after_close("register_buffers")
        registered = self._inner.register_buffers(component, regions)
        if not isinstance(registered, RegisteredBuffers):
            self._tracker.violation(f"{self.label}: register_buffers returned {type(registered).__name__}, "
                                    "not RegisteredBuffers")
        with self._lock:
            self._registrations[id(registered)] = registered
        return registered

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        self._inner.deregister_buffers(registered)
        with self._lock:
            self._registrations.pop(id(registered), None)

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        self._after_close("add_peer")
        return self._inner.add_peer(peer)

    def remove_peer(self, peer_id: str) -> None:
        self._inner.remove_peer(peer_id)

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> Any:
        self._after_close("send_component")
        handle = self._inner.send_component(transfer)
        if handle is None:
            self._tracker.violation(f"{self.label}: send_component returned None instead of a handle")
        with self._lock:
            self.sends += 1
            self._handles[id(handle)] = handle
        return handle

    def poll(self, handle: Any) -> Poll:
        result = self._inner.poll(handle)
        if not isinstance(result, Poll):
            self._tracker.violation(f"{self.label}: poll returned {type(result).__name__}, not Poll")
            return result
        key = id(handle)
        with self._lock:
            if key not in self._handles:
                self._tracker.violation(f"{self.label}: poll of a handle that was released or never returned "
                                        f"by send_component ({handle!r})")
            before = self._terminal.get(key)
            if before is not None and before.state is not result.state:
                self._tracker.violation(f"{self.label}: a handle reported {before.state.name} and later "
                                        f"{result.state.name}; a terminal state must not change")
            if result.state is not HandleState.PENDING:
                self._terminal.setdefault(key, result)
            if result.state is HandleState.FAILED and not result.reason:
                self._tracker.violation(f"{self.label}: a FAILED poll carries no reason")
        return result

    def release(self, handle: Any) -> None:
        self._inner.release(handle)
        with self._lock:
            self._handles.pop(id(handle), None)
            self._terminal.pop(id(handle), None)

    # -- notifications
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        return bool(self._inner.notify_completion(peer_id, notice))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return self._inner.drain_notifications()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._inner.close()

    # -- accounting
    def outstanding_handles(self) -> int:
        with self._lock:
            return len(self._handles)

    def live_registrations(self) -> list[RegisteredBuffers]:
        with self._lock:
            return list(self._registrations.values())

    def leaks(self) -> list[str]:
        out = []
        handles = self.outstanding_handles()
        if handles:
            out.append(f"{self.label}: {handles} transfer handle(s) were never released")
        regs = self.live_registrations()
        if regs and not self.closed:
            names = sorted({r.component for r in regs})
            out.append(f"{self.label}: {len(regs)} registration(s) still live ({', '.join(names)})")
        return out

    def __repr__(self) -> str:
        return f"CheckedBackend({self.label}, {self._inner!r})"


def _checked_factory(factory: str | Callable[..., Any], tracker: Tracker, spec_name: str,
                     **kwargs: Any) -> CheckedBackend:
    inner = resolve(factory)(**kwargs)
    backend = CheckedBackend(inner, f"{spec_name} backend {kwargs.get('name', '?')!r}", tracker)
    tracker.add(backend)
    return backend


def checked_spec(spec: BackendSpec, tracker: Tracker) -> BackendSpec:
    """The same backend, built as a CheckedBackend reporting to ``tracker``."""
    return BackendSpec(name=spec.name, factory=functools.partial(_checked_factory, spec.factory, tracker, spec.name),
                       capabilities=spec.capabilities, description=spec.description,
                       writer_gone_bound_s=spec.writer_gone_bound_s)


def kit_registry(backend: BackendSpec, *, tracker: Tracker, states: Iterable[StateTypeSpec] = (),
                 plugins: Iterable[object] = ()) -> Registry:
    """A registry with only: the built-in ``kv`` state type, ``backend`` (wrapped in CheckedBackend), the
    given state types and plugins. Other installed plugins stay out, so a run tests one thing."""
    state_specs = list(states)
    return Registry.build(allow={"kv"}, block={backend.name, *(s.name for s in state_specs)}, env={},
                          plugins=[SpecPlugin([checked_spec(backend, tracker)], state_specs), *plugins])


_FULL: Registry | None = None


def installed_registry() -> Registry:
    """Every installed plugin (built once per process)."""
    global _FULL
    if _FULL is None:
        _FULL = Registry.build()
    return _FULL


def find_spec_path(spec: BackendSpec | StateTypeSpec) -> str | None:
    """``"module:attr"`` of a loaded module attribute that *is* ``spec`` (so a child process can import it)."""
    for name, module in list(sys.modules.items()):
        if module is None or name == "__main__" or name.startswith(("_pytest", "pytest", "hypothesis")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is spec:
                return f"{name}:{attr}"
    return None


def load_spec(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def options_of(mapping: Mapping[str, str] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (mapping or {}).items()}

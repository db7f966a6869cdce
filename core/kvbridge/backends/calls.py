"""The one seam between an agent and its backend: every call goes through :class:`BackendCalls`.

The agent never calls its backend object directly. ``BackendCalls`` routes the three operations that are
hooks (``register_buffers``, ``send_component``, ``notify_completion``) through the registry's pluggy hooks
(so ``wrapper=True`` plugins see them, as before), calls the rest directly, and calls an optional method only
when the backend's spec declares its :class:`~kvbridge.specs.Capability` (``writer_gone``,
``drain_notify_failures``; undeclared: ``False`` / ``[]``). Around every call, of every kind, it runs the
call monitors (a before/after pair, the idea of pluggy's ``add_hookcall_monitoring``)::

    def before(call: BackendCall) -> None: ...               # may raise: the call is refused with that error
    def after(call: BackendCall, outcome: CallOutcome) -> None: ...   # sees the result or the error
    undo = registry.add_call_monitoring(before, after)
    ...
    undo()

A call interceptor goes around the call instead (the idea of a gRPC interceptor): it is given the call and
``proceed``, which runs the rest of the chain (the interceptors registered after it, then the backend) with the
arguments it passes; it returns what the agent gets. It may change the arguments, call ``proceed`` twice, not at
all, or give the agent another result (the kit's fault injector substitutes handles it then drives itself)::

    def intercept(call: BackendCall, proceed: Proceed) -> Any:
        return proceed(*call.args)                            # the identity interceptor
    undo = registry.add_call_interceptor(intercept)

The monitors run around the whole chain (they see what the agent sees). A plugin object given to
``Registry.build(plugins=[...])`` with ``before_backend_call`` / ``after_backend_call`` methods, or with
``intercept_backend_call``, is attached the same way (the metrics plugin monitors, the kit's fault injector
intercepts). ``after`` runs on success and on error; an exception it raises is logged, never raised into the
agent. Without monitors or interceptors a call costs two tuple checks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from kvbridge.backends.base import ComponentTransfer, Poll, RegisteredBuffers, TransferBackend
from kvbridge.geometry import MemoryRegion
from kvbridge.protocol.records import PeerInfo
from kvbridge.specs import Capability

log = logging.getLogger("kvbridge.backends")


class CallKind(str, enum.Enum):
    """Every kind of call an agent makes to its backend."""

    REGISTER_BUFFERS = "register_buffers"
    DEREGISTER_BUFFERS = "deregister_buffers"
    ADD_PEER = "add_peer"
    REMOVE_PEER = "remove_peer"
    SEND_COMPONENT = "send_component"
    POLL = "poll"
    RELEASE = "release"
    NOTIFY_COMPLETION = "notify_completion"
    DRAIN_NOTIFICATIONS = "drain_notifications"
    DRAIN_NOTIFY_FAILURES = "drain_notify_failures"     # only with Capability.NOTIFY_FAILURES
    WRITER_GONE = "writer_gone"                         # only with Capability.WRITER_GONE
    CLOSE = "close"


class BackendCall(NamedTuple):
    """One call: the backend's type name, the agent (endpoint) making it, its kind and positional arguments
    (a tuple, not a dataclass: built once per monitored call, on the hot path)."""

    backend: str
    agent: str
    kind: CallKind
    args: tuple[Any, ...]


class CallOutcome(NamedTuple):
    """What a call gave: its result, or the error it raised (``error`` not None); its duration."""

    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


Before = Callable[[BackendCall], None]
After = Callable[[BackendCall, CallOutcome], None]
Proceed = Callable[..., Any]
Intercept = Callable[[BackendCall, Proceed], Any]


class CallMonitors:
    """The monitor pairs and interceptors of one registry (copy on write: a call reads two tuples, without a
    lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pairs: tuple[tuple[Before, After], ...] = ()
        self.interceptors: tuple[Intercept, ...] = ()
        self._attached: tuple[tuple[Intercept], ...] = ()

    def add(self, before: Before, after: After) -> Callable[[], None]:
        """Attach a pair; returns the function that detaches it (idempotent)."""
        pair = (before, after)
        with self._lock:
            self.pairs = (*self.pairs, pair)

        def undo() -> None:
            with self._lock:
                self.pairs = tuple(p for p in self.pairs if p is not pair)

        return undo

    def intercept(self, interceptor: Intercept) -> Callable[[], None]:
        """Attach an interceptor (inside those attached before it); returns the function that detaches this
        attachment (idempotent; one attached twice stays attached once)."""
        attachment = (interceptor,)          # a token of its own: detaching removes this one only
        with self._lock:
            self._attached = (*self._attached, attachment)
            self.interceptors = tuple(a[0] for a in self._attached)

        def undo() -> None:
            with self._lock:
                self._attached = tuple(a for a in self._attached if a is not attachment)
                self.interceptors = tuple(a[0] for a in self._attached)

        return undo


def _through(interceptors: tuple[Intercept, ...], call: BackendCall, fn: Callable[..., Any]) -> Any:
    """``call`` through ``interceptors`` (outermost first), then ``fn``."""
    if not interceptors:
        return fn(*call.args)
    first, rest = interceptors[0], interceptors[1:]

    def proceed(*args: Any) -> Any:
        return _through(rest, call._replace(args=args), fn)

    return first(call, proceed)


class OperationHooks(Protocol):
    """The registry's hook facade (``kvbridge.registry.Registry`` provides it)."""

    def register_buffers(self, backend: TransferBackend, component: str,
                         regions: Sequence[MemoryRegion]) -> RegisteredBuffers: ...
    def send_component(self, backend: TransferBackend, transfer: ComponentTransfer) -> Any: ...
    def notify_completion(self, backend: TransferBackend, peer: str, notice: bytes) -> bool: ...


class BackendCalls:
    """An agent's calls to its backend (see the module docstring). Thread-safe as the backend is."""

    def __init__(self, backend: TransferBackend, *, name: str, agent: str,
                 capabilities: frozenset[Capability], hooks: OperationHooks, monitors: CallMonitors) -> None:
        self.backend = backend
        self.name = name                     # the backend type name (the spec's)
        self.agent = agent
        self.capabilities = capabilities
        self._hooks = hooks
        self._monitors = monitors
        # bound once: an undeclared optional method is never looked up again
        self._writer_gone: Callable[[bytes], bool] | None = (
            backend.writer_gone if Capability.WRITER_GONE in capabilities else None)  # type: ignore[attr-defined]
        self._notify_failures: Callable[[], Any] | None = (
            backend.drain_notify_failures  # type: ignore[attr-defined]
            if Capability.NOTIFY_FAILURES in capabilities else None)
        # checked before every call when set (strict mode: no call from inside a protocol handler, see
        # kvbridge.agent.context); None costs one attribute read
        self.guard: Callable[[CallKind], None] | None = None

    @property
    def endpoint(self) -> bytes:
        return self.backend.endpoint

    def invoke(self, kind: CallKind, *args: Any) -> Any:
        """The call of ``kind`` with ``args`` (the runtime's way to run a queued action): the method of that name."""
        return getattr(self, kind.value)(*args)

    def _run(self, kind: CallKind, fn: Callable[..., Any], *args: Any) -> Any:
        if self.guard is not None:
            self.guard(kind)
        pairs, interceptors = self._monitors.pairs, self._monitors.interceptors
        if not pairs and not interceptors:
            return fn(*args)
        call = BackendCall(self.name, self.agent, kind, args)
        for before, _after in pairs:
            before(call)
        started = time.perf_counter()
        try:
            result = _through(interceptors, call, fn) if interceptors else fn(*args)
        except BaseException as exc:
            self._after(pairs, call, CallOutcome(None, exc, time.perf_counter() - started))
            raise
        self._after(pairs, call, CallOutcome(result, None, time.perf_counter() - started))
        return result

    @staticmethod
    def _after(pairs: tuple[tuple[Before, After], ...], call: BackendCall, outcome: CallOutcome) -> None:
        for _before, after in pairs:
            try:
                after(call, outcome)
            except Exception:
                log.exception("a backend call monitor failed after %s", call.kind.value)

    # -- memory
    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        result: RegisteredBuffers = self._run(CallKind.REGISTER_BUFFERS, self._register, component, regions)
        return result

    def _register(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        return self._hooks.register_buffers(self.backend, component, regions)

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        self._run(CallKind.DEREGISTER_BUFFERS, self.backend.deregister_buffers, registered)

    # -- peers
    def add_peer(self, peer: PeerInfo) -> str:
        return str(self._run(CallKind.ADD_PEER, self.backend.add_peer, peer))

    def remove_peer(self, peer_id: str) -> None:
        self._run(CallKind.REMOVE_PEER, self.backend.remove_peer, peer_id)

    def writer_gone(self, endpoint: bytes) -> bool:
        """Does the backend prove the peer at ``endpoint`` can no longer write here? False unless declared."""
        if self._writer_gone is None:
            return False
        return bool(self._run(CallKind.WRITER_GONE, self._writer_gone, endpoint))

    # -- transfers
    def send_component(self, transfer: ComponentTransfer) -> Any:
        return self._run(CallKind.SEND_COMPONENT, self._send, transfer)

    def _send(self, transfer: ComponentTransfer) -> Any:
        return self._hooks.send_component(self.backend, transfer)

    def poll(self, handle: Any) -> Poll:
        result: Poll = self._run(CallKind.POLL, self.backend.poll, handle)
        return result

    def release(self, handle: Any) -> None:
        self._run(CallKind.RELEASE, self.backend.release, handle)

    # -- notifications
    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        return bool(self._run(CallKind.NOTIFY_COMPLETION, self._notify, peer_id, notice))

    def _notify(self, peer_id: str, notice: bytes) -> bool:
        return self._hooks.notify_completion(self.backend, peer_id, notice)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        result: list[tuple[str, bytes]] = self._run(CallKind.DRAIN_NOTIFICATIONS, self.backend.drain_notifications)
        return result

    def drain_notify_failures(self) -> list[tuple[str, bytes]]:
        """(peer, notice) of each notice the engine took but could not deliver; [] unless declared."""
        if self._notify_failures is None:
            return []
        items = self._run(CallKind.DRAIN_NOTIFY_FAILURES, self._notify_failures)
        return [(item.peer, item.notice) for item in items]

    def close(self) -> None:
        self._run(CallKind.CLOSE, self.backend.close)

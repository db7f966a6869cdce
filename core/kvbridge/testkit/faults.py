"""Fault injection as a plugin: an interceptor of the backend-call seam that breaks calls on demand.

Register it explicitly and arm one fault per test::

    faults = FaultInjector()
    registry = kit_registry(spec, tracker=tracker, plugins=[faults])   # or Registry.build(plugins=[faults])
    faults.arm(Fault.STALL, component="kv")     # the next sends of "kv" stay PENDING ...
    ...
    faults.release()                            # ... until released

The injector goes around every call an agent makes to its backend (``intercept_backend_call``, see
:mod:`kvbridge.backends.calls`), with any backend, wrapped or not. Faults of a send:

* ``REFUSE``    - raise :class:`~kvbridge.errors.TransferError` before the write is posted;
* ``FAIL``      - post the write, then report FAILED (once the real write is terminal, so no write is
  left in flight behind a failure);
* ``STALL``     - post the write, report PENDING until :meth:`FaultInjector.release`;
* ``LATE``      - post the write, report PENDING for ``delay_s`` more seconds;
* ``LOSE_NOTICE`` - the completion notice is swallowed: ``notify_completion`` answers True without
  delivering, and a notice attached to the write itself is dropped;
* ``DUPLICATE`` - the write is posted twice and the completion notice delivered twice.

FAIL, STALL, LATE and DUPLICATE hand the agent a :class:`FaultHandle` standing in for the real handle(s); its
``poll`` and ``release`` calls are answered by the injector, which polls and releases the real ones through the
rest of the seam (so the backend never sees a handle it did not make). The injector must therefore stay attached
while stand-ins are out: attach it for the registry's life (``Registry.build(plugins=[faults])``), and
:meth:`FaultInjector.disarm` to stop injecting rather than detaching it. Only calls through the seam (an agent's)
are intercepted; ``Registry.send_component`` and the other operation methods of the registry are the pluggy layer
below it.

Any other backend call (``poll``, ``release``, ``add_peer``, ``drain_notifications``, ``writer_gone``, ...:
:class:`~kvbridge.backends.calls.CallKind`) is broken with :meth:`FaultInjector.arm_call`: the call raises
:class:`InjectedFault` instead of reaching the backend; ``calls`` counts every call by kind. Every send and
notice is recorded (``sends``: every send seen, refused ones included; ``notices``: those delivered) for
exactly-once checks.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.backends.base import ComponentTransfer, HandleState, Poll
from kvbridge.backends.calls import BackendCall, CallKind, Proceed
from kvbridge.errors import KVBridgeError, ProtocolError, TransferError
from kvbridge.protocol.wire import Codec, Notice

__all__ = ["Fault", "FaultHandle", "FaultInjector", "InjectedFault", "NoticeKey"]


class InjectedFault(KVBridgeError):
    """A backend call broken by :meth:`FaultInjector.arm_call`."""


class Fault(enum.Enum):
    REFUSE = "refuse"
    FAIL = "fail"
    STALL = "stall"
    LATE = "late"
    LOSE_NOTICE = "lose-notice"
    DUPLICATE = "duplicate"


#: (backend label, peer, room, sender rank, component, chunk) of one completion notice
NoticeKey = tuple[str, str, int, int, str, int]


@dataclass(kw_only=True)
class _Arming:
    fault: Fault
    component: str | None
    room: int | None
    times: int | None
    delay_s: float
    reason: str
    fired: int = 0

    def matches(self, component: str, room: int) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        return (self.component is None or self.component == component) and (self.room is None or self.room == room)


@dataclass(kw_only=True)
class _CallArming:
    kind: CallKind
    times: int | None
    agent: str | None
    reason: str
    fired: int = 0


@dataclass(eq=False, kw_only=True)
class FaultHandle:
    """Stands in for one (or two, for DUPLICATE) real handles; the injector answers its polls and releases."""

    inner: list[Any]
    fault: Fault
    reason: str
    release_event: threading.Event
    until: float = 0.0
    outcome: Poll | None = field(default=None)

    def poll_with(self, poll: Callable[[Any], Poll]) -> Poll:
        if self.outcome is not None:
            return self.outcome
        if self.fault is Fault.STALL and not self.release_event.is_set():
            return Poll.pending()
        if self.fault is Fault.LATE and time.monotonic() < self.until:
            return Poll.pending()
        results = [poll(h) for h in self.inner]
        if any(r.state is HandleState.PENDING for r in results):
            return Poll.pending()
        failed = [r for r in results if r.state is HandleState.FAILED]
        if failed:
            self.outcome = failed[0]
        elif self.fault is Fault.FAIL:
            self.outcome = Poll.failed(self.reason)
        else:
            self.outcome = Poll.done()
        return self.outcome

    def release_with(self, release: Callable[[Any], None]) -> None:
        """Release every real handle, even when one release raises (the first error is raised after)."""
        first: BaseException | None = None
        for h in self.inner:
            try:
                release(h)
            except BaseException as exc:  # noqa: BLE001 - raised below, once the others are released
                first = first or exc
        if first is not None:
            raise first

    def __repr__(self) -> str:
        return f"FaultHandle({self.fault.value}, {len(self.inner)} inner)"


class FaultInjector:
    """The fault-injection plugin (see the module docstring). Thread-safe; one per registry."""

    __name__ = "kvbridge-testkit-faults"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[_Arming] = []
        self._release = threading.Event()
        self.sends: list[tuple[str, int, str, int]] = []     # (backend label, room, component, chunk)
        self.notices: Counter[NoticeKey] = Counter()
        self.injected: Counter[Fault] = Counter()
        self._lost: set[tuple[int, str, int, str] | None] = set()
        self._doubled: set[tuple[int, str, int, str] | None] = set()
        self._codec = Codec()
        self._broken: list[_CallArming] = []
        self.calls: Counter[CallKind] = Counter()           # every backend call the agents made, by kind
        self.duplicates_refused = 0     # DUPLICATE's second post raised: the write went once (its handle kept)

    # -- control
    def arm(self, fault: Fault, *, component: str | None = None, room: int | None = None, times: int | None = None,
            delay_s: float = 0.5, reason: str = "") -> None:
        """Inject ``fault`` into matching sends (all, or ``times`` of them) until :meth:`disarm`."""
        text = reason or f"injected by kvbridge.testkit: {fault.value}"
        with self._lock:
            if fault is Fault.STALL:
                self._release.clear()
            self._armed.append(_Arming(fault=fault, component=component, room=room, times=times,
                                       delay_s=delay_s, reason=text))

    def arm_call(self, kind: CallKind, *, times: int | None = None, agent: str | None = None,
                 reason: str = "") -> None:
        """Make the next calls of ``kind`` (all, or ``times`` of them; of one agent, or any) raise
        :class:`InjectedFault` before they reach the backend, until :meth:`disarm`."""
        text = reason or f"injected by kvbridge.testkit: {kind.value} raised"
        with self._lock:
            self._broken.append(_CallArming(kind=kind, times=times, agent=agent, reason=text))

    def disarm(self) -> None:
        """Stop injecting, and let stalled writes complete."""
        with self._lock:
            self._armed.clear()
            self._broken.clear()
        self._release.set()

    def release(self) -> None:
        """Let every stalled write complete (the fault stays armed for new sends)."""
        self._release.set()

    def reset(self) -> None:
        self.disarm()
        with self._lock:
            self.sends.clear()
            self.notices.clear()
            self.injected.clear()
            self.calls.clear()

    def _take(self, component: str, room: int) -> _Arming | None:
        with self._lock:
            for arming in self._armed:
                if arming.matches(component, room):
                    arming.fired += 1
                    self.injected[arming.fault] += 1
                    return arming
        return None

    def notice_counts(self, room: int) -> dict[NoticeKey, int]:
        with self._lock:
            return {k: v for k, v in self.notices.items() if k[2] == room}

    # -- the interceptor (every backend call of every agent of the registry)
    def intercept_backend_call(self, call: BackendCall, proceed: Proceed) -> Any:
        self._count_or_break(call)
        kind, args = call.kind, call.args
        if kind is CallKind.SEND_COMPONENT:
            return self._send(call, proceed)
        if kind is CallKind.POLL and isinstance(args[0], FaultHandle):
            return args[0].poll_with(proceed)
        if kind is CallKind.RELEASE and isinstance(args[0], FaultHandle):
            return args[0].release_with(proceed)
        if kind is CallKind.NOTIFY_COMPLETION:
            return self._notify(call, proceed)
        return proceed(*args)

    def _count_or_break(self, call: BackendCall) -> None:
        with self._lock:
            self.calls[call.kind] += 1
            for arming in self._broken:
                if arming.kind is call.kind and (arming.agent is None or arming.agent == call.agent) and (
                        arming.times is None or arming.fired < arming.times):
                    arming.fired += 1
                    break
            else:
                return
        raise InjectedFault(f"{call.backend} {call.kind.value} of {call.agent}: {arming.reason}")

    @staticmethod
    def _label(call: BackendCall) -> str:
        return f"{call.backend} backend {call.agent!r}"

    def _send(self, call: BackendCall, proceed: Proceed) -> Any:
        transfer: ComponentTransfer = call.args[0]
        notice = self._decode(transfer.notice)
        component = notice.component if notice is not None else transfer.component   # staged sends too
        with self._lock:
            self.sends.append((self._label(call), transfer.room, component, transfer.chunk))
        arming = self._take(component, transfer.room)
        if arming is None:
            return proceed(transfer)
        if arming.fault is Fault.REFUSE:
            raise TransferError(transfer.room, arming.reason)
        key = (transfer.room, component, transfer.chunk, transfer.peer)
        if arming.fault is Fault.LOSE_NOTICE:
            handle = proceed(dataclasses.replace(transfer, notice=b"") if transfer.notice else transfer)
            with self._lock:
                self._lost.add(key)
            return handle
        inner = [proceed(transfer)]
        if arming.fault is Fault.DUPLICATE:
            try:
                inner.append(proceed(transfer))
            except Exception:  # noqa: BLE001 - the first write is posted: the agent must get its handle
                with self._lock:
                    self.duplicates_refused += 1
            else:
                with self._lock:
                    self._doubled.add(key)
        return FaultHandle(inner=inner, fault=arming.fault, reason=arming.reason, release_event=self._release,
                           until=time.monotonic() + arming.delay_s)

    def _notify(self, call: BackendCall, proceed: Proceed) -> Any:
        peer, notice = call.args
        decoded = self._decode(notice)
        key = (decoded.room, decoded.component, decoded.chunk, peer) if decoded is not None else None
        with self._lock:
            lose = key in self._lost
            double = key in self._doubled
            self._lost.discard(key)
            self._doubled.discard(key)
        if lose:
            return True                             # "delivered": the control plane does not carry it either
        delivered = proceed(peer, notice)
        if decoded is not None:
            with self._lock:
                self.notices[(self._label(call), peer, decoded.room, decoded.sender, decoded.component,
                              decoded.chunk)] += 1
        if double and delivered:
            proceed(peer, notice)                   # the notice arrives twice as well
        return delivered

    def _decode(self, frame: bytes) -> Notice | None:
        if not frame:
            return None
        try:
            message = self._codec.decode(frame)
        except ProtocolError:
            return None                     # HMAC-protected frames: not decodable without the secret
        return message if isinstance(message, Notice) else None

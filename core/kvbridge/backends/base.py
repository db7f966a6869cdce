"""The protocol a transfer backend implements, and the records that flow through it.

A backend moves bytes and reports state; the core owns slicing, completion counting, timeouts and
retries. It is built by its spec's factory with keyword arguments (``name``: this endpoint's unique name,
``options``: a str->str dict of engine settings) and must be non-blocking: ``send_component`` posts, ``poll``
tells. The instance's ``name`` attribute is the backend *type* name (the spec's), not the endpoint name.
``docs/plugin-api.md`` describes every method: when the agent calls it, on which thread, and what it may
raise. Minimal example (host memory, same process)::

    from kvbridge.plugin import Poll, RegisteredBuffers, check_within, copy_descriptors

    class EchoBackend:
        name = "echo"                                    # the backend type name
        def __init__(self, *, name, options=None):      # name: this endpoint's unique name
            self.endpoint = name.encode()
        def register_buffers(self, component, regions):
            return RegisteredBuffers(component, tuple(regions), descriptor=b"")
        def deregister_buffers(self, registered): pass
        def add_peer(self, peer): return peer.name       # called again with the same name to refresh
        def remove_peer(self, peer_id): pass
        def send_component(self, transfer):
            plan = transfer.plan                         # refuse a plan with any bad descriptor, post nothing
            check_within(plan.src_addr, plan.nbytes, transfer.src.regions, "source")
            check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, "destination")
            copy_descriptors(plan.src_addr, plan.dst_addr, plan.nbytes)   # host memmove per descriptor
            return Poll.done()                           # the handle: here, its final state
        def poll(self, handle): return handle
        def release(self, handle): pass
        def notify_completion(self, peer_id, notice): return False   # let the control plane carry it
        def drain_notifications(self): return []
        def close(self): pass
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvbridge.errors import RegionError
from kvbridge.geometry import MemoryRegion
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo, RegionWire, RemoteBuffers
from kvbridge.slicing import Segments


class HandleState(enum.IntEnum):
    """PENDING: in flight. DONE: every byte landed at the destination. FAILED: the backend posts nothing
    more for this handle; some engines (Mooncake) may still complete writes already posted, so destination
    items are reused only after the control plane's abort handshake confirms quiescence."""

    PENDING = 0
    DONE = 1
    FAILED = 2


@dataclass(frozen=True, slots=True)
class Poll:
    state: HandleState
    reason: str = ""

    @classmethod
    def done(cls) -> Poll:
        return cls(HandleState.DONE)

    @classmethod
    def pending(cls) -> Poll:
        return cls(HandleState.PENDING)

    @classmethod
    def failed(cls, reason: str) -> Poll:
        return cls(HandleState.FAILED, reason)


@dataclass(frozen=True, slots=True, eq=False)
class RegisteredBuffers:
    """A component's regions as registered with the engine. ``descriptor`` is what the peer needs;
    ``handle`` is the backend's private registration object."""

    component: str
    regions: tuple[MemoryRegion, ...]
    descriptor: bytes = b""
    handle: Any = field(default=None, compare=False)

    def remote(self) -> RemoteBuffers:
        return RemoteBuffers(self.component, tuple(RegionWire.of(r) for r in self.regions), self.descriptor)


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class ComponentTransfer:
    """One component of one request (one chunk) to one peer: the unit a backend posts."""

    room: int
    component: str
    peer: str
    chunk: int
    last: bool
    src: RegisteredBuffers
    dst: RemoteBuffers
    plan: TransferPlan
    notice: bytes = b""
    #: ``notice`` is the encoded completion notice the core hands to ``notify_completion`` once the handle is
    #: DONE. A backend may also deliver it with the data (NIXL attaches it to the WRITE, so it can never
    #: overtake the bytes); receivers count each (sender, component, chunk) once, so a second copy is dropped.
    #: The structured form of ``plan``, for engines that index pre-registered descriptor lists (NIXL's
    #: prepped dlists, MoRI's offsets): paired item indices (sorted by source) and, per buffer, the byte
    #: segments inside one item. ``plan`` is exactly these expanded to addresses and merged.
    src_items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dst_items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    segments: tuple[Segments, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.plan.total_nbytes


@runtime_checkable
class TransferBackend(Protocol):
    """What every backend instance provides (see the module docstring for an example).

    The core polls every handle until it leaves PENDING (some engines, NIXL among them, deliver a write's
    notice only once the initiator has observed its completion)."""

    name: str
    endpoint: bytes

    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers: ...
    def deregister_buffers(self, registered: RegisteredBuffers) -> None: ...
    def add_peer(self, peer: PeerInfo) -> str: ...
    def remove_peer(self, peer_id: str) -> None: ...
    def send_component(self, transfer: ComponentTransfer) -> Any: ...
    def poll(self, handle: Any) -> Poll: ...
    def release(self, handle: Any) -> None: ...
    def notify_completion(self, peer_id: str, notice: bytes) -> bool: ...
    def drain_notifications(self) -> list[tuple[str, bytes]]: ...
    def close(self) -> None: ...


_ONE = np.uint64(1)
_BOUNDS: dict[tuple[tuple[int, int], ...], tuple[np.ndarray, np.ndarray]] = {}
_BOUNDS_KEPT = 1024


def _bounds(spans: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """First and last byte of each ``(addr, nbytes)`` region, sorted by address (cached: a backend checks
    every write against the same few registrations; the arrays are never written)."""
    found = _BOUNDS.get(spans)
    if found is None:
        starts = np.array([addr for addr, _ in spans], dtype=np.uint64)
        lasts = starts + (np.array([n for _, n in spans], dtype=np.uint64) - np.uint64(1))   # never wraps
        order = np.argsort(starts)
        found = (starts[order], lasts[order])
        for array in found:
            array.flags.writeable = False
        if len(_BOUNDS) >= _BOUNDS_KEPT:
            _BOUNDS.clear()
        _BOUNDS[spans] = found
    return found


def check_within(plan_addr: np.ndarray, plan_len: np.ndarray, regions: Sequence[MemoryRegion] |
                 Sequence[RegionWire], side: str) -> None:
    """Raise RegionError unless every ``[addr, addr+len)`` lies inside one of ``regions`` (vectorized)."""
    if plan_addr.size == 0:
        return
    if not regions:
        raise RegionError(f"{side}: {plan_addr.size} descriptors, but no region is registered")
    starts, lasts = _bounds(tuple([(r.addr, r.nbytes) for r in regions]))
    pos = np.searchsorted(starts, plan_addr, side="right").astype(np.int64, copy=False) - 1
    last = lasts[np.maximum(pos, 0)]        # the last byte of the region each descriptor starts in
    ok = (pos >= 0) & (plan_len > 0) & (plan_addr <= last)
    # addr + len - 1 <= last, written so that neither side can wrap around 2**64
    ok &= plan_len - _ONE <= last - np.where(ok, plan_addr, last)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise RegionError(f"{side} descriptor {i} [{int(plan_addr[i]):#x}, +{int(plan_len[i])}) is outside every "
                          f"registered region ({int((~ok).sum())} of {ok.size} descriptors out of bounds)")


def check_within_buffers(plan_addr: np.ndarray, plan_len: np.ndarray, plan_buffer: np.ndarray,
                         regions: Sequence[MemoryRegion] | Sequence[RegionWire], side: str) -> None:
    """Like :func:`check_within`, but descriptor ``i`` must lie in ``regions[plan_buffer[i]]``, the region
    of its own buffer (O(n), no search; also catches a plan whose buffers are given in the wrong order)."""
    if plan_addr.size == 0:
        return
    if int(plan_buffer.min()) < 0 or int(plan_buffer.max()) >= len(regions):
        raise RegionError(f"{side}: the plan names buffer {int(plan_buffer.max())} of {len(regions)} regions")
    lo = np.array([r.addr for r in regions], dtype=np.uint64)[plan_buffer]
    size = np.array([r.nbytes for r in regions], dtype=np.uint64)[plan_buffer]
    inside = plan_addr >= lo
    # addr - lo + len <= size, in a form that cannot wrap around 2**64
    ok = inside & (plan_len > 0) & (plan_len <= size) & (np.where(inside, plan_addr - lo, size) <= size - plan_len)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise RegionError(f"{side} descriptor {i} [{int(plan_addr[i]):#x}, +{int(plan_len[i])}) is outside the "
                          f"region of its buffer {int(plan_buffer[i])} ({int((~ok).sum())} of {ok.size} descriptors "
                          "out of bounds)")


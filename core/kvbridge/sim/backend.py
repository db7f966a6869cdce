"""A simulated transfer backend: writes land, fail and notify when the scheduler says so.

``send_component`` only records the write and schedules its landing; executing that delivery copies the
bytes (memmove between registered host regions of this process) and makes ``poll`` say DONE, or a
scheduled failure copies a prefix of the descriptors and says FAILED. A killed writer's writes still
land until the scheduler *reaps* it; only then does ``writer_gone(endpoint)`` answer True.
Registered in-process by :func:`sim_registry` (no packaging, no entry point).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge._markers import hookimpl
from kvbridge.backends.base import ComponentTransfer, HandleState, Poll, RegisteredBuffers, check_within
from kvbridge.backends.copying import copy_descriptors
from kvbridge.errors import RegionError
from kvbridge.geometry import MemoryRegion
from kvbridge.protocol.records import PeerInfo
from kvbridge.registry import Registry
from kvbridge.sim.world import LAND, NOTIFY, Delivery, World
from kvbridge.specs import BackendSpec, Capability

UP, KILLED, GONE = "up", "killed", "gone"


@dataclass(slots=True, kw_only=True)
class SimWrite:
    """A posted write: its transfer, writer and target backends, and what ``poll`` reports."""

    transfer: ComponentTransfer
    writer: str                # backend uid of the writer
    target: str                # backend uid of the destination
    state: Poll
    posted_at: float = 0.0
    delivery: Delivery | None = None


class SimNet:
    """Every simulated backend of one world by uid, their lifecycle, and the landing hook."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.backends: dict[str, SimBackend] = {}
        self.state: dict[str, str] = {}
        self.generation: dict[str, int] = {}
        #: called before a write's bytes are copied (the invariants check its pages); set by the simulator
        self.on_land: Callable[[SimWrite], None] | None = None
        #: the fabric's flight bound: a write still in flight this long after its post is given up, never
        #: delivered (an RDMA transport's retries running out); None: delivered whenever it arrives
        self.flight_bound_s: float | None = None

    def add(self, backend: SimBackend, name: str) -> str:
        gen = self.generation[name] = self.generation.get(name, -1) + 1
        uid = f"{name}/{gen}"
        self.backends[uid] = backend
        self.state[uid] = UP
        return uid

    def kill(self, uid: str, linger: float) -> int:
        """The process died: it posts nothing more, but what it posted may still land (until reaped), up to
        ``linger`` seconds late (a NIC still draining its queue)."""
        if self.state.get(uid) == UP:
            self.state[uid] = KILLED
        world = self.world
        lingering = [d for d in world.pending.values() if d.kind == LAND and d.payload.writer == uid]
        for d in lingering:
            d.due = world.now + world.rng.uniform(0.0, linger)
        return len(lingering)

    def closed(self, uid: str) -> int:
        """The process closed its backend (a drain, a clean shutdown): nothing it posted is in flight, but a
        notification it handed over and that has not arrived yet comes late (up to 3 s) or never, as with an
        engine whose agent is released before its notifications leave (NIXL). Gone from now on."""
        world = self.world
        late = [d for d in world.pending.values() if d.kind == NOTIFY and d.src == uid]
        for d in late:
            if world.rng.random() < 0.5:
                del world.pending[d.id]
                world.log(f"lose  {d.src}->{d.dst} {d.label} (its backend closed)")
            else:
                d.due = world.now + world.rng.uniform(1.0, 3.0)
        self.state[uid] = GONE
        return len(late)

    def reap(self, uid: str) -> int:
        """The killed writer's posted writes can no longer land (its NIC is reset): drop them; gone from now."""
        dropped = [d for d in self.world.pending.values() if d.kind == LAND and d.payload.writer == uid]
        for d in dropped:
            del self.world.pending[d.id]
        self.state[uid] = GONE
        return len(dropped)

    # ------------------------------------------------------------------ executing deliveries
    def land(self, item: Delivery) -> None:
        """Copy the write's bytes and report DONE (FAILED when the target process is dead: its memory is gone)."""
        write: SimWrite = item.payload
        if self.state.get(write.target) != UP:
            write.state = Poll.failed(f"sim: target {write.target} is gone")
            return
        if self._given_up(write):
            return
        if self.on_land is not None:
            self.on_land(write)
        plan = write.transfer.plan
        copy_descriptors(plan.src_addr, plan.dst_addr, plan.nbytes)
        write.state = Poll.done()

    def _given_up(self, write: SimWrite) -> bool:
        """Past the fabric's flight bound: the write fails without a byte landing."""
        bound = self.flight_bound_s
        if bound is None or self.world.now - write.posted_at <= bound:
            return False
        write.state = Poll.failed(f"sim: in flight {self.world.now - write.posted_at:.2f} s, past the fabric's "
                                  f"bound of {bound} s: given up")
        return True

    def fail(self, item: Delivery, landed: int) -> None:
        """The write fails after its first ``landed`` descriptors reached the target."""
        write: SimWrite = item.payload
        plan = write.transfer.plan
        if self._given_up(write):
            return
        if landed and self.state.get(write.target) == UP:
            if self.on_land is not None:
                self.on_land(write)
            copy_descriptors(plan.src_addr[:landed], plan.dst_addr[:landed], plan.nbytes[:landed])
        write.state = Poll.failed(f"sim: write failed after {landed} of {len(plan)} descriptors")

    def notify(self, item: Delivery) -> None:
        backend = self.backends.get(item.dst)
        if backend is not None and self.state.get(item.dst) == UP:
            backend.inbox.append((item.src, item.payload))


class SimBackend:
    """One process's backend on a :class:`SimNet` (options: ``{"world": key}`` of :data:`NETS`)."""

    name = "sim"

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        self.net = NETS[(options or {})["world"]]
        self.uid = self.net.add(self, name)
        self.endpoint = self.uid.encode()
        self.peers: dict[str, PeerInfo] = {}
        self.inbox: list[tuple[str, bytes]] = []

    def register_buffers(self, component: str, regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        return RegisteredBuffers(component, tuple(regions), b"")

    def deregister_buffers(self, registered: RegisteredBuffers) -> None:
        return None

    def add_peer(self, peer: PeerInfo) -> str:
        self.peers[peer.name] = peer
        return peer.name

    def remove_peer(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)

    def send_component(self, transfer: ComponentTransfer) -> Any:
        peer = self.peers.get(transfer.peer)
        if peer is None:
            raise RegionError(f"sim: unknown peer {transfer.peer!r}")
        plan = transfer.plan
        check_within(plan.src_addr, plan.nbytes, transfer.src.regions, f"source ({transfer.component})")
        if tuple(transfer.dst.regions) != tuple(peer.component(transfer.component).regions):
            raise RegionError(f"sim: destination of {transfer.component!r} is not what {transfer.peer} registered")
        check_within(plan.dst_addr, plan.nbytes, transfer.dst.regions, f"destination ({transfer.component})")
        write = SimWrite(transfer=transfer, writer=self.uid, target=peer.endpoint.decode(), state=Poll.pending(),
                         posted_at=self.net.world.now)
        label = f"write room={transfer.room} {transfer.component} c{transfer.chunk}{' last' if transfer.last else ''}"
        world = self.net.world
        lag = world.rng.expovariate(1.0 / (5 * world.knobs.latency))     # a write is slower than a frame
        if self.net.flight_bound_s is not None:      # such a fabric delivers within its bound, or never (a
            lag = min(lag, self.net.flight_bound_s)  # partition, a killed writer's lingering queue)
        write.delivery = world.schedule(LAND, self.uid, write.target, label, write, delay=lag)
        return write

    def poll(self, handle: Any) -> Poll:
        return handle.state if isinstance(handle, SimWrite) else Poll.failed("sim: not a sim handle")

    def release(self, handle: Any) -> None:
        return None

    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        world = self.net.world
        peer = self.peers.get(peer_id)
        if peer is None or world.rng.random() < world.knobs.notify_via_link:
            return False
        world.schedule(NOTIFY, self.uid, peer.endpoint.decode(), "notify", notice)
        if world.knobs.dup and world.rng.random() < world.knobs.dup:
            world.schedule(NOTIFY, self.uid, peer.endpoint.decode(), "notify (dup)", notice)
        return True

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def writer_gone(self, endpoint: bytes) -> bool:
        """True only once the writer was killed *and* reaped: none of its posted writes can land any more."""
        return self.net.state.get(endpoint.decode(errors="replace")) == GONE

    def close(self) -> None:
        self.net.closed(self.uid)


def pending_handles(net: SimNet) -> int:
    return sum(1 for d in net.world.pending.values() if d.kind == LAND and d.payload.state.state is HandleState.PENDING)


#: the SimNet of each live world, by the key its agents' ``backend_options["world"]`` name
NETS: dict[str, SimNet] = {}

SPEC = BackendSpec(name="sim", factory=SimBackend,
                   capabilities=frozenset({Capability.HOST_MEMORY, Capability.WRITER_GONE}),
                   description="deterministic simulation backend (kvbridge.sim)", descriptor_cost_us=0.5)


class _Plugin:
    __name__ = "kvbridge-sim"

    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return [SPEC]


@functools.lru_cache(maxsize=1)
def sim_registry() -> Registry:
    """The built-in ``kv`` state type and the ``sim`` backend, nothing installed (built once per process)."""
    return Registry.build(allow={"kv", "kvbridge-sim", "sim"}, env={}, plugins=[_Plugin()])

"""A simulated control link: every frame sent becomes a scheduled :class:`~kvbridge.sim.world.Delivery`.

Like :class:`kvbridge.links.LocalHub` (addresses, a publish/lookup table of prefill instances), but the
scheduler decides when a frame arrives, whether it arrives twice, and whether it arrives at all.
"""

from __future__ import annotations

from collections import deque

from kvbridge.links import InstanceInfo
from kvbridge.sim.world import FRAME, Delivery, World, frame_label


class SimHub:
    """Addresses of simulated processes; an address can be taken again after its link closed (a restart)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.links: dict[str, SimLink] = {}
        self.instances: dict[str, InstanceInfo] = {}
        #: frames between two processes arrive in the order sent (a ZMQ link's per-peer order; off by default:
        #: the sweep reorders them, which the protocol tolerates; a drain's goodbye relies on the order)
        self.ordered = False
        world.deliver_frame = self._deliver

    def link(self, address: str) -> SimLink:
        old = self.links.get(address)
        if old is not None and not old.closed:
            raise ValueError(f"address {address!r} is already taken")
        link = self.links[address] = SimLink(self, address)
        return link

    def send(self, src: str, dst: str, frame: bytes) -> None:
        world = self.world
        label = frame_label(frame)
        if world.cut(src, dst):
            world.log(f"cut   {src}->{dst} {label}")
            return
        if world.knobs.drop and world.rng.random() < world.knobs.drop:
            world.log(f"lose  {src}->{dst} {label}")
            return
        world.schedule(FRAME, src, dst, label, frame)
        if world.knobs.dup and world.rng.random() < world.knobs.dup:
            world.schedule(FRAME, src, dst, label + " (dup)", frame)

    def _deliver(self, item: Delivery) -> None:
        if self.ordered:              # frames sent earlier between the same two processes arrive first
            world = self.world
            before = [d for d in world.pending.values()
                      if d.kind == FRAME and d.src == item.src and d.dst == item.dst and d.id < item.id]
            for d in sorted(before, key=lambda d: d.id):
                del world.pending[d.id]
                world.log(f"frame {d.src}->{d.dst} {d.label} (in order, before #{item.id})")
                self._put(d)
        self._put(item)

    def _put(self, item: Delivery) -> None:
        link = self.links.get(item.dst)
        if link is not None and not link.closed:    # like a network: frames to a gone address are lost
            link.inbox.append(item.payload)

    def publish(self, instance: str, tp_size: int, rank: int, address: str) -> None:
        info = self.instances.get(instance)
        addresses = dict(info.addresses) if info else {}
        addresses[rank] = address
        self.instances[instance] = InstanceInfo(tp_size, addresses)


class SimLink:
    """One process's mailbox on a :class:`SimHub` (never blocks, never sleeps)."""

    instant_lookup = True      # lookup() answers at once: connect needs no lookup thread

    def __init__(self, hub: SimHub, address: str) -> None:
        self._hub = hub
        self.address = address
        self.inbox: deque[bytes] = deque()
        self.closed = False

    def send(self, address: str, frame: bytes) -> None:
        if not self.closed:
            self._hub.send(self.address, address, frame)

    def recv(self, timeout_s: float = 0.0) -> list[bytes]:
        if not self.inbox:
            return []
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def publish(self, instance: str, tp_size: int, rank: int) -> None:
        self._hub.publish(instance, tp_size, rank, self.address)

    def lookup(self, instance: str) -> InstanceInfo | None:
        return self._hub.instances.get(instance)

    def close(self) -> None:
        self.closed = True
        self.inbox.clear()

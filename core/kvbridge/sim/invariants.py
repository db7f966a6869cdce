"""Invariants checked after every step (byte exactness on Success is checked by the engine when it sees it).

* fences: no write lands in a page its room no longer owns (freed after ``safe_to_reuse``), and no freed
  destination page changes until it is granted again (covers the decode's own staged scatters);
* bounded queues: link inboxes, in-flight deliveries, early requests, in-flight writes per room.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvbridge.protocol.wire import Role
from kvbridge.sim.backend import SimWrite
from kvbridge.sim.cluster import PAGES, UP, Cluster, Proc
from kvbridge.sim.world import World

MAX_INBOX = 2000          # frames waiting in one link (a paused process accumulates heartbeats)
MAX_PENDING = 5000        # deliveries in flight in the whole world
MAX_EARLY = 256           # early requests one prefill rank holds (a schedule opens far fewer rooms)
MAX_INFLIGHT = 256        # writes in flight or queued for one room


class Fences:
    """The landing hook of the sim backend: checks each write's pages against the engines' ownership."""

    def __init__(self, cluster: Cluster, opened_by: Callable[[int, str], int | None]) -> None:
        self.cluster = cluster
        self.opened_by = opened_by          # (room, process) -> the generation whose engine opened it there
        cluster.net.on_land = self.on_land

    def on_land(self, write: SimWrite) -> None:
        t = write.transfer
        if t.component != "kv":
            return                                  # a staging area: checked by the frozen pages and the bytes
        cluster, world = self.cluster, self.cluster.world
        target = cluster.by_uid.get(write.target)
        if target is not None and target.uid == write.target:
            gen = self.opened_by(t.room, target.name)
            if gen is not None and gen != target.gen:
                world.violate(f"a write of room {t.room} lands in {target.name} generation {target.gen}, but room "
                              f"{t.room} was requested there by generation {gen}: a dead incarnation's request is "
                              "written into its successor's memory")
                return
            self._check(world, target, t.plan.dst_addr, t.room, "lands in")
        writer = cluster.by_uid.get(write.writer)
        if writer is not None and writer.uid == write.writer:
            self._check(world, writer, t.plan.src_addr, t.room, "reads")

    @staticmethod
    def _check(world: World, proc: Proc, addrs: np.ndarray, room: int, verb: str) -> None:
        """Every descriptor address lies in a page of ``proc`` that ``room`` owns (the first one that does
        not is reported, in descriptor order)."""
        if not addrs.size:
            return
        item = proc.mem.shape[2]
        offset = addrs.astype(np.int64) - proc.base
        inside = (offset >= 0) & (offset < proc.mem.nbytes)
        page = np.where(inside, offset % (PAGES * item) // item, 0)
        bad = ~inside | (proc.owner[page] != room)
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        addr = int(addrs[i])
        where = proc.span(addr)
        if where is None:
            world.violate(f"a write of room {room} {verb} {proc.name} outside its KV buffers ({addr:#x})")
            return
        b, p = where
        owner = int(proc.owner[p])
        what = "a free page" if owner < 0 else f"a page of room {owner}"
        world.violate(f"a write of room {room} {verb} {proc.name} buffer {b} page {p}, {what} "
                      f"(room {room} was already safe to reuse there)")


def check_frozen(cluster: Cluster) -> None:
    """Free destination pages keep the content they had when freed.

    ``frozen`` holds every page's content as of the last check (a page freed since: as of its freeing, set by
    the engine), so a memory equal to it byte for byte has no free page that changed: one bytes comparison
    instead of the per-page mask. Otherwise the mask is computed as before, and ``frozen`` catches up with
    every page: an owned page may change freely, a free one is reported (once) and the run stops."""
    for proc in cluster.procs:
        if not proc.dirty or proc.status != UP or proc.role is not Role.DECODE:
            continue
        proc.dirty = False
        mem, frozen = proc.mem, proc.frozen
        if mem.tobytes() == frozen.tobytes():
            continue
        changed = (mem != frozen).any(axis=(0, 2)) & (proc.owner < 0)     # per page: a free one that changed
        if changed.any():
            cluster.world.violate(f"free pages {np.flatnonzero(changed).tolist()} of {proc.name} changed after their "
                                  "room was safe to reuse")
        np.copyto(frozen, mem)          # owned pages caught up; a changed free page reported once


def check_bounded(cluster: Cluster, rooms: bool = True) -> None:
    """Queues stay bounded (``rooms``: also the per-room write lists, the costlier part)."""
    world = cluster.world
    if len(world.pending) > MAX_PENDING:
        world.violate(f"{len(world.pending)} deliveries in flight (bound {MAX_PENDING})")
    for name, link in cluster.hub.links.items():
        if len(link.inbox) > MAX_INBOX:
            world.violate(f"link {name} holds {len(link.inbox)} frames (bound {MAX_INBOX})")
    for proc in cluster.procs:
        agent = proc.agent
        if agent is None:
            continue
        if agent.prefill is not None:
            early = len(agent.prefill._early)
            if early > MAX_EARLY:
                world.violate(f"{proc.name} holds {early} early requests (bound {MAX_EARLY})")
            for room in agent.prefill.rooms.values() if rooms else ():
                if len(room.inflight) + len(room.pending) > MAX_INFLIGHT:
                    world.violate(f"{proc.name} room {room.room}: {len(room.inflight)} writes in flight")
        if len(agent.peers.peers) > 4 * len(cluster.procs):
            world.violate(f"{proc.name} holds {len(agent.peers.peers)} peer records")

"""The simulated processes: prefill and decode ranks, each a real ``TransferAgent`` on the sim link and
backend, driven only by the scheduler (``progress()``; never ``start()``), with pause, kill and restart."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent.handshake import Handshake
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis
from kvbridge.pattern import TOKEN_MAJOR, KVSpec, units_held
from kvbridge.protocol.wire import Role
from kvbridge.sim.backend import NETS, SimNet, sim_registry
from kvbridge.sim.link import SimHub
from kvbridge.sim.world import World
from kvbridge.slicing import target_ranks

HEADS, HEAD_DIM, PAGE, LAYERS, PAGES = 4, 4, 2, 2, 12
SPEC = KVSpec(TOKEN_MAJOR, total_heads=HEADS, page_size=PAGE, head_bytes=HEAD_DIM * 2)
INSTANCE = "inst"
UP, PAUSED, DEAD = "up", "paused", "dead"


@functools.cache
def kv_layout(tp: int, rank: int) -> PoolLayout:
    """One dense token-major KV component: K and V of ``LAYERS`` layers, ``PAGES`` pages of ``PAGE`` tokens."""
    local = len(units_held(HEADS, tp, rank))
    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=PAGES, item_shape=(PAGE, local, HEAD_DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, HEADS))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp,
                      tp_rank=rank, page_size=PAGE, model="sim")


class SimAgent(TransferAgent):
    """A TransferAgent whose handshake lookup runs inline: the sim link answers lookups at once, so no
    lookup thread (with its real-time sleeps) is started."""

    def connect_async(self, instance: str, timeout_s: float | None = None) -> Handshake:
        ctx = self.context
        info = ctx.link.lookup(instance)
        with ctx.lock:
            shake = self.peers.begin(instance, {}, [])
            if info is None or not info.complete:
                self.peers.finish(shake)
            else:
                ranks = target_ranks(info.tp_size, ctx.layout.tp_size, ctx.layout.tp_rank)
                self.peers.fill(shake, dict(info.addresses), list(ranks))
        return shake


@dataclass(slots=True, kw_only=True)
class Proc:
    """One rank's process across restarts: its current agent, memory, and page ownership."""

    name: str
    role: Role
    tp: int
    rank: int
    gen: int = -1
    status: str = DEAD
    agent: SimAgent | None = None
    uid: str = ""
    mem: np.ndarray = field(default_factory=lambda: np.zeros((0, PAGES, 1), np.uint8))   # [buffer, page, byte]
    buffers: list[np.ndarray] = field(default_factory=list)       # views of ``mem``, one per KV buffer
    owner: np.ndarray = field(default_factory=lambda: np.full(PAGES, -1, np.int64))   # page -> room, -1 free
    frozen: np.ndarray = field(default_factory=lambda: np.zeros((0, PAGES, 1), np.uint8))   # free pages' content
    paused_until: float = 0.0
    dirty: bool = False      # its memory may have changed since the last frozen-pages check
    base: int = 0            # address of ``mem`` (read once per incarnation: ``ndarray.ctypes`` is slow)

    def span(self, addr: int) -> tuple[int, int] | None:
        """(buffer index, page) of a byte address inside this process's KV buffers."""
        offset = addr - self.base
        if not 0 <= offset < self.mem.nbytes:
            return None
        item = self.mem.shape[2]
        return offset // (PAGES * item), offset % (PAGES * item) // item


class Cluster:
    """Prefill TP ``pt`` and decode TP ``dt`` ranks of one world."""

    def __init__(self, world: World, pt: int, dt: int, config: AgentConfig) -> None:
        self.world, self.pt, self.dt = world, pt, dt
        self.key = f"w{id(world)}"
        self.net = NETS[self.key] = SimNet(world)
        self.hub = SimHub(world)
        extra: dict[str, Any] = {}
        if "prove_writer_death" in AgentConfig.__dataclass_fields__:
            extra["prove_writer_death"] = False     # its real TCP liveness connections are outside the simulation
        self.config = dataclasses.replace(config, backend_options={"world": self.key}, **extra)
        self.procs = [Proc(name=f"p{r}", role=Role.PREFILL, tp=pt, rank=r) for r in range(pt)]
        self.procs += [Proc(name=f"d{r}", role=Role.DECODE, tp=dt, rank=r) for r in range(dt)]
        self.by_name = {p.name: p for p in self.procs}
        self.by_uid: dict[str, Proc] = {}
        self.graveyard: list[np.ndarray] = []    # memory of dead incarnations: late writes may still read it

    def close(self) -> None:
        NETS.pop(self.key, None)

    def start(self, proc: Proc) -> None:
        """Start (or restart under the same name) ``proc`` with fresh memory and a new seeded incarnation."""
        layout = kv_layout(proc.tp, proc.rank)
        self.graveyard.append(proc.mem)
        geoms = layout.components[0].buffers
        proc.mem = np.zeros((len(geoms), PAGES, geoms[0].item_nbytes), np.uint8)
        proc.buffers = [proc.mem[b] for b in range(len(geoms))]
        proc.frozen = proc.mem.copy()
        proc.base = proc.mem.ctypes.data
        proc.owner[:] = -1
        incarnation = self.world.rng.getrandbits(64) | 1
        proc.gen += 1
        proc.agent = SimAgent(layout=layout, buffers={"kv": proc.buffers}, role=proc.role,
                              link=self.hub.link(proc.name), backend="sim", registry=sim_registry(),
                              instance=INSTANCE if proc.role is Role.PREFILL else "", name=proc.name,
                              config=self.config, clock=self.world.clock, incarnation=incarnation)
        if proc.agent.staging is not None:
            self.graveyard.append(proc.agent.staging.view(0, 1, proc.agent.staging.nbytes))
        proc.uid = proc.agent.backend.uid   # type: ignore[attr-defined]
        self.by_uid[proc.uid] = proc
        proc.status = UP
        if proc.role is Role.DECODE:
            proc.agent.connect_async(INSTANCE)
        self.world.log(f"start {proc.name} gen={proc.gen} incarnation={incarnation:#x}")

    def kill(self, proc: Proc) -> None:
        """The process dies: no more progress; its link closes; its posted writes may still land."""
        assert proc.agent is not None
        proc.agent.link.close()
        lingering = self.net.kill(proc.uid, 3 * self.config.peer_timeout_s)
        proc.agent, proc.status = None, DEAD
        self.world.log(f"kill  {proc.name} gen={proc.gen} ({lingering} of its writes still in flight)")

    def stop(self, proc: Proc) -> None:
        """A planned shutdown of a drained process: ``close()`` (its goodbye, its backend closed), then gone."""
        assert proc.agent is not None
        proc.agent.close()
        proc.agent, proc.status = None, DEAD
        self.world.log(f"stop  {proc.name} gen={proc.gen} (drained, closed)")

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.status == UP]

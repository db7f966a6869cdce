"""The seeded scheduler: one schedule = a random topology and fault profile, a run of random steps with
invariants checked after each, then a quiet tail in which every room must finish within a bound."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from kvbridge.agent import AgentConfig
from kvbridge.agent.config import HELLO_RESEND_S
from kvbridge.protocol.wire import Role
from kvbridge.sim.backend import KILLED
from kvbridge.sim.cluster import DEAD, PAUSED, UP, Cluster, Proc
from kvbridge.sim.engine import CLEARED, LOST, Engine
from kvbridge.sim.invariants import Fences, check_bounded, check_frozen
from kvbridge.sim.world import FRAME, LAND, Delivery, Knobs, SimFailure, World

TOPOLOGIES = ((1, 1), (2, 2), (2, 1), (1, 2), (4, 2))
CONFIG = AgentConfig(heartbeat_interval_s=0.5, peer_timeout_s=2.0, bootstrap_timeout_s=4.0, waiting_timeout_s=4.0,
                     staging_bytes=0)
FLIGHT_BOUND_S = 0.5
FAULTS = ("pause", "kill", "partition", "drop", "dup", "write_fail")
#: faults a test pins (``faults=``), never drawn by a seed (so every seed's schedule stays what it was): "drain"
#: drains a prefill rank and closes it once drained (its goodbye, its backend's late notifications); its
#: schedules keep the control link's per-peer order, as ZMQ does
PINNED_FAULTS = ("drain",)


@dataclass(slots=True, kw_only=True)
class Scenario:
    """What a seed draws before the first step."""

    pt: int
    dt: int
    steps: int                 # rounds of the random phase
    faults: frozenset[str]
    staging: str
    staging_bytes: int
    max_requests: int


@dataclass(slots=True, kw_only=True)
class Result:
    seed: int
    scenario: Scenario
    events: int
    requests: int
    successes: int
    trace: list[str] = field(default_factory=list)
    failure: str | None = None


def draw(rng: random.Random) -> Scenario:
    pt, dt = rng.choice(TOPOLOGIES)
    faults = frozenset() if rng.random() < 0.3 else frozenset(f for f in FAULTS if rng.random() < 0.4)
    staging = rng.choice(("never", "never", "always", "auto"))
    return Scenario(pt=pt, dt=dt, steps=rng.randint(6, 30), faults=faults, staging=staging,
                    staging_bytes=0 if staging == "never" else rng.choice((256, 1024, 8192)),
                    max_requests=rng.randint(1, 5))


class Simulation:
    """One schedule of one seed (``run()`` raises :class:`SimFailure` on the first violated invariant)."""

    def __init__(self, seed: int, *, faults: frozenset[str] | None = None) -> None:
        self.seed = seed
        rng = random.Random(seed)
        self.scenario = s = draw(rng)
        if faults is not None:        # swarm testing: a test may pin the fault profile
            s.faults = faults
        knobs = Knobs(drop=0.02 if "drop" in s.faults else 0.0, dup=0.05 if "dup" in s.faults else 0.0,
                      notify_via_link=rng.choice((0.0, 0.3, 1.0)), latency=rng.choice((0.002, 0.01, 0.05)))
        self.world = World(seed=seed, rng=rng, knobs=knobs)
        config = AgentConfig(heartbeat_interval_s=CONFIG.heartbeat_interval_s, peer_timeout_s=CONFIG.peer_timeout_s,
                             bootstrap_timeout_s=CONFIG.bootstrap_timeout_s, waiting_timeout_s=CONFIG.waiting_timeout_s,
                             staging=s.staging if s.staging_bytes else "never", staging_bytes=s.staging_bytes,
                             staging_piece_bytes=max(64, s.staging_bytes // 4) if s.staging_bytes else 1 << 20,
                             write_flight_bound_s=FLIGHT_BOUND_S if seed % 2 else None)
        self.cluster = Cluster(self.world, s.pt, s.dt, config)
        # odd seeds: a fabric whose transport gives a write up (never delivers it) once it was in flight longer
        # than the bound the decodes are told, so they may fence a writer silent past its lease (the parity, not
        # the seed's RNG, decides: every seed's schedule stays what it was)
        self.cluster.net.flight_bound_s = config.write_flight_bound_s
        # a drained rank's closed backend loses or delays notifications: no schedule with it is lossless
        # seeds divisible by 5: engines that let a room go once, whatever its state, as SGLang's scheduler does
        # (clear_when_safe(); the pages are handed back once kvbridge forgot the room). The seed, not its RNG,
        # decides, so every other schedule stays what it was (the fixed bugs' seeds among them)
        self.engine = Engine(self.cluster, lossless=not s.faults & {"drop", "kill", "pause", "partition", "drain"},
                             lets_go=seed % 5 == 0)
        self.fences = Fences(self.cluster, self.engine.opened_by)
        self.config = self.cluster.config
        self.events = 0
        # plain writes are checked page by page as they land; only a staged scatter (the decode's own copy
        # out of its staging area, in progress()) needs the frozen-pages comparison
        self.staged = s.staging_bytes > 0
        self.draining: list[Proc] = []      # prefill ranks draining, closed once drained
        self.cluster.hub.ordered = "drain" in s.faults

    # ------------------------------------------------------------------ running
    def run(self) -> Result:
        # the agents' logs are the trace's noise: silenced for this run only (never left silenced for the
        # process: a test run in the same process after the simulator saw no kvbridge log at all)
        quiet = logging.getLogger("kvbridge")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL + 1)
        try:
            return self._run()
        finally:
            quiet.setLevel(level)

    def _run(self) -> Result:
        world, s = self.world, self.scenario
        world.log(f"seed {self.seed}: prefill TP {s.pt} -> decode TP {s.dt}, faults {sorted(s.faults)}, staging "
                  f"{s.staging}/{s.staging_bytes}, knobs {world.knobs}")
        try:
            for proc in self.cluster.procs:
                self.cluster.start(proc)
            self._boot()
            for _ in range(s.steps):
                self._round()
            self._tail()
            return Result(seed=self.seed, scenario=s, events=self.events, requests=len(self.engine.requests),
                          successes=self.engine.successes, trace=world.trace)
        finally:
            self.cluster.close()

    def _boot(self) -> None:
        """Engines start and connect before they serve: deliver and progress until every handshake is done."""
        world, cluster = self.world, self.cluster
        for _ in range(50):
            for item in sorted(world.ready(), key=lambda d: d.due):
                self._deliver(item, faults=False)
            for proc in cluster.live():
                assert proc.agent is not None
                proc.agent.progress()
            if all(p.agent is not None and not p.agent.peers.handshakes for p in cluster.procs):
                break
            world.now += 0.01
        world.log("booted: every decode rank shook hands")
        self._check()

    def _check(self) -> None:
        if self.staged:                 # only a staged scatter marks a process dirty (see ``staged``)
            check_frozen(self.cluster)
        if self.events % 4 == 0:        # a step adds a few entries at most: every 4th step is enough
            check_bounded(self.cluster, rooms=self.events % 16 == 0)
        if self.world.violations:
            raise SimFailure(self.seed, self.world.violations[0], self.world.trace)

    def _record(self, text: str | None) -> None:
        self.events += 1
        self.world.step = self.events
        if text:
            self.world.log(text)
        self.engine.watch_timeouts()
        self._check()

    def _round(self) -> None:
        """One round: ready deliveries, agent progress steps and engine iterations (each with some chance),
        maybe a new request and a fault, all in a random order, one event each; then the clock moves."""
        world, rng, s, cluster = self.world, self.world.rng, self.scenario, self.cluster
        self._wake()
        actions: list[tuple[str, object]] = [("deliver", d) for d in world.ready() if rng.random() < 0.8]
        actions += [("progress", p) for p in cluster.live() if rng.random() < 0.7]
        actions += [("engine", p) for p in cluster.live() if rng.random() < 0.5]
        if rng.random() < 0.3:
            actions.append(("request", None))
        if s.faults and rng.random() < 0.15:
            actions.append(("fault", None))
        rng.shuffle(actions)
        for kind, what in actions:
            if kind == "deliver":
                assert isinstance(what, Delivery)
                if what.id in world.pending and not world.cut(what.src, what.dst):
                    self._record(self._deliver(what, faults=True))
            elif kind in ("progress", "engine"):
                assert isinstance(what, Proc)
                if what.status != UP or what.agent is None:
                    continue
                what.dirty = self.staged
                if kind == "progress":
                    what.agent.progress()
                    self._record(f"prog  {what.name}")
                else:
                    self._record(self._engine(what))
            elif kind == "request":
                if self._may_open():
                    self.engine.new_request()
                    self._record(None)
            else:
                self._record(self._fault())
        self._stop_drained()
        dt = rng.expovariate(1 / 0.03) if rng.random() < 0.9 else rng.uniform(0.3, 1.5)
        world.now += dt
        self._record(f"tick  +{dt:.3f}")

    def _may_open(self) -> bool:
        return len(self.engine.requests) < self.scenario.max_requests and len(self.engine.open_requests()) < 3

    def _engine(self, proc: Proc) -> str:
        """One engine loop iteration of ``proc``: every request side it holds acts once."""
        texts = [text for req in self.engine.open_requests() if (text := self.engine.act(req, req.sides[proc.name]))]
        return "; ".join(texts) if texts else f"{proc.name} engine idle"

    def _wake(self) -> None:
        for proc in self.cluster.procs:
            if proc.status == PAUSED and self.world.now >= proc.paused_until:
                proc.status = UP
                self.world.log(f"resume {proc.name}")

    def _deliver(self, item: Delivery, *, faults: bool) -> str | None:
        world, net = self.world, self.cluster.net
        if world.pending.pop(item.id, None) is None:
            return None                 # delivered already, ahead of a later frame of its link (``ordered``)
        where = f"{item.src}->{item.dst} {item.label}"
        if item.kind == FRAME:
            assert world.deliver_frame is not None
            world.deliver_frame(item)
            return f"frame {where}"
        if item.kind == LAND:
            plan = item.payload.transfer.plan
            if faults and "write_fail" in self.scenario.faults and world.rng.random() < 0.08:
                landed = world.rng.randint(0, len(plan) - 1) if len(plan) else 0
                net.fail(item, landed)
                return f"FAIL  {where} after {landed}/{len(plan)} descriptors"
            net.land(item)
            return f"land  {where} -> {item.payload.state.state.name}"
        net.notify(item)
        return f"note  {where}"

    def _fault(self) -> str | None:
        world, rng, cluster, s = self.world, self.world.rng, self.cluster, self.scenario
        options = []
        if "pause" in s.faults:
            options.append("pause")
        if "kill" in s.faults:
            options += ["kill", "restart", "reap"]
        if "partition" in s.faults:
            options += ["partition", "heal"]
        if "drain" in s.faults:
            options += ["drain", "restart"]         # a drained rank comes back (a rolling restart)
        if not options:
            return None
        what = rng.choice(options)
        if what == "pause":
            live = cluster.live()
            if not live:
                return None
            proc = rng.choice(live)
            proc.status = PAUSED
            proc.paused_until = world.now + rng.uniform(0.2, 2.5 * self.config.peer_timeout_s)
            return f"PAUSE {proc.name} until {proc.paused_until:.3f}"
        if what == "kill":
            live = [p for p in cluster.procs if p.status in (UP, PAUSED)]
            writing = sorted({d.src for d in world.pending.values() if d.kind == LAND})
            if not live:
                return None
            proc = rng.choice(live)
            if writing and rng.random() < 0.8:      # prefer a writer with writes in flight: the fence problem
                proc = cluster.by_uid[rng.choice(writing)]
                if proc.status not in (UP, PAUSED) or proc.uid not in writing:
                    return None
            uid = proc.uid
            cluster.kill(proc)
            self.engine.lose(proc)
            quiet = not any(d.kind == LAND and d.payload.writer == uid for d in world.pending.values())
            if quiet and rng.random() < 0.5:
                return self._reap(rng.random() < 0.7, uid)      # nothing of it can land: the orchestrator knows
            return None
        if what == "restart":
            dead = [p for p in cluster.procs if p.status == DEAD]
            if not dead:
                return None
            cluster.start(rng.choice(dead))
            return None
        if what == "reap":
            return self._reap(rng.random() < 0.5)
        if what == "drain":
            idle = [p for p in cluster.live() if p.role is Role.PREFILL and p not in self.draining]
            if not idle:
                return None
            proc = rng.choice(idle)
            assert proc.agent is not None
            proc.agent.begin_drain("sim: drain")
            self.draining.append(proc)
            return f"DRAIN {proc.name}"
        if what == "partition":
            names = [p.name for p in cluster.procs]
            group = sorted(rng.sample(names, rng.randint(1, len(names) - 1)))
            world.partition(group, [n for n in names if n not in group])
            return f"CUT   {group} | rest"
        world.cuts.clear()
        return "HEAL"

    def _reap(self, declare: bool, uid: str | None = None) -> str | None:
        """A killed writer (``uid``, else a random one) becomes provably gone; the orchestrator may then also
        declare it gone."""
        cluster = self.cluster
        killed = sorted(u for u, st in cluster.net.state.items() if st == KILLED)
        if not killed:
            return None
        uid = uid if uid is not None else self.world.rng.choice(killed)
        dropped = cluster.net.reap(uid)
        proc = cluster.by_uid[uid]
        text = f"REAP  {uid} ({dropped} writes dropped)"
        if declare and proc.status == DEAD:
            for other in cluster.live():
                if other.role is not proc.role and other.agent is not None:
                    other.agent.declare_gone(proc.name)
            text += ", declared gone"
        return text

    def _stop_drained(self) -> None:
        """Close each draining prefill rank whose rooms are all over (``drained``, read without a progress step)."""
        for proc in list(self.draining):
            agent = proc.agent
            if proc.status == DEAD or agent is None:
                self.draining.remove(proc)       # killed meanwhile
                continue
            if proc.status != UP:
                continue
            with agent.context.lock:
                settled = agent._side().unsettled() == 0
            if settled:
                self.draining.remove(proc)
                self.engine.stopped(proc)
                self.cluster.stop(proc)
                self._record(None)

    # ------------------------------------------------------------------ quiet tail
    def bound(self) -> float:
        c = self.config
        return c.bootstrap_timeout_s + c.waiting_timeout_s + 2 * c.peer_timeout_s + 2 * HELLO_RESEND_S + 2.0

    def _tail(self) -> None:
        world, cluster = self.world, self.cluster
        world.cuts.clear()
        world.knobs = Knobs(notify_via_link=world.knobs.notify_via_link, latency=world.knobs.latency)
        world.log("quiet: heal, resume, restart; reap later")
        for proc in cluster.procs:
            if proc.status == PAUSED:
                proc.status = UP
        for proc in cluster.procs:
            if proc.status == DEAD and world.rng.random() < 0.7:
                cluster.start(proc)
        reap_at = world.now + world.rng.uniform(0.0, 2.5 * self.config.peer_timeout_s)   # killed writers: gone then
        deadline = reap_at + self.bound()
        tail = 0
        while True:
            busy = False
            while world.now >= reap_at and any(st == KILLED for st in cluster.net.state.values()):
                self._record(self._reap(False))
            for item in sorted(world.ready(), key=lambda d: d.due):
                self._record(self._deliver(item, faults=False))
                busy = busy or not item.label.startswith("heartbeat")
            for proc in cluster.live():
                assert proc.agent is not None
                proc.agent.progress()
                proc.dirty = self.staged
            self._stop_drained()
            self.engine.watch_timeouts()
            for req in self.engine.open_requests():
                for name in sorted(req.sides):
                    text = self.engine.act(req, req.sides[name], polite=True)
                    if text:
                        self._record(text)
                        busy = True
            self._check()
            if self._settled():
                world.log(f"quiet: every room finished after {tail} rounds")
                return
            if world.now > deadline:
                raise SimFailure(self.seed, f"liveness: rooms unfinished {self.bound():.1f} s after the faults "
                                            f"stopped: {self._stuck()}", world.trace)
            world.now += 0.02 if busy else 0.2
            tail += 1

    def _settled(self) -> bool:
        for req in self.engine.requests:
            for side in req.sides.values():
                proc = self.cluster.by_name[side.proc]
                if side.state not in (CLEARED, LOST) and proc.status == UP:
                    return False
        return not any(d.kind == LAND for d in self.world.pending.values())

    def _stuck(self) -> str:
        out = []
        for req in self.engine.requests:
            for side in req.sides.values():
                proc = self.cluster.by_name[side.proc]
                if side.state in (CLEARED, LOST) or proc.status != UP:
                    continue
                out.append(f"room {req.room} on {proc.name}: {side.state} {self._room_state(proc, req.room)}")
        return "; ".join(out) or "writes still pending"

    @staticmethod
    def _room_state(proc: Proc, room: int) -> str:
        agent = proc.agent
        if agent is None:
            return "(dead)"
        if agent.prefill is not None and room in agent.prefill.rooms:
            sent = agent.prefill.rooms[room]
            return (f"{sent.status.name} {sent.reason!r} requests={sorted(sent.requests)} "
                    f"inflight={len(sent.inflight)} pending={len(sent.pending)}")
        if agent.decode is not None and room in agent.decode.rooms:
            got = agent.decode.rooms[room]
            return f"{got.status.name} {got.reason!r} quiesced={sorted(got.quiesced)} targets={got.targets}"
        return "(no room)"


def run_seed(seed: int, *, faults: frozenset[str] | None = None) -> Result:
    """Run one schedule; a violated invariant comes back as ``Result.failure`` with the trace."""
    sim = Simulation(seed, faults=faults)
    try:
        return sim.run()
    except SimFailure as exc:
        return Result(seed=seed, scenario=sim.scenario, events=sim.events, requests=len(sim.engine.requests),
                      successes=sim.engine.successes, trace=exc.trace, failure=exc.message)

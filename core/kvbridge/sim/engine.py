"""The simulated inference engines: requests as rooms on every rank, advanced one engine action at a time.

A request has one side per rank. A prefill side opens a Sender, fills its source pages with the reference
pattern, sends random chunks (the last with ``last=True``) and clears once safe. A decode side opens a
Receiver, grants random destination pages, sends metadata, verifies every byte against the independent
reference on Success, and clears (handing its pages back) only once ``safe_to_reuse``. An engine that ``lets_go``
(SGLang's way) instead hands a room to ``clear_when_safe()`` as soon as it is over or aborted, safe or not, and hands
its pages back once kvbridge forgot the room: a write that lands or reads after that breaks the fence invariants, a
room never forgotten breaks liveness.

Every room state an engine observes must have been announced by its room event (``TransferAgent.events()``)
by then: an engine that waits on events instead of polling would otherwise miss it. The engine looks twice per
action: once without a progress step (as an engine beside a progress thread sees it, after frames were handled
elsewhere) and once through the handle (which progresses first); each time the queued events are taken first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbridge.agent import Receiver, Sender
from kvbridge.errors import KVBridgeError
from kvbridge.pattern import TOKEN_MAJOR, pattern, shard_axis
from kvbridge.protocol.events import RoomEventKind
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.sim.cluster import INSTANCE, LAYERS, SPEC, UP, Cluster, Proc

TIMEOUTS = ("waiting timeout", "bootstrap timeout")     # the reasons of a decode room that gave up waiting

NEW, OPEN, META, TERMINAL, LET_GO, CLEARED, LOST = "new", "open", "meta", "terminal", "let go", "cleared", "lost"

assert SPEC.layout == TOKEN_MAJOR and SPEC.head_axis is not None     # reference_pages builds token-major pages
HEAD_AXIS: int = SPEC.head_axis
_BUFFERS = 2 * LAYERS                                   # K and V of every layer: buffer b is tensor b // LAYERS


def reference_pages(seed: int, pages: int) -> np.ndarray:
    """:func:`kvbridge.pattern.logical_pages` of request positions ``0..pages-1`` for every KV buffer at once,
    ``[buffer, page, token, head, byte]`` (buffer ``b``: layer ``b % LAYERS``, tensor ``b // LAYERS``); the
    pattern is elementwise in its coordinates, so broadcasting over the buffers gives the same bytes."""
    buffers = np.arange(_BUFFERS).reshape(-1, 1, 1, 1, 1)
    return pattern(seed, buffers % LAYERS, buffers // LAYERS, np.arange(pages).reshape(1, -1, 1, 1, 1),
                   np.arange(SPEC.page_size).reshape(1, 1, -1, 1, 1),
                   np.arange(SPEC.total_heads).reshape(1, 1, 1, -1, 1),
                   np.arange(SPEC.head_bytes).reshape(1, 1, 1, 1, -1))


@dataclass(slots=True, kw_only=True)
class Side:
    """One rank's part of a request, on one incarnation of its process."""

    proc: str
    gen: int = -1
    state: str = NEW
    handle: Sender | Receiver | None = None
    pages: np.ndarray | None = None
    sent: int = 0                 # chunks sent (prefill)
    status: KVPoll = KVPoll.Bootstrapping
    terminal_at: float | None = None
    succeeded: bool = False       # a prefill side that reached Success (its writes all landed and notified)


@dataclass(slots=True, kw_only=True)
class Request:
    room: int
    pattern: int
    cuts: list[int]               # chunk boundaries, ending with the page count
    created: float
    sides: dict[str, Side] = field(default_factory=dict)
    _logical: np.ndarray | None = None
    _shares: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def shares(self, tp: int, rank: int) -> np.ndarray:
        """The reference bytes rank ``rank`` of TP ``tp`` holds of every request page, every KV buffer:
        ``[buffer, page, *local_page_shape]`` (the un-sharded pattern, cut by :mod:`kvbridge.pattern`, never
        by kvbridge's planner; computed once per request and rank)."""
        found = self._shares.get((tp, rank))
        if found is None:
            if self._logical is None:
                self._logical = reference_pages(self.pattern, self.pages)
            found = self._shares[(tp, rank)] = shard_axis(self._logical, 2 + HEAD_AXIS, tp, rank)
        return found

    def share(self, buffer: int, tp: int, rank: int) -> np.ndarray:
        """The reference bytes of every request page in KV buffer ``buffer`` (see :meth:`shares`)."""
        return self.shares(tp, rank)[buffer]

    @property
    def pages(self) -> int:
        return self.cuts[-1]

    def live_sides(self) -> list[Side]:
        return [s for s in self.sides.values() if s.state not in (CLEARED, LOST)]

    def is_open(self) -> bool:
        """Some side still lives (``live_sides()`` is not empty)."""
        return any(s.state not in (CLEARED, LOST) for s in self.sides.values())


# what an engine may conclude from a state it observes, and the event that must have said so
_NEEDS: dict[KVPoll, RoomEventKind] = {KVPoll.Success: RoomEventKind.FINISHED, KVPoll.Failed: RoomEventKind.FAILED}
_PAST_BOOTSTRAP = (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)


class Engine:
    """Every request of the world; ``act`` performs one engine action on one side."""

    def __init__(self, cluster: Cluster, *, lossless: bool = False, lets_go: bool = False) -> None:
        #: no frame is lost, no process dies, pauses or is cut off: a room has no excuse to time out
        self.lossless = lossless
        #: rooms are handed to clear_when_safe() once over or aborted (see the module's docstring)
        self.lets_go = lets_go
        self.cluster = cluster
        self.world = cluster.world
        self.requests: list[Request] = []
        self.by_room: dict[int, Request] = {}
        self.next_room = self.world.rng.getrandbits(40) << 8
        self.successes = 0
        # the room events each process incarnation announced, by room: {(proc, gen): {room: kinds}}
        self.announced: dict[tuple[str, int], dict[int, set[RoomEventKind]]] = {}

    # ------------------------------------------------------------------ requests
    def new_request(self) -> Request:
        rng = self.world.rng
        self.next_room += rng.randint(1, 3)
        n = rng.randint(1, 5)
        inner = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        req = Request(room=self.next_room, pattern=rng.getrandbits(31), cuts=[*inner, n], created=self.world.now)
        req.sides = {p.name: Side(proc=p.name) for p in self.cluster.procs}
        self.requests.append(req)
        self.by_room[req.room] = req
        self.world.log(f"req   room={req.room} pages={n} chunks={req.cuts}")
        return req

    def opened_by(self, room: int, proc: str) -> int | None:
        """The generation of ``proc`` whose engine opened ``room`` there (None: unknown room, or not opened)."""
        req = self.by_room.get(room)
        side = req.sides.get(proc) if req is not None else None
        return side.gen if side is not None and side.gen >= 0 else None

    def open_requests(self) -> list[Request]:
        return [r for r in self.requests if r.is_open()]

    def stopped(self, proc: Proc) -> None:
        """``proc`` (a prefill rank) drained and closes: what its rooms reached is remembered, then its sides go."""
        assert proc.agent is not None and proc.agent.prefill is not None
        for req in self.requests:
            room = proc.agent.prefill.rooms.get(req.room)
            side = req.sides[proc.name]
            if room is not None and side.gen == proc.gen and room.status is KVPoll.Success:
                side.succeeded = True
        self.lose(proc)

    def planned_goodbye(self, req: Request, proc: Proc, reason: str) -> None:
        """A decode room failed because a prefill said goodbye although every prefill rank of the request
        reached Success (every write landed and was notified): a planned shutdown must not fail it."""
        prefills = [s for s in req.sides.values() if self.cluster.by_name[s.proc].role is Role.PREFILL]
        if "said goodbye" in reason and prefills and all(s.succeeded for s in prefills):
            self.world.violate(f"planned shutdown: room {req.room} on {proc.name} failed ({reason}) although every "
                               "prefill rank of it reached Success")

    def lose(self, proc: Proc) -> None:
        """``proc`` died: its sides of every request are gone with it (its memory too)."""
        for req in self.requests:
            side = req.sides[proc.name]
            if side.state not in (CLEARED, LOST):
                side.state, side.handle = LOST, None

    # ------------------------------------------------------------------ one action
    def act(self, req: Request, side: Side, *, polite: bool = False) -> str | None:
        """Advance ``side`` by one engine action (None: nothing to do now). ``polite``: the quiet tail,
        where the engine finishes every request and never aborts."""
        proc = self.cluster.by_name[side.proc]
        if proc.status != UP or side.state in (CLEARED, LOST):
            return None
        if side.gen not in (-1, proc.gen):
            side.state = LOST
            return None
        try:
            if proc.role is Role.PREFILL:
                return self._prefill(req, side, proc, polite)
            return self._decode(req, side, proc, polite)
        except KVBridgeError as exc:
            return f"{side.proc} refused: {type(exc).__name__}: {str(exc)[:80]}"

    def _grant(self, proc: Proc, req: Request) -> np.ndarray | None:
        free = np.flatnonzero(proc.owner < 0)
        if len(free) < req.pages:
            return None
        pages = np.array(self.world.rng.sample(free.tolist(), req.pages), dtype=np.int64)   # in random order
        proc.owner[pages] = req.room
        return pages

    def _free(self, proc: Proc, side: Side) -> None:
        if side.pages is not None:
            proc.owner[side.pages] = -1
            proc.frozen[:, side.pages] = proc.mem[:, side.pages]
            side.pages = None

    def _prefill(self, req: Request, side: Side, proc: Proc, polite: bool) -> str | None:
        assert proc.agent is not None
        if side.state == NEW:
            pages = self._grant(proc, req)
            if pages is None:
                return None
            proc.mem[:, pages] = req.shares(proc.tp, proc.rank).reshape(len(proc.buffers), req.pages, -1)
            side.pages, side.gen = pages, proc.gen
            side.handle = proc.agent.sender(req.room)
            side.state = OPEN
            return f"{proc.name} sender room={req.room} pages={pages.tolist()}"
        sender = side.handle
        assert isinstance(sender, Sender) and side.pages is not None
        rooms = proc.agent.prefill
        assert rooms is not None
        if side.state == LET_GO:
            return self._forgotten(req, side, proc, req.room not in rooms.rooms)
        self.observe(proc, req.room, rooms.status(req.room), rooms.safe_to_reuse(req.room))
        # the quiet tail reads room state without a progress step per room (the loop progresses every agent)
        status = side.status = rooms.status(req.room) if polite else sender.poll()
        side.succeeded = side.succeeded or status is KVPoll.Success
        if status in (KVPoll.Success, KVPoll.Failed):
            if side.terminal_at is None:
                side.terminal_at = self.world.now
            safe = rooms.safe_to_reuse(req.room) if polite else sender.safe_to_reuse
            self.observe(proc, req.room, status, safe)
            if self.lets_go:
                sender.clear_when_safe()
                return self._let_go(req, side, proc, req.room not in rooms.rooms, f"({status.name})")
            if not safe:
                return None
            sender.clear()
            self._free(proc, side)
            side.state = CLEARED
            return f"{proc.name} clear sender room={req.room} ({status.name})"
        self.observe(proc, req.room, status, False)
        if not polite and self.world.rng.random() < 0.03:
            sender.abort("sim: prefill aborts")
            if self.lets_go:
                sender.clear_when_safe()
                return self._let_go(req, side, proc, req.room not in rooms.rooms, "(aborted)")
            return f"{proc.name} abort sender room={req.room}"
        if self.lets_go and not polite and self.world.rng.random() < 0.02:     # let go live, no abort
            sender.clear_when_safe()
            return self._let_go(req, side, proc, req.room not in rooms.rooms, f"({status.name}, live)")
        # a third of the requests send from position 0 at once (from_start): the core holds them until asked
        early = req.pattern % 3 == 0
        if (status is KVPoll.WaitingForInput or (status is KVPoll.Transferring and side.sent < len(req.cuts))
                or (early and status is KVPoll.Bootstrapping)):
            if side.sent >= len(req.cuts):
                return None
            a = req.cuts[side.sent - 1] if side.sent else 0
            b = req.cuts[side.sent]
            last = side.sent == len(req.cuts) - 1
            sender.send(side.pages[a:b], last=last, from_start=early)
            side.sent += 1
            return f"{proc.name} send room={req.room} pages[{a}:{b}]{' last' if last else ''}{' held' if early else ''}"
        return None

    def _decode(self, req: Request, side: Side, proc: Proc, polite: bool) -> str | None:
        assert proc.agent is not None
        if side.state == NEW:
            side.handle = proc.agent.receiver(req.room, INSTANCE)
            side.gen, side.state = proc.gen, OPEN
            return f"{proc.name} receiver room={req.room}"
        receiver = side.handle
        assert isinstance(receiver, Receiver)
        if side.state == OPEN:
            pages = self._grant(proc, req)
            if pages is None:
                return None
            side.pages = pages
            side.state = META
            receiver.send_metadata({"kv": pages})
            return f"{proc.name} meta room={req.room} pages={pages.tolist()}"
        rooms = proc.agent.decode
        assert rooms is not None
        if side.state == LET_GO:
            return self._forgotten(req, side, proc, req.room not in rooms.rooms)
        self.observe(proc, req.room, rooms.status(req.room), rooms.safe_to_reuse(req.room))
        status = side.status = rooms.status(req.room) if polite else receiver.poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            if side.terminal_at is None:
                side.terminal_at = self.world.now
                if status is KVPoll.Success:
                    self.successes += 1
                    self.verify(req, side, proc)
                else:
                    self.planned_goodbye(req, proc, rooms.get(req.room).reason)
            safe = rooms.safe_to_reuse(req.room) if polite else receiver.safe_to_reuse
            self.observe(proc, req.room, status, safe)
            if self.lets_go:
                receiver.clear_when_safe()
                return self._let_go(req, side, proc, req.room not in rooms.rooms, f"({status.name})")
            if not safe:
                return None
            receiver.clear()
            self._free(proc, side)
            side.state = CLEARED
            return f"{proc.name} clear receiver room={req.room} ({status.name})"
        self.observe(proc, req.room, status, False)
        if not polite and self.world.rng.random() < 0.03:
            receiver.abort("sim: decode aborts")
            if self.lets_go:
                receiver.clear_when_safe()
                return self._let_go(req, side, proc, req.room not in rooms.rooms, "(aborted)")
            return f"{proc.name} abort receiver room={req.room}"
        if self.lets_go and not polite and self.world.rng.random() < 0.02:     # let go live, no abort
            receiver.clear_when_safe()
            return self._let_go(req, side, proc, req.room not in rooms.rooms, f"({status.name}, live)")
        return None

    def _let_go(self, req: Request, side: Side, proc: Proc, forgotten: bool, why: str) -> str:
        """The engine handed the room to ``clear_when_safe()``; its pages come back once kvbridge forgot it."""
        side.state = LET_GO
        text = f"{proc.name} let go room={req.room} {why}"
        return text if not forgotten else f"{text}; {self._forgotten(req, side, proc, True)}"

    def _forgotten(self, req: Request, side: Side, proc: Proc, forgotten: bool) -> str | None:
        """A let-go room: once kvbridge forgot it, nothing more lands in or is read from its pages: handed back."""
        if not forgotten:
            return None
        self._free(proc, side)
        side.state = CLEARED
        return f"{proc.name} room={req.room} forgotten by kvbridge: pages handed back"

    def watch_timeouts(self) -> None:
        """Take every live process's room events (see :meth:`take_events`)."""
        for proc in self.cluster.procs:
            if proc.status == UP and proc.agent is not None:
                self.take_events(proc)

    def take_events(self, proc: Proc) -> dict[int, set[RoomEventKind]]:
        """Take ``proc``'s queued room events (no progress step: the schedule stays the same) into the rooms'
        announced kinds. In a schedule that loses nothing, a decode room that failed by timeout is checked the
        moment it failed (its FAILED event), not when the engine looks at it: by then the prefill may have
        cleared its side after the decode's abort."""
        assert proc.agent is not None
        announced = self.announced.setdefault((proc.name, proc.gen), {})
        if not proc.agent.context.events.queued():
            return announced
        with proc.agent.context.lock:
            events = proc.agent.context.events.take()
        for event in events:
            kinds = announced.setdefault(event.room, set())
            if event.kind in kinds:
                self.world.violate(f"room {event.room} on {proc.name}: event {event.kind.name} announced twice")
            kinds.add(event.kind)
            if {RoomEventKind.FINISHED, RoomEventKind.FAILED} <= kinds:
                self.world.violate(f"room {event.room} on {proc.name}: announced both FINISHED and FAILED")
            if (self.lossless and proc.agent.decode is not None and event.kind is RoomEventKind.FAILED
                    and event.reason.startswith(TIMEOUTS)):
                req = self.by_room.get(event.room)
                if req is not None and event.room in proc.agent.decode.rooms:
                    self.silent_wait(req, proc, event.reason)
        return announced

    def observe(self, proc: Proc, room: int, status: KVPoll, safe: bool) -> None:
        """The engine of ``proc`` sees ``room`` in ``status`` (``safe``: safe to reuse): every conclusion it may
        draw from that must have been announced by the room's event by now (an engine that waits on
        ``events()`` instead of polling every room would otherwise wait for nothing)."""
        kinds = self.take_events(proc).get(room, set())
        missing = []
        need = _NEEDS.get(status)
        if need is not None and need not in kinds:
            missing.append(need.name)
        if proc.role is Role.PREFILL and status in _PAST_BOOTSTRAP and RoomEventKind.READY not in kinds:
            missing.append(RoomEventKind.READY.name)
        if safe and RoomEventKind.SAFE_TO_REUSE not in kinds:
            missing.append(RoomEventKind.SAFE_TO_REUSE.name)
        if missing:
            self.world.violate(f"room {room} on {proc.name}: the engine saw it {status.name}"
                               f"{' and safe to reuse' if safe else ''} without the event {', '.join(missing)} "
                               f"(announced: {sorted(k.name for k in kinds) or 'none'})")

    def silent_wait(self, req: Request, proc: Proc, reason: str) -> None:
        """A decode room timed out in a schedule that loses nothing: a violation when some prefill rank it waits
        for holds no live room with its request and has nothing in flight to it (it waited for nothing)."""
        assert proc.agent is not None and proc.agent.decode is not None
        record = proc.agent.decode.rooms[req.room]
        for rank, name in sorted(record.targets.items()):
            if proc.agent.decode._delivered(record, rank):
                continue                        # this rank delivered all it owed
            writer = self.cluster.by_name[name]
            if writer.agent is None or writer.agent.prefill is None or writer.status != UP:
                continue
            sent = writer.agent.prefill.rooms.get(req.room)
            if sent is not None and proc.name in sent.requests and sent.status not in (KVPoll.Success, KVPoll.Failed):
                continue
            if any(d.src.split("/")[0] == name and d.dst.split("/")[0] == proc.name
                   for d in self.world.pending.values()):
                continue
            state = "no room" if sent is None else f"{sent.status.name} with requests from {sorted(sent.requests)}"
            self.world.violate(f"silent wait: room {req.room} on {proc.name} failed by timeout ({reason}) in a "
                               f"schedule that loses nothing, while prefill {name} holds {state} for it and "
                               "has nothing in flight to it: it waited for nothing")
            return

    # ------------------------------------------------------------------ invariant 1
    def verify(self, req: Request, side: Side, proc: Proc) -> None:
        """A decode room that reports Success holds exactly the reference bytes in every destination page."""
        assert side.pages is not None
        want = req.shares(proc.tp, proc.rank).reshape(len(proc.buffers), req.pages, -1)
        got = proc.mem[:, side.pages]
        if np.array_equal(got, want):
            return
        for b in range(len(proc.buffers)):
            if not np.array_equal(got[b], want[b]):
                bad = np.flatnonzero((got[b] != want[b]).any(axis=1)).tolist()
                self.world.violate(f"room {req.room} reports Success on {proc.name} but buffer {b} differs from the "
                                   f"reference at request positions {bad}")
                return

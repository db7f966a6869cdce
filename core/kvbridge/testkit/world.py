"""Prefill and decode ranks of one process (TransferAgent over LocalHub), and bounded waits on rooms.

A world holds one prefill instance per prefill TP size and one decode instance per decode TP size it
was asked for, every decode instance connected to every prefill instance it pairs with, so one set of
agents serves a whole (Pt, Dt) matrix. Rooms are driven through the public Sender/Receiver API only.

    world = World(registry=reg, backend="loopback", pairs=[(2, 1)], make_pool=lambda role, tp, r: KVPool(tp, r))
    room = world.open(2, 1, room_id, {"gqa": dst_pages, ...})
    room.send([pages[:2], pages[2:]])
    room.wait_success(10.0)
    room.settle(10.0)                     # both sides safe to reuse, then cleared
    world.close()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from kvbridge.agent import AgentConfig, Receiver, Sender, TransferAgent
from kvbridge.geometry import PoolLayout
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry

__all__ = ["Pool", "Room", "World", "wait_until"]

log = logging.getLogger(__name__)


class Pool(Protocol):
    layout: PoolLayout

    def arrays(self) -> dict[str, list[object]]: ...
    def close(self) -> None: ...


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: Callable[[], str],
               poll_s: float = 0.001) -> float:
    """Wait for ``predicate``; raise AssertionError with ``what()`` after ``timeout_s``. Returns the time taken."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what()} (waited {timeout_s:.1f} s)")
        time.sleep(poll_s)
    return time.monotonic() - started


class Rank:
    """One agent and the pool it registered."""

    def __init__(self, agent: TransferAgent, pool: Any) -> None:
        self.agent, self.pool = agent, pool


def _status(side: Sender | Receiver) -> str:
    try:
        status = side.poll()
        reason = side.failure_reason
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return f"<{type(exc).__name__}: {exc}>"
    return f"{status.name}" + (f" ({reason})" if reason else "")


class Room:
    """One request across Pt prefill and Dt decode ranks of a world."""

    def __init__(self, world: World, pt: int, dt: int, room: int, senders: list[Sender],
                 receivers: list[Receiver]) -> None:
        self.world, self.pt, self.dt, self.room = world, pt, dt, room
        self.senders, self.receivers = senders, receivers
        self.cleared = False

    def describe(self) -> str:
        return (f"room {self.room} (Pt {self.pt} -> Dt {self.dt}): prefill ranks "
                f"[{', '.join(_status(s) for s in self.senders)}], decode ranks "
                f"[{', '.join(_status(r) for r in self.receivers)}]")

    def send(self, chunks: Sequence[np.ndarray], state: Mapping[str, Any] | None = None) -> None:
        """Send ``chunks`` of source pages from every prefill rank; the last one carries ``state``."""
        for k, pages in enumerate(chunks):
            last = k == len(chunks) - 1
            for sender in self.senders:
                sender.send(np.asarray(pages, dtype=np.int64), last=last, state=state if last else None)

    def statuses(self) -> tuple[list[KVPoll], list[KVPoll]]:
        return [s.poll() for s in self.senders], [r.poll() for r in self.receivers]

    def _hint(self, senders: list[KVPoll], receivers: list[KVPoll]) -> str:
        if all(s is KVPoll.Success for s in senders) and not all(r is KVPoll.Success for r in receivers):
            return ("; every prefill rank finished its writes, so their completion notices did not reach "
                    "the decode ranks")
        return ""

    def wait_success(self, timeout_s: float) -> None:
        def done() -> bool:
            senders, receivers = self.statuses()
            if KVPoll.Failed in senders or KVPoll.Failed in receivers:
                raise AssertionError(f"a rank failed: {self.describe()}{self._hint(senders, receivers)}")
            return all(s is KVPoll.Success for s in senders + receivers)

        wait_until(done, timeout_s,
                   lambda: f"transfer did not complete: {self.describe()}{self._hint(*self.statuses())}")

    def wait_failed(self, timeout_s: float, *, senders: bool = True, receivers: bool = True) -> float:
        def failed() -> bool:
            s, r = self.statuses()
            return (not senders or all(x is KVPoll.Failed for x in s)) and \
                   (not receivers or all(x is KVPoll.Failed for x in r))

        return wait_until(failed, timeout_s, lambda: f"the room did not fail in time: {self.describe()}")

    def safe(self) -> bool:
        return all(s.safe_to_reuse for s in self.senders) and all(r.safe_to_reuse for r in self.receivers)

    def settle(self, timeout_s: float) -> None:
        """Wait until no write can still land (both sides safe to reuse), then clear the room everywhere."""
        wait_until(self.safe, timeout_s, lambda: f"a side is still not safe to reuse its pages: {self.describe()}")
        self.clear()

    def clear(self) -> None:
        if self.cleared:
            return
        self.cleared = True
        sides: list[Sender | Receiver] = [*self.senders, *self.receivers]
        for side in sides:
            try:
                side.clear()
            except Exception:  # noqa: BLE001 - a room with writes in flight stays; the leak check reports it
                self.cleared = False


class World:
    """One process's prefill and decode instances for the TP sizes of ``pairs`` (see module docstring)."""

    def __init__(self, *, registry: Registry, backend: str, pairs: Iterable[tuple[int, int]],
                 make_pool: Callable[[Role, int, int], Any], config: AgentConfig, label: str = "kit",
                 connect_timeout_s: float = 20.0) -> None:
        self.registry, self.backend, self.config, self.label = registry, backend, config, label
        self.pairs = sorted(set(pairs))
        self.hub = LocalHub()
        self.prefill: dict[int, list[Rank]] = {}
        self.decode: dict[int, list[Rank]] = {}
        self._pools: list[Any] = []
        try:
            for pt in sorted({p for p, _ in self.pairs}):
                self.prefill[pt] = [self._rank(Role.PREFILL, pt, r, make_pool) for r in range(pt)]
            for dt in sorted({d for _, d in self.pairs}):
                self.decode[dt] = [self._rank(Role.DECODE, dt, r, make_pool) for r in range(dt)]
            for ranks in [*self.prefill.values(), *self.decode.values()]:
                for rank in ranks:
                    rank.agent.start()
            for pt, dt in self.pairs:
                for rank in self.decode[dt]:
                    rank.agent.connect(self.instance(pt), timeout_s=connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def instance(self, pt: int) -> str:
        return f"{self.label}-prefill-tp{pt}"

    def _rank(self, role: Role, tp: int, rank: int, make_pool: Callable[[Role, int, int], Any]) -> Rank:
        pool = make_pool(role, tp, rank)
        self._pools.append(pool)
        name = f"{self.label}-{role.value}-tp{tp}-r{rank}"
        agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=role, link=self.hub.link(name),
                              backend=self.backend, registry=self.registry, name=name, config=self.config,
                              instance=self.instance(tp) if role is Role.PREFILL else "")
        return Rank(agent, pool)

    def open(self, pt: int, dt: int, room: int, metadata: Mapping[str, Any], timeout_s: float,
             prefix_len: int = 0) -> Room:
        """Receivers send their destination indices; senders wait until every request arrived."""
        receivers = [r.agent.receiver(room, self.instance(pt)) for r in self.decode[dt]]
        for receiver in receivers:
            receiver.send_metadata(metadata, prefix_len=prefix_len)
        senders = [p.agent.sender(room) for p in self.prefill[pt]]
        opened = Room(self, pt, dt, room, senders, receivers)
        wait_until(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders), timeout_s,
                   lambda: f"prefill ranks never got the decode requests: {opened.describe()}")
        return opened

    def close(self) -> None:
        ranks = [r for rs in self.decode.values() for r in rs] + [r for rs in self.prefill.values() for r in rs]
        for rank in ranks:
            try:
                rank.agent.close()
            except Exception:
                log.exception("closing %s failed", rank.agent.name)
        self.prefill, self.decode = {}, {}
        for pool in self._pools:
            pool.close()
        self._pools = []

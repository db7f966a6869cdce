"""Transfer threads: they post engine batches so the caller's thread never waits on the engine.

Every Mooncake call that waits (``get_batch_transfer_status``, ``transfer_sync``) releases the GIL, but it
spins until the batch ends, so it runs here. A peer always maps to the same thread, which keeps that peer's
writes and notices in posting order and its in-flight descriptors under the engine's per-peer limit.

A handle turns DONE once every batch of its plan completed (acknowledged by the peer, see engine.py), and
FAILED once every batch it posted was reported finished or failed. Mooncake reports a batch failed as soon
as one of its transfers fails; the batch's other transfers may still be landing then, and the engine gives
no way to wait for them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvbridge.plugin import HandleState, Poll

log = logging.getLogger("kvbridge.mooncake")
_BAD_BATCH_IDS = frozenset({0, 2**64 - 1})  # submit failed (0), or no segment for the peer (-1 as uint64)
_NOTIFY_ATTEMPTS = 3


class MooncakeHandle:
    """What ``send_component`` returns: a pollable, thread-safe completion slot.

    ``elapsed`` is the time from posting to the terminal state as the transfer thread saw it (None while
    pending), which excludes how late the caller polls.
    """

    __slots__ = ("_poll", "descriptors", "finished_at", "nbytes", "peer", "posted_at")

    def __init__(self, peer: str, descriptors: int, nbytes: int) -> None:
        self._poll = Poll.pending()
        self.peer, self.descriptors, self.nbytes = peer, descriptors, nbytes
        self.posted_at = time.perf_counter()
        self.finished_at: float | None = None

    @property
    def poll(self) -> Poll:
        return self._poll

    @property
    def elapsed(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    def finish(self, result: Poll) -> None:
        if self._poll.state is HandleState.PENDING:
            self.finished_at = time.perf_counter()
            self._poll = result  # one reference store, after the timestamp: atomic under the GIL

    def __repr__(self) -> str:
        return f"MooncakeHandle(peer={self.peer!r}, {self.descriptors} descriptors, {self._poll.state.name})"


class Job(Protocol):
    def run(self, engine: Any) -> None: ...
    def abandon(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class SendJob:
    """Write ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]`` of ``session``, in windowed batches."""

    handle: MooncakeHandle
    session: str
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    chunk: int
    window: int

    def run(self, engine: Any) -> None:
        total = int(self.nbytes.size)
        in_flight: deque[tuple[int, int]] = deque()
        error = ""
        for start in range(0, total, self.chunk):
            if len(in_flight) == self.window:
                error = self._wait(engine, *in_flight.popleft(), total)
                if error:
                    break
            end = min(start + self.chunk, total)
            batch = engine.batch_transfer_async_write(
                self.session, self.src[start:end].tolist(), self.dst[start:end].tolist(),
                self.nbytes[start:end].tolist())
            if batch in _BAD_BATCH_IDS:
                error = (f"mooncake batch_transfer_async_write to {self.session} returned {_signed(batch)} "
                         f"for descriptors [{start}, {end}) of {total} (peer unreachable or queue full)")
                break
            in_flight.append((batch, start))
        while in_flight:  # nothing may stay in flight once the handle is terminal
            late = self._wait(engine, *in_flight.popleft(), total)
            error = error or late
        self.handle.finish(Poll.failed(error) if error else Poll.done())

    def _wait(self, engine: Any, batch: int, start: int, total: int) -> str:
        rc = engine.get_batch_transfer_status([batch])
        if rc == 0:
            return ""
        end = min(start + self.chunk, total)
        return (f"mooncake get_batch_transfer_status returned {rc} for descriptors [{start}, {end}) of "
                f"{total} to {self.session} (write failed, rejected by the peer, or timed out)")

    def abandon(self, reason: str) -> None:
        self.handle.finish(Poll.failed(reason))


@dataclass(frozen=True, slots=True)
class NotifyFailure:
    """A notice the backend accepted but could not deliver (the caller may carry it another way)."""

    peer: str
    notice: bytes
    reason: str


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class NotifyJob:
    """Deliver one notice through Mooncake's notify channel, riding a 1-byte scratch-to-scratch write."""

    peer: str
    session: str
    local_scratch: int
    peer_scratch: int
    sender: str
    notice: bytes
    failures: deque[NotifyFailure]

    def run(self, engine: Any) -> None:
        from mooncake.engine import TransferNotify, TransferOpcode

        message = self.notice.decode("latin-1")  # every byte value survives Mooncake's str round trip
        rc = -1
        for attempt in range(_NOTIFY_ATTEMPTS):
            rc = engine.transfer_sync(self.session, self.local_scratch, self.peer_scratch, 1,
                                      TransferOpcode.Write, TransferNotify(self.sender, message))
            if rc == 0:
                return
            time.sleep(0.01 * 2**attempt)
        self.abandon(f"notice to {self.session} not delivered: transfer_sync returned {rc} "
                     f"after {_NOTIFY_ATTEMPTS} attempts")

    def abandon(self, reason: str) -> None:
        log.warning("%s", reason)
        self.failures.append(NotifyFailure(self.peer, self.notice, reason))


class Worker:
    """One transfer thread and its FIFO of jobs."""

    def __init__(self, engine: Any, name: str, closing: threading.Event) -> None:
        self._engine = engine
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closing = closing
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float) -> bool:
        """Abandon transfers that have not started, deliver queued notices, wait for what has started; True
        when the thread ended in time."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._engine = None  # drop the reference so the engine can be destroyed
        return True

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closing.is_set() and not isinstance(job, NotifyJob):
                # a queued notice announces a write that already landed: deliver it even while closing,
                # or the peer waits for a completion that happened (a closing prefill lost them)
                job.abandon("mooncake backend closed before the transfer started")
                continue
            try:
                job.run(self._engine)
            except Exception as exc:  # a bad job fails its handle, never the thread
                log.exception("mooncake transfer job failed")
                job.abandon(f"mooncake transfer raised {type(exc).__name__}: {exc}")


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value

"""The records of a prefill room: the room itself, its writes in flight and its writes not posted yet."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvbridge.agent.lateness import Since
from kvbridge.backends.base import ComponentTransfer
from kvbridge.protocol.states import SEND_POLL, WRITE, SendState, WriteEvent, WriteState
from kvbridge.protocol.wire import KVPoll, Notice, TransferRequest
from kvbridge.tracing import RoomTrace


@dataclass(slots=True, kw_only=True)
class InFlight:
    """One posted write and the notice that announces it once it completed."""

    handle: Any
    peer: str
    notice: Notice
    frame: bytes                               # the notice, encoded once
    staging: tuple[int, int] | None = None     # (offset, bytes) of our staging area to free when done
    state: WriteState = WriteState.POSTING     # changed only through ``WRITE``

    def step(self, event: WriteEvent) -> None:
        self.state = WRITE.step(self.state, event, f"write of {self.notice.component} chunk {self.notice.chunk} "
                                                   f"to {self.peer}")


class WriteEnded(NamedTuple):
    """A posted write the backend reported ended (polled outside the lock; applied under it)."""

    room: SendRoom
    item: InFlight
    done: bool                                 # every byte landed; else it failed with ``reason``
    reason: str


@dataclass(slots=True, kw_only=True)
class Piece:
    """A staged piece: layers ``layers`` of the source items ``src`` (destination positions ``first`` ..),
    gathered buffer by buffer into our staging area, written to ``remote_offset`` of the peer's reservation."""

    comp_index: int
    layers: range
    buffers: tuple[int, ...]                   # buffer indices, in the staged order
    src: np.ndarray
    dst: np.ndarray
    start: int                                 # position of its first item among the write's items
    nbytes: int
    remote_offset: int                         # bytes inside the peer's staging area
    # ``src`` on our CUDA device (with its pinned copy), uploaded by the first gather that needs it; the
    # pieces of one write over the same items share this holder, so a request uploads its index once
    src_on_device: list[Any] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class StagingRing:
    """A peer's staging reservation smaller than the slice it receives: ``len(slots)`` slots of ``slot_bytes``
    at ``base``, each holding the chunk number of the piece written into it until that piece's credit."""

    base: int                                  # offset of the reservation in the peer's staging area
    slot_bytes: int
    slots: list[int | None]

    def take(self, chunk: int) -> int | None:
        """The reservation-relative offset of a free slot, now holding ``chunk``; None when all are busy."""
        for i, held in enumerate(self.slots):
            if held is None:
                self.slots[i] = chunk
                return i * self.slot_bytes
        return None

    def release(self, chunk: int) -> bool:
        """Free the slot of ``chunk``; False when no slot holds it (a duplicate or stale credit)."""
        for i, held in enumerate(self.slots):
            if held == chunk:
                self.slots[i] = None
                return True
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldChunk:
    """A chunk the engine sent (``from_start=True``) before every decode request arrived: posted, in order, once
    they did (its pages still include the decode's cached prefix; nothing reads them before then)."""

    pages: np.ndarray
    last: bool
    state: Any                                 # the state components' indices (on the last chunk)
    after: Any                                 # the engine's CUDA event at send() time (None on the host)


@dataclass(slots=True, kw_only=True)
class Pending:
    """A write not posted yet: a plain one waiting for the engine's CUDA work (``after``), or a staged piece
    waiting for space in our staging area, then for its gather."""

    peer: str
    notice: Notice
    frame: bytes
    transfer: ComponentTransfer | None = None  # a plain write, ready once ``after`` completed
    piece: Piece | None = None
    after: Any = None                          # CUDA event: the engine's work the write must follow
    local: tuple[int, int] | None = None       # (offset, bytes) of our staging area, once allocated
    gathered: Any = None                       # the gather's CUDA event, or True once done on the host
    keep: list[Any] = field(default_factory=list)   # device tensors the queued gather still reads
    ring: StagingRing | None = None            # the peer's ring: the piece waits for a slot, offset set then
    state: WriteState = WriteState.QUEUED      # changed only through ``WRITE``

    def step(self, event: WriteEvent) -> None:
        """Raises IllegalTransition (the caller fails the room) when the write table has no such step."""
        self.state = WRITE.step(self.state, event, f"queued write of {self.notice.component} chunk "
                                                   f"{self.notice.chunk} to {self.peer}")


@dataclass(slots=True, kw_only=True)
class OpenChunk:
    """A chunk sent layer group by layer group: its pages and which layers went."""

    pages: np.ndarray
    sent: np.ndarray                           # bool per layer


@dataclass(slots=True, kw_only=True)
class SendRoom:
    room: int
    created: Since                             # its bootstrap timer
    opened_ns: int = 0                         # wall clock at sender(): a traced room's span starts there
    traces: dict[str, RoomTrace] = field(default_factory=dict)    # decode agent -> its span (kvbridge.tracing)
    requests: dict[str, TransferRequest] = field(default_factory=dict)
    # decode agent -> the incarnation whose request it is: a restart under the same name is another decode
    incarnations: dict[str, int] = field(default_factory=dict)
    expected_requests: int | None = None
    state: SendState = SendState.BOOTSTRAPPING    # changed only through ``SEND_ROOM`` (PrefillSide._step)
    reason: str = ""
    chunks: int = 0
    cursor: int = 0
    last_sent: bool = False
    inflight: list[InFlight] = field(default_factory=list)
    pending: deque[Pending] = field(default_factory=deque)
    seq: dict[tuple[str, str], int] = field(default_factory=dict)      # (decode agent, component) -> next notice
    open_chunk: OpenChunk | None = None
    must_confirm: dict[str, tuple[str, int]] = field(default_factory=dict)   # owed an Abort(quiesced): agent ->
    #                                                                          (address, incarnation)
    nbytes: int = 0
    descriptors: int = 0
    rings: dict[tuple[str, str], StagingRing] = field(default_factory=dict)    # (decode agent, component)
    held: list[HeldChunk] = field(default_factory=list)     # sent before every request came (from_start)
    from_start: bool | None = None            # how the engine positions its chunks (fixed by its first send)
    skip_left: int | None = None              # from_start: prefix pages of the decode still to drop

    @property
    def status(self) -> KVPoll:
        """What the engine polls: a projection of ``state``."""
        return SEND_POLL[self.state]

    @property
    def busy(self) -> bool:
        """Writes in flight or not yet posted (a queued gather may still read the source pages)."""
        return bool(self.inflight or self.pending)

    def next_seq(self, agent: str, component: str) -> int:
        key = (agent, component)
        n = self.seq.get(key, 0)
        self.seq[key] = n + 1
        return n

"""The records of a prefill room: the room itself and its writes in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.wire import KVPoll, Notice, TransferRequest


@dataclass(slots=True, kw_only=True)
class InFlight:
    """One posted write and the notice that announces it once it completed."""

    handle: Any
    peer: str
    notice: Notice
    frame: bytes                               # the notice, encoded once
    staging: tuple[int, int] | None = None     # (offset, bytes) of our staging area to free when done


@dataclass(slots=True, kw_only=True)
class SendRoom:
    room: int
    created: float
    requests: dict[str, TransferRequest] = field(default_factory=dict)
    expected_requests: int | None = None
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    chunks: int = 0
    cursor: int = 0
    last_sent: bool = False
    inflight: list[InFlight] = field(default_factory=list)
    must_confirm: dict[str, tuple[str, int]] = field(default_factory=dict)   # owed an Abort(quiesced): agent ->
    #                                                                          (address, incarnation)
    nbytes: int = 0
    descriptors: int = 0

"""``Sender`` and ``Receiver``: an engine's handles on one request, thin over the role objects.

The handles are runtime: each call takes the agent lock around the role object's method (which takes none), and
the actions it queued run at the lock's release, in the engine's thread."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from kvbridge.agent.decode import DecodeSide
from kvbridge.agent.prefill import PrefillSide
from kvbridge.errors import GeometryError
from kvbridge.geometry import PoolLayout
from kvbridge.planner import check_indices
from kvbridge.protocol.wire import KVPoll, PackedIndices

IndexArg = np.ndarray | tuple[np.ndarray, int]


def _split(value: IndexArg) -> tuple[np.ndarray, int]:
    return value if isinstance(value, tuple) else (value, 0)


def _let_go(side: PrefillSide | DecodeSide, lock: AbstractContextManager[Any], room: int, record: object) -> None:
    """``clear_when_safe`` of the room a handle opened, under the lock; nothing once that room is gone (a later room
    of the same number is another request's)."""
    with lock:
        if side.rooms.get(room) is record:
            side.clear_when_safe(room)


class Sender:
    """The prefill side of one request on one rank.

        sender = agent.sender(room=42)
        while sender.poll() < KVPoll.WaitingForInput: ...
        sender.send(pages[:8]); sender.send(pages[8:], last=True, state={"mamba": slot})
    """

    def __init__(self, side: PrefillSide, lock: AbstractContextManager[Any], progress: Callable[[], None],
                 room: int, record: object) -> None:
        self._side, self._lock, self._progress, self.room = side, lock, progress, room
        self._record = record        # the room this handle opened (a later room of the same number is not its own)

    def poll(self) -> KVPoll:
        self._progress()
        with self._lock:
            return self._side.status(self.room)

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode side already holds (the first request's prefix length)."""
        with self._lock:
            return self._side.prefix_len(self.room)

    def send(self, pages: np.ndarray, last: bool = False, *, layers: range | None = None,
             state: Mapping[str, IndexArg] | None = None, from_start: bool = False) -> None:
        """Send one chunk: KV ``pages`` (source page ids), and on the last chunk every state component's
        indices (``{name: indices}`` or ``{name: (indices, first_position)}``).

        Layer-wise: ``layers=range(a, b)`` sends only those layers of the chunk's pages (layer indices of
        the chunked components, see ``kvbridge.agent.layers``); post the same ``pages`` once per layer group
        as the forward pass writes them, every layer exactly once, then the next chunk. The chunk counts
        once all its layers went; ``last=True`` goes with the final group of the final chunk, and the state
        components travel with it. Returns at once: on CUDA the writes follow the work queued so far on the
        caller's current stream, without waiting for it.

        ``from_start=True``: the chunks hold the request's pages from position 0 and kvbridge drops the ones the
        decode has cached (``decode_prefix_len``); such a send is accepted in Bootstrapping too and held until
        every decode request arrived (whole chunks only, every chunk of the room the same way)::

            sender = agent.sender(room)
            sender.send(all_pages, last=True, from_start=True)    # no need to wait for WaitingForInput
        """
        normalized = {k: _split(v) for k, v in (state or {}).items()}
        after = self._side.engine_event()      # before the lock: only the engine's own stream is touched
        with self._side.refusals() as refused:
            with self._lock:        # the posts it decides on run at the release, in this thread
                self._side.send(self.room, np.asarray(pages), last, normalized, layers, from_start=from_start,
                                after=after)
        if refused:                 # the engine hears the backend's error
            raise refused[0]
        self._progress()

    @property
    def failure_reason(self) -> str:
        with self._lock:
            return self._side.reason(self.room)

    @property
    def stats(self) -> tuple[int, int]:
        """(bytes posted, descriptors posted) so far."""
        with self._lock:
            return self._side.stats(self.room)

    def abort(self, reason: str = "aborted by prefill") -> None:
        with self._lock:
            self._side.abort(self.room, reason)
        self._progress()

    @property
    def safe_to_reuse(self) -> bool:
        """True once no write from this room's source pages is in flight (after Success or Failed)."""
        self._progress()
        with self._lock:
            return self._side.safe_to_reuse(self.room)

    def clear(self) -> None:
        """Forget the room; raises while a write still reads its pages (wait for ``safe_to_reuse``)."""
        with self._lock:
            self._side.clear(self.room)

    def clear_when_safe(self) -> None:
        """Forget the room now if it is over, else as soon as it is (the progress step clears it); no event of it
        comes any more. For an engine that lets a request go once, whatever its state::

            sender.abort("client went away"); sender.clear_when_safe()

        Again, or after kvbridge forgot the room, it does nothing (a later room of the same number is not touched).
        """
        _let_go(self._side, self._lock, self.room, self._record)
        self._progress()


class Receiver:
    """The decode side of one request on one rank.

        receiver = agent.receiver(room=42, instance="llama")
        receiver.send_metadata({"kv": dst_pages})
        while receiver.poll() < KVPoll.Success: ...
    """

    def __init__(self, side: DecodeSide, lock: AbstractContextManager[Any], progress: Callable[[], None],
                 layout: PoolLayout, room: int, record: object) -> None:
        self._side, self._lock, self._progress, self._layout, self.room = side, lock, progress, layout, room
        self._record = record        # the room this handle opened (a later room of the same number is not its own)

    def send_metadata(self, indices: Mapping[str, IndexArg], *, prefix_len: int = 0, tokens: int | None = None) -> None:
        """Give the destination items of every component (``{name: ids}`` or ``{name: (ids, first)}``).

        ``tokens``: the request's length, when the engine knows it. The KV page lists are then checked against it
        (``ceil(tokens / page) - prefix_len // page`` pages each), and with a prefill of another page size the
        room succeeds only once every token up to it landed; without it, a list off by less than one page of the
        larger side cannot be told from the padding of a last page. It travels to the prefill ranks (protocol 9),
        which refuse a last chunk that does not end in the request's last page (``send()`` raises, both sides
        fail)."""
        packed: dict[str, PackedIndices] = {}
        for comp in self._layout.components:
            if comp.name not in indices:
                raise GeometryError(f"room {self.room}: no destination indices for component {comp.name!r}")
            ids, first = _split(indices[comp.name])
            checked = check_indices(ids, comp.num_items, f"room {self.room} {comp.name} destination")
            packed[comp.name] = PackedIndices.pack(checked, first)
        unknown = sorted(set(indices) - set(self._layout.component_names))
        if unknown:
            raise GeometryError(f"room {self.room}: indices for unknown components {unknown}")
        with self._lock:
            self._side.send_metadata(self.room, packed, prefix_len, tokens)

    def poll(self) -> KVPoll:
        self._progress()
        with self._lock:
            return self._side.status(self.room)

    @property
    def failure_reason(self) -> str:
        with self._lock:
            return self._side.reason(self.room)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._side.nbytes(self.room)

    def abort(self, reason: str = "aborted by decode") -> None:
        with self._lock:
            self._side.abort(self.room, reason)

    @property
    def safe_to_reuse(self) -> bool:
        """True when no write into this room's destination items can still happen: the room succeeded,
        or every sender confirmed quiescence (or is dead) after a failure or abort."""
        self._progress()
        with self._lock:
            return self._side.safe_to_reuse(self.room)

    def clear(self) -> None:
        """Forget the room. Its staging reservations are freed when it is safe to reuse at this call; a room cleared
        before that keeps them for good (a write may still land there; a warning says so): wait for
        ``safe_to_reuse`` first."""
        self._progress()
        with self._lock:        # judged and cleared in one hold: no write can be decided on in between
            safe = self._side.safe_to_reuse(self.room) if self.room in self._side.rooms else True
            self._side.clear(self.room, safe)

    def clear_when_safe(self) -> None:
        """Forget the room now if it is safe to reuse, else as soon as it is (the progress step clears it and frees
        its staging reservations then); no event of it comes any more::

            receiver.abort("request cancelled"); receiver.clear_when_safe()

        Again, or after kvbridge forgot the room, it does nothing (a later room of the same number is not touched).
        """
        _let_go(self._side, self._lock, self.room, self._record)
        self._progress()

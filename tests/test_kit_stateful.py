"""The kit's stateful tier is deterministic for an asynchronous backend, and takes a False from
``notify_completion`` as docs/plugin-api.md allows (issue 23 item 4).

Before: the machine's rules depended on whether a handle had completed in real time, which hypothesis refuses
(``FlakyStrategyDefinition`` every time at 150 examples, the project's NIXL backend included), and it required
``notify_completion`` to return True. The subject here is the loopback backend made asynchronous: each write
lands only once a random 0-4 ms passed since it was posted, and every third notice is refused (False).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvbridge.backends.base import ComponentTransfer, Poll
from kvbridge.backends.loopback import LoopbackBackend
from kvbridge.testkit.stateful import run_backend_machine


@dataclass(eq=False)
class _Later:
    transfer: ComponentTransfer
    due: float
    result: Poll | None = None


class AsyncLoopback(LoopbackBackend):
    """Loopback whose writes land a random 0-4 ms after they were posted (at the first poll past that)."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        super().__init__(name=name, options=options)
        self._rng = random.Random(name)
        self._notices = itertools.count()

    def send_component(self, transfer: ComponentTransfer) -> Any:
        return _Later(transfer, time.monotonic() + self._rng.uniform(0.0, 0.004))

    def poll(self, handle: Any) -> Poll:
        if not isinstance(handle, _Later):
            return super().poll(handle)
        if handle.result is None:
            if time.monotonic() < handle.due:
                return Poll.pending()
            handle.result = super().poll(super().send_component(handle.transfer))
        return handle.result

    def notify_completion(self, peer_id: str, notice: bytes) -> bool:
        if next(self._notices) % 3 == 2:
            return False            # "cannot deliver": the agent sends it over the control link
        return super().notify_completion(peer_id, notice)


@pytest.fixture
def make_async() -> Iterator[Any]:
    made: list[AsyncLoopback] = []

    def make(purpose: str) -> AsyncLoopback:
        backend = AsyncLoopback(name=f"async-{purpose}-{len(made)}")
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def test_the_machine_is_deterministic_for_an_asynchronous_backend_that_may_refuse_notices(make_async: Any) -> None:
    run_backend_machine(make_async, True, examples=60, steps=20, bound_s=5.0)

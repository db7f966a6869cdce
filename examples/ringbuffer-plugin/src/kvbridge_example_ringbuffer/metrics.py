"""A ``wrapper=True`` hook implementation that counts component sends per backend.

A wrapper runs around the one implementation that answers the call (kvbridge's dispatcher, which
calls the backend selected by name), so it sees the sends of every backend alike: loopback, NIXL,
Mooncake, ... It must re-yield the result unchanged (or raise to inject a fault).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Generator
from typing import Any

from kvbridge.plugin import hookimpl

_LOCK = threading.Lock()
_SENDS: Counter[str] = Counter()
_BYTES: Counter[str] = Counter()


@hookimpl(wrapper=True)
def kvbridge_send_component(backend: Any, transfer: Any) -> Generator[None, Any, Any]:
    """Count one send (and its bytes) for ``backend.name``, then pass the backend's handle through."""
    with _LOCK:
        _SENDS[backend.name] += 1
        _BYTES[backend.name] += transfer.nbytes
    return (yield)


def sends_per_backend() -> dict[str, int]:
    """A snapshot: backend name -> number of component sends seen since the last reset."""
    with _LOCK:
        return dict(_SENDS)


def bytes_per_backend() -> dict[str, int]:
    with _LOCK:
        return dict(_BYTES)


def reset() -> None:
    with _LOCK:
        _SENDS.clear()
        _BYTES.clear()

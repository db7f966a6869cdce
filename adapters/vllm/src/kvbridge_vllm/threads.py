"""Keep kvbridge's threads off the core vLLM pins a CPU worker to.

vLLM's CPU workers bind their main thread to cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0|1"`` for TP 2),
and every thread started from it inherits that mask. Between steps the main thread spins on its message
queue, so kvbridge's threads pinned beside it starved: on a 2-core host bootstrap answers and handshakes
arrived seconds late and decode requests timed out. Threads (and ZMQ I/O threads) started inside
``unpinned()`` may run on every CPU the process is allowed.

    with unpinned():
        context = zmq.Context()        # its I/O thread starts with the first socket, unpinned
        worker = WorkerSide(...)        # the agents' progress and heartbeat threads unpinned
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("kvbridge.vllm")

__all__ = ["allowed_cpus", "unpinned"]


def allowed_cpus() -> set[int]:
    """The CPUs this process's cgroup allows (every online CPU when the cpuset cannot be read)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return _parse_cpu_list(text)
    return set(range(os.cpu_count() or 1))


def _parse_cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@contextmanager
def unpinned() -> Iterator[None]:
    """Run the block with the calling thread allowed on every CPU, then restore its own mask."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine = os.sched_getaffinity(0)
    wide = allowed_cpus()
    try:
        if wide != mine:
            os.sched_setaffinity(0, wide)
    except OSError as exc:      # a cpuset narrower than we read: keep the mask we have
        log.debug("kvbridge: could not widen the CPU mask to %s: %s", sorted(wide), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)

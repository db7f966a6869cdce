"""How demo ranks are started: from a fork server that imported the heavy modules once.

A ``spawn`` rank re-imports everything (kvbridge's demo worker ~0.5 CPU-s, NIXL's API ~1 CPU-s through
``kvbridge_nixl.preload``, which leaves a CPU build of torch unimported) before it does any work; on a small
host a 4 + 4 demo spends most of its start there. Under ``forkserver`` a server process (started fresh, never
forked from the launcher, which has threads and sockets) imports :data:`PRELOAD` once and forks every rank
from that state.

Why forking that server is safe: the preloaded modules are pure imports. They create no socket, no agent and
no thread of their own (``tests/test_demo_ranks.py`` checks it); NIXL and Mooncake agents, ZMQ links and the
host pools are made in the rank, after the fork. (``mooncake.engine`` is left out on purpose: importing it
starts threads and opens a socket.) numpy's OpenBLAS pool is the one thread an import starts; OpenBLAS stops
it before every fork (its ``pthread_atfork`` handler), so the server forks with one thread. The rank's
:class:`~kvbridge.demo.worker.WorkerConfig`, secret included, travels over the pipe from the launcher to the
rank (multiprocessing writes the pickled process object there), never through argv or the environment;
/dev/shm names take the rank's own pid at the time a pool is made, and the launcher's run tag (imported
here, before the server starts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import ForkServerContext, SpawnContext

# fixes this run's /dev/shm tag in the environment (kvbridge.shmnames.RUN_ENV) before a fork server starts, so
# that the server, and every rank it forks, names its segments with the launcher's tag (the launcher reaps them)
from kvbridge import shmnames as _shmnames  # noqa: F401

__all__ = ["PRELOAD", "rank_context"]

#: imported by the fork server before it forks a rank: always, and per backend (a backend not installed is
#: skipped: the server ignores a preload that fails to import)
PRELOAD: dict[str, tuple[str, ...]] = {"": ("kvbridge.demo.worker",), "nixl": ("kvbridge_nixl.preload",)}


def rank_context(backend: str = "") -> ForkServerContext | SpawnContext:
    """The multiprocessing context to start ranks of ``backend`` with: ``forkserver`` where the platform has
    it, else ``spawn``. The fork server is one per launcher process, started by the first rank: the backend
    of that first start decides what it preloaded (a later rank of another backend imports its engine itself,
    as a spawned one would)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # the server imports NIXL before any rank runs: NIXL's Python logger takes its level at import, so the
    # default a rank sets (kvbridge.demo.worker.run_worker) must already be in the environment the server inherits
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ctx.set_forkserver_preload([*PRELOAD[""], *PRELOAD.get(backend, ())])
    return ctx

"""The kvbridge internals this package uses: everything else it imports comes from kvbridge's public modules
(``kvbridge``, ``kvbridge.agent``, ``kvbridge.plugin``). Each name below is internal to kvbridge and may move;
this module is the one place to follow such a move (``tests/test_bench_imports.py`` holds the list).

* ``Registry``: build backends by name outside an agent (the raw and backend benchmarks), list the backends
  usable here and their specs, and pass ``--plugin`` modules to the rank processes' agents;
* ``PluginKind``, ``resolve``: find a backend's own benchmark through its spec (``BackendSpec.bench``);
* ``HostPool``, ``reap_segments``, ``segment_prefix``: host pools in ``/dev/shm`` that the loopback backend reaches
  from another process, and their clean-up after a rank process is gone;
* ``gather``, ``regular_rows``, ``scatter``: the staging path's host gather and scatter, timed against memcpy;
* ``digest_items``, ``run_bytes``: what ``AgentConfig(checksums=True)`` costs, timed against memcpy;
* ``Codec``, ``Heartbeat``: the flood benchmark forges frames (a real envelope under a wrong MAC).
"""

from __future__ import annotations

from kvbridge.digests import digest_items, run_bytes
from kvbridge.hostpool import HostPool, reap_segments
from kvbridge.protocol.wire import Codec, Heartbeat
from kvbridge.registry import Registry
from kvbridge.shmnames import segment_prefix
from kvbridge.specs import PluginKind, resolve
from kvbridge.staging import gather, regular_rows, scatter

__all__ = ["Codec", "Heartbeat", "HostPool", "PluginKind", "Registry", "digest_items", "gather", "reap_segments",
           "regular_rows", "resolve", "run_bytes", "scatter", "segment_prefix"]

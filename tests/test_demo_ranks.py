"""Demo ranks forked by a fork server (kvbridge.demo.ranks): the server holds no thread and no socket but its
own listener when it forks (a check that a preload starting threads, like mooncake.engine, fails), a rank
gets its secret over the pipe only (never argv or environment), names its segments with the launcher's run
tag, and dies with its launcher even though its parent is the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvbridge.demo.ranks import PRELOAD, rank_context
from kvbridge.registry import Registry

pytestmark = pytest.mark.kvbridge_multiprocess

_SERVER_STATE = r"""
import json, multiprocessing as mp, os, sys
from multiprocessing import forkserver
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(sys.argv[1:])
p = ctx.Process(target=os.getpid)
p.start()
p.join(60)
pid = forkserver._forkserver._forkserver_pid
fds = {}
for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        pass
with open("/proc/net/unix") as f:
    unix = {line.split()[6] for line in f.read().splitlines()[1:]}
with open(f"/proc/{pid}/maps") as f:
    maps = f.read()
sockets = [v[len("socket:["):-1] for v in fds.values() if v.startswith("socket:[")]
print(json.dumps({"exitcode": p.exitcode, "threads": len(os.listdir(f"/proc/{pid}/task")), "sockets": sockets,
                  "other_sockets": [s for s in sockets if s not in unix], "torch": "libtorch" in maps,
                  "nixl": "/nixl_cu" in maps or "/nixl_rocm" in maps}))
"""


def _server_state(preload: list[str]) -> dict[str, Any]:
    """Start a fork server with ``preload`` in a fresh process, fork one child, and read the server's state."""
    done = subprocess.run([sys.executable, "-c", _SERVER_STATE, *preload], capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    state: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["exitcode"] == 0, state
    return state


def test_the_fork_server_forks_with_one_thread_and_only_its_own_socket() -> None:
    preload = [*PRELOAD[""], *(m for b in Registry.build().backend_names() for m in PRELOAD.get(b, ()))]
    state = _server_state(preload)
    assert state["threads"] == 1, f"the fork server runs {state['threads']} threads after preloading {preload}"
    assert len(state["sockets"]) == 1 and not state["other_sockets"], state     # its listener (AF_UNIX) only
    if "nixl" in Registry.build().backend_names():
        assert state["nixl"], "NIXL's native module was not preloaded"
        # a CPU build of torch is not imported by the way NIXL is loaded (kvbridge_nixl.api): ~4.5 CPU-s per run
        from kvbridge_nixl.api import torch_build_has_cuda
        if torch_build_has_cuda() is False:
            assert not state["torch"], "the fork server imported torch to load NIXL"


def test_the_check_catches_a_preload_that_starts_threads_and_opens_sockets() -> None:
    """mooncake.engine starts threads and opens a socket at import: exactly why PRELOAD leaves it out."""
    if "mooncake" not in Registry.build().backend_names():
        pytest.skip("mooncake is not usable here")
    assert not any("mooncake" in m for ms in PRELOAD.values() for m in ms)
    state = _server_state([*PRELOAD[""], "mooncake.engine"])
    assert state["threads"] > 1 or state["other_sockets"], state


def _probe(secret: bytes, results: Any) -> None:
    from kvbridge.demo import worker
    from kvbridge.hostpool import SEGMENT_PREFIX

    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    with open("/proc/self/environ", "rb") as f:
        environ = f.read()
    leaked = [form for form in (secret, secret.hex().encode()) if form in cmdline or form in environ]
    results.put({"nixl_log": os.environ.get("NIXL_LOG_LEVEL"), "leaked": len(leaked), "pid": os.getpid(),
                 "ppid": os.getppid(), "prefix": SEGMENT_PREFIX,
                 "preloaded": "kvbridge.demo.worker" in sys.modules and worker.__name__ == "kvbridge.demo.worker"})


def test_a_forked_rank_gets_its_secret_over_the_pipe_and_the_launchers_segment_tag() -> None:
    from kvbridge.hostpool import SEGMENT_PREFIX

    ctx = rank_context("loopback")
    results = ctx.Queue()
    secret = os.urandom(32)
    procs = [ctx.Process(target=_probe, args=(secret, results), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(r["leaked"] == 0 for r in reports), reports
    assert all(r["prefix"] == SEGMENT_PREFIX for r in reports), (SEGMENT_PREFIX, reports)
    assert len({r["pid"] for r in reports}) == 2
    # NIXL takes its log level at import (in the server): the ranks' default is in the server's environment
    assert all(r["nixl_log"] == os.environ["NIXL_LOG_LEVEL"] for r in reports), reports
    if ctx.get_start_method() == "forkserver":
        assert all(r["ppid"] != os.getpid() for r in reports)      # the server's children, not this process's

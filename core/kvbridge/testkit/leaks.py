"""Process resources a test must give back: file descriptors, threads, child processes, /dev/shm segments.

    before = Snapshot.take()
    ...                                   # the test
    problems = before.leaked()            # re-checks for a short grace period; [] when clean

Threads are compared by identity (Python threads) and by count (native threads, from /proc/self/task);
descriptors by what they point at (``socket``, ``pipe``, ``anon_inode:[eventfd]``, a path); child
processes from /proc/self/task/*/children; /dev/shm segments this process maps, or named
``kvbridge-...-<pid>-...`` after this process or a child the kit started. Linux only: elsewhere the /proc parts compare as empty.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

__all__ = ["CHILD_PIDS", "SHM_PREFIXES", "Snapshot", "prime_process_singletons"]

#: /dev/shm names a leak check looks at even when unmapped: ``kvbridge-...-<pid>-...`` of this process or of a
#: child it started (the kit's peers register here); /dev/shm is host-wide, other processes' are not ours
SHM_PREFIXES = ("kvbridge-",)
CHILD_PIDS: set[int] = set()


def _fd_kinds() -> Counter[str]:
    out: Counter[str] = Counter()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in names:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue                                    # the listdir's own descriptor, already closed
        out[target.split(":[", 1)[0] if target.startswith(("socket:", "pipe:")) else target] += 1
    return out


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _children() -> frozenset[int]:
    pids: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return frozenset()
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except (OSError, IndexError):
            continue
    return frozenset(alive)


def _shm() -> frozenset[str]:
    """Segments this process maps, plus kvbridge-named ones of this process and its kit children."""
    mine = {str(os.getpid()), *map(str, CHILD_PIDS)}
    try:
        names = {n for n in os.listdir("/dev/shm")
                 if n.startswith(SHM_PREFIXES) and mine.intersection(n.split("-"))}
    except OSError:
        return frozenset()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[5].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    names.add(path[len("/dev/shm/"):].removesuffix(" (deleted)"))
    except (OSError, IndexError):
        pass
    return frozenset(n for n in names if os.path.exists(f"/dev/shm/{n}"))


@dataclass(frozen=True)
class Snapshot:
    fds: Counter[str]
    threads: frozenset[threading.Thread]
    native_threads: int
    children: frozenset[int]
    shm: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(_fd_kinds(), frozenset(threading.enumerate()), _native_threads(), _children(), _shm())

    def diff(self, now: Snapshot, *, threads_and_fds: bool = True, allowed_threads: tuple[str, ...] = ()) -> list[str]:
        """What ``now`` holds that this snapshot did not. ``allowed_threads``: name prefixes of threads that
        live as long as the process (declared by a plugin); they are not counted, nor are native threads."""
        out = []
        if not threads_and_fds:
            now = Snapshot(self.fds, self.threads, self.native_threads, now.children, now.shm)
        extra_fds = now.fds - self.fds
        if extra_fds:
            what = ", ".join(f"{n} x {k}" for k, n in sorted(extra_fds.items()))
            out.append(f"{sum(extra_fds.values())} file descriptor(s) left open: {what}")
        new_threads = [t for t in now.threads - self.threads if t.is_alive()]
        threads = [t for t in new_threads if not t.name.startswith(allowed_threads or ("\0",))]
        if threads:
            out.append(f"{len(threads)} thread(s) left running: {', '.join(sorted(t.name for t in threads))}")
        elif now.native_threads > self.native_threads + len(new_threads):
            out.append(f"{now.native_threads - self.native_threads} native thread(s) left running "
                       f"({self.native_threads} before, {now.native_threads} after)")
        children = now.children - self.children
        if children:
            out.append(f"{len(children)} child process(es) left running: pids {sorted(children)}")
        segments = now.shm - self.shm
        if segments:
            out.append(f"{len(segments)} /dev/shm segment(s) left behind: {sorted(segments)}")
        return out

    def leaked(self, grace_s: float = 3.0, *, threads_and_fds: bool = True,
               allowed_threads: tuple[str, ...] = ()) -> list[str]:
        """What is still held that was not held at this snapshot (waits up to ``grace_s`` for stragglers)."""
        deadline = time.monotonic() + grace_s
        while True:
            problems = self.diff(Snapshot.take(), threads_and_fds=threads_and_fds, allowed_threads=allowed_threads)
            if not problems or time.monotonic() > deadline:
                return problems
            gc.collect()                    # only when something is still held: a full collection is not free
            time.sleep(0.05)


_PRIMED: set[str] = set()


def prime_process_singletons(*, cuda: bool = False) -> None:
    """Create the process-wide helpers that live until exit - the ZMQ context and its I/O thread, and with
    ``cuda`` the CUDA context (device files, UVM, driver threads) - so a test that happens to use them
    first is not blamed for them."""
    if "zmq" not in _PRIMED:
        _PRIMED.add("zmq")
        try:
            import zmq
        except ImportError:
            pass
        else:
            zmq.Context.instance().socket(zmq.PULL).close(0)
    if cuda and "cuda" not in _PRIMED:
        _PRIMED.add("cuda")
        import torch

        for device in range(torch.cuda.device_count()):
            torch.zeros(1, device=f"cuda:{device}")

"""Process resources a test must give back: file descriptors, threads, child processes, /dev/shm segments and
files, temporary files.

    before = Snapshot.take()
    ...                                   # the test
    problems = before.leaked()            # re-checks for a short grace period; [] when clean

Threads are compared by identity (Python threads) and by count (native threads, from /proc/self/task);
descriptors by what they point at (``socket``, ``pipe``, ``anon_inode:[eventfd]``, a path), and a report
names each new descriptor: its number and, for a socket, its protocol and addresses as /proc/net lists
them (``fd 17: tcp 127.0.0.1:40112 -> 127.0.0.1:5555 ESTABLISHED``, ``unix /tmp/engine.sock``); child
processes from /proc/self/task/*/children; /dev/shm segments this process maps, or named
``kvbridge-<kit|demo>-<run tag>-<pid>-...`` by this run (:mod:`kvbridge.shmnames`) after this process or a child the
kit started; another run's segments on the host are never counted. Linux only: elsewhere the /proc parts compare as
empty.

Files (:func:`left_behind`): a before/after listing of /dev/shm, of the kit's own temporary directory and of the
host's temporary directory; an entry new since the snapshot and still there after the grace period is the test's
when something ties it to the test. /dev/shm and /tmp are shared by every process of the host (other test workers,
other runs: a busy host's engines drop ``sem.mp-*`` and ``psm_*`` files there every few seconds, created and
orphaned by processes long gone), and no listing says who created an entry, so "new and unclaimed" would blame a
test for other processes' files. The ties:

* it is in the kit's temporary directory (:func:`push_private_tempdir`: Python's ``tempfile`` of this process,
  and the ``TMPDIR`` of the kit's child processes, point there while a kit class runs), which holds nothing else;
* this process created it through Python (an audit hook records ``open``/``os.open`` with ``O_CREAT``,
  ``tempfile``, ``os.mkdir``, renames and links, ``mmap`` of a file, a unix socket's ``bind``) while a kit class
  ran;
* this process or a kit child holds it open or mapped;
* it carries the pid of this process or of a kit child as a word of its name (``<prefix>-<pid>-<n>``), or is
  this run's kvbridge segment of one of them.

Not caught: a file that native code (an engine's C library) creates in this process, closes and unmaps, with no
pid in its name - there is no way to tell it from another process's.
"""

from __future__ import annotations

import gc
import itertools
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass, field

from kvbridge.shmnames import RUN_TAG, segment_prefix

__all__ = ["CHILD_PIDS", "SHM_PREFIXES", "Snapshot", "child_env", "describe_fds", "left_behind", "pop_private_tempdir",
           "prime_process_singletons", "push_private_tempdir"]

#: /dev/shm names a leak check looks at even when unmapped: this run's ``<prefix><pid>-...`` of this process or of a
#: child it started (the kit's peers register here); /dev/shm is host-wide, other runs' segments are not ours
SHM_PREFIXES = (segment_prefix("kit"), segment_prefix("demo"))
CHILD_PIDS: set[int] = set()


def _fd_targets() -> dict[int, str]:
    """Descriptor number -> what it points at (``socket:[inode]``, ``pipe:[inode]``, a path, ...)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in names:
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except (OSError, ValueError):
            continue                                    # the listdir's own descriptor, already closed
    return out


def _kind(target: str) -> str:
    return target.split(":[", 1)[0] if target.startswith(("socket:", "pipe:")) else target


def _fd_kinds(targets: dict[int, str]) -> Counter[str]:
    return Counter(_kind(t) for t in targets.values())


_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
               "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
               "0B": "CLOSING"}


def _inet_address(text: str) -> str:
    """``0100007F:15B3`` (or the 32-hex-digit IPv6 form) as ``127.0.0.1:5555`` / ``[::1]:5555``."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc/net prints each 32-bit word of the address in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    import ipaddress

    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    shown = f"[{addr}]" if isinstance(addr, ipaddress.IPv6Address) else str(addr)
    return f"{shown}:{int(port, 16)}"


def _sockets() -> dict[str, str]:
    """Socket inode -> ``tcp 127.0.0.1:40112 -> 127.0.0.1:5555 ESTABLISHED`` (this network namespace)."""
    out: dict[str, str] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/self/net/{proto}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10:
                continue
            try:
                local, remote = _inet_address(fields[1]), _inet_address(fields[2])
            except ValueError:
                continue
            name = proto.removesuffix("6")
            if name == "tcp" and fields[3] == "0A":
                out[fields[9]] = f"tcp listening on {local}"
            elif remote.endswith(":0") and name == "udp":
                out[fields[9]] = f"udp bound to {local}"
            else:
                state = _TCP_STATES.get(fields[3], "") if name == "tcp" else ""
                out[fields[9]] = f"{name} {local} -> {remote} {state}".rstrip()
    try:
        with open("/proc/self/net/unix") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        rows = []
    for row in rows:
        fields = row.split()
        if len(fields) >= 7:
            path = fields[7] if len(fields) > 7 else ""
            shown = f"abstract {path}" if path.startswith("@") else path
            out[fields[6]] = f"unix {shown}" if path else "unix (unnamed)"
    return out


def describe_fds(targets: dict[int, str]) -> list[str]:
    """One line per descriptor: ``fd 17: tcp 127.0.0.1:40112 -> 127.0.0.1:5555 ESTABLISHED`` for a socket
    (the protocol and addresses from /proc/net; ``socket`` and its inode for one /proc/net does not list:
    netlink, or TCP bound but neither listening nor connected), ``fd 9: pipe``, ``fd 12: /dev/shm/x``."""
    sockets = _sockets() if any(t.startswith("socket:") for t in targets.values()) else {}
    lines = []
    for fd, target in sorted(targets.items()):
        if target.startswith("socket:["):
            inode = target[len("socket:["):-1]
            unlisted = f"socket (inode {inode}; /proc/net lists no address: unconnected, or not tcp/udp/unix)"
            lines.append(f"fd {fd}: {sockets.get(inode, unlisted)}")
        else:
            lines.append(f"fd {fd}: {_kind(target)}")
    return lines


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
        names = {n for n in os.listdir("/dev/shm") for p in SHM_PREFIXES
                 if n.startswith(p) and n[len(p):].split("-", 1)[0] in mine}
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


SHM_DIR = "/dev/shm"
#: the host's temporary directory, as this process saw it before the kit pointed ``tempfile`` elsewhere
SYSTEM_TMP = tempfile.gettempdir()
_PRIVATE: list[tuple[str, str | None]] = []     # (the kit's temporary directory, tempfile.tempdir before it)
_PRIVATE_NAMES = itertools.count()
_KVBRIDGE_NAME = re.compile(r"kvbridge-[a-z]{1,16}-([a-z0-9]{4,16})-(\d+)-")
_CREATED: set[str] = set()                      # paths (or dir_fd-relative names) this process created, by audit
_AUDITED = [False]


def _path_of(value: object) -> str | None:
    if isinstance(value, int):
        try:
            return os.readlink(f"/proc/self/fd/{value}") if value >= 0 else None
        except OSError:
            return None
    try:
        return os.fsdecode(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _created_path(event: str, args: tuple[object, ...]) -> object:
    """What an audit event of this process creates (a path, an fd, a name), or None."""
    if event == "open":
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        return args[0] if flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) else None
    if event in ("tempfile.mkstemp", "tempfile.mkdtemp", "os.mkdir"):
        return args[0]
    if event in ("os.rename", "os.link", "os.symlink"):
        return args[1]
    if event == "mmap.__new__":
        return args[0]
    if event == "socket.bind" and len(args) > 1 and isinstance(args[1], (str, bytes)):
        return args[1]
    return None


def _audit(event: str, args: tuple[object, ...]) -> None:
    """Record what this process creates while a kit class runs (Python-level calls: ``open``, ``os.open``,
    ``tempfile``, ``mmap`` of a file, a unix socket's ``bind``...)."""
    if not _PRIVATE or event not in _CREATING:
        return
    path = _path_of(_created_path(event, args))
    if not path:
        return
    if not os.path.isabs(path):
        _CREATED.add(os.path.basename(path))      # relative to a dir_fd the event does not name, or to the cwd
    elif path.startswith((SHM_DIR + os.sep, SYSTEM_TMP + os.sep)):
        _CREATED.add(path)


_CREATING = frozenset({"open", "tempfile.mkstemp", "tempfile.mkdtemp", "os.mkdir", "os.rename", "os.link",
                       "os.symlink", "mmap.__new__", "socket.bind"})


def push_private_tempdir() -> str:
    """Point Python's ``tempfile`` at a new directory of this process (under the host's temporary directory) and
    return it; the kit's child processes get it as ``TMPDIR`` (:func:`child_env`). From then on, until the last
    :func:`pop_private_tempdir`, the files this process creates through Python are recorded (an audit hook)."""
    if not _AUDITED[0]:
        _AUDITED[0] = True
        sys.addaudithook(_audit)
    path = os.path.join(SYSTEM_TMP, f"kvbridge-kittmp-{RUN_TAG}-{os.getpid()}-{next(_PRIVATE_NAMES)}")
    os.makedirs(path, mode=0o700)
    _PRIVATE.append((path, tempfile.tempdir))
    tempfile.tempdir = path
    return path


def pop_private_tempdir() -> None:
    """Undo the last :func:`push_private_tempdir` and delete that directory (what was left there was reported)."""
    path, before = _PRIVATE.pop()
    tempfile.tempdir = before
    shutil.rmtree(path, ignore_errors=True)
    if not _PRIVATE:
        _CREATED.clear()


def child_env() -> dict[str, str]:
    """Environment for a kit child process: this one's, with ``TMPDIR`` the kit's temporary directory if any."""
    return dict(os.environ, TMPDIR=_PRIVATE[-1][0]) if _PRIVATE else dict(os.environ)


def _listing(directory: str) -> set[str]:
    try:
        return {os.path.join(directory, name) for name in os.listdir(directory)}
    except OSError:
        return set()


def _files() -> frozenset[str]:
    """Every entry of /dev/shm, of the host's temporary directory and of the kit's (full paths)."""
    out = _listing(SHM_DIR) | _listing(SYSTEM_TMP)
    if _PRIVATE:
        out |= _listing(_PRIVATE[-1][0])
    return frozenset(out)


def _held_by(pid: int, paths: set[str]) -> set[str]:
    """Which of ``paths`` process ``pid`` holds open or mapped (its /proc entries; unreadable: none)."""
    held: set[str] = set()
    with suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with suppress(OSError):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    with suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                held.add(fields[5].strip().removesuffix(" (deleted)"))
    return held & paths


def _owner_pids(name: str) -> set[int]:
    """Words of a name that may be pids: all digits, two or more (``torch_4711_0`` -> 4711; not ``psm_3914da4a``)."""
    return {int(t) for t in re.split(r"[^A-Za-z0-9]+", name) if len(t) >= 2 and t.isdigit()}


def _named_ours(path: str, mine: set[int]) -> bool:
    """Named by this run for one of ``mine`` (a kvbridge segment name), or with one of their pids as a word."""
    name = os.path.basename(path)
    named = _KVBRIDGE_NAME.match(name)
    if named:
        return named.group(1) == RUN_TAG and int(named.group(2)) in mine
    return bool(_owner_pids(name) & mine)


def left_behind(new: Iterable[str]) -> list[str]:
    """The entries of ``new`` (paths new since a snapshot, still there) that are the test's, by the rules of the
    module docstring; sorted."""
    new = {p for p in new if os.path.lexists(p)}
    if not new:
        return []
    mine = {os.getpid(), *(pid for pid in CHILD_PIDS if os.path.exists(f"/proc/{pid}"))}
    private = _PRIVATE[-1][0] + os.sep if _PRIVATE else "\0"
    out = {p for p in new if p.startswith(private) or p in _CREATED or os.path.basename(p) in _CREATED
           or _named_ours(p, mine)}
    rest = new - out
    if rest:
        out |= set().union(*(_held_by(pid, rest) for pid in mine))
    return sorted(out)


def _describe_files(paths: list[str]) -> list[str]:
    """One report line per place: /dev/shm entries, temporary files."""
    lines = []
    shm = [p for p in paths if p.startswith(SHM_DIR + os.sep)]
    tmp = [p for p in paths if not p.startswith(SHM_DIR + os.sep)]
    for found, what in ((shm, "file(s) left in /dev/shm"), (tmp, "temporary file(s) left behind")):
        if found:
            shown = ", ".join(found[:12]) + (f", ... ({len(found) - 12} more)" if len(found) > 12 else "")
            lines.append(f"{len(found)} {what} (created during the test, never removed): {shown}")
    return lines


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    fds: Counter[str]
    threads: frozenset[threading.Thread]
    native_threads: int
    children: frozenset[int]
    shm: frozenset[str]
    #: descriptor number -> target, to name the new descriptors in a report
    fd_targets: dict[int, str] = field(default_factory=dict)
    #: entries of /dev/shm and the temporary directories (full paths)
    files: frozenset[str] = frozenset()

    @classmethod
    def take(cls) -> Snapshot:
        targets = _fd_targets()
        return cls(fds=_fd_kinds(targets), threads=frozenset(threading.enumerate()),
                   native_threads=_native_threads(), children=_children(), shm=_shm(),
                   fd_targets=targets, files=_files())

    def merged(self, other: Snapshot) -> Snapshot:
        """A baseline holding what either snapshot holds (what was already reported is not reported again)."""
        return Snapshot(fds=self.fds | other.fds, threads=self.threads | other.threads,
                        native_threads=max(self.native_threads, other.native_threads),
                        children=self.children | other.children,
                        shm=self.shm | other.shm, fd_targets={**self.fd_targets, **other.fd_targets},
                        files=self.files | other.files)

    def diff(self, now: Snapshot, *, threads_and_fds: bool = True, allowed_threads: tuple[str, ...] = ()) -> list[str]:
        """What ``now`` holds that this snapshot did not. ``allowed_threads``: name prefixes of threads that
        live as long as the process (declared by a plugin); they are not counted, nor are native threads."""
        out = []
        if not threads_and_fds:
            now = Snapshot(fds=self.fds, threads=self.threads, native_threads=self.native_threads,
                           children=now.children, shm=now.shm, fd_targets=self.fd_targets, files=now.files)
        extra_fds = now.fds - self.fds
        if extra_fds:
            what = ", ".join(f"{n} x {k}" for k, n in sorted(extra_fds.items()))
            known = set(self.fd_targets.values())
            new = {fd: t for fd, t in now.fd_targets.items() if t not in known and _kind(t) in extra_fds}
            detail = describe_fds(new)
            more = f" ({'; '.join(detail[:12])}{'; ...' if len(detail) > 12 else ''})" if detail else ""
            out.append(f"{sum(extra_fds.values())} file descriptor(s) left open: {what}{more}")
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
        reported = {os.path.join(SHM_DIR, s) for s in segments}
        out += _describe_files(left_behind(now.files - self.files - reported))
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

"""Proof that a writer's process is gone, from its own kernel, on every backend.

A prefill rank listens on a TCP port (:class:`LivenessListener`, named in its Welcome) and holds every
connection a decode rank makes to it, sending nothing. The decode rank keeps one connection to each prefill
rank that writes into its memory (:class:`LivenessWatch`). When the prefill's process ends for any reason
(exit, crash, ``kill -9``, the OOM killer), its kernel closes those connections and the decode reads EOF (or
a reset) on the established connection. A connection that never got established (refused, unreachable, a
firewall) proves nothing: the writer may be alive behind it, so it is reported as
:meth:`LivenessWatch.unproven` and that writer's death still needs ``declare_gone``. A process that is only
stopped (SIGSTOP, a long pause) keeps them open, and a partition or a dead host closes nothing: silence is
never taken for death (``declare_gone`` is still the engine's word for those).

What the FIN does not say: whether a write the process posted before it died is still in flight in a NIC,
a copy engine or the receiving side's transport queue. The decode therefore waits
``AgentConfig.writer_exit_grace_s`` after the EOF before it treats the writer as gone
(:meth:`kvbridge.agent.peers.PeerTable.writer_gone`).

    listener = LivenessListener("127.0.0.1")      # prefill
    watch = LivenessWatch()                       # decode
    watch.watch(("prefill-0", 7), listener.address)
    listener.poll(); watch.closed()               # [] while the prefill lives
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading

from kvbridge.logs import LineBudget

log = logging.getLogger("kvbridge.agent")

WatchKey = tuple[str, int]   # (agent, incarnation)
MAX_HELD = 4096           # connections a listener holds; past it, new ones wait in the kernel's backlog (never closed:
#                           an EOF is the signal of our death, so closing a decode's connection would fence us alive)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"liveness address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def host_of(link_address: str) -> str:
    """The host a rank's control link is reachable at (``tcp://host:port``), else the loopback address."""
    rest = link_address.partition("://")[2] if "://" in link_address else ""
    if not rest:
        return "127.0.0.1"
    try:
        host = split_address(rest)[0]
    except ValueError:
        return "127.0.0.1"
    return "127.0.0.1" if host in ("", "*", "0.0.0.0", "::") else host


_LISTENING = object()         # the selector's mark of the listening socket


class LivenessListener:
    """A prefill rank's listening socket; every accepted connection is held until its peer closes it."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._server.bind((host, 0))
            self._server.listen(128)
            self._server.setblocking(False)
        except BaseException:
            self._server.close()
            raise
        port = self._server.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        # the listening socket and every held connection in one selector: a poll with nothing to do is one
        # epoll_wait (an accept per progress step raised BlockingIOError each time: a tenth of a progress
        # thread's time on a GPU rank moving 16 MiB requests)
        self._held = selectors.DefaultSelector()
        self._held.register(self._server, selectors.EVENT_READ, data=_LISTENING)
        self._accept_errors = LineBudget(per_interval=1)

    @property
    def held(self) -> int:
        held = self._held.get_map()
        return len(held) - 1 if held is not None else 0

    def poll(self) -> None:
        """Accept pending connections (up to ``MAX_HELD``) and let go of those whose peer went away or that
        carry bytes (a decode never sends any: that is not a decode). Never blocks, bounded work per call."""
        for key, _ in self._held.select(0):
            if key.data is _LISTENING:
                self._accept()
                continue
            held = key.fileobj
            assert isinstance(held, socket.socket)
            if _peer_state(held) != "open":
                self._held.unregister(held)
                held.close()

    def _accept(self) -> None:
        while self.held < MAX_HELD:          # past the cap they wait in the backlog: an un-accepted connection
            try:                             # still reads EOF/RST when we die, and is never closed by us alive
                conn, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:           # e.g. out of file descriptors: try again next time
                if self._accept_errors.take("accept"):
                    log.warning("liveness listener %s: accept failed: %s%s", self.address, exc,
                                self._accept_errors.suppressed_note("accept"))
                break
            conn.setblocking(False)
            self._held.register(conn, selectors.EVENT_READ)

    def close(self) -> None:
        if self._server.fileno() < 0:
            return                           # closed already
        for key in list(self._held.get_map().values()):
            if key.data is not _LISTENING:
                key.fileobj.close()          # type: ignore[union-attr]
        self._held.close()
        self._server.close()


class LivenessWatch:
    """A decode rank's connections to its writers, by key (e.g. (agent, incarnation)). Thread-safe: the runtime
    connects and forgets from the threads that run the agent's actions and polls from its progress step, none of
    them under the agent lock (its own small lock serializes them)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._open = True                       # False once closed: a watch queued before that connects nothing
        self._selector = selectors.DefaultSelector()
        self._keys: dict[WatchKey, socket.socket] = {}
        self._connecting: set[WatchKey] = set()
        self._closed: list[WatchKey] = []
        self._unproven: list[tuple[WatchKey, str]] = []

    def watch(self, key: WatchKey, address: str) -> None:
        """Connect to a writer's listener (non-blocking); a connect that fails proves nothing (``unproven``)."""
        with self._mutex:
            self._watch(key, address)

    def _watch(self, key: WatchKey, address: str) -> None:
        if not self._open:
            return
        self._forget(key)
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            err = sock.connect_ex((host, port))
        except OSError:                 # e.g. a name that does not resolve: no socket left behind
            sock.close()
            raise
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
            sock.close()
            self._unproven.append((key, errno.errorcode.get(err, str(err))))
            return
        self._keys[key] = sock
        if err:
            self._connecting.add(key)
            self._selector.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ, key)
        else:
            self._selector.register(sock, selectors.EVENT_READ, key)

    def changes(self) -> tuple[list[WatchKey], list[tuple[WatchKey, str]]]:
        """What happened since the last call: the keys whose connection the other side's kernel closed (each once),
        and those whose connection could not be established, with the error. Never blocks."""
        with self._mutex:
            return self._closed_keys(), self._unproven_keys()

    def closed(self) -> list[WatchKey]:
        """Keys whose connection the other side's kernel closed or refused since the last call (each once)."""
        with self._mutex:
            return self._closed_keys()

    def _closed_keys(self) -> list[WatchKey]:
        if self._keys:
            for sel_key, events in self._selector.select(0):
                key, sock = sel_key.data, sel_key.fileobj
                assert isinstance(sock, socket.socket)
                if key in self._connecting and events & selectors.EVENT_WRITE:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:                      # never established: no proof either way
                        self._forget(key)
                        self._unproven.append((key, errno.errorcode.get(err, str(err))))
                        continue
                    self._connecting.discard(key)
                    self._selector.modify(sock, selectors.EVENT_READ, key)
                if events & selectors.EVENT_READ:
                    state = _peer_state(sock)
                    if state == "closed":
                        self._lost(key)
                    elif state == "data":        # a kvbridge listener never sends: not one, no proof either way
                        self._forget(key)
                        self._unproven.append((key, "the listener sent data: not a kvbridge liveness listener"))
        found, self._closed = self._closed, []
        return found

    def unproven(self) -> list[tuple[WatchKey, str]]:
        """Keys whose connection could not be established (with the error) since the last call."""
        with self._mutex:
            return self._unproven_keys()

    def _unproven_keys(self) -> list[tuple[WatchKey, str]]:
        found, self._unproven = self._unproven, []
        return found

    def _lost(self, key: WatchKey) -> None:
        self._forget(key)
        self._closed.append(key)

    def forget(self, key: WatchKey) -> None:
        with self._mutex:
            self._forget(key)

    def _forget(self, key: WatchKey) -> None:
        sock = self._keys.pop(key, None)
        self._connecting.discard(key)
        if sock is not None:
            self._selector.unregister(sock)
            sock.close()

    def close(self) -> None:
        with self._mutex:
            self._open = False
            for key in list(self._keys):
                self._forget(key)
            if self._selector.get_map() is not None:
                self._selector.close()


def _peer_state(sock: socket.socket) -> str:
    """One bounded read: ``"closed"`` (EOF or an error: the other side's kernel closed the connection),
    ``"data"`` (bytes arrived, which no kvbridge peer sends) or ``"open"`` (nothing to read)."""
    try:
        data = sock.recv(64)
    except (BlockingIOError, InterruptedError):
        return "open"
    except OSError:
        return "closed"
    return "data" if data else "closed"

"""Control links between processes over ZMQ, and the bootstrap server a prefill instance is found at.

Each agent binds one PULL socket (its address). Sending never blocks the caller: ``send()`` appends
the frame to that peer's own bounded queue and a sender thread moves queues to per-peer PUSH sockets
(``IMMEDIATE``, ``LINGER=0``) without waiting on any one of them, so a dead, slow or unreachable peer
fills only its own queue (oldest frames dropped first) and delays nobody else. The bootstrap server is a
ROUTER socket that maps an instance name to the addresses of its TP ranks; with a secret, every
registration, lookup and answer is authenticated (HMAC, timestamp, single-use nonce). Links re-publish
their instances periodically, so a restarted bootstrap server learns them again.

    server = BootstrapServer("tcp://127.0.0.1:0", secret=key).start()   # once per prefill instance
    link = ZmqLink(bootstrap=server.address, secret=key)                 # in every rank process
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque

import msgspec
import zmq

from kvbridge.links import InstanceInfo
from kvbridge.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

_MAX_FRAME = MAX_MESSAGE_BYTES + 64          # a frame above this is refused by ZMQ before it is read
_MAX_REQUEST = 1 << 20
_MAC = 32
_CLOCK_SKEW_S = 60.0                          # authenticated bootstrap requests older than this are refused
_NONCES = 1 << 16


class _Publish(msgspec.Struct, frozen=True, tag="publish", kw_only=True):
    instance: str
    tp_size: int
    rank: int
    address: str
    nonce: bytes = b""
    time: float = 0.0


class _Lookup(msgspec.Struct, frozen=True, tag="lookup", kw_only=True):
    instance: str
    nonce: bytes = b""
    time: float = 0.0


class _Answer(msgspec.Struct, frozen=True, tag="answer", kw_only=True):
    info: InstanceInfo | None
    error: str = ""
    nonce: bytes = b""     # the request's: an answer cannot be replayed to another request


_Request = _Publish | _Lookup
_REQ_DECODER = msgspec.msgpack.Decoder(_Request)
_ANS_DECODER = msgspec.msgpack.Decoder(_Answer)


def _tag(secret: bytes, purpose: bytes, body: bytes) -> bytes:
    return hmac.new(secret, purpose + b"\0" + body, hashlib.sha256).digest()


def _seal(secret: bytes | None, purpose: bytes, body: bytes) -> bytes:
    return body if secret is None else _tag(secret, purpose, body) + body


def _unseal(secret: bytes | None, purpose: bytes, frame: bytes) -> bytes:
    if secret is None:
        return frame
    tag, body = frame[:_MAC], frame[_MAC:]
    if not hmac.compare_digest(tag, _tag(secret, purpose, body)):
        raise ValueError("bad or missing HMAC (is the shared secret the same?)")
    return body


class BootstrapServer:
    """Answers publish/lookup requests for prefill instances on one ROUTER socket (a daemon thread)."""

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, secret: bytes | None = None,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._secret = secret
        self._instances: dict[str, InstanceInfo] = {}
        self._nonces: OrderedDict[bytes, float] = OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rejected = 0

    def start(self) -> BootstrapServer:
        self._thread = threading.Thread(target=self._serve, name="kvbridge-bootstrap", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                ident, _, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                continue
            nonce = b""
            try:
                request = _REQ_DECODER.decode(_unseal(self._secret, b"bootstrap-request", frame))
                nonce = request.nonce
                self._check_fresh(request)
                answer = self._answer(request)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                self.rejected += 1
                log.error("bootstrap: rejected request: %s", exc)
                answer = _Answer(info=None, error=f"bad request: {exc}")
            answer = msgspec.structs.replace(answer, nonce=nonce)
            body = msgspec.msgpack.encode(answer)
            self._sock.send_multipart([ident, b"", _seal(self._secret, b"bootstrap-answer", body)])
        self._sock.close(0)

    def _check_fresh(self, request: _Request) -> None:
        """With a secret, a request is accepted once and only while fresh (no replay)."""
        if self._secret is None:
            return
        now = time.time()
        if abs(now - request.time) > _CLOCK_SKEW_S or len(request.nonce) < 16:
            raise ValueError("stale or unnumbered request")
        if request.nonce in self._nonces:
            raise ValueError("replayed request")
        self._nonces[request.nonce] = now
        while self._nonces and (len(self._nonces) > _NONCES
                                or now - next(iter(self._nonces.values())) > 2 * _CLOCK_SKEW_S):
            self._nonces.popitem(last=False)

    def _answer(self, request: _Request) -> _Answer:
        if isinstance(request, _Publish):
            info = self._instances.get(request.instance)
            if info is not None and info.tp_size != request.tp_size:
                return _Answer(info=None, error=f"instance {request.instance!r} already has TP {info.tp_size}, "
                                                f"rank says {request.tp_size}")
            if not 0 <= request.rank < request.tp_size:
                return _Answer(info=None, error=f"rank {request.rank} outside TP {request.tp_size}")
            addresses = dict(info.addresses) if info else {}
            addresses[request.rank] = request.address
            self._instances[request.instance] = InstanceInfo(request.tp_size, addresses)
            return _Answer(info=self._instances[request.instance])
        return _Answer(info=self._instances.get(request.instance))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class ZmqLink:
    """A process's control mailbox (PULL), per-peer outgoing queues drained by one sender thread, and
    the bootstrap client (with periodic re-publication).

    ``queue_frames`` bounds each peer's queue; ``dropped_frames`` counts what a full queue lost. ``context``:
    the ZMQ context whose I/O thread carries the frames (default: the process's shared instance); an engine
    that pins its threads to cores may give kvbridge its own, made where its I/O thread is not pinned.
    """

    def __init__(self, *, bootstrap: str, host: str = "127.0.0.1", timeout_s: float = 2.0,
                 secret: bytes | None = None, queue_frames: int = 4096, republish_s: float = 2.0,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        self._pull.bind(f"tcp://{host}:0")
        self.address: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bootstrap = bootstrap
        self._secret = secret
        self._timeout_ms = int(timeout_s * 1000)
        self._queue_frames = queue_frames
        self._queues: dict[str, deque[bytes]] = {}
        self._sockets: dict[str, zmq.Socket[bytes]] = {}       # PUSH per peer; used only under _lock
        self._forgotten: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dropped_frames = 0
        self._recv_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._published: dict[tuple[str, int], int] = {}     # (instance, rank) -> tp_size
        self._republish_s = republish_s
        self._sender = threading.Thread(target=self._send_loop, name="kvbridge-link-send", daemon=True)
        self._sender.start()
        self._republisher: threading.Thread | None = None

    # ---------------------------------------------------------------- sending (never blocks)
    def send(self, address: str, frame: bytes) -> None:
        """Queue ``frame`` for ``address``; returns at once (a non-blocking hand-off to ZMQ when the peer's
        queue is empty and its socket can take it, else the sender thread retries). A full queue drops
        its oldest frame."""
        if self._stop.is_set():
            raise ConnectionError("link is closed")
        with self._lock:
            queue = self._queues.get(address)
            if queue is None:
                queue = self._queues[address] = deque()
                self._forgotten.discard(address)
            sock = self._sockets.get(address)
            if not queue and sock is not None:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if len(queue) >= self._queue_frames:
                queue.popleft()
                self.dropped_frames += 1
            queue.append(frame)
        self._wake.set()

    def forget(self, address: str) -> None:
        """Drop the queue and close the socket of a peer that left."""
        with self._lock:
            self._queues.pop(address, None)
            self._forgotten.add(address)
        self._wake.set()

    @property
    def queued(self) -> dict[str, int]:
        with self._lock:
            return {a: len(q) for a, q in self._queues.items() if q}

    def _send_loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(0.005 if self._pending() else 0.5)
                self._wake.clear()
                with self._lock:
                    for address in self._forgotten:
                        sock = self._sockets.pop(address, None)
                        if sock is not None:
                            sock.close(0)
                    self._forgotten = set()
                    for address, queue in self._queues.items():
                        if queue:
                            sock = self._sockets.get(address)
                            if sock is None:
                                sock = self._sockets[address] = self._push(address)
                            self._drain(queue, sock)
        finally:
            with self._lock:
                for sock in self._sockets.values():
                    sock.close(0)
                self._sockets.clear()

    def _pending(self) -> bool:
        with self._lock:
            return any(self._queues.values())

    def _push(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)          # not connected: EAGAIN, the frame stays in our queue
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(address)
        return sock

    @staticmethod
    def _drain(queue: deque[bytes], sock: zmq.Socket) -> None:
        """Hand queued frames to ZMQ until the socket would block (call with the link lock held)."""
        while queue:
            try:
                sock.send(queue[0], zmq.NOBLOCK)
            except zmq.Again:
                return                               # this peer is slow or gone: the others go on
            except zmq.ZMQError as exc:
                log.warning("link: a frame was dropped: %s", exc)
            queue.popleft()

    # ---------------------------------------------------------------- receiving
    def recv(self, timeout_s: float = 0.0) -> list[bytes]:
        out: list[bytes] = []
        with self._recv_lock:
            if timeout_s > 0 and not self._poller.poll(max(1, math.ceil(timeout_s * 1000))):
                return out   # (poll takes whole milliseconds: never round a short wait down to a spin)
            while True:
                try:
                    out.append(self._pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    return out

    # ---------------------------------------------------------------- bootstrap client
    def _ask(self, request: _Request) -> _Answer:
        if self._secret is not None:
            request = msgspec.structs.replace(request, nonce=os.urandom(16), time=time.time())
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        try:
            sock.connect(self._bootstrap)
            sock.send(_seal(self._secret, b"bootstrap-request", msgspec.msgpack.encode(request)))
            answer = _ANS_DECODER.decode(_unseal(self._secret, b"bootstrap-answer", sock.recv()))
        except zmq.Again:
            return _Answer(info=None, error=f"bootstrap server {self._bootstrap} did not answer in "
                                            f"{self._timeout_ms} ms")
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _Answer(info=None, error=f"bootstrap server {self._bootstrap} answered badly: {exc}")
        finally:
            sock.close(0)
        if self._secret is not None and answer.nonce != request.nonce:
            return _Answer(info=None, error="bootstrap answer does not belong to this request")
        return answer

    def publish(self, instance: str, tp_size: int, rank: int) -> None:
        answer = self._ask(_Publish(instance=instance, tp_size=tp_size, rank=rank, address=self.address))
        if answer.error:
            raise ConnectionError(f"could not publish rank {rank} of {instance!r}: {answer.error}")
        with self._lock:
            self._published[(instance, rank)] = tp_size
            if self._republisher is None and self._republish_s > 0:
                self._republisher = threading.Thread(target=self._republish_loop, name="kvbridge-republish",
                                                     daemon=True)
                self._republisher.start()

    def _republish_loop(self) -> None:
        """Tell the bootstrap server again, now and then, where our instances' ranks are: a restarted
        server learns them back without anyone calling publish()."""
        while not self._stop.wait(self._republish_s):
            with self._lock:
                published = list(self._published.items())
            for (instance, rank), tp_size in published:
                answer = self._ask(_Publish(instance=instance, tp_size=tp_size, rank=rank, address=self.address))
                if answer.error:
                    log.debug("link: re-publishing rank %d of %r failed: %s", rank, instance, answer.error)

    def lookup(self, instance: str) -> InstanceInfo | None:
        answer = self._ask(_Lookup(instance=instance))
        if answer.error:
            log.warning("bootstrap lookup of %r failed: %s", instance, answer.error)
        return answer.info

    def close(self) -> None:
        """Stop sending (frames still queued get a short moment to leave) and close every socket."""
        deadline = time.monotonic() + 0.2
        while self._pending() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout=2)
        if self._republisher is not None:
            self._republisher.join(timeout=self._timeout_ms / 1000 + 1)
        with self._recv_lock:
            self._pull.close(0)

"""Control links between processes over ZMQ, and the bootstrap server a prefill instance is found at.

Each agent binds one PULL socket (its address) and keeps one PUSH socket per peer it talks to
(``IMMEDIATE`` so frames for a dead peer are dropped, never queued forever; ``LINGER=0``). The
bootstrap server is a ROUTER socket that maps an instance name to the addresses of its TP ranks:
prefill ranks publish themselves there, decode ranks look their targets up.

    server = BootstrapServer("tcp://127.0.0.1:0"); server.start()        # once per prefill instance
    link = ZmqLink(bootstrap=server.address)                           # in every rank process
"""

from __future__ import annotations

import logging
import math
import threading

import msgspec
import zmq

from kvbridge.links import InstanceInfo

log = logging.getLogger(__name__)

_MAX_FRAME = 64 << 20


class _Publish(msgspec.Struct, frozen=True, tag="publish"):
    instance: str
    tp_size: int
    rank: int
    address: str


class _Lookup(msgspec.Struct, frozen=True, tag="lookup"):
    instance: str


class _Answer(msgspec.Struct, frozen=True, tag="answer"):
    info: InstanceInfo | None
    error: str = ""


_Request = _Publish | _Lookup
_REQ_DECODER = msgspec.msgpack.Decoder(_Request)
_ANS_DECODER = msgspec.msgpack.Decoder(_Answer)


class BootstrapServer:
    """Answers publish/lookup requests for prefill instances on one ROUTER socket (a daemon thread)."""

    def __init__(self, address: str = "tcp://127.0.0.1:0") -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._instances: dict[str, InstanceInfo] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
                ident, _, body = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                continue
            try:
                answer = self._answer(_REQ_DECODER.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                log.error("bootstrap: rejected request: %s", exc)
                answer = _Answer(None, f"bad request: {exc}")
            self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(answer)])
        self._sock.close(0)

    def _answer(self, request: _Publish | _Lookup) -> _Answer:
        if isinstance(request, _Publish):
            info = self._instances.get(request.instance)
            if info is not None and info.tp_size != request.tp_size:
                return _Answer(None, f"instance {request.instance!r} already has TP {info.tp_size}, "
                                     f"rank says {request.tp_size}")
            if not 0 <= request.rank < request.tp_size:
                return _Answer(None, f"rank {request.rank} outside TP {request.tp_size}")
            addresses = dict(info.addresses) if info else {}
            addresses[request.rank] = request.address
            self._instances[request.instance] = InstanceInfo(request.tp_size, addresses)
            return _Answer(self._instances[request.instance])
        return _Answer(self._instances.get(request.instance))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class ZmqLink:
    """A process's control mailbox (PULL) plus cached PUSH sockets to peers."""

    def __init__(self, *, bootstrap: str, host: str = "127.0.0.1", timeout_s: float = 2.0) -> None:
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        self._pull.bind(f"tcp://{host}:0")
        self.address: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bootstrap = bootstrap
        self._timeout_ms = int(timeout_s * 1000)
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def send(self, address: str, frame: bytes) -> None:
        with self._send_lock:
            sock = self._push.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(address)
                self._push[address] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                # not connected (yet) or the peer stopped reading: wait briefly once, then drop
                if sock.poll(self._timeout_ms // 4, zmq.POLLOUT):
                    sock.send(frame, zmq.NOBLOCK)
                else:
                    raise ConnectionError(f"peer at {address} is not accepting frames") from None

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

    def _ask(self, request: _Request) -> _Answer:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        try:
            sock.connect(self._bootstrap)
            sock.send(msgspec.msgpack.encode(request))
            return _ANS_DECODER.decode(sock.recv())
        except zmq.Again:
            return _Answer(None, f"bootstrap server {self._bootstrap} did not answer in {self._timeout_ms} ms")
        finally:
            sock.close(0)

    def publish(self, instance: str, tp_size: int, rank: int) -> None:
        answer = self._ask(_Publish(instance, tp_size, rank, self.address))
        if answer.error:
            raise ConnectionError(f"could not publish rank {rank} of {instance!r}: {answer.error}")

    def lookup(self, instance: str) -> InstanceInfo | None:
        answer = self._ask(_Lookup(instance))
        if answer.error:
            log.warning("bootstrap lookup of %r failed: %s", instance, answer.error)
        return answer.info

    def close(self) -> None:
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        with self._recv_lock:
            self._pull.close(0)

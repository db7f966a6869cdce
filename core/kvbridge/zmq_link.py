"""Control links between processes over ZMQ, and the embedded bootstrap server that is the default discovery.

Each agent binds one PULL socket (its address). Sending never blocks the caller: ``send()`` appends
the frame to that peer's own bounded queue and a sender thread moves queues to per-peer PUSH sockets
(``IMMEDIATE``, ``LINGER=0``) without waiting on any one of them, so a dead, slow or unreachable peer
fills only its own queue (oldest frames dropped first) and delays nobody else.

Addresses (:mod:`kvbridge.addresses`): ``host`` is the address the link binds (``127.0.0.1`` by default;
``0.0.0.0`` or ``::`` for every interface), ``advertise`` the host it tells its peers (default: the bound
host, or when that is unspecified the interface that routes to the discovery service; never ``0.0.0.0``),
``port_range`` the ports it may bind (``"17600-17699"``; default: any free port).

Discovery (:mod:`kvbridge.discovery`): ``bootstrap="tcp://host:port"`` talks to a :class:`BootstrapServer`
(a ROUTER socket that maps an instance name to the addresses of its TP ranks) through
:class:`ZmqBootstrap`; another scheme (``etcd://...``) opens the discovery plugin that declares it; or pass
``discovery=`` a client. With a secret, every bootstrap registration, lookup and answer is authenticated
(HMAC, timestamp, single-use nonce). Clients re-publish their ranks every ``republish_s``, so a restarted
server learns them again, and the server forgets a rank ``lease_s`` after its last publication (a dead
process vanishes) or at once when its link closes.

    server = BootstrapServer("tcp://127.0.0.1:0", secret=key).start()   # once per prefill instance
    link = ZmqLink(bootstrap=server.address, secret=key)                 # in every rank process
    link = ZmqLink(bootstrap="tcp://198.18.0.1:17600", host="0.0.0.0", port_range="17610-17629", secret=key)

Secure by default: a link or bootstrap server bound where other hosts can reach it (not loopback) is refused
without a secret (:class:`~kvbridge.errors.InsecureSetup`) unless ``allow_insecure=True`` says so, which is
logged at start.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import zmq

from kvbridge.addresses import (
    NoFreePort,
    advertised_host,
    endpoint_host_port,
    format_tcp,
    is_loopback,
    is_unspecified,
    parse_port_range,
)
from kvbridge.clockskew import (
    CLOCK_WINDOW_ENV,
    CLOCK_WINDOW_SETTING,
    Clock,
    check_window,
    clock_window_from_env,
    skew_log_budget,
)
from kvbridge.discovery import (
    ZMQ_SCHEMES,
    Change,
    Discovery,
    DiscoveryError,
    check_address,
    check_rank,
    open_discovery,
    scheme_of,
)
from kvbridge.errors import InsecureSetup
from kvbridge.links import InstanceInfo
from kvbridge.logs import LineBudget
from kvbridge.protocol.wire import MAX_MESSAGE_BYTES
from kvbridge.sealing import FreshnessGuard, Stale, new_nonce, seal, unseal

_POLLIN = int(zmq.POLLIN)      # a plain int: enum flag arithmetic costs microseconds per poll
log = logging.getLogger(__name__)

_MAX_FRAME = MAX_MESSAGE_BYTES + 64          # a frame above this is refused by ZMQ before it is read
_MAX_REQUEST = 1 << 20
_NONCES = 1 << 16
_CLOCKS = 1024                               # instances whose rank clocks the server remembers (oldest forgotten)
_WATCH_LOG = 4096                             # changes the server remembers for watchers
_MAX_WATCH_WAIT_S = 5.0                       # longest a watch request is parked on the server
_TELL_LINGER_MS = 500                         # how long a fire-and-forget withdrawal may try to leave
DOWN_QUEUE_FRAMES = 16                        # frames kept for an address whose peer is dead (peer_down)


class _Publish(msgspec.Struct, frozen=True, tag="publish", kw_only=True):
    instance: str
    tp_size: int
    rank: int
    address: str
    lease_s: float = 0.0    # forget the rank this long after its last publication (0: keep it)
    life: bytes = b""       # the publishing client's random id: another one at the same rank is a restart
    nonce: bytes = b""
    time: float = 0.0


class _Lookup(msgspec.Struct, frozen=True, tag="lookup", kw_only=True):
    instance: str
    nonce: bytes = b""
    time: float = 0.0


class _Withdraw(msgspec.Struct, frozen=True, tag="withdraw", kw_only=True):
    instance: str
    rank: int
    address: str            # only this registration: a restarted rank's newer one stays
    nonce: bytes = b""
    time: float = 0.0


class _Watch(msgspec.Struct, frozen=True, tag="watch", kw_only=True):
    instance: str = ""      # "" = every instance
    since: int = 0          # the revision the client has seen
    epoch: int = 0          # the server life it was seen in (0: start watching now)
    wait_s: float = 0.0     # park the request this long when nothing changed
    nonce: bytes = b""
    time: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockProbe:
    """A bootstrap server's wall clock against ours (:meth:`ZmqBootstrap.clock_probe`): ``offset_s`` is its clock
    minus ours (None when not measured, with ``error``); ``refused``: it refused our request as stale (the offset
    is the one it measured, ``window_s`` its window)."""

    offset_s: float | None = None
    rtt_s: float = 0.0
    window_s: float = 0.0
    refused: bool = False
    error: str = ""


class RankClock(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill rank's wall clock as its last publication showed it (with a secret): ``offset_s`` = the
    publication's time minus the server's clock when it arrived (within the network delay), ``at`` = that server
    time; ``refused``: the publication was refused as stale (the rank is not listed because of it)."""

    offset_s: float
    at: float
    refused: bool = False


class _Answer(msgspec.Struct, frozen=True, tag="answer", kw_only=True):
    info: InstanceInfo | None
    error: str = ""
    nonce: bytes = b""     # the request's: an answer cannot be replayed to another request
    revision: int = 0
    epoch: int = 0
    changes: list[Change] = []
    reset: bool = False    # the server cannot tell what changed since (restart, log overrun): a snapshot
    skew_s: float = 0.0    # refused as stale: the request's time minus the server's clock (0: not refused so)
    window_s: float = 0.0  # ... and the server's window (its clock_window_s)
    server_time: float = 0.0  # the server's wall clock as it answered (`kvbridge doctor` measures the offset)
    clocks: dict[int, RankClock] = {}   # a lookup's instance: each rank's clock at its last publication


PUBLISH_ATTEMPTS = 3        # a publication the server did not answer in time is asked this many times in all

_Request = _Publish | _Lookup | _Withdraw | _Watch
_REQ_DECODER = msgspec.msgpack.Decoder(_Request)
_ANS_DECODER = msgspec.msgpack.Decoder(_Answer)


ALLOW_INSECURE_ENV = "KVBRIDGE_ALLOW_INSECURE"


def check_exposure(what: str, bound: str, *, secret: bytes | None, allow_insecure: bool) -> None:
    """Secure by default: an endpoint bound or advertised where other hosts can reach it (not loopback) needs
    the shared secret, or an explicit ``allow_insecure`` (then logged as such). Raises :class:`InsecureSetup`.
    A ``tcp`` endpoint whose host and port cannot be read counts as exposed."""
    if secret is not None or not bound.startswith("tcp://"):
        return                                  # ipc:// and inproc:// are this host's (file modes, this process)
    hp = endpoint_host_port(bound)
    if hp is not None and is_loopback(hp[0]):
        return
    if not allow_insecure:
        raise InsecureSetup(f"{what} bound at {bound} is reachable from other hosts and has no shared secret: "
                            "anyone who reaches it could forge control frames. Set a secret (KVBRIDGE_SECRET, "
                            f"secret=...) or opt in explicitly with allow_insecure=True ({ALLOW_INSECURE_ENV}=1)")
    log.warning("%s bound at %s without a shared secret (allow_insecure): anyone who reaches it can forge "
                "control frames", what, bound)


def _ipv6(address: str) -> bool:
    return address.startswith("tcp://[") or address.startswith("tcp://::")


@dataclass(slots=True, kw_only=True)
class _Entry:
    tp_size: int
    address: str
    expires: float          # monotonic; math.inf without a lease
    life: bytes = b""       # the publisher's id (_Publish.life)
    stamp: float = 0.0      # the publication's own time (with a secret): an older one from another life is stale


@dataclass(slots=True)
class _Parked:
    ident: bytes
    request: _Watch
    deadline: float


def _peer_address(frame: zmq.Frame) -> str:
    """The TCP peer of a received frame ("?" when ZMQ cannot tell)."""
    try:
        return str(frame.get("Peer-Address")) or "?"
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "?"


class BootstrapServer:
    """Answers publish/lookup/withdraw/watch requests for prefill instances on one ROUTER socket (a daemon
    thread). ``address``: what clients connect to (``advertise`` replaces the bound host in it, for a server
    bound to every interface).

    With a secret, a request is refused unless its time is within ``clock_window_s`` of ``clock()`` (default
    ``KVBRIDGE_CLOCK_WINDOW_S`` or 60 s; the wall clock); such refusals are counted in ``rejected_skew`` and
    logged once a minute per client address with the measured offset."""

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, secret: bytes | None = None,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None, advertise: str | None = None,
                 clock_window_s: float | None = None, clock: Clock = time.time,
                 allow_insecure: bool = False) -> None:
        self._window = (clock_window_from_env() if clock_window_s is None
                        else check_window(clock_window_s, f"BootstrapServer.{CLOCK_WINDOW_SETTING}"))
        self._clock = clock
        self._skew_log = skew_log_budget()
        self._refusal_log = LineBudget(per_interval=5, interval_s=60.0)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        if _ipv6(address):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.bind(address)
        self.bound: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address: str = self.bound
        try:
            if advertise is not None:
                hp = endpoint_host_port(self.bound)
                if hp is None or is_unspecified(advertise):
                    raise ValueError(f"advertise={advertise!r} for a server bound at {self.bound}")
                self.address = format_tcp(advertise, hp[1])
            for endpoint in dict.fromkeys((self.bound, self.address)):
                check_exposure("bootstrap server", endpoint, secret=secret, allow_insecure=allow_insecure)
        except (InsecureSetup, ValueError):
            self._sock.close(0)
            raise
        self._secret = secret
        self._ranks: dict[str, dict[int, _Entry]] = {}
        # instance -> rank -> that rank's clock at its last publication, accepted or refused as stale
        self._clocks: OrderedDict[str, dict[int, RankClock]] = OrderedDict()
        self._fresh = FreshnessGuard(window_s=self._window, capacity=_NONCES)
        self._epoch = secrets.randbits(62) | 1
        self._revision = 0
        self._log: deque[tuple[int, str]] = deque()
        self._log_floor = 0                    # changes after this revision are all in _log
        self._parked: list[_Parked] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rejected = 0
        self.rejected_skew = 0          # of which: authentic but outside the clock window

    @property
    def clock_window_s(self) -> float:
        return self._window

    def start(self) -> BootstrapServer:
        self._thread = threading.Thread(target=self._serve, name="kvbridge-bootstrap", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    wait_ms = 50 if not self._parked else max(1, min(50, int(1000 * (
                        min(p.deadline for p in self._parked) - time.monotonic())) + 1))
                    if poller.poll(wait_ms):
                        self._receive()
                    self._expire(time.monotonic())
                    self._answer_parked(time.monotonic())
                except Exception:       # one bad request must never stop the server for everyone
                    self.rejected += 1
                    log.exception("bootstrap: error while serving; the server goes on")
                    self._parked.clear()
        finally:
            self._sock.close(0)

    def _receive(self) -> None:
        try:
            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        if len(parts) != 3:
            return
        ident, frame = parts[0].bytes, parts[2].bytes
        nonce = b""
        try:
            request = _REQ_DECODER.decode(unseal(self._secret, b"bootstrap-request", frame))
            nonce = request.nonce
            self._check_fresh(request, parts[2])
            if isinstance(request, _Publish):
                answer = self._publish(request)
            elif isinstance(request, _Withdraw):
                answer = self._withdraw(request)
            elif isinstance(request, _Watch):
                parked = self._watch(ident, request)
                if parked is None:
                    return
                answer = parked
            else:
                answer = _Answer(info=self._info(request.instance), clocks=self._clocks_of(request.instance))
        except Stale as exc:
            self.rejected += 1
            self.rejected_skew += 1
            if isinstance(request, _Publish):
                self._note_clock(request, refused=True)
            answer = _Answer(info=None, error=(f"clock skew: the request's time is {exc.offset_s:+.1f} s off the "
                                               f"bootstrap server's clock, outside its {CLOCK_WINDOW_SETTING}="
                                               f"{exc.window_s:g} ({CLOCK_WINDOW_ENV})"),
                             skew_s=exc.offset_s, window_s=exc.window_s)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.rejected += 1
            peer = _peer_address(parts[2])
            if self._refusal_log.take(peer):      # a flood of bad requests must not become a flood of log lines
                log.error("bootstrap: rejected request from %s: %s%s", peer, exc,
                          self._refusal_log.suppressed_note(peer))
            answer = _Answer(info=None, error=f"bad request: {exc}")
        self._reply(ident, answer, nonce)

    def _reply(self, ident: bytes, answer: _Answer, nonce: bytes) -> None:
        body = msgspec.msgpack.encode(msgspec.structs.replace(answer, nonce=nonce, server_time=self._clock()))
        try:
            self._sock.send_multipart([ident, b"", seal(self._secret, b"bootstrap-answer", body)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("bootstrap: an answer was dropped: %s", exc)

    def _check_fresh(self, request: _Request, frame: zmq.Frame) -> None:
        """With a secret, a request is accepted once and only while fresh (no replay). An authentic request
        outside the clock window raises :class:`~kvbridge.sealing.Stale` (logged once a minute per client address)."""
        if self._secret is None:
            return
        try:
            self._fresh.admit(request.nonce, sent_at=request.time, now=self._clock())
        except Stale as exc:
            peer = _peer_address(frame)
            if self._skew_log.take(peer):
                log.warning("bootstrap: requests from %s are %+.1f s off this server's clock, outside %s=%g s (%s)"
                            ": refused until the clocks agree (NTP) or the window is raised; logged once a minute "
                            "per address%s", peer, exc.offset_s, CLOCK_WINDOW_SETTING, self._window,
                            CLOCK_WINDOW_ENV, self._skew_log.suppressed_note(peer))
            raise

    # ---------------------------------------------------------------- rank clocks
    def _note_clock(self, request: _Publish, *, refused: bool) -> None:
        """Remember how far a publishing rank's clock is from ours (only stamped requests carry a time). A
        refused one may also be an old publication replayed: the doctor says both."""
        if not request.time:
            return
        try:
            check_rank(request.instance, request.tp_size, request.rank)
        except DiscoveryError:
            return
        now = self._clock()
        ranks = self._clocks.pop(request.instance, {})
        self._clocks[request.instance] = ranks
        ranks[request.rank] = RankClock(offset_s=request.time - now, at=now, refused=refused)
        while len(self._clocks) > _CLOCKS:
            self._clocks.popitem(last=False)

    def _clocks_of(self, instance: str) -> dict[int, RankClock]:
        return dict(self._clocks.get(instance, {})) if instance else {}

    # ---------------------------------------------------------------- the table
    def _info(self, instance: str) -> InstanceInfo | None:
        ranks = self._ranks.get(instance)
        if not ranks:
            return None
        tp = next(iter(ranks.values())).tp_size
        return InstanceInfo(tp, {rank: e.address for rank, e in sorted(ranks.items())})

    def _changed(self, instance: str) -> None:
        self._revision += 1
        self._log.append((self._revision, instance))
        while len(self._log) > _WATCH_LOG:
            self._log_floor = self._log.popleft()[0]

    def _publish(self, request: _Publish) -> _Answer:
        try:
            check_rank(request.instance, request.tp_size, request.rank)
            check_address(request.address)
        except DiscoveryError as exc:
            return _Answer(info=None, error=str(exc))
        ranks = self._ranks.setdefault(request.instance, {})
        others = {e.tp_size for r, e in ranks.items() if r != request.rank}
        if others and request.tp_size not in others:
            return _Answer(info=None, error=f"instance {request.instance!r} already has TP {others.pop()}, "
                                            f"rank says {request.tp_size}")
        old = ranks.get(request.rank)
        new_life = old is not None and (old.life != request.life if old.life and request.life
                                        else old.address != request.address)
        if new_life and old is not None and request.time and old.stamp and request.time < old.stamp:
            return _Answer(info=None, error=f"rank {request.rank} of {request.instance!r}: this publication is older "
                                            "than the rank's current one (a replay?)")
        if new_life and old is not None and math.isfinite(old.expires):
            # a new life of this rank (a restart under the same name): the other ranks' records may be the dead
            # life's, still leased. Forget the leased ones; live ranks publish again within their renewal
            # interval, so a lookup never assembles the new rank with a dead one.
            stale = [r for r, e in ranks.items() if r != request.rank and math.isfinite(e.expires)]
            for r in stale:
                del ranks[r]
            if stale:
                log.info("bootstrap: rank %d of %r restarted at %s; ranks %s wait until they publish again",
                         request.rank, request.instance, request.address, stale)
        self._note_clock(request, refused=False)
        expires = time.monotonic() + request.lease_s if request.lease_s > 0 else math.inf
        ranks[request.rank] = _Entry(tp_size=request.tp_size, address=request.address, expires=expires,
                                     life=request.life, stamp=request.time)
        if old is None or old.address != request.address or old.tp_size != request.tp_size:
            self._changed(request.instance)
        return _Answer(info=self._info(request.instance))

    def _withdraw(self, request: _Withdraw) -> _Answer:
        ranks = self._ranks.get(request.instance, {})
        entry = ranks.get(request.rank)
        if entry is not None and entry.address == request.address:
            del ranks[request.rank]
            if not ranks:
                del self._ranks[request.instance]
            self._changed(request.instance)
        return _Answer(info=self._info(request.instance))

    def _expire(self, now: float) -> None:
        for instance in list(self._ranks):
            ranks = self._ranks[instance]
            gone = [rank for rank, e in ranks.items() if e.expires < now]
            for rank in gone:
                log.info("bootstrap: rank %d of %r expired (not re-published in time)", rank, instance)
                del ranks[rank]
            if not ranks:
                del self._ranks[instance]
            if gone:
                self._changed(instance)

    # ---------------------------------------------------------------- watchers
    def _changes(self, request: _Watch) -> _Answer | None:
        """The answer to a watch request, or None when nothing changed since it (park it)."""
        wanted = (lambda name: True) if not request.instance else (lambda name: name == request.instance)
        if request.epoch == 0:      # a new watcher: where we are, and what exists now (not reported as changes)
            snapshot = [Change(name, self._info(name)) for name in sorted(self._ranks) if wanted(name)]
            return _Answer(info=None, revision=self._revision, epoch=self._epoch, changes=snapshot)
        if request.epoch != self._epoch or not self._log_floor <= request.since <= self._revision:
            snapshot = [Change(name, self._info(name)) for name in sorted(self._ranks) if wanted(name)]
            return _Answer(info=None, revision=self._revision, epoch=self._epoch, changes=snapshot, reset=True)
        names = list(dict.fromkeys(name for rev, name in self._log if rev > request.since and wanted(name)))
        if not names:
            return None
        return _Answer(info=None, revision=self._revision, epoch=self._epoch,
                       changes=[Change(name, self._info(name)) for name in names])

    def _watch(self, ident: bytes, request: _Watch) -> _Answer | None:
        answer = self._changes(request)
        if answer is not None:
            return answer
        if not request.wait_s > 0:             # zero, negative or NaN: answer now (NaN would poison the poll)
            return _Answer(info=None, revision=self._revision, epoch=self._epoch)
        wait = min(request.wait_s, _MAX_WATCH_WAIT_S)
        self._parked.append(_Parked(ident, request, time.monotonic() + wait))
        return None

    def _answer_parked(self, now: float) -> None:
        keep: list[_Parked] = []
        for parked in self._parked:
            answer = self._changes(parked.request)
            if answer is None and parked.deadline <= now:
                answer = _Answer(info=None, revision=self._revision, epoch=self._epoch)
            if answer is None:
                keep.append(parked)
            else:
                self._reply(parked.ident, answer, parked.request.nonce)
        self._parked = keep

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class ZmqBootstrap:
    """The client of a :class:`BootstrapServer`: a :class:`~kvbridge.discovery.Discovery`.

    Published ranks are re-published every ``republish_s`` (a restarted server learns them back) and carry
    ``lease_s``: the server forgets a rank that long after its last publication. ``republish_s=0`` publishes
    once, without a lease. ``close()`` withdraws every published rank without waiting for the server.
    """

    def __init__(self, url: str, *, secret: bytes | None = None, timeout_s: float = 2.0, lease_s: float = 10.0,
                 republish_s: float = 2.0, context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: Mapping[str, str] | None = None, clock: Clock = time.time) -> None:
        unknown = sorted(set(options or {}) - {"republish_s"})
        if unknown:
            raise ValueError(f"unknown zmq discovery option(s) {unknown}; known: ['republish_s']")
        if options and "republish_s" in options:
            republish_s = float(options["republish_s"])
        if scheme_of(url) not in ZMQ_SCHEMES:
            raise ValueError(f"{url!r} is not a ZMQ bootstrap address (tcp://host:port)")
        if republish_s > 0 and 0 < lease_s < 2 * republish_s:
            raise ValueError(f"lease_s={lease_s} must be at least twice republish_s={republish_s} (or 0: no lease)")
        self.url = url
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._secret = secret
        self._timeout_ms = int(timeout_s * 1000)
        self._lease_s = lease_s if republish_s > 0 else 0.0
        self._republish_s = republish_s
        self._lock = threading.Lock()
        self._published: dict[tuple[str, int], tuple[int, str]] = {}    # (instance, rank) -> (tp, address)
        self._life = secrets.token_bytes(8)      # in every publication: the server tells lives apart by it
        self._stop = threading.Event()
        self._republisher: threading.Thread | None = None
        self._clock = clock
        self._skew_log = skew_log_budget()
        self.skew_rejections = 0         # requests the server refused because our clocks disagree

    def route_target(self) -> tuple[str, int] | None:
        return endpoint_host_port(self.url)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        if _ipv6(self.url):
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    def _stamp(self, request: _Request) -> _Request:
        if self._secret is None:
            return request
        return msgspec.structs.replace(request, nonce=new_nonce(), time=self._clock())

    def _ask(self, request: _Request, timeout_ms: int | None = None, *, attempts: int = 1) -> _Answer:
        """One request and its answer; a server that did not answer in time is asked again, ``attempts`` times in
        all (each time freshly stamped); an answer, even a refusal, is never asked again."""
        timeout_ms = self._timeout_ms if timeout_ms is None else timeout_ms
        for _ in range(attempts):
            stamped = self._stamp(request)
            sock = self._socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            try:
                sock.connect(self.url)
                sock.send(seal(self._secret, b"bootstrap-request", msgspec.msgpack.encode(stamped)))
                answer = _ANS_DECODER.decode(unseal(self._secret, b"bootstrap-answer", sock.recv()))
                break
            except zmq.Again:
                continue
            except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                return _Answer(info=None, error=f"bootstrap server {self.url} answered badly: {exc}")
            finally:
                sock.close(0)
        else:
            return _Answer(info=None, error=f"bootstrap server {self.url} did not answer in {timeout_ms} ms"
                                            + (f" ({attempts} times)" if attempts > 1 else ""))
        if self._secret is not None and answer.nonce != stamped.nonce:
            return _Answer(info=None, error="bootstrap answer does not belong to this request")
        if answer.skew_s:
            self._skewed(answer)
        return answer

    def _skewed(self, answer: _Answer) -> None:
        """The server refused an authentic request of ours as stale: say so once a minute, with the offset."""
        with self._lock:
            self.skew_rejections += 1
            due = self._skew_log.take(self.url)
            note = self._skew_log.suppressed_note(self.url) if due else ""
        if due:
            log.warning("bootstrap server %s refuses our requests: this host's clock is %+.1f s off the server's, "
                        "outside its %s=%g s (%s): publications, lookups and watches fail until the clocks agree "
                        "(NTP) or the window is raised on the server; logged once a minute%s", self.url,
                        answer.skew_s, CLOCK_WINDOW_SETTING, answer.window_s, CLOCK_WINDOW_ENV, note)

    def _tell(self, request: _Request) -> None:
        """Send a request and do not wait for the answer (it is dropped); the frame may try to leave for
        ``_TELL_LINGER_MS`` after this returns."""
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, _TELL_LINGER_MS)
        try:
            sock.connect(self.url)
            sock.send_multipart([b"", seal(self._secret, b"bootstrap-request",
                                             msgspec.msgpack.encode(self._stamp(request)))], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("bootstrap: a withdrawal was not sent: %s", exc)
        finally:
            sock.close()

    def publish(self, instance: str, tp_size: int, rank: int, address: str) -> None:
        """Tell the server where our rank is; a server that does not answer in time is asked again (up to
        ``PUBLISH_ATTEMPTS`` times: a rank must not fail its start on one slow answer of a starved server thread on
        a loaded host, as three tests of one clean-clone CI run did)."""
        answer = self._ask(_Publish(instance=instance, tp_size=tp_size, rank=rank, address=address,
                                    lease_s=self._lease_s, life=self._life), attempts=PUBLISH_ATTEMPTS)
        if answer.error:
            raise DiscoveryError(f"could not publish rank {rank} of {instance!r}: {answer.error}")
        with self._lock:
            self._published[(instance, rank)] = (tp_size, address)
            if self._republisher is None and self._republish_s > 0:
                self._republisher = threading.Thread(target=self._republish_loop, name="kvbridge-republish",
                                                     daemon=True)
                self._republisher.start()

    def _republish_loop(self) -> None:
        """Tell the bootstrap server again, now and then, where our ranks are: the lease is renewed, and a
        restarted server learns them back without anyone calling publish()."""
        while not self._stop.wait(self._republish_s):
            with self._lock:
                published = list(self._published.items())
            for (instance, rank), (tp_size, address) in published:
                answer = self._ask(_Publish(instance=instance, tp_size=tp_size, rank=rank, address=address,
                                            lease_s=self._lease_s, life=self._life))
                if answer.error:
                    log.debug("bootstrap: re-publishing rank %d of %r failed: %s", rank, instance, answer.error)

    def withdraw(self, instance: str, rank: int) -> None:
        with self._lock:
            entry = self._published.pop((instance, rank), None)
        if entry is not None:
            answer = self._ask(_Withdraw(instance=instance, rank=rank, address=entry[1]))
            if answer.error:
                log.warning("bootstrap: withdrawing rank %d of %r failed: %s", rank, instance, answer.error)

    def lookup(self, instance: str) -> InstanceInfo | None:
        answer = self._ask(_Lookup(instance=instance))
        if answer.error and not answer.skew_s:       # a skew is logged once a minute by _ask
            log.warning("bootstrap lookup of %r failed: %s", instance, answer.error)
        return answer.info

    def rank_clocks(self, instance: str) -> dict[int, RankClock]:
        """Each rank of ``instance``: its wall clock against the server's at its last publication (only
        publications stamped with a time, i.e. with a secret; an older server names none)."""
        return dict(self._ask(_Lookup(instance=instance)).clocks)

    def clock_probe(self) -> ClockProbe:
        """Ask the server its wall clock (a lookup of no instance): its offset from ours, within half the round
        trip, or why it cannot be measured (no answer; refused, with the skew the server measured)."""
        sent = self._clock()
        answer = self._ask(_Lookup(instance=""))
        received = self._clock()
        rtt = received - sent
        if answer.skew_s:
            return ClockProbe(offset_s=-answer.skew_s, rtt_s=rtt, window_s=answer.window_s, refused=True,
                              error=answer.error)
        if answer.error and not answer.server_time:
            return ClockProbe(rtt_s=rtt, error=answer.error)
        if not answer.server_time:
            return ClockProbe(rtt_s=rtt, error="the server names no time (an older release)")
        return ClockProbe(offset_s=answer.server_time - (sent + received) / 2, rtt_s=rtt)

    def watch(self, instance: str | None = None) -> _BootstrapWatch:
        return _BootstrapWatch(self, instance or "")

    def close(self) -> None:
        self._stop.set()
        if self._republisher is not None:
            self._republisher.join(timeout=self._timeout_ms / 1000 + 1)
        with self._lock:
            published, self._published = self._published, {}
        for (instance, rank), (_, address) in published.items():
            self._tell(_Withdraw(instance=instance, rank=rank, address=address))


class _BootstrapWatch:
    """A :class:`~kvbridge.discovery.Watch` over a bootstrap server: long polls (the server parks a request
    until something changes or a few seconds pass); a server restart is answered with a snapshot, from which
    instances that disappeared meanwhile are reported as gone."""

    def __init__(self, client: ZmqBootstrap, instance: str) -> None:
        self._client, self._instance = client, instance
        self._known: set[str] = set()
        self._epoch = 0
        self._revision = 0
        self._closed = False
        self._start()

    def _start(self) -> None:
        answer = self._client._ask(_Watch(instance=self._instance))
        if not answer.error:
            self._epoch, self._revision = answer.epoch, answer.revision
            self._known = {c.instance for c in answer.changes if c.info is not None}

    def changes(self, timeout_s: float = 0.0) -> list[Change]:
        if self._closed:
            return []
        deadline = time.monotonic() + timeout_s
        while True:
            if self._epoch == 0:
                self._start()
            wait = max(0.0, min(deadline - time.monotonic(), _MAX_WATCH_WAIT_S))
            answer = self._client._ask(_Watch(instance=self._instance, since=self._revision, epoch=self._epoch,
                                              wait_s=wait),
                                       timeout_ms=self._client._timeout_ms + int(wait * 1000))
            if answer.error:
                log.debug("bootstrap watch: %s", answer.error)
                if time.monotonic() >= deadline:
                    return []
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                continue
            changes = list(answer.changes)
            if answer.reset:
                seen = {c.instance for c in changes}
                changes += [Change(name, None) for name in sorted(self._known - seen)]
            self._epoch, self._revision = answer.epoch, answer.revision
            for change in changes:
                (self._known.add if change.info is not None else self._known.discard)(change.instance)
            if changes or time.monotonic() >= deadline:
                return changes

    def close(self) -> None:
        self._closed = True


class ZmqLink:
    """A process's control mailbox (PULL), per-peer outgoing queues drained by one sender thread, and its
    discovery client (see the module docstring for addresses and discovery).

    ``queue_frames`` bounds each peer's queue; ``dropped_frames`` counts what a full queue lost, and what was
    dropped for a peer that died or left (``dropped_dead_frames``, of those). ``peer_down(address)``: the peer
    there is dead: its queued frames are dropped and at most ``DOWN_QUEUE_FRAMES`` are kept from then on (the
    newest) until ``peer_up(address)`` or ``forget(address)``. ``context``:
    the ZMQ context whose I/O thread carries the frames (default: the process's shared instance); an engine
    that pins its threads to cores may give kvbridge its own, made where its I/O thread is not pinned.
    ``address`` is the advertised endpoint (``tcp://<advertised host>:<port>``), ``bound`` the bound one.
    """

    def __init__(self, *, bootstrap: str | None = None, discovery: Discovery | None = None,
                 host: str = "127.0.0.1", advertise: str | None = None,
                 port_range: str | tuple[int, int] | None = None, timeout_s: float = 2.0,
                 secret: bytes | None = None, queue_frames: int = 4096, republish_s: float = 2.0,
                 lease_s: float = 10.0, context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 allow_insecure: bool = False) -> None:
        if (bootstrap is None) == (discovery is None):
            raise ValueError("give exactly one of bootstrap= (a URL) and discovery= (a client)")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context.instance()
        self._owns_discovery = discovery is None
        if discovery is None:
            assert bootstrap is not None
            if scheme_of(bootstrap) in ZMQ_SCHEMES:
                discovery = ZmqBootstrap(bootstrap, secret=secret, timeout_s=timeout_s, lease_s=lease_s,
                                         republish_s=republish_s, context=self._ctx)
            else:
                discovery = open_discovery(bootstrap, secret=secret, timeout_s=timeout_s, lease_s=lease_s)
        self.discovery: Discovery = discovery
        try:
            self._pull = self._bind(host, advertise, parse_port_range(port_range))
            try:
                for endpoint in dict.fromkeys((self.bound, self.address)):
                    check_exposure("control link", endpoint, secret=secret, allow_insecure=allow_insecure)
            except InsecureSetup:
                self._pull.close(0)
                raise
        except BaseException:
            if self._owns_discovery:
                discovery.close()
            raise
        self._secret = secret
        self._queue_frames = queue_frames
        self._queues: dict[str, deque[bytes]] = {}
        self._sockets: dict[str, zmq.Socket[bytes]] = {}       # PUSH per peer; used only under _lock
        self._forgotten: set[str] = set()
        self._down: set[str] = set()            # addresses whose peer is dead: queues capped at DOWN_QUEUE_FRAMES
        self._closing: list[zmq.Socket[bytes]] = []     # sockets of dead peers, for the sender thread to close
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dropped_frames = 0
        self.dropped_dead_frames = 0
        self._recv_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._published: set[tuple[str, int]] = set()
        self._sender = threading.Thread(target=self._send_loop, name="kvbridge-link-send", daemon=True)
        self._sender.start()

    def _bind(self, host: str, advertise: str | None, ports: tuple[int, int] | None) -> zmq.Socket[bytes]:
        """Bind the PULL socket at ``host`` (a port of ``ports``, else any) and set ``address``/``bound``."""
        public = advertised_host(bind=host, advertise=advertise, toward=self.discovery.route_target())
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        bind_host = "*" if host.strip() in ("", "*") else host
        if ":" in bind_host or ":" in public:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if ports is None:
                sock.bind(format_tcp(bind_host, 0))
            else:
                for port in range(ports[0], ports[1] + 1):
                    try:
                        sock.bind(format_tcp(bind_host, port))
                        break
                    except zmq.ZMQError as exc:
                        if exc.errno != zmq.EADDRINUSE:
                            raise
                else:
                    raise NoFreePort(host, *ports)
            self.bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            hp = endpoint_host_port(self.bound)
            assert hp is not None, self.bound
            self.address: str = format_tcp(public, hp[1])
        except BaseException:
            sock.close(0)
            raise
        return sock

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
            down = address in self._down
            if len(queue) >= (DOWN_QUEUE_FRAMES if down else self._queue_frames):
                queue.popleft()
                self.dropped_frames += 1
                self.dropped_dead_frames += down
            queue.append(frame)
        self._wake.set()

    def forget(self, address: str) -> None:
        """Drop the queue and close the socket of a peer that left (the dropped frames are counted)."""
        with self._lock:
            lost = len(self._queues.pop(address, ()))
            self.dropped_frames += lost
            self.dropped_dead_frames += lost
            self._down.discard(address)
            self._forgotten.add(address)
        self._wake.set()

    def secret_mismatch(self, secret: bytes | None) -> str:
        """Why an agent holding ``secret`` must not use this link, or "" when they agree: agent, link and
        bootstrap take one secret, or none at all (issue 26: a secret set in one place only protects nothing)."""
        mine = self._secret
        if mine is None and not self._owns_discovery:
            return ""                          # a discovery client given with its own credentials
        if mine is not None and secret is not None:
            return "" if hmac.compare_digest(mine, secret) else (
                "the agent's shared secret and its control link's differ: peers would refuse every frame; give "
                "both the same secret (one setting: KVBRIDGE_SECRET / Settings.secret)")
        if mine is None and secret is None:
            return ""
        if secret is None:
            return ("its control link has a shared secret but the agent has none: every control frame would go "
                    "unauthenticated; give the agent the same secret (AgentConfig.secret, KVBRIDGE_SECRET)")
        return ("the agent has a shared secret but its control link has none: its bootstrap registrations and "
                "lookups would go unauthenticated (anyone who reaches the bootstrap could redirect this rank); give "
                "the link the same secret (ZmqLink(secret=...), KVBRIDGE_SECRET)")

    def peer_down(self, address: str) -> int:
        """The peer at ``address`` died or left: drop its queued frames (and the socket's, which ZMQ may still
        hold) and keep at most ``DOWN_QUEUE_FRAMES`` of the frames sent there from now on. Returns how many
        frames were dropped."""
        with self._lock:
            queue = self._queues.get(address)
            lost = len(queue) if queue else 0
            if queue:
                queue.clear()
            self.dropped_frames += lost
            self.dropped_dead_frames += lost
            self._down.add(address)
            sock = self._sockets.pop(address, None)
            if sock is not None:                # closed by the sender thread (LINGER 0): never used again, so a
                self._closing.append(sock)      # frame sent meanwhile goes to a fresh socket, not into this one
        self._wake.set()
        return lost

    def peer_up(self, address: str) -> None:
        """A live peer listens at ``address`` again (re-admitted, or a new incarnation): its queue's bound is
        ``queue_frames`` again."""
        with self._lock:
            self._down.discard(address)

    def queued_to(self, address: str) -> int:
        """Frames waiting in this link's queue for ``address``."""
        with self._lock:
            queue = self._queues.get(address)
            return len(queue) if queue else 0

    def is_down(self, address: str) -> bool:
        """Is ``address`` marked by :meth:`peer_down` (and not since by ``peer_up``/``forget``)?"""
        with self._lock:
            return address in self._down

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
                    for sock in self._closing:
                        sock.close(0)
                    self._closing.clear()
                    for address, queue in self._queues.items():
                        if queue:
                            sock = self._sockets.get(address)
                            if sock is None:
                                sock = self._sockets[address] = self._push(address)
                            self._drain(queue, sock)
        finally:
            with self._lock:
                for sock in [*self._sockets.values(), *self._closing]:
                    sock.close(0)
                self._sockets.clear()
                self._closing.clear()

    def _pending(self) -> bool:
        with self._lock:
            return any(self._queues.values())

    def _push(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)          # not connected: EAGAIN, the frame stays in our queue
        sock.setsockopt(zmq.SNDHWM, 1000)
        if _ipv6(address):
            sock.setsockopt(zmq.IPV6, 1)
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
            # ask the socket first: a progress loop polls this thousands of times a second, and a failed
            # NOBLOCK recv costs a raised exception each time
            while int(self._pull.getsockopt(zmq.EVENTS)) & _POLLIN:
                try:
                    out.append(self._pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            return out

    # ---------------------------------------------------------------- discovery
    def publish(self, instance: str, tp_size: int, rank: int) -> None:
        """Publish this link's address as rank ``rank`` of ``instance``; raises ConnectionError
        (:class:`~kvbridge.discovery.DiscoveryError`) when refused or unreachable."""
        self.discovery.publish(instance, tp_size, rank, self.address)
        with self._lock:
            self._published.add((instance, rank))

    def lookup(self, instance: str) -> InstanceInfo | None:
        return self.discovery.lookup(instance)

    def close(self) -> None:
        """Stop sending (frames still queued get a short moment to leave), withdraw what this link published
        and close every socket."""
        deadline = time.monotonic() + 0.2
        while self._pending() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout=2)
        if self._owns_discovery:
            self.discovery.close()
        else:
            with self._lock:
                published, self._published = self._published, set()
            for instance, rank in published:
                try:
                    self.discovery.withdraw(instance, rank)
                except Exception as exc:  # noqa: BLE001 - closing anyway; the lease ends it
                    log.warning("link: withdrawing rank %d of %r failed: %s", rank, instance, exc)
        with self._recv_lock:
            self._pull.close(0)

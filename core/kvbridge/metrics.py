"""Prometheus metrics of transfers (optional: ``pip install 'kvbridge[metrics]'``, i.e. ``prometheus_client``).

Nothing here runs unless enabled: :func:`enable` creates the metrics, optionally starts the exporter, and
returns the plugin that monitors every call an agent makes to its backend (``before_backend_call`` /
``after_backend_call``, the one call seam ``kvbridge.backends.calls``, which fault injection goes through too):
it counts every call, and reads what was posted, notified and registered from the calls of those kinds. The
plugin is registered only into a registry built for it (:func:`instrumented_registry`), so an agent built
without it has no monitor on its hot path at all::

    from kvbridge import metrics
    registry = metrics.instrumented_registry(port=9400)          # exporter on :9400
    agent = TransferAgent(..., registry=registry)
    metrics.watch_agent(agent)                                   # peers' silence, peer deaths by reason

What is measured (every name starts with ``kvbridge_``):

* ``bytes_total``, ``descriptors_total`` {backend, component}: what ``send_component`` posted (component
  ``__staging__``: writes out of the staging area);
* ``staged_bytes_total`` {backend}: the bytes of those staged writes (staging use);
* ``post_seconds`` {backend}: histogram of the time to post one component (inside ``send_component``);
* ``send_failures_total`` {backend, reason}: ``send_component`` raising (reason: the exception type);
* ``backend_calls_total`` {backend, call, outcome}: every call an agent made to its backend, by kind (``poll``,
  ``release``, ``add_peer``, ``drain_notifications``, ``writer_gone``, ...) and outcome (``ok`` or the
  exception type);
* ``notices_total`` {backend, delivered}: completion notices, delivered by the engine or left to the link;
* ``registered_bytes`` {backend, component}: memory registered with the backend;
* ``transfer_seconds`` {role}: histogram of a request's transfer (prefill: first chunk posted -> Success;
  decode: metadata sent -> Success), ``rooms_total`` {role, outcome} and ``room_failures_total``
  {role, reason}, and the gauge ``rooms`` {role, state}: fed by the engine-facing layer through
  :func:`observe_room` and :func:`room_state` (the demo's ranks, adapters);
* ``peer_silence_seconds`` {agent, peer}: time since the last frame of each peer (heartbeats every
  ``heartbeat_interval_s``; a live peer stays below it plus the link's round trip),
  ``peer_heartbeat_rtt_seconds`` {agent, peer}: the heartbeat round trip (each heartbeat echoes the last one
  the peer sent), ``peer_protocol_version`` {agent, peer}: the version negotiated at its handshake (5: a
  peer of the previous release), ``agent_rooms`` {agent, role, state}: the agent's open rooms by state, and
  ``peer_deaths_total`` {agent, reason}, and ``rooms_unsafe_overdue`` {agent}: failed decode rooms still not
  safe to reuse longer than the peer timeout after they failed (an unproven writer: the orchestrator's
  ``declare_gone`` is due), and ``rejected_frames_total`` {agent}: control frames the agent refused (bad MAC,
  malformed, replayed, stale, from a non-participant, over a bound; ``TransferAgent.rejected_frames``; a
  flood of forged frames shows here, its log lines are rate-limited): sampled by :func:`watch_agent`;
  ``link_dropped_frames_total`` {agent, reason}: control frames its link dropped
  (``full``: a peer's queue overflowed; ``dead_peer``: queued to a peer that died or left, see
  ``ZmqLink.peer_down``): sampled by :func:`watch_agent`.

Several processes of one host (the demo's ranks) share one exporter through ``prometheus_client``'s
multiprocess mode: each process calls :func:`enable` with ``multiprocess_dir`` (before anything else imports
``prometheus_client``), and one process serves them all with :func:`serve_multiprocess`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections import Counter
from typing import Any

from kvbridge.backends.calls import BackendCall, CallKind, CallOutcome

__all__ = ["MetricsPlugin", "enable", "enabled", "instrumented_registry", "observe_room", "room_state",
           "serve_multiprocess", "watch_agent"]

INSTALL_HINT = "pip install 'kvbridge[metrics]'"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LOCK = threading.Lock()
_METRICS: _Metrics | None = None
_PLUGIN: MetricsPlugin | None = None


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(f"kvbridge metrics need prometheus_client: {INSTALL_HINT}") from None
    return prometheus_client


class _Metrics:
    def __init__(self) -> None:
        pc = _client()
        multi = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        gauge = {"multiprocess_mode": "livesum"} if multi else {}
        self.bytes = pc.Counter("kvbridge_bytes", "Bytes posted by send_component", ["backend", "component"])
        self.descriptors = pc.Counter("kvbridge_descriptors", "Descriptors posted by send_component",
                                      ["backend", "component"])
        self.staged = pc.Counter("kvbridge_staged_bytes", "Bytes written out of the staging area", ["backend"])
        self.post = pc.Histogram("kvbridge_post_seconds", "Time to post one component (send_component)",
                                 ["backend"], buckets=_LATENCY_BUCKETS)
        self.send_failures = pc.Counter("kvbridge_send_failures", "send_component raised", ["backend", "reason"])
        self.notices = pc.Counter("kvbridge_notices", "Completion notices", ["backend", "delivered"])
        self.calls = pc.Counter("kvbridge_backend_calls", "Calls an agent made to its backend, by kind and outcome",
                                ["backend", "call", "outcome"])
        self.registered = pc.Gauge("kvbridge_registered_bytes", "Memory registered with the backend",
                                   ["backend", "component"], **gauge)
        self.transfer = pc.Histogram("kvbridge_transfer_seconds", "A request's transfer until Success",
                                     ["role"], buckets=_LATENCY_BUCKETS)
        self.rooms_total = pc.Counter("kvbridge_rooms", "Rooms finished", ["role", "outcome"])
        self.room_failures = pc.Counter("kvbridge_room_failures", "Rooms failed, by reason", ["role", "reason"])
        self.rooms = pc.Gauge("kvbridge_rooms_open", "Rooms open, by state", ["role", "state"], **gauge)
        self.silence = pc.Gauge("kvbridge_peer_silence_seconds", "Time since the last frame of a peer",
                                ["agent", "peer"], **({"multiprocess_mode": "max"} if multi else {}))
        self.overdue = pc.Gauge("kvbridge_rooms_unsafe_overdue", "Failed decode rooms not safe to reuse longer "
                                "than the peer timeout (a writer neither acknowledged nor proven gone)", ["agent"],
                                **gauge)
        self.link_dropped = pc.Counter("kvbridge_link_dropped_frames", "Control frames the agent's link dropped "
                                       "(reason full: a peer's queue overflowed; dead_peer: queued to a peer that "
                                       "died or left)", ["agent", "reason"])
        self.deaths = pc.Counter("kvbridge_peer_deaths", "Peers declared dead, by reason", ["agent", "reason"])
        self.rtt = pc.Gauge("kvbridge_peer_heartbeat_rtt_seconds", "Heartbeat round trip to a peer",
                            ["agent", "peer"], **({"multiprocess_mode": "max"} if multi else {}))
        self.version = pc.Gauge("kvbridge_peer_protocol_version", "The protocol version negotiated with a peer",
                                ["agent", "peer"], **({"multiprocess_mode": "max"} if multi else {}))
        self.agent_rooms = pc.Gauge("kvbridge_agent_rooms", "An agent's rooms, by state", ["agent", "role", "state"],
                                    **gauge)
        self.rejected = pc.Counter("kvbridge_rejected_frames", "Control frames an agent refused (bad MAC, malformed, "
                                   "replayed, stale, from a non-participant, over a bound)", ["agent"])


class MetricsPlugin:
    """A monitor of the backend-call seam; registered only into an instrumented registry."""

    def __init__(self, metrics: _Metrics) -> None:
        self._m = metrics
        self._calls: dict[tuple[str, str, str], Any] = {}     # labelled children, looked up once

    def before_backend_call(self, call: BackendCall) -> None:
        pass

    def after_backend_call(self, call: BackendCall, outcome: CallOutcome) -> None:
        key = (call.backend, call.kind.value, "ok" if outcome.error is None else type(outcome.error).__name__)
        child = self._calls.get(key)
        if child is None:
            child = self._calls[key] = self._m.calls.labels(*key)
        child.inc()
        kind = call.kind
        if kind is CallKind.SEND_COMPONENT:
            self._sent(call.backend, call.args[0], outcome)
        elif kind is CallKind.NOTIFY_COMPLETION and outcome.error is None:
            self._m.notices.labels(call.backend, "engine" if outcome.result else "link").inc()
        elif kind is CallKind.REGISTER_BUFFERS and outcome.error is None:
            component, regions = call.args
            self._m.registered.labels(call.backend, component).inc(sum(int(r.nbytes) for r in regions))

    def _sent(self, name: str, transfer: Any, outcome: CallOutcome) -> None:
        m = self._m
        if outcome.error is not None:
            m.send_failures.labels(name, type(outcome.error).__name__).inc()
            return
        m.post.labels(name).observe(outcome.seconds)
        plan = transfer.plan
        nbytes = int(plan.total_nbytes)
        m.bytes.labels(name, transfer.component).inc(nbytes)
        m.descriptors.labels(name, transfer.component).inc(len(plan))
        if transfer.component == "__staging__":
            m.staged.labels(name).inc(nbytes)


def enable(port: int = 0, *, addr: str = "127.0.0.1", multiprocess_dir: str | None = None) -> MetricsPlugin:
    """Create the metrics of this process (once) and return the call-monitor plugin; ``port`` > 0 also starts the
    exporter (``/metrics`` on ``addr:port``). ``multiprocess_dir``: this process writes its values there for
    :func:`serve_multiprocess` in another process (set before ``prometheus_client`` is first imported)."""
    global _METRICS, _PLUGIN
    with _LOCK:
        if multiprocess_dir is not None:
            os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", multiprocess_dir)
        if _METRICS is None:
            _METRICS = _Metrics()
            _PLUGIN = MetricsPlugin(_METRICS)
        assert _PLUGIN is not None
        if port:
            _client().start_http_server(port, addr=addr)
        return _PLUGIN


def enabled() -> bool:
    return _METRICS is not None


def instrumented_registry(port: int = 0, addr: str = "127.0.0.1", **build: Any) -> Any:
    """``Registry.build(plugins=[the metrics plugin], **build)``; ``port`` and ``addr`` as in :func:`enable`."""
    from kvbridge.registry import Registry

    plugins = [*build.pop("plugins", ()), enable(port, addr=addr)]
    return Registry.build(plugins=plugins, **build)


def serve_multiprocess(port: int, directory: str, addr: str = "127.0.0.1") -> Any:
    """Serve the metrics that the processes writing into ``directory`` recorded, summed (gauges: live
    processes' sum, silence: their maximum). Returns the server (``.shutdown()``)."""
    pc = _client()
    from prometheus_client import multiprocess

    registry = pc.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    server, _thread = pc.start_http_server(port, addr=addr, registry=registry)
    return server


def observe_room(role: str, ok: bool, seconds: float | None = None, reason: str = "") -> None:
    """One room finished (no-op unless enabled): its outcome, its transfer time, why it failed."""
    m = _METRICS
    if m is None:
        return
    m.rooms_total.labels(role, "success" if ok else "failed").inc()
    if ok and seconds is not None:
        m.transfer.labels(role).observe(seconds)
    if not ok:
        m.room_failures.labels(role, _reason_class(reason)).inc()


def room_state(role: str, before: str | None, after: str | None) -> None:
    """A room moved from state ``before`` to ``after`` (None: not open) (no-op unless enabled)."""
    m = _METRICS
    if m is None or before == after:
        return
    if before is not None:
        m.rooms.labels(role, before).dec()
    if after is not None:
        m.rooms.labels(role, after).inc()


def _reason_class(reason: str) -> str:
    """A bounded label from a failure text: its leading words, without numbers or names after a colon."""
    head = reason.split(":", 1)[0].strip().lower() or "unknown"
    head = "".join(c if c.isalpha() or c == " " else " " for c in head)
    return " ".join(head.split()[:6]) or "unknown"


def _death_class(reason: str) -> str:
    """A bounded label from a peer death's text: why it is gone, without the peer's name and address
    (``peer X at tcp://h:p is gone (no message for 3.0 s)`` -> ``no message for s``)."""
    found = re.search(r" is gone \((.*)\)\s*$", reason)
    why = found.group(1) if found else re.sub(r"^peer \S+ ", "", reason)
    return _reason_class(re.sub(r"0x[0-9a-fA-F]+", "", why))


_ROOM_STATES = ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")


def watch_agent(agent: Any, interval_s: float = 1.0) -> None:
    """Sample ``agent`` every ``interval_s`` (its peers' silence and heartbeat round trip, its rooms by state)
    and count peer deaths by reason, until the agent is closed or collected (no-op unless enabled)."""
    m = _METRICS
    if m is None:
        return
    name = getattr(agent, "name", "?")
    agent.peers.on_death(lambda peer, reason: m.deaths.labels(name, _death_class(reason)).inc())
    ref = weakref.ref(agent)

    def sample() -> None:
        seen: set[str] = set()
        counted = 0
        dropped_counted = {"full": 0, "dead_peer": 0}
        while True:
            current = ref()
            if current is None or getattr(current, "_closed", False):
                break
            now = current.context.clock()       # the agent's clock: peers' last_seen and rooms' failed_at are on it
            rejected = int(getattr(current, "rejected_frames", 0))
            if rejected > counted:
                m.rejected.labels(name).inc(rejected - counted)
                counted = rejected
            with current.context.lock:       # a snapshot of the tables; the gauges are set after the release
                alive = [(peer.agent, now - peer.last_seen, peer.version, peer.rtt_s)
                         for peer in current.peers.peers.values() if peer.alive]
                overdue = current.decode.overdue_fences(now) if current.decode is not None else None
                rooms = {role: Counter(room.status.name for room in side.rooms.values())
                         for role, side in (("prefill", current.prefill), ("decode", current.decode))
                         if side is not None}
            for agent_name, silence, version, rtt in alive:
                m.silence.labels(name, agent_name).set(max(0.0, silence))
                m.version.labels(name, agent_name).set(version)
                if rtt is not None:
                    m.rtt.labels(name, agent_name).set(rtt)
                seen.add(agent_name)
            if overdue is not None:
                m.overdue.labels(name).set(overdue)
            dropped, dead = (getattr(current.link, "dropped_frames", None),
                             getattr(current.link, "dropped_dead_frames", None))
            if isinstance(dropped, int) and isinstance(dead, int):
                for reason, count in (("full", dropped - dead), ("dead_peer", dead)):
                    if count > dropped_counted[reason]:       # the link's running counts, as counter increments
                        m.link_dropped.labels(name, reason).inc(count - dropped_counted[reason])
                        dropped_counted[reason] = count
            for role, counts in rooms.items():
                for state in _ROOM_STATES:
                    m.agent_rooms.labels(name, role, state).set(counts.get(state, 0))
            del current
            time.sleep(interval_s)
        for peer_name in seen:
            for gauge in (m.silence, m.rtt, m.version):
                try:
                    gauge.remove(name, peer_name)
                except KeyError:
                    pass

    threading.Thread(target=sample, name=f"kvbridge-metrics-{name}", daemon=True).start()

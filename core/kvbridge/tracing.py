"""One trace per request across every rank it touches (OpenTelemetry; the optional ``tracing`` extra).

Tracing is on in a process whose application configured an OpenTelemetry tracer provider (the SDK's, say);
otherwise :func:`room_trace` returns None and kvbridge neither imports OpenTelemetry nor pays for it: the check
is one look into ``sys.modules`` per room.

A decode rank's room is the span ``kvbridge.receive``; its phases (``bootstrap``: discovery and handshake,
``waiting_for_input``, ``transferring``, ``fencing``) are child spans, its request, notices and checksum checks
events, each scatter a child span. Its parent is the engine's current span when it has one, else a span id
derived from (prefill instance, room), so every decode rank of one request lands in one trace without talking
to each other. The request frame carries the span's W3C ``traceparent``; each prefill rank opens
``kvbridge.send`` under it (the wait for that decode's request included), with a child span per write (bytes,
component, chunk, layers) and per staged gather. A failed room's span has status ERROR with the reason.

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    trace.set_tracer_provider(TracerProvider())     # before the agent's rooms open: they are traced from then on
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: attribute values OpenTelemetry accepts
Attr = str | int | float | bool
_TRACER_NAME = "kvbridge"


def _tracer() -> Any | None:
    """The kvbridge tracer when the application configured a tracer provider, else None (nothing imported)."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return None
    provider = api.get_tracer_provider()
    if isinstance(provider, (api.ProxyTracerProvider, api.NoOpTracerProvider)):
        return None
    return provider.get_tracer(_TRACER_NAME)


def derived_parent(instance: str, room: int) -> tuple[int, int]:
    """(trace id, span id) every rank of request (``instance``, ``room``) derives alike."""
    digest = hashlib.blake2b(f"{instance}\0{room}".encode(), digest_size=24).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:], "big") or 1


class RoomTrace:
    """The span of one room on one rank, its current phase and its open child spans."""

    __slots__ = ("_api", "_children", "_phase", "_tracer", "span")

    def __init__(self, tracer: Any, span: Any) -> None:
        from opentelemetry import trace as api

        self._api, self._tracer, self.span = api, tracer, span
        self._phase: Any = None
        self._children: dict[object, Any] = {}

    # ------------------------------------------------------------ whole room
    def phase(self, name: str, start_ns: int | None = None) -> None:
        """End the current phase span and start ``name`` (a state of the room's table), now or at ``start_ns``."""
        if self._phase is not None:
            self._phase.end()
        self._phase = self._tracer.start_span(name, context=self._api.set_span_in_context(self.span),
                                              start_time=start_ns)

    def event(self, name: str, attributes: Mapping[str, Attr] | None = None) -> None:
        self.span.add_event(name, dict(attributes or {}))

    def end(self, reason: str = "", attributes: Mapping[str, Attr] | None = None) -> None:
        """Close the room's span (ERROR with ``reason`` when given) and every child still open."""
        if attributes:
            self.span.set_attributes(dict(attributes))
        for child in self._children.values():
            child.end()
        self._children.clear()
        if self._phase is not None:
            self._phase.end()
            self._phase = None
        if reason:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("kvbridge.reason", reason)
            self.span.set_status(Status(StatusCode.ERROR, reason))
        self.span.end()

    def traceparent(self) -> str:
        """The W3C ``traceparent`` of the room's span (carried by the request frame)."""
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    # ------------------------------------------------------------ child spans (writes, gathers, scatters)
    def start(self, key: object, name: str, attributes: Mapping[str, Attr] | None = None) -> None:
        """Open child span ``name`` under the room's span, ended by :meth:`finish` with the same ``key``."""
        self._children[key] = self._tracer.start_span(name, context=self._api.set_span_in_context(self.span),
                                                      attributes=dict(attributes or {}))

    def finish(self, key: object, reason: str = "", attributes: Mapping[str, Attr] | None = None) -> None:
        child = self._children.pop(key, None)
        if child is None:
            return
        if attributes:
            child.set_attributes(dict(attributes))
        if reason:
            from opentelemetry.trace import Status, StatusCode

            child.set_status(Status(StatusCode.ERROR, reason))
        child.end()


def receive_trace(*, room: int, instance: str, attributes: Mapping[str, Attr]) -> RoomTrace | None:
    """The span of a decode rank's room (None when tracing is off)."""
    tracer = _tracer()
    if tracer is None:
        return None
    from opentelemetry import trace as api

    current = api.get_current_span().get_span_context()
    if current.is_valid:
        parent = api.set_span_in_context(api.get_current_span())
    else:
        trace_id, span_id = derived_parent(instance, room)
        parent = api.set_span_in_context(api.NonRecordingSpan(api.SpanContext(
            trace_id, span_id, is_remote=True, trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED))))
    span = tracer.start_span("kvbridge.receive", context=parent, attributes={"kvbridge.room": room, **attributes})
    trace = RoomTrace(tracer, span)
    trace.phase("bootstrap")
    return trace


def send_trace(*, room: int, traceparent: str, opened_ns: int,
               attributes: Mapping[str, Attr]) -> RoomTrace | None:
    """The span of a prefill rank's room towards one decode rank, under that decode's ``traceparent`` (None when
    tracing is off or the decode sent none); it starts when the sender opened (``opened_ns``, wall clock)."""
    tracer = _tracer() if traceparent else None
    if tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span = tracer.start_span("kvbridge.send", context=parent, start_time=opened_ns,
                             attributes={"kvbridge.room": room, **attributes})
    trace = RoomTrace(tracer, span)
    trace.event("request received")
    return trace


def wall_ns() -> int:
    """Wall-clock nanoseconds (span times; the protocol's own clock is monotonic and may be injected)."""
    return time.time_ns()


def require() -> None:
    """Raise PluginError naming the extra when the OpenTelemetry SDK is not installed."""
    import importlib.util

    if importlib.util.find_spec("opentelemetry") is None or importlib.util.find_spec("opentelemetry.sdk") is None:
        from kvbridge.errors import PluginError

        raise PluginError("tracing needs the OpenTelemetry SDK: pip install 'kvbridge[tracing]'")


def export_to(path: str, service: str) -> Callable[[], None]:
    """Trace this process's rooms into ``path``, one span a line as the OpenTelemetry SDK writes it in JSON
    (appended; ``service`` names the process); returns the call that flushes and stops it. Needs the extra."""
    from opentelemetry import trace as api
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    out = open(path, "a", encoding="utf-8")     # closed by the returned call
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(
        out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    api.set_tracer_provider(provider)

    def close() -> None:
        provider.shutdown()
        out.close()

    return close


def load_spans(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The spans of JSON lines written by :func:`export_to` (blank lines skipped)."""
    return [json.loads(line) for line in lines if line.strip()]


def traces(spans: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Spans by trace id, each trace's spans by start time."""
    by_trace: dict[str, list[Mapping[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    for members in by_trace.values():
        members.sort(key=lambda s: s["start_time"])
    return by_trace


_SHOWN = ("kvbridge.room", "kvbridge.component", "kvbridge.chunk", "kvbridge.bytes", "kvbridge.staged")


def render(spans: Sequence[Mapping[str, Any]]) -> str:
    """One trace as an indented tree: span, process, duration, its key attributes, its events, failures."""
    ids = {s["context"]["span_id"] for s in spans}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    for span in spans:
        parent = span.get("parent_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    lines: list[str] = [f"trace {spans[0]['context']['trace_id']}" if spans else "no spans"]

    def walk(span: Mapping[str, Any], depth: int) -> None:
        start, end = _ns(span["start_time"]), _ns(span["end_time"])
        attrs = span.get("attributes", {})
        service = span.get("resource", {}).get("attributes", {}).get("service.name", "")
        shown = " ".join(f"{k.split('.', 1)[1]}={attrs[k]}" for k in _SHOWN if k in attrs)
        status = span.get("status", {})
        failed = f"  ERROR: {status.get('description', '')}" if status.get("status_code") == "ERROR" else ""
        lines.append(f"{'  ' * depth}{span['name']} [{service}] {(end - start) / 1e6:.2f} ms {shown}{failed}".rstrip())
        for event in span.get("events", ()):
            eattrs = event.get("attributes", {})
            detail = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in eattrs.items())
            at = (_ns(event["timestamp"]) - start) / 1e6
            lines.append(f"{'  ' * (depth + 1)}* {event['name']} +{at:.2f} ms {detail}".rstrip())
        for child in sorted(children.get(span["context"]["span_id"], ()), key=lambda s: s["start_time"]):
            walk(child, depth + 1)

    for root in sorted(children.get(None, ()), key=lambda s: s["start_time"]):
        walk(root, 1)
    return "\n".join(lines)


def _ns(stamp: str) -> int:
    """Nanoseconds of the SDK's ISO time stamp (``2026-11-28T13:20:00.123456Z``)."""
    from datetime import datetime

    whole, _, frac = stamp.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole + "+00:00").timestamp()
    return int(seconds) * 1_000_000_000 + int((frac + "000000000")[:9])

"""One OpenTelemetry trace per request across every rank it touches (kvbridge.tracing, the ``tracing`` extra).

Every test runs its ranks in processes of its own: a tracer provider is process-wide, and one set in a test worker
would trace every later test there. Spans are checked for structure (the prefill ranks' spans under the decode
room's span, the writes under them), for bytes (what the writes carried is what the decode received) and for
failures (the reason on the span); without a provider nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs kvbridge[tracing]")

from kvbridge import tracing

TESTS = Path(__file__).resolve().parent


def _demo(tmp_path: Path, prefill_tp: int, decode_tp: int, requests: int) -> list[dict[str, Any]]:
    out = tmp_path / f"trace-{prefill_tp}-{decode_tp}.jsonl"
    run = subprocess.run([sys.executable, "-m", "kvbridge.cli", "demo", "--backend", "loopback", "--prefill-tp",
                          str(prefill_tp), "--decode-tp", str(decode_tp), "--requests", str(requests),
                          "--trace", str(out), "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"spans of {requests} requests" in run.stdout and "kvbridge.receive [decode-0]" in run.stdout
    return tracing.load_spans(out.read_text().splitlines())


def _named(spans: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [s for s in spans if s["name"] == name]


def _service(span: Mapping[str, Any]) -> str:
    return str(span["resource"]["attributes"]["service.name"])


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_request_is_one_trace_across_the_ranks_of_a_hetero_tp_demo(tmp_path: Path, prefill_tp: int,
                                                                       decode_tp: int) -> None:
    """Each request of the demo (its ranks are separate processes) is one trace: a ``kvbridge.receive`` per decode
    rank, siblings under one parent every rank derives alike; a ``kvbridge.send`` per (prefill rank, decode rank)
    it serves, whose parent is that decode rank's span (the context travelled in the request frame); every write
    and gather under a send span; the bytes the writes carried to a decode rank are the bytes it received."""
    requests = 3
    by_trace = tracing.traces(_demo(tmp_path, prefill_tp, decode_tp, requests))
    assert len(by_trace) == requests
    for spans in by_trace.values():
        receives, sends = _named(spans, "kvbridge.receive"), _named(spans, "kvbridge.send")
        assert sorted(_service(s) for s in receives) == [f"decode-{r}" for r in range(decode_tp)]
        assert len({s["parent_id"] for s in receives}) == 1                 # one request, one (derived) parent
        assert len({s["attributes"]["kvbridge.room"] for s in receives + sends}) == 1
        by_id = {s["context"]["span_id"]: s for s in spans}
        served = {(_service(s), _service(by_id[s["parent_id"]])) for s in sends}
        assert served == {(f"prefill-{p}", f"decode-{d}") for p in range(prefill_tp) for d in range(decode_tp)
                          if (p * decode_tp) // prefill_tp == d or (d * prefill_tp) // decode_tp == p}, served
        for receive in receives:
            assert receive["status"]["status_code"] == "UNSET"
            assert [e["name"] for e in receive["events"]][0] == "request"
            writes = [w for w in _named(spans, "write") if by_id[w["parent_id"]]["parent_id"] ==
                      receive["context"]["span_id"]]
            assert writes and all(by_id[w["parent_id"]]["name"] == "kvbridge.send" for w in writes)
            assert sum(w["attributes"]["kvbridge.bytes"] for w in writes) == receive["attributes"]["kvbridge.bytes"]
            notices = [e for e in receive["events"] if e["name"] == "notice"]
            assert len(notices) == len(writes)                    # one notice per write, none lost or doubled
        receive_ids = {s["context"]["span_id"] for s in receives}
        for phase in ("bootstrap", "waiting_for_input", "transferring"):
            assert len([s for s in _named(spans, phase) if s["parent_id"] in receive_ids]) == decode_tp, phase
        assert _named(spans, "gather")                            # the demo stages: each piece is gathered


_FAILING = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from test_agent import kv_buffers, kv_layout
from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.links import LocalHub
hub = LocalHub()
config = AgentConfig(peer_timeout_s=5.0)
pre = TransferAgent(layout=kv_layout(1, 0), buffers={{"kv": kv_buffers(kv_layout(1, 0))}}, role=Role.PREFILL,
                    link=hub.link("p0"), instance="inst", config=config, name="p0")
dec = TransferAgent(layout=kv_layout(1, 0), buffers={{"kv": kv_buffers(kv_layout(1, 0))}}, role=Role.DECODE,
                    link=hub.link("d0"), config=config, name="d0")
pre.start(); dec.start()
dec.connect("inst", timeout_s=10)
sender = pre.sender(9)
receiver = dec.receiver(9, "inst")
receiver.send_metadata({{"kv": np.array([1, 2])}})
import time
deadline = time.monotonic() + 10
while sender.poll().name != "WaitingForInput" and time.monotonic() < deadline:
    time.sleep(0.002)
sender.abort("the engine gave the request up")
while not (receiver.poll().name == "Failed" and receiver.safe_to_reuse) and time.monotonic() < deadline:
    time.sleep(0.002)                           # Failed shows while the decode still fences: wait until it ended
pre.close(); dec.close()
print(json.dumps([json.loads(s.to_json(indent=None)) for s in exporter.get_finished_spans()]))
"""


def test_a_failed_room_ends_its_spans_with_the_reason_on_both_sides() -> None:
    """In-memory exporter: the prefill aborts a room; the decode's ``kvbridge.receive`` and the prefill's
    ``kvbridge.send`` end with status ERROR naming the reason, and no span is left open (every phase ended)."""
    run = subprocess.run([sys.executable, "-c", _FAILING.format(tests=str(TESTS))], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    spans = json.loads(run.stdout.splitlines()[-1])
    (receive,), (send,) = _named(spans, "kvbridge.receive"), _named(spans, "kvbridge.send")
    for span in (receive, send):
        assert span["status"]["status_code"] == "ERROR"
        assert "the engine gave the request up" in span["status"]["description"]
    assert send["parent_id"] == receive["context"]["span_id"]
    assert {s["context"]["trace_id"] for s in spans} == {receive["context"]["trace_id"]}
    assert "fencing" in {s["name"] for s in spans} or "failing" in {s["name"] for s in spans}


def test_a_room_cleared_or_closed_before_it_ended_still_ends_its_spans() -> None:
    """An engine that clears a decode room while it waits for input, and an agent closed with a prefill room open:
    their spans end (ERROR naming why) instead of staying open and never being exported."""
    script = _FAILING.split("sender.abort(")[0] + """
receiver.clear()                                 # the decode engine gives up without aborting
pre.close(); dec.close()                         # the prefill room is still waiting for its data
print(json.dumps([json.loads(s.to_json(indent=None)) for s in exporter.get_finished_spans()]))
"""
    run = subprocess.run([sys.executable, "-c", script.format(tests=str(TESTS))], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    spans = json.loads(run.stdout.splitlines()[-1])
    (receive,), (send,) = _named(spans, "kvbridge.receive"), _named(spans, "kvbridge.send")
    assert "cleared by the engine before it ended" in receive["status"]["description"], receive["status"]
    assert "closed before the room ended" in send["status"]["description"], send["status"]


_UNTRACED = """
import sys
if {block}:
    sys.modules["opentelemetry"] = None          # the extra is absent: any import of it fails
sys.path.insert(0, {tests!r})
import numpy as np
from test_agent import kv_buffers, kv_layout
from kvbridge.agent import AgentConfig, Role, TransferAgent
from kvbridge.links import LocalHub
hub = LocalHub()
pre = TransferAgent(layout=kv_layout(1, 0), buffers={{"kv": kv_buffers(kv_layout(1, 0))}}, role=Role.PREFILL,
                    link=hub.link("p0"), instance="inst", name="p0")
dec = TransferAgent(layout=kv_layout(1, 0), buffers={{"kv": kv_buffers(kv_layout(1, 0))}}, role=Role.DECODE,
                    link=hub.link("d0"), name="d0")
pre.start(); dec.start()
dec.connect("inst", timeout_s=10)
sender, receiver = pre.sender(3), dec.receiver(3, "inst")
receiver.send_metadata({{"kv": np.array([1, 2])}})
import time
deadline = time.monotonic() + 10
while sender.poll().name != "WaitingForInput" and time.monotonic() < deadline:
    time.sleep(0.002)
sender.send(np.array([4, 5]), last=True)
while receiver.poll().name != "Success" and time.monotonic() < deadline:
    time.sleep(0.002)
assert receiver.poll().name == "Success", receiver.poll()
assert dec.decode.rooms[3].trace is None
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry") and sys.modules[m] is not None)
pre.close(); dec.close()
print("loaded:", loaded)
"""


@pytest.mark.parametrize("block", [False, True], ids=["installed-no-provider", "extra-absent"])
def test_without_a_tracer_provider_nothing_of_opentelemetry_is_imported(block: bool) -> None:
    """A room succeeds untraced, and no OpenTelemetry module is loaded: with the extra installed but no provider
    set, and with any import of it failing (the extra absent)."""
    run = subprocess.run([sys.executable, "-c", _UNTRACED.format(block=block, tests=str(TESTS))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "loaded: []"

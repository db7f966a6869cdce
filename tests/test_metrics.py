"""Prometheus metrics (issue 15 item 5): fed by a monitor of the backend-call seam registered only when enabled,
exported on a port; `kvbridge demo --metrics-port N` serves its ranks' metrics while it runs."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="kvbridge[metrics] is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvbridge.agent import TransferAgent  # noqa: E402
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis  # noqa: E402
from kvbridge.links import LocalHub  # noqa: E402
from kvbridge.protocol.wire import KVPoll, Role  # noqa: E402
from kvbridge.registry import Registry  # noqa: E402

SCRIPT = Path(sys.executable).with_name("kvbridge")
CMD = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("kvbridge") or "kvbridge"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(text: str) -> dict[str, float]:
    """name{labels} -> value, summed over the labels (enough for "is it non-zero")."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _total(name: str) -> float:
    """A metric of this process's default registry, summed over its labels."""
    return sum(s.value for family in prometheus_client.REGISTRY.collect() for s in family.samples
               if s.name == name)


def _layout(tp: int, rank: int) -> PoolLayout:
    heads = 2 // tp
    bufs = tuple(BufferGeometry(name=f"{t}.{i}", num_items=8, item_shape=(4, heads, 8), dtype=DType.BFLOAT16,
                                shard=ShardAxis(1, 2)) for t in "kv" for i in range(2))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=tp, tp_rank=rank,
                      page_size=4, model="m")


def _buffers(layout: PoolLayout) -> dict[str, list[np.ndarray]]:
    return {"kv": [np.ones((g.num_items, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]}


def test_without_metrics_no_wrapper_is_on_the_hot_path() -> None:
    registry = Registry.build()
    for hook in ("kvbridge_send_component", "kvbridge_notify_completion", "kvbridge_register_buffers"):
        impls = getattr(registry._pm.hook, hook).get_hookimpls()
        assert [i for i in impls if i.wrapper or i.hookwrapper] == [], hook
    assert registry._monitors.pairs == () and registry._monitors.interceptors == ()   # nor a monitor or interceptor
    code = ("import sys\nfrom kvbridge.agent import TransferAgent\nimport kvbridge.demo.worker\n"
            "print('prometheus_client' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_an_instrumented_registry_counts_a_transfer_and_exports_it() -> None:
    from kvbridge import metrics

    port = _free_port()
    registry = metrics.instrumented_registry(port=port)
    # the metrics plugin watches the one call seam (no pluggy wrapper of its own)
    assert [after for _before, after in registry._monitors.pairs if getattr(after, "__self__", None) is not None
            and type(after.__self__).__name__ == "MetricsPlugin"]
    assert not [i for i in registry._pm.hook.kvbridge_send_component.get_hookimpls() if i.wrapper]
    hub = LocalHub()
    pl, dl = _layout(1, 0), _layout(1, 0)
    before = _total("kvbridge_bytes_total")
    polls = {k: prometheus_client.REGISTRY.get_sample_value("kvbridge_backend_calls_total",
                                                            {"backend": "loopback", "call": k, "outcome": "ok"}) or 0.0
             for k in ("poll", "release", "add_peer", "drain_notifications")}
    with TransferAgent(layout=pl, buffers=_buffers(pl), role=Role.PREFILL, link=hub.link("p"), instance="i",
                       registry=registry) as pre, \
         TransferAgent(layout=dl, buffers=_buffers(dl), role=Role.DECODE, link=hub.link("d"),
                       registry=registry) as dec:
        metrics.watch_agent(dec, interval_s=0.05)
        pre.start()
        dec.connect("i", timeout_s=5)
        receiver = dec.receiver(5, "i")
        receiver.send_metadata({"kv": np.array([1, 2, 3])})
        sender = pre.sender(5)
        deadline = time.monotonic() + 10
        while sender.poll() < KVPoll.WaitingForInput and time.monotonic() < deadline:
            time.sleep(0.001)
        sender.send(np.array([4, 5, 6]), last=True)
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert receiver.poll() == KVPoll.Success
        metrics.observe_room("decode", True, 0.01)
        time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    # 3 pages x 4 buffers x 64-byte pages, directly or through the staging area (component __staging__)
    assert _total("kvbridge_bytes_total") - before == 3 * 4 * (4 * 2 * 8 * 2)
    scraped = _samples(text)
    for name in ("kvbridge_bytes_total", "kvbridge_descriptors_total", "kvbridge_post_seconds_count",
                 "kvbridge_registered_bytes", "kvbridge_transfer_seconds_count", "kvbridge_rooms_total",
                 "kvbridge_peer_silence_seconds"):
        assert name in scraped, sorted(scraped)
    assert scraped["kvbridge_bytes_total"] > 0 and scraped["kvbridge_descriptors_total"] > 0
    # the call monitor saw the calls that are no hook: every kind, each at least once more than before
    for kind, was in polls.items():
        now = prometheus_client.REGISTRY.get_sample_value("kvbridge_backend_calls_total",
                                                          {"backend": "loopback", "call": kind, "outcome": "ok"})
        assert now is not None and now > was, kind


def test_room_failures_are_counted_by_reason() -> None:
    from kvbridge import metrics

    metrics.enable()
    labels = {"role": "decode", "reason": "peer died"}
    before = prometheus_client.REGISTRY.get_sample_value("kvbridge_room_failures_total", labels) or 0.0
    metrics.observe_room("decode", False, None, "peer died: no message for 3.1 s from prefill-0-1234")
    assert prometheus_client.REGISTRY.get_sample_value("kvbridge_room_failures_total", labels) == before + 1
    metrics.room_state("decode", None, "waiting")
    assert prometheus_client.REGISTRY.get_sample_value("kvbridge_rooms_open",
                                                       {"role": "decode", "state": "waiting"}) >= 1
    metrics.room_state("decode", "waiting", None)


@pytest.mark.kvbridge_multiprocess
@pytest.mark.timeout(300)
def test_demo_metrics_port_is_scraped_while_the_demo_runs() -> None:
    port = _free_port()
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvbridge-metrics-*")))
    env = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS")}
    # this test is about the metrics port: a loaded CI host (2 cores, other tests beside it) once starved a prefill
    # rank past the default peer timeout, and the decode rightly judged it dead (3 of 300 requests failed)
    env["KVBRIDGE_PEER_TIMEOUT_S"] = "30"
    proc = subprocess.Popen([*CMD, "demo", "--backend", "loopback", "--requests", "120", "--prefill-tp", "2",
                             "--decode-tp", "1", "--metrics-port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    scraped: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    scraped = _samples(response.read().decode())
            except OSError:
                scraped = {}
            if scraped.get("kvbridge_bytes_total", 0) > 0 and scraped.get("kvbridge_transfer_seconds_count", 0) > 0:
                break
            time.sleep(0.2)
        running = proc.poll() is None
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert running, f"the demo ended before its metrics showed transfers:\n{out}\n{err}"
    assert scraped.get("kvbridge_bytes_total", 0) > 0, sorted(scraped)
    assert scraped.get("kvbridge_descriptors_total", 0) > 0
    assert scraped.get("kvbridge_rooms_total", 0) > 0
    assert proc.returncode == 0, out + err
    assert f"metrics on http://127.0.0.1:{port}/metrics" in out
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvbridge-metrics-*"))) <= before   # cleaned up
    with pytest.raises(OSError):                                                                 # and closed
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_heartbeat_round_trip_and_rooms_by_state_are_sampled() -> None:
    """Each heartbeat echoes the last one the peer sent: both sides learn the round trip (a number below the
    peer timeout), exported per peer; the agent's rooms are exported by state without the engine's help."""
    from kvbridge import metrics
    from kvbridge.agent import AgentConfig

    metrics.instrumented_registry()
    hub = LocalHub()
    pl, dl = _layout(1, 0), _layout(1, 0)
    config = AgentConfig(heartbeat_interval_s=0.05)
    with TransferAgent(layout=pl, buffers=_buffers(pl), role=Role.PREFILL, link=hub.link("p"), instance="i",
                       config=config) as pre, \
         TransferAgent(layout=dl, buffers=_buffers(dl), role=Role.DECODE, link=hub.link("d"), config=config) as dec:
        pre.start()
        dec.start()
        dec.connect("i", timeout_s=5)
        dec.receiver(9, "i").send_metadata({"kv": np.array([1, 2])})     # a room left waiting for its data
        metrics.watch_agent(dec, interval_s=0.05)
        deadline = time.monotonic() + 10
        peers = [*pre.peers.peers.values(), *dec.peers.peers.values()]
        while any(p.rtt_s is None for p in peers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(p.rtt_s is not None and 0 <= p.rtt_s < config.peer_timeout_s for p in peers), \
            [(p.agent, p.rtt_s) for p in peers]
        time.sleep(0.2)
        rtt = [s for f in prometheus_client.REGISTRY.collect() for s in f.samples
               if s.name == "kvbridge_peer_heartbeat_rtt_seconds" and s.labels["agent"] == dec.name]
        assert rtt and all(0 <= s.value < config.peer_timeout_s for s in rtt), rtt
        rooms = {s.labels["state"]: s.value for f in prometheus_client.REGISTRY.collect() for s in f.samples
                 if s.name == "kvbridge_agent_rooms" and s.labels["agent"] == dec.name}
        assert rooms.get("WaitingForInput") == 1 and rooms.get("Success") == 0, rooms


def test_a_failed_room_unsafe_past_the_peer_timeout_is_counted() -> None:
    """A writer that neither acknowledges nor is proven gone (a partition, a dead host): the failed room stays
    FENCING, and once that lasts longer than the peer timeout the operator sees it (declare_gone is due)."""
    from kvbridge import metrics
    from kvbridge.agent import AgentConfig

    metrics.instrumented_registry()
    hub = LocalHub()
    pl, dl = _layout(1, 0), _layout(1, 0)
    config = AgentConfig(heartbeat_interval_s=0.05, peer_timeout_s=0.3)
    with TransferAgent(layout=pl, buffers=_buffers(pl), role=Role.PREFILL, link=hub.link("p"), instance="i",
                       config=config) as pre, \
         TransferAgent(layout=dl, buffers=_buffers(dl), role=Role.DECODE, link=hub.link("d"), config=config) as dec:
        pre.start()
        dec.start()
        dec.connect("i", timeout_s=5)
        receiver = dec.receiver(4, "i")
        receiver.send_metadata({"kv": np.array([1, 2])})
        time.sleep(0.2)
        pre._stop.set()                       # silent from now on, its process (and liveness listener) alive
        metrics.watch_agent(dec, interval_s=0.05)
        deadline = time.monotonic() + 10

        def overdue() -> float:
            return sum(s.value for f in prometheus_client.REGISTRY.collect() for s in f.samples
                       if s.name == "kvbridge_rooms_unsafe_overdue" and s.labels["agent"] == dec.name)

        while overdue() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.poll() == KVPoll.Failed and not receiver.safe_to_reuse
        assert overdue() == 1
        dec.declare_gone(pre.name)            # the orchestrator's word
        while overdue() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.safe_to_reuse and overdue() == 0


def test_rejected_frames_are_exported_per_agent() -> None:
    """A flood of forged frames is visible to the operator as a number (its log lines are rate-limited)."""
    from kvbridge import metrics
    from kvbridge.agent import AgentConfig
    from kvbridge.protocol.wire import Codec, Heartbeat

    metrics.instrumented_registry()
    hub = LocalHub()
    dl = _layout(1, 0)
    with TransferAgent(layout=dl, buffers=_buffers(dl), role=Role.DECODE, link=hub.link("d"),
                       config=AgentConfig(secret=b"the secret")) as dec:
        metrics.watch_agent(dec, interval_s=0.05)
        forger = Codec(b"a guess", sender="m", address="m")
        for seq in range(1, 301):
            dec.handle_frame(forger.encode(Heartbeat(agent="m", address="m", seq=seq), to="d"))

        def exported() -> float:
            return sum(s.value for f in prometheus_client.REGISTRY.collect() for s in f.samples
                       if s.name == "kvbridge_rejected_frames_total" and s.labels["agent"] == dec.name)

        deadline = time.monotonic() + 10
        while exported() < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dec.rejected_frames == 300 and exported() == 300


def test_peer_death_reasons_are_bounded_labels_naming_the_cause() -> None:
    """The death label is the cause, not the peer (it was "peer <name> at tcp": cut at the address's colon)."""
    from kvbridge.metrics import _death_class

    cases = {"peer p0 at tcp://127.0.0.1:5 is gone (no message for 3.0 s)": "no message for s",
             "peer p7 at tcp://h:1 is gone (exited: its kernel closed our liveness connection)": "exited",
             "peer p0 declared gone by the engine": "declared gone by the engine",
             "peer x at tcp://h:1 is gone (restarted as incarnation 0xabc12)": "restarted as incarnation",
             "peer p0 at tcp://h:1 is gone (said goodbye)": "said goodbye"}
    for reason, label in cases.items():
        assert _death_class(reason) == label, (reason, _death_class(reason))


def test_the_exporter_binds_metrics_host() -> None:
    """``metrics_host`` (``KVBRIDGE_METRICS_HOST``) is the address the exporter binds: served there, refused on
    another address of this host (it was 127.0.0.1 whatever was asked, so no scraper on another host could
    reach it)."""
    from kvbridge import metrics
    from kvbridge.settings import load_settings

    assert load_settings(env={"KVBRIDGE_METRICS_HOST": "0.0.0.0"}, check_backend=False).metrics_host == "0.0.0.0"
    assert load_settings(env={}, check_backend=False).metrics_host == "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    directory = tempfile.mkdtemp(prefix="kvbridge-metrics-host-")
    server = metrics.serve_multiprocess(port, directory, addr="127.0.0.2")
    try:
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10) as answer:
            assert answer.status == 200
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(directory, ignore_errors=True)

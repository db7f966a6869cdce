"""``kvbridge doctor``'s NIXL check: which UCX protocol carries NIXL's writes here and how fast
(kvbridge_nixl.routes). The verdicts are checked on UCX's own protocol tables (as UCX 1.23 prints them with
UCX_PROTO_INFO=y, GPU ones included), and the probe runs for real on this host's host-memory route (two NIXL
agents, 64 MiB writes checked byte for byte)."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.plugin import Severity

routes = pytest.importorskip("kvbridge_nixl.routes")
pytest.importorskip("nixl", reason="needs the nixl wheel")


def _table(agent: str, scope: str, src: str, dst: str, rows: list[tuple[str, str, str]]) -> str:
    pre = "[1795872097.333706] [vm:1589 :0]   "
    lines = [f"{pre}+--------+", f"{pre}| {agent} {scope} cfg#2                 |",
             f"{pre}| remote memory write by ucp_put* from {src} to {dst} |", f"{pre}+--------+",
             f"{pre}| Range  | Description |   Config   |", f"{pre}+--------+"]
    lines += [f"{pre}| {r} | {d} | {c}      |" for r, d, c in rows]
    return "\n".join([*lines, f"{pre}+--------+"]) + "\n"


_HOST_CMA = _table("a", "intra-node", "host memory", "host", [("0..inf", "zero-copy", "cma/memory")])
_HOST_TCP = _table("a", "intra-node", "host memory", "host", [("0..inf", "software emulation", "tcp/lo")])
_SELF = _table("a", "self", "host memory", "host", [("0..4294967295", "short", "cuda_copy/cuda")])
_GPU_IPC = _table("g", "intra-node", "cuda/dev[0]", "cuda/dev[1]",
                  [("0..8k", "short", "cuda_copy/cuda"), ("8k..inf", "zero-copy", "cuda_ipc/cuda")])


def test_protocol_tables_are_read_for_the_agents_own_endpoint() -> None:
    assert routes.put_protocols(_SELF + _HOST_CMA, "a") == {("host memory", "host"): [("0..inf", "zero-copy",
                                                                                         "cma/memory")]}
    assert routes.put_protocols(_HOST_CMA, "b") == {}          # another agent's tables are not this one's
    assert routes.put_protocols(_SELF, "a") == {}              # its loop-back endpoint is not the peer


@pytest.mark.parametrize("log, src, dst, gbps, severity, words", [
    (_HOST_CMA, "cpu", "cpu", 9.5, Severity.OK, "zero-copy over cma/memory"),
    (_HOST_TCP, "cpu", "cpu", 1.2, Severity.WARNING, "copied through a socket"),
    (_HOST_CMA, "cpu", "cpu", 0.8, Severity.WARNING, "a busy host"),
    (_GPU_IPC, "cuda:0", "cuda:1", 250.0, Severity.OK, "zero-copy over cuda_ipc/cuda"),
    ("", "cuda:0", "cuda:1", 3.1, Severity.WARNING, "not going peer to peer"),
], ids=["host-cma", "host-tcp", "host-cma-slow", "gpu-cuda-ipc", "gpu-slow-no-table"])
def test_each_route_is_judged_by_its_protocol_and_speed(log: str, src: str, dst: str, gbps: float,
                                                         severity: Severity, words: str) -> None:
    agent = "g" if log is _GPU_IPC else "a"
    finding = routes.judge(f"{src} -> {dst}", src, dst, gbps, routes.put_protocols(log, agent))
    assert finding.severity is severity and words in finding.text and f"{gbps:.1f} GB/s" in finding.text, finding


def test_the_probe_runs_on_this_host_and_measures_the_host_memory_route() -> None:
    """One finding per route; the host-memory route's writes landed byte-exact (no error) and were timed."""
    findings = list(routes.diagnose())
    host = [f for f in findings if f.text.startswith("host memory -> host memory")]
    assert len(host) == 1 and len(findings) == len(routes.routes()), findings
    assert "failed" not in host[0].text and " GB/s " in host[0].text, host[0]


def _lines_until(stream: Any, text: str, most: int = 200) -> list[str]:
    lines: list[str] = []
    while len(lines) < most and (not lines or text not in lines[-1]):
        line = stream.readline()
        if not line:
            break
        lines.append(line)
    return lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(step_timeout_s: float) -> tuple[Any, str]:
    import subprocess
    import sys

    address = f"tcp://127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-c", "from kvbridge_nixl.routes import serve; "
                               f"serve({address!r}, 240, step_timeout_s={step_timeout_s})"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return server, address


def _open(address: str, request: bytes) -> tuple[Any, dict[str, Any] | list[Any]]:
    """A prober's first step: ask, wait for the answer (refusal or the receiver's metadata), socket kept."""
    import msgspec
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(request)
    assert sock.poll(60_000), "the probe server did not answer"
    return sock, msgspec.msgpack.decode(sock.recv())


def test_a_probe_server_answers_probes_refuses_what_it_lacks_and_outlives_probers_that_vanish_or_fall_silent(
        ) -> None:
    """``kvbridge doctor --serve-probe``'s NIXL end, tried as another host would and as a careless one would: garbage
    and a device it lacks get a refusal naming what it offers; a prober that asks and then vanishes (its connection
    closes) frees it at once, one that stays connected but silent holds it for its step timeout only; a real probe
    from another process then writes 64 MiB into it byte-exact, timed."""
    import json
    import subprocess
    import sys

    import msgspec

    server, address = _serve(30)
    silent_server, silent_address = _serve(1)         # for the prober that falls silent (its own step timeout)
    try:
        for out in (server.stdout, silent_server.stdout):
            assert out is not None and "serving NIXL route probes" in _lines_until(out, "serving")[-1]
        assert server.stdout is not None and silent_server.stdout is not None
        for request in (b"\xc1not msgpack", msgspec.msgpack.encode({"op": "open", "device": "cuda:7"})):
            sock, answer = _open(address, request)
            assert isinstance(answer, dict) and "this host offers ['cpu'" in answer["error"], answer
            sock.close(0)
        opening = msgspec.msgpack.encode({"op": "open", "device": "cpu"})
        vanishing, metadata = _open(address, opening)        # takes the metadata, never says "check"
        assert isinstance(metadata, list), metadata
        sock, answer = _open(address, opening)               # meanwhile another prober is told to come back
        assert isinstance(answer, dict) and "busy with another probe" in answer["error"], answer
        sock.close(0)
        vanishing.close(0)
        said = _lines_until(server.stdout, "dropped a probe")   # the server's lines among its children's logs
        assert "dropped a probe into cpu: the prober went away" in said[-1], said
        silent, metadata = _open(silent_address, opening)   # stays connected, says nothing
        assert isinstance(metadata, list), metadata
        said = _lines_until(silent_server.stdout, "dropped a probe")
        assert "dropped a probe into cpu: the prober did not answer in time" in said[-1], said
        silent.close(0)
        # the server goes on serving. The prober's turn after the metadata is its whole measurement (a NIXL agent,
        # 6 writes of 64 MiB): a step timeout of 3 s here dropped that session and killed its receiving child under
        # a loaded host's CPU starvation, and the probe then failed with "UCX connect refused" (clean-clone runs 39,
        # 40 and 42; the server said "dropped a probe ... prober did not answer in time"), so 30 s
        probe = subprocess.run([sys.executable, "-m", "kvbridge_nixl.routes", json.dumps([["cpu", f"cpu@{address}"]])],
                               capture_output=True, text=True, timeout=180)
        result = json.loads(next(line for line in probe.stdout.splitlines() if line.startswith("{")))
        assert "error" not in result and result["gbps"] > 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    finally:
        for proc in (server, silent_server):
            proc.kill()
            proc.wait(timeout=30)

"""``kvbridge doctor``'s NIXL check: which UCX protocol carries NIXL's writes here and how fast
(kvbridge_nixl.routes). The verdicts are checked on UCX's own protocol tables (as UCX 1.23 prints them with
UCX_PROTO_INFO=y, GPU ones included), and the probe runs for real on this host's host-memory route (two NIXL
agents, 64 MiB writes checked byte for byte)."""

from __future__ import annotations

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

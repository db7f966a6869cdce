"""``kvbridge doctor``'s NIXL check: which UCX transports NIXL picks here (kvbridge_nixl.routes). The verdicts are
checked on UCX's own log lines (as UCX 1.23 prints them, GPU ones included), and the probe runs for real on this
host's host-memory route (two NIXL agents, a 1 MiB write checked byte for byte)."""

from __future__ import annotations

import pytest

from kvbridge.findings import Severity

routes = pytest.importorskip("kvbridge_nixl.routes")
pytest.importorskip("nixl", reason="needs the nixl wheel")

_HOST_TCP = ("[1.0] [vm:1:0] ucp_worker.c:1997 UCX  INFO    a self cfg#0 rma_am(tcp/lo)  am(tcp/lo)\n"
             "[1.1] [vm:1:0] ucp_worker.c:1997 UCX  INFO    a intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  "
             "am(tcp/lo cma/memory)  ka(tcp/lo)\n")
_GPU_IPC = ("[2.0] [h:7:0] ucp_worker.c:1997 UCX  INFO    g intra-node cfg#2 rma_bw(cuda_ipc/cuda)  "
            "am(tcp/lo sysv/memory cuda_copy/cuda)  ka(tcp/lo)\n")
_GPU_COPY = ("[3.0] [h:7:0] ucp_worker.c:1997 UCX  INFO    g intra-node cfg#2 rma_bw(cuda_copy/cuda posix/memory)  "
             "am(tcp/lo sysv/memory)  ka(tcp/lo)\n")


def test_lanes_are_read_from_the_endpoint_line_of_the_agent() -> None:
    assert routes.lanes_of(_HOST_TCP, "a") == {"rma_am": ["tcp/lo"], "amo_am": ["tcp/lo"],
                                               "am": ["tcp/lo", "cma/memory"], "ka": ["tcp/lo"]}
    assert routes.lanes_of(_HOST_TCP, "b") == {}          # another agent's lines are not this one's


@pytest.mark.parametrize("log, route, severity, words", [
    (_HOST_TCP, "host memory -> host memory", Severity.WARNING, "active messages over tcp/lo"),
    (_GPU_IPC, "cuda:0 -> cuda:1", Severity.OK, "rma_bw over cuda_ipc/cuda"),
    (_GPU_COPY, "cuda:0 -> cuda:1", Severity.WARNING, "through host memory (no cuda_ipc)"),
    ("", "cuda:1 -> cuda:0", Severity.WARNING, "could not tell"),
], ids=["host-over-tcp", "gpu-cuda-ipc", "gpu-through-host", "no-log"])
def test_each_route_is_judged_by_its_bulk_write_lane(log: str, route: str, severity: Severity, words: str) -> None:
    agent = "a" if log is _HOST_TCP else "g"
    finding = routes.judge(route, routes.lanes_of(log, agent))
    assert finding.severity is severity and words in finding.text, finding


def test_the_probe_runs_on_this_host_and_names_the_host_memory_transports() -> None:
    """One finding per route; the host-memory route's write landed byte-exact (no error) and its lanes were read
    from UCX's log (the verdict names the transport, whatever this host offers)."""
    findings = list(routes.diagnose())
    host = [f for f in findings if f.text.startswith("host memory -> host memory")]
    assert len(host) == 1 and len(findings) == len(routes.routes()), findings
    assert "could not tell" not in host[0].text and "failed" not in host[0].text, host[0]
    assert "rma_bw over" in host[0].text or "active messages over" in host[0].text, host[0]

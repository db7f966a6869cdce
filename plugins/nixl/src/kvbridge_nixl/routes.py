"""Which UCX transports NIXL picks on this host (``kvbridge doctor``): host memory to host memory between two
local agents, and GPU to GPU for every pair of local GPUs.

A child process (UCX reads ``UCX_LOG_LEVEL`` once, when it loads) starts two NIXL agents per route, registers
1 MiB on each side, writes it once and checks the bytes; UCX logs each endpoint's lanes (``rma_bw`` carries
bulk writes; ``rma_am`` means writes are emulated by active messages, i.e. copied through a socket or a
bounce buffer). A route without a zero-copy ``rma_bw`` lane, or one whose GPU lanes go through host memory
(``cuda_copy`` only), is a warning with what to check::

    warning  nixl       host memory -> host memory: writes go as active messages over tcp/lo (no zero-copy ...
    ok       nixl       cuda:0 -> cuda:1: rma_bw over cuda_ipc/cuda (GPU to GPU, no host copy)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from kvbridge.findings import Finding, Severity

PROBE_BYTES = 1 << 20
PROBE_TIMEOUT_S = 90.0
_LANES = re.compile(r"(\w+)\(([^)]*)\)")
_CONFIG = re.compile(r"UCX\s+INFO\s+(\S+) (?:intra-node|inter-node|self) cfg#\d+ (.*)$")
#: transports that write without a copy through a socket or a bounce buffer
ZERO_COPY = ("cuda_ipc", "cma", "knem", "xpmem", "posix", "sysv", "rc", "dc", "ud", "gdr_copy")


def lanes_of(log: str, agent: str) -> dict[str, list[str]]:
    """The lanes UCX logged for ``agent``'s endpoint to its peer (the last config line naming it):
    ``{"rma_bw": ["cuda_ipc/cuda"], "am": ["tcp/lo", "cma/memory"], ...}``."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        match = _CONFIG.search(line)
        if match is None or match.group(1) != agent or " self cfg#" in line:
            continue
        found = {lane: transports.split() for lane, transports in _LANES.findall(match.group(2))}
    return found


def judge(route: str, lanes: dict[str, list[str]]) -> Finding:
    """A finding for one route from its lanes."""
    bulk = lanes.get("rma_bw") or lanes.get("rma") or []
    names = {t.split("/")[0] for t in bulk}
    if not lanes:
        return Finding(severity=Severity.WARNING, check="nixl", text=f"{route}: UCX logged no lanes for it (an "
                                                                     "unknown UCX version?): could not tell")
    if not bulk:
        via = " ".join(lanes.get("rma_am") or lanes.get("am") or ["?"])
        return Finding(severity=Severity.WARNING, check="nixl", text=(
            f"{route}: writes go as active messages over {via} (no zero-copy transport): expect a fraction of the "
            "link; check UCX_TLS, that CMA is allowed (kernel.yama.ptrace_scope, the container's seccomp profile) "
            "and, between GPUs, cuda_ipc (peer access, the same container)"))
    if route.startswith("cuda") and not names & {"cuda_ipc", "gdr_copy", "rc", "dc"}:
        return Finding(severity=Severity.WARNING, check="nixl", text=(
            f"{route}: rma_bw over {' '.join(bulk)}: GPU memory goes through host memory (no cuda_ipc): check GPU "
            "peer access and that both processes see both GPUs (CUDA_VISIBLE_DEVICES)"))
    copies = "" if names & set(ZERO_COPY) else " (copied through a socket: slow)"
    return Finding(severity=Severity.OK if not copies else Severity.WARNING, check="nixl",
                   text=f"{route}: rma_bw over {' '.join(bulk)}{copies}")


def routes() -> list[tuple[str, str]]:
    """The routes worth probing here: host memory, and every ordered pair of local GPUs (one GPU: itself)."""
    found = [("cpu", "cpu")]
    count = _gpus()
    found += [(f"cuda:{a}", f"cuda:{b}") for a in range(count) for b in range(count) if a != b or count == 1]
    return found


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def diagnose() -> Iterator[Finding]:
    """``BackendSpec.diagnose`` of the NIXL backend: one finding per route (see the module)."""
    wanted = routes()
    env = {**os.environ, "UCX_LOG_LEVEL": "info", "NIXL_LOG_LEVEL": "WARN"}
    try:
        run = subprocess.run([sys.executable, "-m", "kvbridge_nixl.routes", json.dumps(wanted)], env=env,
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        yield Finding(severity=Severity.WARNING, check="nixl", text=f"the transport probe did not finish in "
                                                                    f"{PROBE_TIMEOUT_S:.0f} s")
        return
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 and not results:
        last = (run.stderr.strip().splitlines() or ["?"])[-1]
        yield Finding(severity=Severity.WARNING, check="nixl", text=f"the transport probe failed: {last}")
        return
    log = run.stdout + run.stderr                # UCX logs to stdout unless UCX_LOG_FILE says otherwise
    version = re.search(r"UCX\s+INFO\s+Version (\S+)", log)
    for result in results:
        route = f"{_label(result['src'])} -> {_label(result['dst'])}"
        if result.get("error"):
            yield Finding(severity=Severity.WARNING, check="nixl", text=f"{route}: a 1 MiB write failed: "
                                                                        f"{result['error']}")
            continue
        finding = judge(route, lanes_of(log, result["agent"]))
        suffix = f" (UCX {version.group(1)})" if version and finding.severity is Severity.OK else ""
        yield Finding(severity=finding.severity, check="nixl", text=finding.text + suffix)


def _label(device: str) -> str:
    return "host memory" if device == "cpu" else device


# ------------------------------------------------------------------ the child process
def _buffer(device: str) -> tuple[Any, int, int, str]:
    """(keep-alive object, address, device id, NIXL memory type) of PROBE_BYTES on ``device``."""
    if device == "cpu":
        import numpy as np

        array = np.arange(PROBE_BYTES, dtype=np.uint8)
        return array, int(array.ctypes.data), 0, "DRAM"
    import torch

    index = int(device.split(":")[1])
    tensor = torch.arange(PROBE_BYTES, dtype=torch.int32, device=device).to(torch.uint8)
    return tensor, int(tensor.data_ptr()), index, "VRAM"


def _probe(index: int, src: str, dst: str) -> dict[str, Any]:
    from kvbridge_nixl import api

    nixl = api.load()
    name = f"kvbridge-route-{index}"
    out: dict[str, Any] = {"src": src, "dst": dst, "agent": name}
    sender = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    receiver = nixl.nixl_agent(f"{name}-dst", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    source, s_addr, s_dev, s_kind = _buffer(src)
    target, d_addr, d_dev, d_kind = _buffer(dst)
    if dst == "cpu":
        target[:] = 0
    else:
        target.zero_()
    sender.register_memory([(s_addr, PROBE_BYTES, s_dev, "")], s_kind)
    receiver.register_memory([(d_addr, PROBE_BYTES, d_dev, "")], d_kind)
    sender.add_remote_agent(receiver.get_agent_metadata())
    xfer = sender.initialize_xfer("WRITE", sender.get_xfer_descs([(s_addr, PROBE_BYTES, s_dev)], s_kind),
                                  receiver.get_xfer_descs([(d_addr, PROBE_BYTES, d_dev)], d_kind), f"{name}-dst", b"r")
    state = sender.transfer(xfer)
    deadline = time.monotonic() + 20
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        receiver.get_new_notifs()
        state = sender.check_xfer_state(xfer)
    if state != "DONE":
        out["error"] = f"NIXL state {state}"
    else:
        landed = bytes(target.cpu().numpy()) if dst != "cpu" else bytes(target)
        sent = bytes(source.cpu().numpy()) if src != "cpu" else bytes(source)
        if landed != sent:
            out["error"] = "the bytes that landed differ from the source"
    sender.release_xfer_handle(xfer)
    return out


def main(argv: list[str]) -> int:
    for index, (src, dst) in enumerate(json.loads(argv[0])):
        try:
            result = _probe(index, src, dst)
        except Exception as exc:  # noqa: BLE001 - reported per route
            result = {"src": src, "dst": dst, "agent": "", "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

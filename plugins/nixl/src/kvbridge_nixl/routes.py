"""Which UCX transports NIXL picks on this host, and how fast it writes (``kvbridge doctor``): host memory to host
memory between two local agents, and GPU to GPU for every ordered pair of local GPUs.

A child process (UCX reads its settings once, when it loads) starts a NIXL agent per route and another process
with the receiving agent (prefill and decode ranks are separate processes; inside one, UCX picks other
transports), registers PROBE_BYTES on each side, writes them once to warm up, then ``PROBE_WRITES`` more times
timed, and checks the bytes. UCX prints the protocol it selected for each kind of write (``UCX_PROTO_INFO``):
"remote memory write by ucp_put* from host memory to host ... zero-copy cma/memory", or "software emulation
tcp/lo" (copied through a socket). The verdict names that protocol when UCX printed one for the route's memory
types, and the throughput; a GPU pair below ``GPU_SLOW_GBPS`` (a copy through host memory or a socket, not NVLink
or PCIe peer to peer) or a host route through a socket is a warning::

    warning  nixl       host memory -> host memory: 1.9 GB/s; UCX writes it by software emulation over tcp/lo ...
    ok       nixl       cuda:0 -> cuda:1: 212.4 GB/s (64 MiB writes)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from kvbridge.plugin import Finding, Severity

PROBE_BYTES = 64 << 20
PROBE_WRITES = 5
PROBE_TIMEOUT_S = 120.0
_CHILD_S = 120.0              # what the receiving process may take for a step (a NIXL start on a loaded host)
_MAX_PROBE_MESSAGE = 1 << 20  # a probe server's messages: NIXL agent metadata and a few words
GPU_SLOW_GBPS = 20.0          # below: GPU memory is not going peer to peer (NVLink, PCIe P2P)
HOST_SLOW_GBPS = 2.0          # below: a socket, not shared memory or CMA
_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")
_HEADER = re.compile(r"^\|\s*(\S+) (intra-node|inter-node|self) cfg#\d+\s*\|$")
_WRITE = re.compile(r"^\|\s*remote memory write by ucp_put\* from (.+?) to (.+?)\s*\|$")
_ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$")


def put_protocols(log: str, agent: str) -> dict[tuple[str, str], list[tuple[str, str, str]]]:
    """The write protocols UCX printed for ``agent``'s endpoint to its peer (``UCX_PROTO_INFO=y``): (source
    memory, destination memory) -> rows of (size range, description, transports), e.g.
    ``{("host memory", "host"): [("0..inf", "zero-copy", "cma/memory")]}``. Tables of its loop-back endpoint
    (``self``) and variants such as ``ucp_put*(multi)`` are left out."""
    found: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    owner: str | None = None
    key: tuple[str, str] | None = None
    for raw in log.splitlines():
        line = _PREFIX.sub("", raw).strip()
        header = _HEADER.match(line)
        if header is not None:
            owner = header.group(1) if header.group(2) != "self" else None
            key = None
            continue
        write = _WRITE.match(line)
        if write is not None:
            key = (write.group(1), write.group(2)) if owner == agent else None
            if key is not None:
                found[key] = []
            continue
        row = _ROW.match(line)
        if key is not None and row is not None and row.group(1) != "Range":
            found[key].append((row.group(1), row.group(2), row.group(3)))
    return found


def _kind(memory: str) -> str:
    return "host" if memory == "cpu" or memory.startswith("host") else "cuda"


def judge(route: str, src: str, dst: str, gbps: float, protocols: dict[tuple[str, str], list[tuple[str, str, str]]],
          *, remote: bool = False) -> Finding:
    """A finding for one route from its measured throughput and the protocols UCX printed for it (``remote``: the
    destination is another host's probe server, where RDMA is what a transfer wants and TCP its slow fallback)."""
    wanted = (_kind(src), _kind(dst))
    rows = next((r for (s, d), r in protocols.items() if (_kind(s), _kind(d)) == wanted and r), [])
    how = ""
    if rows:
        size, description, transports = rows[-1]            # the largest writes
        how = f"; UCX writes it ({size} B) by {description} over {transports}"
    speed = f"{route}: {gbps:.1f} GB/s ({PROBE_BYTES >> 20} MiB writes){how}"
    socket = any("tcp" in t or "emulation" in d for _, d, t in rows)
    if remote:
        if socket or not rows:
            return Finding(severity=Severity.WARNING, check="nixl", text=(
                f"{speed}: no RDMA between the hosts (UCX copies through TCP sockets"
                f"{'' if rows else ', or printed no protocol'}); check the RDMA devices (ibv_devinfo), that NIXL's UCX "
                "sees them (UCX_NET_DEVICES, UCX_TLS) and, in containers, /dev/infiniband and the memlock limit"))
        return Finding(severity=Severity.OK, check="nixl", text=speed)
    if wanted == ("host", "host"):
        if socket:
            return Finding(severity=Severity.WARNING, check="nixl", text=(
                f"{speed}: copied through a socket, not shared memory; check UCX_TLS and that CMA is allowed "
                "(kernel.yama.ptrace_scope, the container's seccomp profile)"))
        if gbps < HOST_SLOW_GBPS:
            return Finding(severity=Severity.WARNING, check="nixl", text=(
                f"{speed}: below {HOST_SLOW_GBPS:g} GB/s (a busy host, or little memory bandwidth): measure again "
                "when the host is idle"))
        return Finding(severity=Severity.OK, check="nixl", text=speed)
    if gbps < GPU_SLOW_GBPS or socket:
        return Finding(severity=Severity.WARNING, check="nixl", text=(
            f"{speed}: GPU memory is not going peer to peer (cuda_ipc over NVLink or PCIe); check GPU peer access, "
            "that both processes see both GPUs (CUDA_VISIBLE_DEVICES) and UCX_TLS"))
    return Finding(severity=Severity.OK, check="nixl", text=speed)


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


def diagnose(peers: Sequence[str] = ()) -> Iterator[Finding]:
    """``BackendSpec.diagnose`` of the NIXL backend: one finding per route (see the module); ``peers``: probe
    servers on other hosts (``kvbridge doctor --serve-probe`` there), each probed from host memory (and from
    cuda:0 when this host has a GPU) into the same kind of memory there."""
    wanted = routes()
    for peer in peers:
        wanted += [(device, f"{device}@{peer}") for device in ("cpu", "cuda:0")[:1 + (_gpus() > 0)]]
    env = {**os.environ, "UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "y", "NIXL_LOG_LEVEL": "WARN"}
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
        dst, _, peer = result["dst"].partition("@")
        route = f"{_label(result['src'])} -> {_label(dst)}" + (f" at {peer}" if peer else "")
        if result.get("error"):
            yield Finding(severity=Severity.WARNING, check="nixl", text=f"{route}: a probe write failed: "
                                                                        f"{result['error']}")
            continue
        finding = judge(route, result["src"], dst, result["gbps"], put_protocols(log, result["agent"]),
                        remote=bool(peer))
        suffix = f" (UCX {version.group(1)})" if version and finding.severity is Severity.OK else ""
        yield Finding(severity=finding.severity, check="nixl", text=finding.text + suffix)


def _label(device: str) -> str:
    return "host memory" if device == "cpu" else device


# ------------------------------------------------------------------ the child process
def _buffer(device: str) -> tuple[Any, int, int, str]:
    """(keep-alive object, address, device id, NIXL memory type) of PROBE_BYTES on ``device``."""
    if device == "cpu":
        import numpy as np

        array = (np.arange(PROBE_BYTES, dtype=np.uint64) % 251).astype(np.uint8)
        return array, int(array.ctypes.data), 0, "DRAM"
    import torch

    index = int(device.split(":")[1])
    tensor = (torch.arange(PROBE_BYTES, dtype=torch.int64, device=device) % 251).to(torch.uint8)
    return tensor, int(tensor.data_ptr()), index, "VRAM"


def _receiver(name: str, dst: str, conn: Any) -> None:
    """The probe's other process (as a decode rank is): register PROBE_BYTES on ``dst``, hand over its metadata,
    and once told, say whether every byte landed."""
    from kvbridge_nixl import api

    nixl = api.load()
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    target, addr, dev, kind = _buffer(dst)
    if dst == "cpu":
        target[:] = 0
    else:
        target.zero_()
    agent.register_memory([(addr, PROBE_BYTES, dev, "")], kind)
    conn.send((agent.get_agent_metadata(), addr, dev, kind))
    conn.recv()                                        # the writes are done
    source, _, _, _ = _buffer(dst)
    landed = bytes(target.cpu().numpy()) if dst != "cpu" else bytes(target)
    sent = bytes(source.cpu().numpy()) if dst != "cpu" else bytes(source)
    conn.send(landed == sent)
    conn.recv()


class _Remote:
    """The probe's other side on another host: a probe server (:func:`serve`) asked over ZMQ, with the calls of
    the local child's pipe (``poll``, ``recv``, ``send``)."""

    def __init__(self, address: str, device: str) -> None:
        import zmq

        self._sock: Any = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_PROBE_MESSAGE)
        self._sock.connect(address)
        self.send({"op": "open", "device": device})

    def poll(self, timeout_s: float) -> bool:
        return bool(self._sock.poll(int(timeout_s * 1000)))

    def recv(self) -> Any:
        return msgspec.msgpack.decode(self._sock.recv())

    def send(self, message: Any) -> None:
        self._sock.send(msgspec.msgpack.encode(message))

    def close(self) -> None:
        self._sock.close(0)


def _probe(index: int, src: str, dst: str) -> dict[str, Any]:
    """Write PROBE_BYTES from ``src`` in this process to ``dst`` in another one (prefill and decode ranks are
    separate processes: UCX picks other transports inside one), once to warm up, then PROBE_WRITES times timed.
    ``dst`` = ``device@tcp://host:port``: that device of the probe server at that address (another host)."""
    import multiprocessing

    from kvbridge_nixl import api

    nixl = api.load()
    name = f"kvbridge-route-{index}"
    out: dict[str, Any] = {"src": src, "dst": dst, "agent": name}
    device, _, server = dst.partition("@")
    mine: Any
    child: Any = None
    if server:
        mine = _Remote(server, device)
    else:
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=_receiver, args=(f"{name}-dst", dst, theirs), daemon=True)
        child.start()
    try:
        if not mine.poll(_CHILD_S):
            out["error"] = (f"the probe server at {server} did not answer in {_CHILD_S:.0f} s" if server
                            else f"the receiving process did not start in {_CHILD_S:.0f} s")
            return out
        opened = mine.recv()
        if isinstance(opened, dict):
            out["error"] = f"the probe server refused: {opened.get('error')}"
            return out
        metadata, d_addr, d_dev, d_kind = opened
        sender = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        source, s_addr, s_dev, s_kind = _buffer(src)
        sender.register_memory([(s_addr, PROBE_BYTES, s_dev, "")], s_kind)
        peer = sender.add_remote_agent(metadata)
        xfer = sender.initialize_xfer("WRITE", sender.get_xfer_descs([(s_addr, PROBE_BYTES, s_dev)], s_kind),
                                      sender.get_xfer_descs([(d_addr, PROBE_BYTES, d_dev)], d_kind), peer, b"r")
        seconds = 0.0
        for attempt in range(1 + PROBE_WRITES):      # the first write warms up (connection, registration caches)
            started = time.perf_counter()
            state = sender.transfer(xfer)
            deadline = time.monotonic() + 20
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = sender.check_xfer_state(xfer)
            if attempt:
                seconds += time.perf_counter() - started
            if state != "DONE":
                out["error"] = f"NIXL state {state}"
                break
        sender.release_xfer_handle(xfer)
        mine.send("check")
        if not mine.poll(_CHILD_S):
            out["error"] = "the receiving process did not answer"
            return out                      # (a request socket may not ask again before it got an answer)
        if not mine.recv():
            out["error"] = "the bytes that landed differ from the source"
        elif "error" not in out:
            out["gbps"] = PROBE_WRITES * PROBE_BYTES / seconds / 1e9 if seconds else 0.0
        mine.send("bye")
    finally:
        if child is None:
            mine.close()
        else:
            child.join(10)
            if child.is_alive():
                child.kill()
    return out


# ------------------------------------------------------------------ the probe server (another host's end)
def serve(address: str, seconds: float = 300.0, say: Callable[[str], None] = print, *,
          step_timeout_s: float = 60.0) -> int:
    """Answer other hosts' route probes at ``address`` (``tcp://HOST:PORT``) for ``seconds``, one at a time: each
    gets a fresh process with a NIXL agent and PROBE_BYTES of its own on the device it asks for (host memory or a
    local GPU), nothing else of this host. A prober whose connection closes frees it at once, one that stops
    answering holds it ``step_timeout_s`` at most; one that asks while another probe runs is told so.
    ``BackendSpec.serve_probe`` of the NIXL backend. Returns how many probes it answered."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sock: Any = zmq.Context.instance().socket(zmq.ROUTER)   # no request/reply lockstep: a vanished prober costs nothing
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_PROBE_MESSAGE)
    sock.bind(address)
    # which connection closed: the monitor names its file descriptor, a received frame the one it came through
    closed: Any = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(closed, zmq.POLLIN)
    devices = ["cpu", *(f"cuda:{i}" for i in range(_gpus()))]
    say(f"serving NIXL route probes at {sock.getsockopt_string(zmq.LAST_ENDPOINT)} for {seconds:g} s "
        f"(devices: {', '.join(devices)})")
    deadline = time.monotonic() + seconds
    session: _Session | None = None
    served = 0
    try:
        while time.monotonic() < deadline:
            ready = dict(poller.poll(50))
            # closed connections first: a frame that came through a descriptor since reused is read after them
            while closed.poll(0):
                fd = recv_monitor_message(closed)["value"]
                if session is not None and fd == session.fd:
                    say(f"dropped a probe into {session.device}: the prober went away")
                    session.close(wait_s=0.0)
                    session = None
            if sock in ready:
                frames = sock.recv_multipart(copy=False)
                parts = [frame.bytes for frame in frames]
                if len(parts) != 3 or parts[1]:
                    continue
                ident, body = parts[0], parts[2]
                if session is not None and ident == session.ident:
                    if session.forward(body):
                        served += 1
                        say(f"answered probe {served} into {session.device}")
                        session.close()
                        session = None
                    continue
                try:
                    request = msgspec.msgpack.decode(body)
                    device = request.get("device") if isinstance(request, dict) and request.get("op") == "open" \
                        else None
                except (msgspec.DecodeError, AttributeError):
                    device = None
                if session is not None:
                    sock.send_multipart([ident, b"", msgspec.msgpack.encode({"error": "busy with another probe: "
                                                                                      "ask again in a minute"})])
                elif device not in devices:
                    sock.send_multipart([ident, b"", msgspec.msgpack.encode(
                        {"error": f"asked for {device!r}; this host offers {devices}"})])
                else:
                    session = _Session(ident, str(device), served, step_timeout_s, fd=frames[-1].get(zmq.SRCFD))
            if session is not None and not session.step(sock):
                say(f"dropped a probe into {session.device}: {session.why}")
                session.close(wait_s=0.0)
                session = None
    finally:
        if session is not None:
            session.close()
        sock.disable_monitor()
        closed.close(0)
        sock.close(0)
    return served


class _Session:
    """One probe on the server: the receiving child (its metadata, then whether the bytes landed) and the prober
    that asked for it (then asks "check" and "bye"), each wait bounded."""


    def __init__(self, ident: bytes, device: str, index: int, step_s: float, *, fd: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.ident, self.device, self.why, self._step_s = ident, device, "", step_s
        self.fd = fd                    # the prober's connection (its close ends the session)
        self._pipe, theirs = ctx.Pipe()
        self._child = ctx.Process(target=_receiver, args=(f"kvbridge-route-peer-{index}", device, theirs),
                                  daemon=True)
        self._child.start()
        self._prober_turn = False
        self._until = time.monotonic() + _CHILD_S

    def step(self, sock: Any) -> bool:
        """Pass on what the child said; False when the side whose turn it is is late (the session is over)."""
        if not self._prober_turn and self._pipe.poll(0):
            sock.send_multipart([self.ident, b"", msgspec.msgpack.encode(self._pipe.recv())])
            self._prober_turn, self._until = True, time.monotonic() + self._step_s
        if time.monotonic() > self._until:
            self.why = f"the {'prober' if self._prober_turn else 'receiving process'} did not answer in time"
            return False
        return True

    def forward(self, body: bytes) -> bool:
        """The prober spoke: "check" or "bye" go to the child (anything else, or out of turn, is dropped); True
        once it said "bye" (the probe is over)."""
        try:
            message = msgspec.msgpack.decode(body)
        except msgspec.DecodeError:
            return False
        if not self._prober_turn or message not in ("check", "bye"):
            return False
        self._pipe.send(message)
        self._prober_turn, self._until = False, time.monotonic() + _CHILD_S     # the child's work: a start, a check
        return message == "bye"

    def close(self, *, wait_s: float = 10.0) -> None:
        self._child.join(wait_s)
        if self._child.is_alive():
            self._child.kill()
            self._child.join(10)


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

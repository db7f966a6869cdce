"""Network namespaces for the multi-host tests (``test_netns.py``): hosts joined by veth pairs through a bridge,
or by a userspace wire with delay and loss; and rank processes started inside them with ``ip netns exec``.

Parent side:

* :class:`Lan`: a switch namespace with a bridge, one namespace per host, a veth pair from each host to the
  switch, addresses from 198.18.0.0/15 (the benchmarking range). ``down(host)``/``up(host)`` take a host's
  link down and up (``ip link set``); ``shape(host, rate)`` caps what the host sends (``tc tbf``).
* :class:`Wire`: the same hosts, each with a TUN interface served by one userspace process (``python
  tests/_netnsrig.py wire ...``) that forwards IPv4 packets between them after ``delay_s``, dropping a fraction
  ``loss`` (what ``tc netem`` would do; this host's kernel has no ``sch_netem``). It forwards only between its
  own interfaces: a packet for any other address is dropped, so nothing leaves the namespaces.
* :class:`Child`: one process in a host namespace (``ip netns exec``) running this file; JSON commands on its
  stdin, ``NETNSRIG {json}`` events on its stdout, stderr in a temporary file; every wait is bounded.

Everything is torn down by ``close()`` (processes killed, namespaces deleted, which deletes their links), and
namespaces left by a run that was killed are deleted by the next one (their names carry the creator's pid).

Child side (``python tests/_netnsrig.py``, first stdin line = the job):

* ``bootstrap``: a :class:`kvbridge.zmq_link.BootstrapServer` at ``bind``;
* ``prefill``: one prefill rank (``tp``, ``rank``) of instance ``instance`` over ``backend``, its link bound to
  ``host`` in ``port_range`` and published through ``discovery`` (a URL); command ``room`` fills the request's
  pages with the reference pattern, sends them in ``chunks`` and reports ``room`` (status, when it failed, when
  it was safe to reuse);
* ``decode``: one decode rank; ``connect``; ``room`` (background everywhere, receive, check every byte of the
  rank against the reference reshard: ``result``, then ``safe`` once ``safe_to_reuse``); ``scribble`` writes a
  marker into pages (what an engine does when it reuses them) and ``marker`` checks it is still there;
  ``lookup`` asks discovery for an instance's ranks.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
_TAG = "NETNSRIG "
PREFIX = "kvbt"                 # namespace names: kvbt-<pid>-<n>-<host>
SUBNET = "198.18"               # 198.18.0.0/15: addresses for benchmarking, never routed outside
MARKER = 0xA5
BACKGROUND = 200


# ============================================================================ parent side: capability
def netns_unusable() -> str:
    """Why network namespaces cannot be made here ('' when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        caps = 0
    if not caps & (1 << 12):
        return "needs CAP_NET_ADMIN (run as root) to create network namespaces and veth pairs"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # a bound, not a budget: a Python start inside a namespace took over 30 s once on a loaded 2-core host
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=90)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def reap_stale_namespaces() -> list[str]:
    """Delete namespaces of this rig whose creating process is gone (a run that was killed)."""
    gone = []
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


_COUNTER = iter(range(1, 1 << 30))


class _Hosts:
    """Namespaces named after their hosts, deleted by ``close()`` (which also deletes their links)."""

    def __init__(self, hosts: Sequence[str], third: int) -> None:
        reap_stale_namespaces()
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self.ns = {h: f"{self.tag}-{h}" for h in hosts}
        self.ip = {h: f"{SUBNET}.{third}.{i + 1}" for i, h in enumerate(hosts)}
        self._namespaces: list[str] = []
        self.children: list[Child] = []

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def exec(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", self.ns[host], *argv, check=check)

    def child(self, host: str, label: str, job: dict[str, Any]) -> Child:
        child = Child(self.ns[host], label, job)
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            child.kill()
        self.children.clear()
        for name in reversed(self._namespaces):
            _run("ip", "netns", "del", name, check=False)
        self._namespaces.clear()

    def __enter__(self) -> _Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lan(_Hosts):
    """Hosts on one bridged segment: ``<tag>-sw`` holds the bridge; host ``h`` has ``eth0`` at ``ip[h]/24``."""

    def __init__(self, hosts: Sequence[str], third: int = 0) -> None:
        super().__init__(hosts, third)
        try:
            self.switch = f"{self.tag}-sw"
            self._add_ns(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(hosts):
                ns = self.ns[host]
                self._add_ns(ns)
                port = f"p{i}"
                _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def link(self, a: str, b: str, third: int) -> tuple[str, str]:
        """A second network: a veth pair straight from host ``a`` to host ``b`` (``eth1`` on both), addresses
        ``198.18.<third>.1`` and ``.2``/24; returns them."""
        ips = (f"{SUBNET}.{third}.1", f"{SUBNET}.{third}.2")
        _run("ip", "-n", self.ns[a], "link", "add", "eth1", "type", "veth", "peer", "name", "eth1", "netns",
             self.ns[b])
        for host, ip in zip((a, b), ips):
            _run("ip", "-n", self.ns[host], "addr", "add", f"{ip}/24", "dev", "eth1")
            _run("ip", "-n", self.ns[host], "link", "set", "eth1", "up")
        return ips

    def down(self, host: str) -> None:
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "down")

    def up(self, host: str) -> None:
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "up")
        # the address's routes come back with the link; wait until the kernel has them
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            routes = _run("ip", "-n", self.ns[host], "route", "show", "dev", "eth0", check=False).stdout
            if "198.18." in routes:
                return
            time.sleep(0.05)
        raise RuntimeError(f"no route on {host}'s eth0 10 s after it came up")

    def shape(self, host: str, rate: str | None) -> None:
        """Cap what ``host`` sends at ``rate`` (``"16mbit"``; packets wait in a deep queue rather than drop),
        or remove the cap (None)."""
        ns = self.ns[host]
        if rate is None:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        else:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                 "burst", "32kb", "latency", "2s")


class Wire(_Hosts):
    """Hosts joined by a userspace wire: each has a TUN interface ``wire0`` at ``ip[h]/24``, and one forwarding
    process delays every packet by ``delay_s`` and drops a ``loss`` fraction of them."""

    def __init__(self, hosts: Sequence[str], *, delay_s: float, loss: float, third: int = 1, mtu: int = 1500,
                 lifetime_s: float = 600.0) -> None:
        super().__init__(hosts, third)
        self.proc: subprocess.Popen[str] | None = None
        self.stats_file = Path(tempfile.gettempdir()) / f"{self.tag}-wire.json"
        try:
            for host in hosts:
                self._add_ns(self.ns[host])
            devices = {f"{self.tag.replace('-', '')[-9:]}{i}": host for i, host in enumerate(hosts)}
            spec = ",".join(f"{dev}={self.ip[h]}" for dev, h in devices.items())
            self.proc = subprocess.Popen([sys.executable, str(HERE), "wire", spec, str(delay_s), str(loss),
                                          str(lifetime_s), str(self.stats_file)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert self.proc.stdout is not None
            ready = self.proc.stdout.readline().strip()
            if ready != "ready":
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"the wire did not start: {ready!r} {err}")
            for dev, host in devices.items():
                ns = self.ns[host]
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "link", "set", dev, "name", "wire0")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "wire0")
                _run("ip", "-n", ns, "link", "set", "wire0", "mtu", str(mtu), "up")
        except BaseException:
            self.close()
            raise

    def stats(self) -> dict[str, int]:
        """Packets forwarded and dropped so far (from the counters file the wire rewrites once a second)."""
        try:
            return json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        super().close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self.proc = None
        self.stats_file.unlink(missing_ok=True)


# ============================================================================ parent side: processes
class Child:
    """One rank (or bootstrap) process in a namespace; events are read by a thread; every wait is bounded."""

    def __init__(self, namespace: str, label: str, job: dict[str, Any]) -> None:
        self.label = label
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1",
                   GLOG_minloglevel="1", NIXL_LOG_LEVEL="WARN")
        self.proc = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, str(HERE)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.pid = self.proc.pid
        self._cond = threading.Condition()
        self._events: list[dict[str, Any]] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"netnsrig-{label}", daemon=True)
        self._reader.start()
        self.send(**job)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                text = raw.decode(errors="replace").rstrip("\n")
                if text.startswith(_TAG):
                    with self._cond:
                        self._events.append(json.loads(text[len(_TAG):]))
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        try:
            self.log.seek(0)
            return self.log.read().decode(errors="replace")[-4000:]
        except (OSError, ValueError):
            return "<closed>"

    def wait(self, event: str, timeout_s: float, **match: Any) -> dict[str, Any]:
        """The first unconsumed ``event`` whose fields equal ``match`` (consumed)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for k, e in enumerate(self._events):
                    if e["event"] == "error":
                        raise AssertionError(f"{self.label} failed: {e['text']}")
                    if e["event"] == event and all(e.get(key) == value for key, value in match.items()):
                        return self._events.pop(k)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    why = f"exited ({self.proc.poll()})" if self._closed else f"sent nothing in {timeout_s:.1f} s"
                    raise AssertionError(f"no {event!r} {match or ''} from {self.label}: it {why}\n--- stderr:\n"
                                         f"{self.stderr()}")
                self._cond.wait(min(left, 0.1))

    def ask(self, event: str, timeout_s: float, **command: Any) -> dict[str, Any]:
        self.send(cmd=event, **command)
        return self.wait(event, timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (``ip netns exec`` execs it: same pid), close pipes and log."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self._reader.join(timeout=5)
        self.log.close()

    def close(self, timeout_s: float = 15.0) -> int:
        """Ask for a clean exit (stdin closed) and wait; SIGKILL after ``timeout_s``."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9


# ============================================================================ child side
def _say(event: str, **fields: Any) -> None:
    sys.stdout.write(_TAG + json.dumps(dict(event=event, **fields)) + "\n")
    sys.stdout.flush()


def _wait(predicate: Any, timeout_s: float, step_s: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


def _pool(job: dict[str, Any], role: str) -> Any:
    from kvbridge.testkit import reference as ref
    from kvbridge.testkit.kvmodel import KVKind, KVPool

    kinds = [KVKind(name="gqa", layout=ref.TOKEN_MAJOR, total_heads=job.get("heads", 2),
                    head_dim=job.get("head_dim", 8), layers=job.get("layers", 2))]
    return KVPool(job["tp"], job["rank"], kinds=kinds, num_pages=job["num_pages"], role=role)


def _agent(job: dict[str, Any], pool: Any, role: Any) -> Any:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.zmq_link import ZmqLink

    secret = bytes.fromhex(job["secret"]) if job.get("secret") else None
    config = AgentConfig(heartbeat_interval_s=job.get("heartbeat_s", 0.1), peer_timeout_s=job["peer_timeout_s"],
                         bootstrap_timeout_s=job["bound_s"], waiting_timeout_s=job["bound_s"], secret=secret,
                         staging_bytes=job.get("staging_bytes", 8 << 20),
                         backend_options=dict(job.get("options", {})))
    link = ZmqLink(bootstrap=job["discovery"], host=job.get("host", "0.0.0.0"), port_range=job.get("port_range"),
                   secret=secret, lease_s=job.get("lease_s", 10.0), allow_insecure=True)    # namespaces of this test
    try:
        return TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=role, link=link, backend=job["backend"],
                             instance=job.get("instance") if role.value == "prefill" else None,
                             name=f"{role.value}-{job['rank']}-{os.getpid()}", config=config)
    except BaseException:
        link.close()
        raise


def _prefill(job: dict[str, Any]) -> None:
    import numpy as np

    from kvbridge.protocol.wire import KVPoll, Role

    pool = _pool(job, "prefill")
    agent = _agent(job, pool, Role.PREFILL)
    agent.start()
    _say("ready", address=agent.link.address)
    busy = threading.Lock()

    def serve(cmd: dict[str, Any]) -> None:
        with busy:
            room = cmd["room"]
            src, positions = np.array(cmd["src"], np.int64), np.array(cmd["positions"], np.int64)
            pool.fill(cmd["seed"], BACKGROUND, src, positions)
            sender = agent.sender(room)
            t_failed = None
            reason = ""
            if not _wait(lambda: sender.poll() >= KVPoll.WaitingForInput or sender.poll() is KVPoll.Failed,
                         job["bound_s"]):
                reason = f"no request from decode: {sender.poll().name}"
            elif sender.poll() is not KVPoll.Failed:
                chunks = np.array_split(src, max(1, min(cmd.get("chunks", 2), len(src))))
                for k, chunk in enumerate(chunks):
                    if sender.poll() is not KVPoll.Failed:
                        sender.send(chunk, last=k == len(chunks) - 1)
                        _say("posted", room=room, chunk=k)
                _wait(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), job["bound_s"])
            status = sender.poll()
            if status is KVPoll.Failed:
                t_failed = time.time()
            reason = reason or sender.failure_reason
            _say("room-end", room=room, status=status.name, reason=reason, t=time.time())
            safe = _wait(lambda: sender.safe_to_reuse, cmd.get("safe_bound_s", job["bound_s"]), 0.005)
            t_safe = time.time() if safe else None
            if safe:
                sender.clear()
            _say("room", room=room, status=status.name, reason=reason, t_failed=t_failed, safe=safe, t_safe=t_safe)

    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "room":
                threading.Thread(target=serve, args=(cmd,), daemon=True).start()
            elif cmd.get("cmd") == "exit":
                break
    finally:
        agent.close()
        pool.close()


def _decode(job: dict[str, Any]) -> None:
    import numpy as np

    from kvbridge.protocol.wire import KVPoll, Role

    pool = _pool(job, "decode")
    agent = _agent(job, pool, Role.DECODE)
    agent.start()
    _say("ready", address=agent.link.address)
    receivers: dict[int, Any] = {}

    def receive(cmd: dict[str, Any]) -> None:
        room, seed = cmd["room"], cmd["seed"]
        dst, positions = np.array(cmd["dst"], np.int64), np.array(cmd["positions"], np.int64)
        receiver = receivers[room]
        _wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), job["bound_s"])
        status = receiver.poll()
        t_end = time.time()
        problems: list[str] = []
        if status is KVPoll.Success:
            problems = pool.check(seed, BACKGROUND, dst, positions)
            if receiver.nbytes != pool.expected_nbytes(len(dst)):
                problems.append(f"counted {receiver.nbytes} bytes, the request is {pool.expected_nbytes(len(dst))}")
        _say("result", room=room, status=status.name, reason=receiver.failure_reason, problems=problems, t=t_end)
        safe = _wait(lambda: receiver.safe_to_reuse, cmd.get("safe_bound_s", job["bound_s"]), 0.005)
        _say("safe", room=room, safe=safe, t=time.time())
        if safe:
            receiver.clear()

    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            what = cmd.get("cmd")
            if what == "connect":
                started = time.monotonic()
                agent.connect(cmd["instance"], timeout_s=job["bound_s"])
                _say("connect", took=time.monotonic() - started)
            elif what == "room":
                pool.fill(0, BACKGROUND)                     # everything background before the request
                receiver = receivers[cmd["room"]] = agent.receiver(cmd["room"], cmd["instance"])
                receiver.send_metadata({k.name: np.array(cmd["dst"], np.int64) for k in pool.kinds})
                threading.Thread(target=receive, args=(cmd,), daemon=True).start()
            elif what == "scribble":
                for bufs in pool.buffers.values():
                    for buf in bufs:
                        data = buf.read().reshape(pool.num_pages, -1)
                        data[np.array(cmd["pages"], np.int64)] = MARKER
                        buf.write(data.reshape(-1))
                _say("scribble")
            elif what == "lookup":
                info = agent.link.lookup(cmd["instance"])
                _say("lookup", addresses=None if info is None else {str(k): v for k, v in info.addresses.items()})
            elif what == "marker":
                changed = 0
                for bufs in pool.buffers.values():
                    for buf in bufs:
                        data = buf.read().reshape(pool.num_pages, -1)[np.array(cmd["pages"], np.int64)]
                        changed += int((data != MARKER).sum())
                _say("marker", changed=changed)
            elif what == "exit":
                break
    finally:
        agent.close()
        pool.close()


def _bootstrap(job: dict[str, Any]) -> None:
    from kvbridge.zmq_link import BootstrapServer

    secret = bytes.fromhex(job["secret"]) if job.get("secret") else None
    server = BootstrapServer(job["bind"], secret=secret, allow_insecure=True).start()    # namespaces of this test
    _say("ready", address=server.address)
    try:
        for _ in sys.stdin:
            pass
    finally:
        server.close()


# ============================================================================ the wire (its own process)
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


def _wire(spec: str, delay_s: float, loss: float, lifetime_s: float, stats_file: str) -> None:
    """Forward IPv4 packets between TUN devices ``name=ip,...`` after ``delay_s``, dropping ``loss`` of them;
    exits after ``lifetime_s`` at the latest (or when killed). Counters go to a JSON file once a second."""
    fds: dict[int, str] = {}
    route: dict[bytes, int] = {}
    for item in spec.split(","):
        name, ip = item.split("=")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
        os.set_blocking(fd, False)
        fds[fd] = name
        route[bytes(int(x) for x in ip.split("."))] = fd
    counters = {"forwarded": 0, "dropped_loss": 0, "dropped_foreign": 0}
    stats_path = Path(stats_file)
    print("ready", flush=True)
    rng = random.Random(0x5EED)
    queue: list[tuple[float, int, int, bytes]] = []
    seq = 0
    end = time.monotonic() + lifetime_s
    next_stats = time.monotonic() + 1.0
    while time.monotonic() < end:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.5
        readable, _, _ = select.select(list(fds), [], [], min(timeout, 0.5))
        now = time.monotonic()
        for fd in readable:
            for _ in range(256):
                try:
                    packet = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue                                     # IPv4 only (no IPv6 is configured)
                out = route.get(packet[16:20])
                if out is None:
                    counters["dropped_foreign"] += 1             # never forwarded anywhere else
                    continue
                if rng.random() < loss:
                    counters["dropped_loss"] += 1
                    continue
                seq += 1
                heapq.heappush(queue, (now + delay_s, seq, out, packet))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(queue)
            try:
                os.write(out, packet)
                counters["forwarded"] += 1
            except OSError:
                pass                                             # the device is down: the packet is lost
        if now >= next_stats:
            next_stats = now + 1.0
            tmp = stats_path.with_name(stats_path.name + ".tmp")     # a reader never sees a half-written file
            tmp.write_text(json.dumps(counters))
            os.replace(tmp, stats_path)


# ============================================================================ entry
def _main(argv: Sequence[str]) -> int:
    if argv[:1] == ["wire"]:
        _wire(argv[1], float(argv[2]), float(argv[3]), float(argv[4]), argv[5])
        return 0
    line = sys.stdin.readline()
    if not line:
        return 0
    job = json.loads(line)
    try:
        {"prefill": _prefill, "decode": _decode, "bootstrap": _bootstrap}[job["role"]](job)
    except Exception as exc:  # noqa: BLE001 - report, then fail
        import traceback

        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        sys.stderr.write(text)
        _say("error", text=text)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

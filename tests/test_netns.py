"""Multi-host for real (issue 15, item 1): prefill, decode and the discovery service on different hosts, each
host a network namespace of its own, joined by veth pairs through a bridge (``_netnsrig.Lan``) or by a wire
with delay and loss (``_netnsrig.Wire``), addresses from 198.18.0.0/15. Every rank is a process started with
``ip netns exec``; its link binds every interface and advertises the address of the interface that routes to
the discovery service, inside a port range.

* NIXL (UCX pinned to TCP) and Mooncake (TCP) move a prefill TP 2 -> decode TP 1 request byte-exact across
  the hosts, with authenticated control frames and bootstrap;
* 10 ms one-way delay and 0.1 % packet loss on every packet: still byte-exact (the kernel here has no
  ``sch_netem``, so a userspace wire delays and drops; the test checks that it did drop packets);
* the prefill host's link taken down mid-transfer (``ip link set down``, its sending rate capped with ``tc tbf``
  so the transfer is still running): every room fails within the peer timeout + 2 s, the decode's
  ``safe_to_reuse`` waits for the prefill's acknowledgement (it comes only once the link is back and the
  writes in flight have drained), nothing changes in the room's pages after that, and a new request succeeds
  without restarting anything;
* a partition longer than twice the peer timeout: the decode's failed room should become safe to reuse once
  it ends; today it does not (an agent bug this test found, kept as a strict expected failure with the cause);
* discovery on etcd (``kvbridge-etcd``): a real etcd on its own host, the ranks publishing and looking up
  through it, a byte-exact transfer, and killed prefill ranks vanishing from it when their lease runs out.

Skipped, with the reason, where namespaces cannot be made (no CAP_NET_ADMIN). Namespaces, links and
processes are removed after each test, also when it fails; traffic goes only to addresses inside them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _netnsrig import Child, Lan, Wire, _Hosts, netns_unusable

from kvbridge.registry import Registry

try:
    from kvbridge_etcd.testing import EtcdServer, etcd_unavailable
except ImportError:                      # kvbridge-etcd not installed
    EtcdServer = None  # type: ignore[assignment,misc]

    def etcd_unavailable() -> str:
        return "kvbridge-etcd is not installed"

_WHY_NOT = netns_unusable()
pytestmark = [pytest.mark.skipif(bool(_WHY_NOT), reason=f"network namespaces: {_WHY_NOT}"),
              pytest.mark.timeout(600)]      # NIXL's start in a namespace under load alone took 90 s in CI

_AVAILABLE = Registry.build().backend_names()
BACKENDS = ["nixl", "mooncake"]
SECRET = os.urandom(32).hex()
PORTS = (17610, 17629)
PEER_TIMEOUT_S = 2.5     # 1.5 s failed a healthy first room once on a starved 2-core CI host (no message for 1.8 s)
# The link-down test's: after an outage of about this long, TCP's next retransmission (backed off to 0.2, 0.6,
# 1.4, 3.0 s after the first loss) reaches the prefill well before it releases the silent decode peer (2 x this).
LINK_DOWN_PEER_TIMEOUT_S = 2.5
BOUND_S = 30.0
INSTANCE = "netns-prefill"
TIMINGS: dict[str, float] = {}


def _need(backend: str) -> None:
    if backend not in _AVAILABLE:
        pytest.skip(f"{backend}: the engine cannot be imported here")


def _options(backend: str, net: _Hosts, host: str) -> dict[str, str]:
    """Engine options: UCX pinned to TCP (no shared-memory or CMA shortcut between the hosts); Mooncake's
    engine told the address peers reach it at."""
    return {"ucx_tls": "tcp"} if backend == "nixl" else {"host": net.ip[host]}


@dataclass
class Cluster:
    """A bootstrap server on host b, prefill ranks (TP ``pt``) on host p, decode ranks (TP ``dt``) on host d."""

    net: _Hosts
    backend: str
    pt: int = 2
    dt: int = 1
    num_pages: int = 16
    head_dim: int = 8
    discovery: str = ""
    prefill: list[Child] = field(default_factory=list)
    decode: list[Child] = field(default_factory=list)

    def start(self, **extra: Any) -> Cluster:
        if not self.discovery:
            boot = self.net.child("b", "bootstrap", {"role": "bootstrap", "bind": f"tcp://{self.net.ip['b']}:17600",
                                                     "secret": SECRET})
            self.discovery = boot.wait("ready", 60)["address"]
        common = dict(backend=self.backend, discovery=self.discovery, peer_timeout_s=PEER_TIMEOUT_S, bound_s=BOUND_S,
                      num_pages=self.num_pages, heads=2, head_dim=self.head_dim, secret=SECRET, host="0.0.0.0",
                      port_range=f"{PORTS[0]}-{PORTS[1]}")
        common.update(extra)
        self.prefill = [self.net.child("p", f"prefill-{r}", dict(common, role="prefill", tp=self.pt, rank=r,
                                                                 instance=INSTANCE,
                                                                 options=_options(self.backend, self.net, "p")))
                        for r in range(self.pt)]
        self.decode = [self.net.child("d", f"decode-{r}", dict(common, role="decode", tp=self.dt, rank=r,
                                                               options=_options(self.backend, self.net, "d")))
                       for r in range(self.dt)]
        for child, host in [(c, "p") for c in self.prefill] + [(c, "d") for c in self.decode]:
            address = child.wait("ready", 240)["address"]      # importing and starting NIXL under load: minutes
            # bound to every interface, advertised: the address towards the bootstrap host, inside the range
            prefix = f"tcp://{self.net.ip[host]}:"
            assert address.startswith(prefix), f"{child.label} advertises {address}, expected {prefix}<port>"
            assert PORTS[0] <= int(address.rsplit(":", 1)[1]) <= PORTS[1], address
        for child in self.decode:
            child.ask("connect", BOUND_S + 5, instance=INSTANCE)
        return self

    def room(self, room: int, pages: int, *, chunks: int = 2, safe_bound_s: float = BOUND_S) -> list[int]:
        """Start request ``room`` of ``pages`` pages on every rank (decode first); returns the decode's pages."""
        rng = np.random.default_rng(room)
        src = rng.permutation(self.num_pages)[:pages].tolist()
        dst = rng.permutation(self.num_pages)[:pages].tolist()
        positions = list(range(pages))
        for child in self.decode:
            child.send(cmd="room", room=room, seed=room + 100, dst=dst, positions=positions, instance=INSTANCE,
                       safe_bound_s=safe_bound_s)
        for child in self.prefill:
            child.send(cmd="room", room=room, seed=room + 100, src=src, positions=positions, chunks=chunks,
                       safe_bound_s=safe_bound_s)
        return dst

    def exact(self, room: int, timeout_s: float = BOUND_S + 10) -> None:
        """Request ``room`` succeeded on every rank, every decode byte equal to the reference reshard."""
        for child in self.decode:
            result = child.wait("result", timeout_s, room=room)
            assert result["status"] == "Success", f"{child.label} room {room}: {result['reason']}"
            assert not result["problems"], "\n".join(result["problems"])
            assert child.wait("safe", timeout_s, room=room)["safe"]
        for child in self.prefill:
            sent = child.wait("room", timeout_s, room=room)
            assert sent["status"] == "Success" and sent["safe"], f"{child.label} room {room}: {sent}"


@pytest.fixture
def lan() -> Iterator[Lan]:
    net = Lan(["b", "p", "d"])
    try:
        yield net
    finally:
        net.close()
        _assert_gone(net)


def _assert_gone(net: _Hosts) -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert net.tag not in listing, f"namespaces left behind: {listing}"
    for child in net.children:
        assert child.proc.poll() is not None, f"{child.label} still runs"


@pytest.fixture(autouse=True)
def _timed(request: pytest.FixtureRequest) -> Iterator[None]:
    started = time.monotonic()
    yield
    TIMINGS[request.node.name] = time.monotonic() - started


def teardown_module() -> None:
    if TIMINGS:
        sys.stdout.write("\nnetns timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items())
                         + f"; total {sum(TIMINGS.values()):.1f} s\n")


# ------------------------------------------------------------------------------------------ addresses
_DETECT = """
import sys
from kvbridge.addresses import advertised_host
print(advertised_host(bind="0.0.0.0", advertise=None, toward=(sys.argv[1], 17600)))
"""


def test_the_advertised_address_is_the_interface_towards_discovery(lan: Lan) -> None:
    """A host with two networks advertises, to each discovery service, its address on the network that
    reaches it (the kernel's routing decision, no packet sent)."""
    mine, theirs = lan.link("p", "d", third=9)
    for toward, want in ((lan.ip["b"], lan.ip["p"]), (theirs, mine)):
        out = lan.exec("p", sys.executable, "-c", _DETECT, toward).stdout.strip()
        assert out == want, f"towards {toward}: advertised {out}, expected {want}"
    gone = lan.exec("p", sys.executable, "-c", _DETECT, "198.19.200.1", check=False)
    assert gone.returncode != 0 and "give advertise=" in gone.stderr, gone.stderr[-500:]


# ------------------------------------------------------------------------------------------ transfers
@pytest.mark.parametrize("backend", BACKENDS)
def test_hetero_tp_across_hosts_is_byte_exact(lan: Lan, backend: str) -> None:
    _need(backend)
    cluster = Cluster(lan, backend).start()
    for room, pages in ((1, 5), (2, 16), (3, 1)):
        cluster.room(room, pages, chunks=3)
        cluster.exact(room)


@pytest.mark.parametrize("backend", BACKENDS)
def test_delay_and_loss_stay_byte_exact(backend: str) -> None:
    """Every packet between the hosts waits 10 ms and 0.1 % are dropped (MTU 1500); ~8 MB cross the wire."""
    _need(backend)
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("no /dev/net/tun: the delay-and-loss wire needs TUN devices (CONFIG_TUN)")
    net = Wire(["b", "p", "d"], delay_s=0.010, loss=0.001, mtu=1500)
    try:
        # no peer dies here: a peer timeout that a loaded CI host's scheduling cannot reach (1.5 s was reached
        # under load and failed a live peer's room)
        cluster = Cluster(net, backend, head_dim=1024).start(peer_timeout_s=10.0)   # 64 KiB a page: 16 pages = 1 MiB
        started = time.monotonic()
        for room in range(1, 9):
            cluster.room(room, 16 if room % 2 else 11, chunks=3)
            cluster.exact(room, timeout_s=60)
        took = time.monotonic() - started
        # the wire writes its counters once a second (later on a loaded host): wait for a write after the rooms
        deadline = time.monotonic() + 15.0
        time.sleep(1.2)
        while not (stats := net.stats()).get("dropped_loss") and time.monotonic() < deadline:
            time.sleep(0.5)
        sys.stdout.write(f"\n[{backend}] delay 10 ms + 0.1 % loss: 8 requests in {took:.1f} s, wire {stats}\n")
        assert stats.get("dropped_loss", 0) >= 1, f"the wire dropped nothing, so loss was not exercised: {stats}"
        assert stats.get("dropped_foreign", 0) == 0, stats
    finally:
        net.close()
        _assert_gone(net)


@pytest.mark.parametrize("backend", BACKENDS)
def test_link_down_mid_transfer_fails_within_the_bound_and_recovers(lan: Lan, backend: str) -> None:
    _need(backend)
    # 256 KiB a decode page. The outage lasts until every room failed (the peer timeout) and no longer: see
    # test_a_partition_longer_than_twice_the_peer_timeout_still_makes_the_decode_room_safe for a longer one.
    cluster = Cluster(lan, backend, head_dim=4096).start(peer_timeout_s=LINK_DOWN_PEER_TIMEOUT_S)
    pids = [c.pid for c in cluster.prefill + cluster.decode]
    cluster.room(1, 4)
    cluster.exact(1)                                          # warm: the peers know each other

    lan.shape("p", "8mbit")                                   # ~1 MB/s from the prefill host: 3 MiB take ~3 s
    dst = cluster.room(2, 12, chunks=4, safe_bound_s=60)
    for child in cluster.prefill:                             # each prefill rank has posted writes
        child.wait("posted", BOUND_S, room=2, chunk=0)
    time.sleep(0.3)
    lan.down("p")
    t_down = time.time()
    decode = cluster.decode[0]
    result = decode.wait("result", BOUND_S, room=2)
    assert result["status"] == "Failed", f"the room was over before the link went down: {result}"
    bound = LINK_DOWN_PEER_TIMEOUT_S + 2.0
    assert result["t"] - t_down < bound, f"decode room failed {result['t'] - t_down:.2f} s after the link went down"
    for child in cluster.prefill:
        end = child.wait("room-end", BOUND_S, room=2)
        assert end["status"] == "Failed", f"{child.label}: {end}"
        assert end["t"] - t_down < bound, f"{child.label} failed {end['t'] - t_down:.2f} s after the link went down"
    lan.up("p")
    t_up = time.time()

    # the decode may reuse the pages only once the prefill said its writes are over, which needs the link
    safe = decode.wait("safe", 70, room=2)
    if not safe["safe"]:
        prefill = [c.wait("room", 10, room=2) for c in cluster.prefill]
        raise AssertionError(f"decode room never became safe to reuse after the link came back; the prefill "
                             f"ranks' rooms: {prefill}\n--- decode stderr:\n{decode.stderr()}\n--- prefill 0:\n"
                             f"{cluster.prefill[0].stderr()}\n--- prefill 1:\n{cluster.prefill[1].stderr()}")
    assert safe["t"] >= t_up, "safe_to_reuse came while the prefill was unreachable: from silence alone"
    decode.ask("scribble", 10, pages=dst)                     # the engine reuses the pages
    for child in cluster.prefill:
        done = child.wait("room", 70, room=2)
        assert done["safe"], f"{child.label}: source pages never safe to reuse: {done}"
    time.sleep(3.0)                                           # anything still on its way would land meanwhile
    marker = decode.ask("marker", 10, pages=dst)
    assert marker["changed"] == 0, f"{marker['changed']} bytes of the room's pages changed after safe_to_reuse"

    lan.shape("p", None)
    cluster.room(3, 12, chunks=4)                             # same processes, no restart: new requests succeed
    cluster.exact(3)
    assert [c.proc.poll() for c in cluster.prefill + cluster.decode] == [None] * len(pids)
    assert [c.pid for c in cluster.prefill + cluster.decode] == pids
    sys.stdout.write(f"\n[{backend}] link down: decode room failed after {result['t'] - t_down:.2f} s, safe to "
                     f"reuse {safe['t'] - t_up:.2f} s after the link came back\n")


def test_a_partition_longer_than_twice_the_peer_timeout_still_makes_the_decode_room_safe(lan: Lan) -> None:
    """The decode asks for a room, the prefill host's link goes down for 3 x the peer timeout before anything
    was sent, then comes back: the failed decode room must become safe to reuse (the prefill never wrote). The
    prefill has forgotten the silent decode by then; it still acknowledges the decode's Abort (it holds nothing
    for it) instead of dropping it as "not a peer" (found by this test)."""
    backend = next((b for b in ("mooncake", "nixl") if b in _AVAILABLE), None)
    if backend is None:
        pytest.skip("neither nixl nor mooncake can be imported here")
    cluster = Cluster(lan, backend).start()
    cluster.room(1, 4)
    cluster.exact(1)
    decode = cluster.decode[0]
    decode.send(cmd="room", room=2, seed=7, dst=[0, 1], positions=[0, 1], instance=INSTANCE, safe_bound_s=60)
    time.sleep(0.5)                                           # the prefill ranks have the request, nothing sent
    lan.down("p")
    t_down = time.time()
    assert decode.wait("result", BOUND_S, room=2)["status"] == "Failed"
    time.sleep(max(0.0, 3 * PEER_TIMEOUT_S - (time.time() - t_down)))
    lan.up("p")
    try:
        safe = decode.wait("safe", 10.0 + 2 * PEER_TIMEOUT_S, room=2)
    except AssertionError:
        safe = {"safe": False}
    assert safe["safe"], "the failed decode room never became safe to reuse after the partition ended"


# ------------------------------------------------------------------------------------------ etcd discovery
def test_etcd_discovery_across_hosts(lan: Lan, tmp_path: Any) -> None:
    """etcd on host b (started by the test in b's namespace, data in a temporary directory), prefill TP 2 on
    host p and decode TP 1 on host d publishing and looking up through it (``etcd://198.18.0.1:2379``), records
    sealed with the shared secret; byte-exact; the prefill ranks, killed with SIGKILL, vanish from etcd once
    their 3 s lease runs out."""
    why = etcd_unavailable()
    if why:
        pytest.skip(why)
    backend = next((b for b in BACKENDS if b in _AVAILABLE), None)
    if backend is None:
        pytest.skip("neither nixl nor mooncake can be imported here")
    etcd = EtcdServer(tmp_path / "etcd", host=lan.ip["b"], client_port=2379, peer_port=2380,
                      prefix=["ip", "netns", "exec", lan.ns["b"]])
    try:
        cluster = Cluster(lan, backend, discovery=etcd.url).start(lease_s=3.0)
        for room, pages in ((1, 7), (2, 16)):
            cluster.room(room, pages, chunks=2)
            cluster.exact(room)
        decode = cluster.decode[0]
        seen = decode.ask("lookup", 10, instance=INSTANCE)["addresses"]
        assert sorted(seen) == ["0", "1"] and all(a.startswith(f"tcp://{lan.ip['p']}:") for a in seen.values())
        for child in cluster.prefill:
            child.kill()
        killed = time.monotonic()
        deadline = killed + 3.0 + 10.0
        while decode.ask("lookup", 10, instance=INSTANCE)["addresses"] is not None:
            assert time.monotonic() < deadline, "the killed prefill ranks are still published in etcd"
            time.sleep(0.2)
        sys.stdout.write(f"\n[{backend}] etcd discovery across hosts: killed ranks gone from etcd after "
                         f"{time.monotonic() - killed:.1f} s (lease 3 s)\n")
    finally:
        for child in lan.children:
            child.kill()
        lan.children.clear()
        etcd.kill()

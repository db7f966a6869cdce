"""``kvbridge doctor``: what will make this host slow or fail before traffic arrives, one finding per line with
what to do, and an exit status by the worst finding (0 ok, 1 warning, 2 error).

Checks: the settings (validated as every rank validates them), the configured backend installed and usable,
``/dev/shm`` free space against the staging areas of the ranks this host runs, the locked-memory limit RDMA
registration needs, CUDA devices and their peer access, given a ZMQ bootstrap server that it answers and how
far its clock is from ours against the authenticated time window (``clock_window_s``), given another discovery
service (``etcd://...``) that its plugin is installed and it answers a lookup, given the ranks' port range that
enough of its ports are free here, and each usable backend's own checks (``BackendSpec.diagnose``: NIXL's says
which UCX transports carry its writes here)::

    $ kvbridge doctor --bootstrap tcp://10.0.0.5:17500 --ranks 8
    ok       settings   valid (backend nixl, staging 32 MiB per rank, clock window 60 s)
    warning  memlock    ulimit -l is 64 KiB, below one staging area (32 MiB): NIXL (UCX) and Mooncake ...
    error    clock      the bootstrap server's clock is +75.2 s from ours (+- 0.001 s), outside ...
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.findings import Finding, Severity

if TYPE_CHECKING:
    from kvbridge.registry import Registry

__all__ = ["Finding", "Severity", "exit_status", "run_checks"]


def exit_status(findings: Sequence[Finding]) -> int:
    return max((f.severity.exit_code for f in findings), default=0)


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.0f} KiB"


def run_checks(*, bootstrap: str | None = None, ranks: int = 1, shm_path: str = "/dev/shm",
               env: Mapping[str, str] | None = None, port_range: str | None = None,
               bind_host: str = "0.0.0.0", instance: str | None = None,
               probe_peers: Sequence[str] = ()) -> list[Finding]:
    """Every check, in order; a check that cannot run says why (an error of its own never stops the others)."""
    from kvbridge.settings import Settings, SettingsError, load_settings

    environ = dict(os.environ if env is None else env)
    findings: list[Finding] = []
    try:
        settings: Settings | None = load_settings(env=environ)
    except SettingsError as exc:
        findings.append(Finding(severity=Severity.ERROR, check="settings", text=f"{exc}: every rank refuses to start "
                                                                              "with it; fix the variable or file"))
        settings = None
    checks: list[Callable[[], Iterator[Finding]]] = []
    if settings is not None:
        s = settings
        findings.append(Finding(severity=Severity.OK, check="settings",
                                text=f"valid (backend {s.backend or 'auto'}, staging {_mib(s.staging_bytes)} per rank, "
                                     f"clock window {s.clock_window_s:g} s)"))
        checks += [lambda: _backend(s.backend), lambda: _shm(s.staging_bytes, ranks, shm_path),
                   lambda: _memlock(s.staging_bytes, s.backend), lambda: _diagnoses(s.backend, peers=probe_peers)]
    checks.append(_cuda)
    if bootstrap:
        window = settings.clock_window_s if settings is not None else 60.0
        secret = settings.secret.encode() if settings is not None and settings.secret else None
        if _is_zmq(bootstrap):
            checks.append(lambda: _bootstrap(bootstrap, secret, window))
            if instance:
                checks.append(lambda: _instance(bootstrap, instance, secret))
                checks.append(lambda: _rank_clocks(bootstrap, instance, secret, window))
        else:
            checks.append(lambda: _discovery(bootstrap, secret))
    if port_range:
        checks.append(lambda: _ports(port_range, ranks, bind_host))
    for check in checks:
        try:
            findings.extend(check())
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            findings.append(Finding(severity=Severity.WARNING, check="doctor",
                                    text=f"a check could not run: {type(exc).__name__}: {exc}"))
    return findings


def _backend(wanted: str) -> Iterator[Finding]:
    from kvbridge.registry import Registry

    registry = Registry.build()
    usable = registry.backend_names(available_only=True)
    records = {r.name: r for r in registry.records()}
    if not wanted:
        yield Finding(severity=Severity.OK, check="backend", text=f"usable here: {', '.join(usable) or 'none'}")
        return
    if wanted in usable:
        yield Finding(severity=Severity.OK, check="backend", text=f"{wanted} is installed and usable here")
        return
    record = records.get(wanted)
    why = " ".join(record.reason.split()) if record is not None else "not installed"
    hint = f" (hint: {record.hint})" if record is not None and record.hint else ""
    yield Finding(severity=Severity.ERROR, check="backend",
                  text=f"the configured backend {wanted!r} cannot run here: {why}{hint}; usable: "
                       f"{', '.join(usable) or 'none'} (kvbridge plugins lists them)")


def _diagnoses(wanted: str, registry: Registry | None = None, peers: Sequence[str] = ()) -> Iterator[Finding]:
    """Each usable backend's own checks (``BackendSpec.diagnose``): the configured one, else every usable one;
    given ``peers`` (other hosts' probe servers), the routes to them too."""
    from kvbridge.registry import Registry
    from kvbridge.specs import resolve

    registry = registry if registry is not None else Registry.build()
    for name in registry.backend_names(available_only=True):
        spec = registry.backend_spec(name)
        if spec.diagnose is None or (wanted and name != wanted):
            continue
        try:
            yield from (resolve(spec.diagnose)(peers=list(peers)) if peers else resolve(spec.diagnose)())
        except Exception as exc:  # noqa: BLE001 - a plugin's broken check is a finding, not a crash
            yield Finding(severity=Severity.WARNING, check=name, text=f"its checks could not run: "
                                                                      f"{type(exc).__name__}: {exc}")


def serve_probe(*, address: str, seconds: float, env: Mapping[str, str] | None = None,
                say: Callable[[str], None] = print) -> int:
    """Answer other hosts' ``--probe-peer`` at ``address`` for ``seconds`` with the configured backend (else the
    first usable one that can): ``BackendSpec.serve_probe``. Returns how many probes it answered."""
    from kvbridge.registry import Registry
    from kvbridge.settings import load_settings
    from kvbridge.specs import resolve

    wanted = load_settings(env=dict(os.environ if env is None else env)).backend
    registry = Registry.build()
    usable = [n for n in registry.backend_names(available_only=True) if not wanted or n == wanted]
    serving = [n for n in usable if registry.backend_spec(n).serve_probe is not None]
    if not serving:
        raise ValueError(f"no usable backend here answers route probes (usable: {', '.join(usable) or 'none'}; "
                         f"configured: {wanted or 'auto'})")
    entry = registry.backend_spec(serving[0]).serve_probe
    assert entry is not None
    return int(resolve(entry)(address, seconds, say))


def _shm(staging_bytes: int, ranks: int, path: str) -> Iterator[Finding]:
    if not os.path.isdir(path):
        yield Finding(severity=Severity.WARNING, check="shm", text=f"{path} does not exist: host staging areas and "
                                                                   "the demo's pools live there")
        return
    free = shutil.disk_usage(path).free
    need = staging_bytes * max(1, ranks)
    if free < need:
        yield Finding(severity=Severity.ERROR, check="shm",
                      text=f"{path} has {_mib(free)} free, {ranks} rank(s) x {_mib(staging_bytes)} of host staging "
                           f"need {_mib(need)}: a rank fails to create its staging area (raise the tmpfs size, e.g. "
                           "docker --shm-size, or lower staging_bytes)")
    else:
        yield Finding(severity=Severity.OK, check="shm", text=f"{path} has {_mib(free)} free for {_mib(need)} of "
                                                               "host staging")


def _memlock(staging_bytes: int, backend: str) -> Iterator[Finding]:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        yield Finding(severity=Severity.OK, check="memlock", text="ulimit -l is unlimited")
        return
    if soft < staging_bytes:
        rdma = backend in ("", "nixl", "mooncake")
        yield Finding(severity=Severity.WARNING if rdma else Severity.INFO, check="memlock",
                      text=f"ulimit -l is {_mib(soft)}, below one staging area ({_mib(staging_bytes)}): NIXL (UCX) and "
                           "Mooncake over RDMA pin registered host memory and fail or fall back to slower paths; "
                           "raise it (ulimit -l unlimited, LimitMEMLOCK=infinity, docker --ulimit memlock=-1)")
    else:
        yield Finding(severity=Severity.OK, check="memlock", text=f"ulimit -l is {_mib(soft)}")


def _cuda() -> Iterator[Finding]:
    import importlib.util
    import sys

    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        yield Finding(severity=Severity.INFO, check="cuda", text="torch is not installed: host memory only")
        return
    import torch

    if not torch.cuda.is_available():
        yield Finding(severity=Severity.INFO, check="cuda", text="no CUDA device here: host memory only")
        return
    count = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    yield Finding(severity=Severity.OK, check="cuda", text=f"{count} device(s): {names}")
    blocked = [(a, b) for a in range(count) for b in range(count) if a != b
               and not torch.cuda.can_device_access_peer(a, b)]
    if blocked:
        pairs = ", ".join(f"{a}->{b}" for a, b in blocked[:8])
        yield Finding(severity=Severity.WARNING, check="cuda",
                      text=f"no peer access between GPUs {pairs}: transfers between them go through host memory "
                           "(UCX cuda_copy), several times slower than NVLink or PCIe peer-to-peer; check the "
                           "topology (nvidia-smi topo -m) and IOMMU/ACS settings")
    elif count > 1:
        yield Finding(severity=Severity.OK, check="cuda", text="every GPU pair has peer access")


def _bootstrap(url: str, secret: bytes | None, window_s: float) -> Iterator[Finding]:
    from kvbridge.zmq_link import ZmqBootstrap

    client = ZmqBootstrap(url, secret=secret, timeout_s=2.0, republish_s=0.0)
    try:
        probes = [client.clock_probe()]
        while len(probes) < 3 and probes[-1].offset_s is not None and not probes[-1].refused:
            probes.append(client.clock_probe())       # the fastest round trip bounds the offset best
    finally:
        client.close()
    probe = min(probes, key=lambda p: (p.offset_s is None, p.rtt_s))
    if probe.offset_s is None:
        yield Finding(severity=Severity.ERROR, check="bootstrap",
                      text=f"{url} cannot be used: {probe.error}; check the address, the port's firewall and "
                           "that the server runs (and, with a secret, that both sides have the same one)")
        return
    yield Finding(severity=Severity.OK, check="bootstrap", text=f"{url} answers in {probe.rtt_s * 1000:.1f} ms")
    offset, window = probe.offset_s, probe.window_s or window_s
    where = f"the bootstrap server's clock is {offset:+.1f} s from ours (+- {probe.rtt_s / 2:.3f} s)"
    if probe.refused or abs(offset) >= window:
        yield Finding(severity=Severity.ERROR, check="clock",
                      text=f"{where}, outside clock_window_s={window:g}: with a secret, every publication, lookup and "
                           "watch of this host is refused as stale; synchronise the clocks (NTP/chrony) or raise "
                           "KVBRIDGE_CLOCK_WINDOW_S on the server")
    elif abs(offset) >= window / 4:
        yield Finding(severity=Severity.WARNING, check="clock",
                      text=f"{where}, inside clock_window_s={window:g} but over a quarter of it: a little more drift "
                           "and this host is refused; synchronise the clocks (NTP/chrony)")
    else:
        yield Finding(severity=Severity.OK, check="clock", text=f"{where}, well inside clock_window_s={window:g}")


def _instance(url: str, instance: str, secret: bytes | None) -> Iterator[Finding]:
    """The prefill instance's ranks as the bootstrap server lists them, each one's control port reachable from here."""
    import socket

    from kvbridge.addresses import endpoint_host_port
    from kvbridge.zmq_link import ZmqBootstrap

    client = ZmqBootstrap(url, secret=secret, timeout_s=2.0, republish_s=0.0)
    try:
        info = client.lookup(instance)
    except Exception as exc:  # noqa: BLE001 - reported
        yield Finding(severity=Severity.ERROR, check="instance", text=f"looking up {instance!r} failed: {exc}")
        return
    finally:
        client.close()
    if info is None:
        yield Finding(severity=Severity.ERROR, check="instance",
                      text=f"{url} knows no prefill instance {instance!r}: is it started, with this bootstrap "
                           "address (and secret)?")
        return
    missing = sorted(set(range(info.tp_size)) - set(info.addresses))
    if missing:
        yield Finding(severity=Severity.ERROR, check="instance",
                      text=f"{instance!r} has {len(info.addresses)} of its {info.tp_size} ranks published (missing "
                           f"{missing}): its decodes wait for the rest (bootstrap_timeout_s)")
    for rank, address in sorted(info.addresses.items()):
        where = endpoint_host_port(address)
        if where is None:
            yield Finding(severity=Severity.INFO, check="instance", text=f"rank {rank} at {address}: not TCP, "
                                                                           "not checked from here")
            continue
        try:
            with socket.create_connection(where, timeout=2.0):
                pass
        except OSError as exc:
            yield Finding(severity=Severity.ERROR, check="instance",
                          text=f"rank {rank} of {instance!r} at {address} is not reachable from here ({exc}): check "
                               "the firewall between the hosts and the address the rank binds (ZmqLink's host)")
        else:
            yield Finding(severity=Severity.OK, check="instance", text=f"rank {rank} of {instance!r} at {address} "
                                                                       "accepts connections")


def _rank_clocks(url: str, instance: str, secret: bytes | None, window_s: float) -> Iterator[Finding]:
    """Each rank's wall clock against the bootstrap server's, as its last publication showed it: with a secret
    the server refuses a publication further than the clock window from its clock, and that rank is missing."""
    from kvbridge.zmq_link import ZmqBootstrap

    if secret is None:
        yield Finding(severity=Severity.INFO, check="clock", text=f"ranks of {instance!r}: without a secret nothing "
                                                                   "between the ranks and the server is time-bounded")
        return
    client = ZmqBootstrap(url, secret=secret, timeout_s=2.0, republish_s=0.0)
    try:
        clocks = client.rank_clocks(instance)
        now = client.clock_probe()
    finally:
        client.close()
    if not clocks:
        yield Finding(severity=Severity.INFO, check="clock",
                      text=f"{url} names no clock for the ranks of {instance!r} (none published with a time, or an "
                           "older release of the server)")
        return
    server_now = time.time() + (now.offset_s or 0.0)
    for rank, clock in sorted(clocks.items()):
        ago = max(0.0, server_now - clock.at)
        where = (f"rank {rank} of {instance!r}: its clock was {clock.offset_s:+.1f} s from the bootstrap server's "
                 f"at its last publication ({ago:.0f} s ago)")
        if clock.refused:
            yield Finding(severity=Severity.ERROR, check="clock",
                          text=f"{where}, which the server refused as stale (outside its clock window; or an old "
                               "publication replayed): the rank is not listed and its decodes wait for it; "
                               "synchronise its clock (NTP/chrony) or raise KVBRIDGE_CLOCK_WINDOW_S on the server")
        elif abs(clock.offset_s) >= window_s / 4:
            yield Finding(severity=Severity.WARNING, check="clock",
                          text=f"{where}, over a quarter of clock_window_s={window_s:g}: a little more drift and its "
                               "publications are refused; synchronise its clock (NTP/chrony)")
        else:
            yield Finding(severity=Severity.OK, check="clock", text=f"{where}, well inside clock_window_s={window_s:g}")


def _is_zmq(url: str) -> bool:
    from kvbridge.discovery import ZMQ_SCHEMES, scheme_of

    return scheme_of(url) in ZMQ_SCHEMES


def _discovery(url: str, secret: bytes | None) -> Iterator[Finding]:
    """A discovery service of a plugin (etcd, ...): its plugin installed, its host accepting a connection, and a
    lookup answered (the protocol's lookup reports an unreachable service as "no ranks", so the connection is
    what proves it reachable)."""
    import secrets
    import socket
    import time

    from kvbridge.discovery import DiscoveryError, open_discovery
    from kvbridge.errors import PluginError

    try:
        client = open_discovery(url, secret=secret, timeout_s=2.0)
    except (PluginError, DiscoveryError) as exc:
        yield Finding(severity=Severity.ERROR, check="discovery", text=f"{url}: {exc}")
        return
    try:
        target = client.route_target()
        started = time.monotonic()
        if target is not None:
            try:
                socket.create_connection(target, timeout=2.0).close()
            except OSError as exc:
                yield Finding(severity=Severity.ERROR, check="discovery",
                              text=f"{url} cannot be used: {target[0]}:{target[1]} refuses or does not answer "
                                   f"({exc}); check the address, the port's firewall and that the service runs")
                return
        client.lookup(f"kvbridge-doctor-{secrets.token_hex(4)}")     # a name nobody publishes
        took = time.monotonic() - started
    finally:
        client.close()
    yield Finding(severity=Severity.OK, check="discovery", text=f"{url} answers a lookup in {took * 1000:.1f} ms")


def _ports(port_range: str, ranks: int, host: str) -> Iterator[Finding]:
    """How many ports of the ranks' ``port_range`` this host can bind now (each rank's control link takes one)."""
    import socket

    from kvbridge.addresses import parse_port_range

    bounds = parse_port_range(port_range)
    assert bounds is not None
    lo, hi = bounds
    free = 0
    for port in range(lo, hi + 1):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            free += 1
    where = f"port_range {lo}-{hi}: {free} of {hi - lo + 1} ports free on {host}"
    if free < ranks:
        yield Finding(severity=Severity.ERROR, check="ports",
                      text=f"{where}, {ranks} rank(s) need one each: widen the range or stop what holds them "
                           "(ss -ltnp)")
    elif free < 2 * ranks:
        yield Finding(severity=Severity.WARNING, check="ports",
                      text=f"{where}: enough for {ranks} rank(s), not for a restart that overlaps the old ranks")
    else:
        yield Finding(severity=Severity.OK, check="ports", text=f"{where} for {ranks} rank(s)")

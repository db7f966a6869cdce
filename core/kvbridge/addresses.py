"""Addresses of a control link: what it binds, what it tells its peers, which ports it may take.

A link binds one host (``127.0.0.1`` by default, ``0.0.0.0`` / ``::`` for every interface) and advertises
one address to its peers through discovery. The advertised host is, in this order: the one given; the
bound host when it names one interface; else the address of the interface that routes to the discovery
service (a UDP ``connect()`` to the bootstrap host, which sends no packet, then ``getsockname()``). An
unspecified address (``0.0.0.0``, ``::``, ``*``) is never advertised: a peer cannot reach it.

A port range (``"17600-17699"`` or ``(17600, 17699)``, both ends included) makes the link bind the first
free port of the range, so a firewall can allow the range; :class:`NoFreePort` says so when every port of
it is taken.

    host = advertised_host(bind="0.0.0.0", advertise=None, toward=("198.18.0.1", 17600))   # "198.18.0.2"
    lo, hi = parse_port_range("17600-17699")
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from urllib.parse import urlsplit

__all__ = ["NoFreePort", "advertised_host", "endpoint_host_port", "format_tcp", "is_ipv6_literal", "is_loopback",
           "is_unspecified", "parse_port_range", "route_source"]

_UNSPECIFIED = {"", "*", "0.0.0.0", "::", "[::]"}


class NoFreePort(OSError):
    """Every port of a link's port range is taken on the bound host."""

    def __init__(self, host: str, lo: int, hi: int) -> None:
        super().__init__(errno.EADDRINUSE, f"no free port in {lo}-{hi} on {host} (all {hi - lo + 1} in use); "
                                           "widen port_range or free a port")
        self.host, self.lo, self.hi = host, lo, hi


def is_unspecified(host: str) -> bool:
    """``0.0.0.0``, ``::``, ``*`` or empty: every interface, never an address a peer can reach. Other spellings
    the resolver reads as 0.0.0.0 (``0``, ``0.0``, ``0x0``, ``000.000.000.000``) are too."""
    host = host.strip()
    if host in _UNSPECIFIED:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(host) == b"\0\0\0\0"
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``: reachable from this host only. A name other than localhost is
    not (it may resolve anywhere), nor is an unspecified address (every interface)."""
    host = _strip(host.strip()).split("%")[0]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ipv6_literal(host: str) -> bool:
    """``fe80::1``, ``::1``, ``fe80::1%eth0`` (no brackets)."""
    try:
        return isinstance(ipaddress.ip_address(host.split("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def _strip(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def format_tcp(host: str, port: int) -> str:
    """``tcp://host:port`` with an IPv6 literal in brackets."""
    host = _strip(host)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def endpoint_host_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of ``tcp://h:p``, ``etcd://h:p/...`` or ``http://h:p``; None when it names no TCP host
    (``ipc://``, ``inproc://``) or no port."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("ipc", "inproc") or not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    if port is None:
        return None
    return parts.hostname, port


def route_source(host: str, port: int = 9) -> str:
    """The local address the kernel would use to reach ``host``: a UDP socket is connected (no packet is
    sent) and its own address read back. Raises OSError when ``host`` is unreachable from here."""
    infos = socket.getaddrinfo(_strip(host), port, type=socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(sockaddr)
            except OSError as exc:
                last = exc
                continue
            source = str(sock.getsockname()[0])
        if not is_unspecified(source):
            return source
    raise OSError(f"no route from this host to {host!r}: {last}")


def advertised_host(*, bind: str, advertise: str | None, toward: tuple[str, int] | None) -> str:
    """The host a link bound at ``bind`` tells its peers (see the module docstring). ``toward`` is the
    discovery service's (host, port), used only when ``bind`` is unspecified and ``advertise`` is not given."""
    if advertise is not None:
        if is_unspecified(advertise):
            raise ValueError(f"advertise={advertise!r} is an unspecified address that peers cannot reach; "
                             "give this host's address on the network the peers use")
        host = _strip(advertise.strip())
        if ":" in host and not is_ipv6_literal(host):
            raise ValueError(f"advertise={advertise!r} is not a host (an IPv6 literal has colons; a port does not "
                             "belong here: the link picks it)")
        return host
    if not is_unspecified(bind):
        return _strip(bind.strip())
    if toward is None:
        raise ValueError(f"the link binds {bind!r} (every interface) and its discovery service has no TCP host to "
                         "find the interface that reaches it: give advertise=<this host's address>")
    try:
        return route_source(*toward)
    except OSError as exc:
        raise ValueError(f"the link binds {bind!r} and cannot find the interface that routes to the discovery "
                         f"service at {toward[0]}:{toward[1]} ({exc}): give advertise=<this host's address>") from exc


def parse_port_range(value: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"lo-hi"``, ``"port"`` or ``(lo, hi)`` -> ``(lo, hi)``, both ends included; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        lo_text, sep, hi_text = text.partition("-")
        try:
            lo, hi = int(lo_text), int(hi_text) if sep else int(lo_text)
        except ValueError:
            raise ValueError(f"port_range={value!r}: expected 'LOW-HIGH' (e.g. '17600-17699')") from None
    else:
        lo, hi = (int(v) for v in value)
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"port_range={value!r}: expected 1 <= LOW <= HIGH <= 65535")
    return lo, hi

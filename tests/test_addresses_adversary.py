"""Adversarial tests of advertised addresses: an address that means "every interface" (0.0.0.0 in any
spelling the resolver accepts) must never be advertised or registered; a malformed advertise= refused
early; IPv6 literals bracketed."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvbridge.addresses import advertised_host, format_tcp, is_unspecified
from kvbridge.discovery import DiscoveryError, check_address
from kvbridge.zmq_link import BootstrapServer, ZmqBootstrap, ZmqLink

# every one of these is resolved to 0.0.0.0 by getaddrinfo/inet_aton (what ZMQ uses to connect)
ZERO_SPELLINGS = ["0", "0.0", "00.0.0.0", "0x0", "000.000.000.000"]


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer().start()
    yield srv
    srv.close()


def test_the_spellings_really_mean_every_interface() -> None:
    for host in ZERO_SPELLINGS:
        assert socket.getaddrinfo(host, 1, type=socket.SOCK_STREAM)[0][4][0] == "0.0.0.0", host


@pytest.mark.parametrize("host", ZERO_SPELLINGS)
def test_other_spellings_of_0000_are_unspecified(host: str) -> None:
    assert is_unspecified(host), f"{host!r} resolves to 0.0.0.0 but is not taken for unspecified"


@pytest.mark.parametrize("host", ZERO_SPELLINGS)
def test_advertise_of_another_spelling_of_0000_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="unspecified"):
        advertised_host(bind="127.0.0.1", advertise=host, toward=("127.0.0.1", 9))


@pytest.mark.parametrize("host", ZERO_SPELLINGS)
def test_a_control_address_on_another_spelling_of_0000_is_refused(host: str) -> None:
    with pytest.raises(DiscoveryError):
        check_address(f"tcp://{host}:5555")


def test_a_link_bound_at_0_does_not_advertise_0(server: BootstrapServer) -> None:
    try:
        link = ZmqLink(bootstrap=server.address, host="0")
    except (ValueError, OSError):
        return                                             # refused: fine
    try:
        assert not link.address.startswith("tcp://0:"), f"advertised {link.address}"
    finally:
        link.close()


def test_the_bootstrap_server_refuses_registering_0(server: BootstrapServer) -> None:
    client = ZmqBootstrap(server.address, republish_s=0)
    try:
        with pytest.raises(DiscoveryError):
            client.publish("zero", 1, 0, "tcp://0:5555")
        assert client.lookup("zero") is None
    finally:
        client.close()


@pytest.mark.parametrize("advertise", ["127.0.0.2:80", "tcp://127.0.0.2:80", "127.0.0.2/8"])
def test_an_advertise_that_is_not_a_host_is_refused(server: BootstrapServer, advertise: str) -> None:
    """advertise= is a host; one carrying a port or a scheme gives peers an address they cannot reach."""
    try:
        link = ZmqLink(bootstrap=server.address, advertise=advertise)
    except (ValueError, OSError):
        return
    try:
        with pytest.raises((ValueError, DiscoveryError)):
            link.publish("bad-adv", 1, 0)
    finally:
        link.close()


def test_ipv6_literals_are_bracketed_and_unspecified_ones_refused(server: BootstrapServer) -> None:
    assert format_tcp("fd00::5", 7) == "tcp://[fd00::5]:7"
    assert check_address("tcp://[fd00::5]:7") == "tcp://[fd00::5]:7"
    for zero in ("::", "0:0:0:0:0:0:0:0", "0::0", "[::]"):
        with pytest.raises(ValueError, match="unspecified"):
            advertised_host(bind="::1", advertise=zero, toward=None)
        with pytest.raises(DiscoveryError):
            check_address(f"tcp://[{zero.strip('[]')}]:7")
    with pytest.raises(ValueError):
        BootstrapServer("tcp://0.0.0.0:0", advertise="::").close()


def test_a_link_bound_everywhere_without_a_route_asks_for_advertise() -> None:
    # a path of this process's own: two runs on one host (parallel workers, CI beside a developer) must not
    # bind the same ipc endpoint
    srv = BootstrapServer(f"ipc:///tmp/kvbridge-adv-ops-bootstrap-{os.getpid()}.ipc").start()
    try:
        with pytest.raises(ValueError, match="give advertise="):
            ZmqLink(bootstrap=srv.address, host="0.0.0.0")
        with pytest.raises(ValueError, match="give advertise="):
            ZmqLink(bootstrap=srv.address, host="::")
    finally:
        srv.close()

"""Secure by default (issue 26 item 6): a control endpoint other hosts can reach needs the shared secret or an
explicit ``allow_insecure`` (logged); loopback needs neither. A refused endpoint leaves nothing bound."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kvbridge.addresses import is_loopback
from kvbridge.errors import InsecureSetup
from kvbridge.zmq_link import BootstrapServer, ZmqLink

SECRET = b"secure-default-secret-0123456789"


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(secret=SECRET).start()
    try:
        yield srv
    finally:
        srv.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_spellings(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*", "", "198.18.0.1", "10.0.0.1", "example.com", "fe80::1%lo",
                                  "127.0.0.1.example.com"])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_a_link_on_every_interface_without_a_secret_is_refused_and_leaves_nothing_bound(
        server: BootstrapServer) -> None:
    ZmqLink(bootstrap=server.address, host="0.0.0.0", secret=SECRET).close()        # warm up ZMQ's own fds
    before = open_fds()
    for _ in range(20):
        with pytest.raises(InsecureSetup, match=r"control link bound at tcp://0\.0\.0\.0:\d+ .*no shared secret.*"
                                                r"KVBRIDGE_ALLOW_INSECURE=1"):
            ZmqLink(bootstrap=server.address, host="0.0.0.0")
    assert open_fds() <= before + 2


def test_with_a_secret_or_an_explicit_opt_in_it_binds(server: BootstrapServer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    link = ZmqLink(bootstrap=server.address, host="0.0.0.0", secret=SECRET)
    link.close()
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        link = ZmqLink(bootstrap=server.address, host="0.0.0.0", secret=SECRET, allow_insecure=True)
        link.close()
    assert not [r for r in caplog.records if "allow_insecure" in r.getMessage()]      # a secret: nothing to say
    open_server = BootstrapServer()
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge"):
            link = ZmqLink(bootstrap=open_server.address, host="0.0.0.0", allow_insecure=True)
            link.close()
    finally:
        open_server.close()
    said = [r.getMessage() for r in caplog.records if "allow_insecure" in r.getMessage()]
    assert said and "tcp://0.0.0.0:" in said[0]


def test_a_loopback_link_needs_no_secret() -> None:
    srv = BootstrapServer().start()
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            ZmqLink(bootstrap=srv.address, host=host).close()
    finally:
        srv.close()


def test_a_bootstrap_server_on_every_interface_needs_the_secret() -> None:
    with pytest.raises(InsecureSetup, match="bootstrap server bound at tcp://0.0.0.0"):
        BootstrapServer("tcp://0.0.0.0:0")
    BootstrapServer("tcp://0.0.0.0:0", secret=SECRET).close()
    BootstrapServer("tcp://0.0.0.0:0", allow_insecure=True).close()
    BootstrapServer("tcp://127.0.0.1:0").close()

"""Secure by default (issue 26 item 6): a control endpoint other hosts can reach needs the shared secret or an
explicit ``allow_insecure`` (logged); loopback needs neither. A refused endpoint leaves nothing bound."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest

from kvbridge.addresses import is_loopback
from kvbridge.errors import InsecureSetup
from kvbridge.zmq_link import BootstrapServer, ZmqLink, check_exposure

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
    # ZMQ closes a socket's descriptors on its I/O thread, a little later; a leak per refusal would be 20-40
    deadline = time.monotonic() + 5
    while open_fds() > before + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds() <= before + 8, f"{open_fds() - before} descriptors more after 20 refused links"


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


def test_advertising_a_reachable_address_needs_the_secret_too(server: BootstrapServer) -> None:
    """Bound to loopback behind a proxy or port-forward, advertised to other hosts: exposed all the same."""
    with pytest.raises(InsecureSetup, match="198.18.0.7"):
        ZmqLink(bootstrap=server.address, host="127.0.0.1", advertise="198.18.0.7")
    with pytest.raises(InsecureSetup, match="198.18.0.9"):
        BootstrapServer("tcp://127.0.0.1:0", advertise="198.18.0.9")
    ZmqLink(bootstrap=server.address, host="127.0.0.1", advertise="198.18.0.7", secret=SECRET).close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0", "tcp://0.0.0.0:99999", "tcp://[::]:0x10", "tcp://"])
def test_an_unreadable_tcp_endpoint_counts_as_exposed(endpoint: str) -> None:
    with pytest.raises(InsecureSetup):
        check_exposure("x", endpoint, secret=None, allow_insecure=False)


def test_a_flood_of_bad_bootstrap_requests_logs_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    import zmq

    srv = BootstrapServer(secret=SECRET).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(srv.address)
        with caplog.at_level(logging.ERROR, logger="kvbridge"):
            for i in range(200):
                sock.send_multipart([b"", b"garbage %d" % i])
            deadline = time.monotonic() + 10
            while srv.rejected < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert srv.rejected >= 200
        lines = [r for r in caplog.records if "rejected request" in r.getMessage()]
        assert 1 <= len(lines) <= 5
    finally:
        sock.close(0)
        srv.close()


# ---------------------------------------------------------------------------------------------- one secret
def _agent(link: object, secret: bytes | None) -> object:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.wire import Role
    from kvbridge.testkit.kvmodel import KVPool

    pool = KVPool(1, 0, role="prefill")
    try:
        agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.PREFILL, link=link,  # type: ignore[arg-type]
                              name="one-secret", config=AgentConfig(secret=secret))
    finally:
        pool.close()
    agent.close()
    return agent


@pytest.mark.parametrize(("agent_secret", "link_secret", "why"), [
    (b"k" * 32, None, "the agent has a shared secret but its control link has none"),
    (None, b"k" * 32, "its control link has a shared secret but the agent has none"),
    (b"k" * 32, b"j" * 32, "the agent's shared secret and its control link's differ"),
], ids=["agent-only", "link-only", "different"])
def test_a_secret_given_to_the_agent_or_the_link_alone_is_refused(server: BootstrapServer, agent_secret: bytes | None,
                                                                   link_secret: bytes | None, why: str) -> None:
    """Issue 26: with the secret on the agents only, an outsider still got a readable Hello through the
    unauthenticated bootstrap and wrote into the decode's KV. Agent and link take one secret or none."""
    link = ZmqLink(bootstrap=server.address, secret=link_secret)
    try:
        with pytest.raises(InsecureSetup, match=why):
            _agent(link, agent_secret)
    finally:
        link.close()


def test_the_same_secret_or_none_on_both_is_accepted(server: BootstrapServer) -> None:
    from kvbridge.links import LocalHub

    for secret in (None, b"k" * 32):
        link = ZmqLink(bootstrap=server.address, secret=secret)
        try:
            _agent(link, secret)
        finally:
            link.close()
    _agent(LocalHub().link("in-process"), b"k" * 32)     # in-process links carry no secret of their own

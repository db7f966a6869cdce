"""kvbridge-etcd: discovery of prefill instances through etcd (``etcd://host:port/prefix``).

Discovery only: the client (``kvbridge_etcd.client.EtcdDiscovery``) and its library are imported when a
client is opened, not here.
"""

from __future__ import annotations

from kvbridge.plugin import DiscoverySpec, hookimpl, probe_import

INSTALL_HINT = "pip install kvbridge-etcd (brings etcd3gw); an etcd v3.4+ server, e.g. apt install etcd-server"


@hookimpl
def kvbridge_discovery_services() -> list[DiscoverySpec]:
    return [DiscoverySpec(name="etcd", schemes=("etcd",), factory="kvbridge_etcd.client:EtcdDiscovery",
                          probe=lambda: probe_import("etcd3gw.client", INSTALL_HINT),
                          description="etcd v3 (gRPC gateway): ranks under leases, watches, HMAC-sealed records")]

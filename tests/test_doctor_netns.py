"""``kvbridge doctor --probe-peer`` between two hosts: network namespaces joined by a bridge, the probe server
started in one with ``--serve-probe``, the doctor in the other. Each "host" gets its own boot id (a bind mount in a
mount namespace of its own), which is how UCX tells hosts apart: otherwise it would see one machine and copy
through shared memory. With no RDMA device, NIXL's UCX writes over TCP, and the doctor must say so: a warning
naming the transport and what to check, with the measured throughput of 64 MiB writes that landed byte-exact."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _netnsrig import Lan, netns_unusable

pytest.importorskip("nixl", reason="needs the nixl wheel")
_WHY_NOT = netns_unusable()
pytestmark = [pytest.mark.skipif(bool(_WHY_NOT), reason=f"network namespaces: {_WHY_NOT}"),
              pytest.mark.timeout(600)]

KVBRIDGE = str(Path(sys.executable).with_name("kvbridge"))
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def test_the_doctor_names_the_transport_to_another_host_and_warns_without_rdma(tmp_path: Path) -> None:
    boot_id = tmp_path / "boot_id"
    boot_id.write_text(f"{uuid.uuid4()}\n")
    env = {**os.environ, "KVBRIDGE_BACKEND": "nixl"}
    with Lan(["a", "b"], third=61) as lan:
        url = f"tcp://{lan.ip['b']}:17611"
        server = subprocess.Popen(
            ["ip", "netns", "exec", lan.ns["b"], "unshare", "--mount", "sh", "-c",
             f"mount --bind {boot_id} {BOOT_ID} && exec {KVBRIDGE} doctor --serve-probe {url} --serve-s 400"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            assert server.stdout is not None
            first = server.stdout.readline()
            assert f"serving NIXL route probes at {url}" in first, first + server.stdout.read(4000)
            done = subprocess.run(["ip", "netns", "exec", lan.ns["a"], KVBRIDGE, "doctor", "--probe-peer", url],
                                  capture_output=True, text=True, env=env, timeout=400)
            remote = [line for line in done.stdout.splitlines() if f" at {url}:" in line]
            assert len(remote) == 1, done.stdout + done.stderr[-3000:]
            line = remote[0]
            assert line.startswith("warning  nixl       host memory -> host memory at"), line
            assert "GB/s (64 MiB writes)" in line and "failed" not in line, line
            assert "over tcp/eth0" in line and "no RDMA between the hosts" in line, line
            assert done.returncode == 1, done.stdout         # the worst finding: a warning
        finally:
            server.kill()
            server.wait(timeout=30)

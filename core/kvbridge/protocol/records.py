"""The records that travel on the wire and that the backend contract shares: a peer's registered buffers.

A decode rank describes its buffers in its Hello (a prefill rank in its Welcome) as :class:`RemoteBuffers`;
the agent hands them to its backend inside :class:`PeerInfo` (``add_peer``) and ``ComponentTransfer.dst``.
The encoding is msgspec's: field order and ``array_like`` are the wire format (change neither).
"""

from __future__ import annotations

import msgspec

from kvbridge.geometry import DeviceKind, MemoryRegion


class RegionWire(msgspec.Struct, frozen=True, array_like=True):
    addr: int
    nbytes: int
    device: DeviceKind = DeviceKind.CPU
    device_id: int = 0

    def region(self) -> MemoryRegion:
        return MemoryRegion(self.addr, self.nbytes, self.device, self.device_id)

    @classmethod
    def of(cls, region: MemoryRegion) -> RegionWire:
        return cls(region.addr, region.nbytes, region.device, region.device_id)


class RemoteBuffers(msgspec.Struct, frozen=True):
    """A peer's registered buffers of one component, as the peer described them (travels on the wire)."""

    component: str
    regions: tuple[RegionWire, ...]
    descriptor: bytes = b""


class PeerInfo(msgspec.Struct, frozen=True):
    """Everything a backend needs to write into a peer: its endpoint blob and its registered buffers."""

    name: str
    endpoint: bytes
    buffers: tuple[RemoteBuffers, ...]

    def component(self, name: str) -> RemoteBuffers:
        for buf in self.buffers:
            if buf.component == name:
                return buf
        raise KeyError(f"peer {self.name!r} registered no component {name!r}")

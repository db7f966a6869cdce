"""What a NIXL backend puts on the wire: its endpoint blob and its per-component buffer descriptor."""

from __future__ import annotations

import msgspec

from kvbridge.plugin import ProtocolError

#: Bumped when the endpoint or descriptor layout changes.
WIRE_VERSION = 1


class NixlEndpoint(msgspec.Struct, frozen=True, array_like=True):
    """``TransferBackend.endpoint`` of a NIXL backend: the agent's name and its full NIXL metadata
    (connection info plus the remote keys of every region registered when it was taken)."""

    version: int
    agent: str
    metadata: bytes


class NixlBuffers(msgspec.Struct, frozen=True, array_like=True):
    """``RegisteredBuffers.descriptor``: which agent registered the regions, and as which NIXL memory type."""

    version: int
    agent: str
    mem_type: str          # "DRAM" | "VRAM"


_ENDPOINT = msgspec.msgpack.Decoder(NixlEndpoint)
_BUFFERS = msgspec.msgpack.Decoder(NixlBuffers)


def encode(record: NixlEndpoint | NixlBuffers) -> bytes:
    return msgspec.msgpack.encode(record)


def decode_endpoint(blob: bytes) -> NixlEndpoint:
    return _checked(_ENDPOINT, blob, "endpoint")


def decode_buffers(blob: bytes) -> NixlBuffers:
    return _checked(_BUFFERS, blob, "buffer descriptor")


def _checked(decoder: msgspec.msgpack.Decoder, blob: bytes, what: str):  # type: ignore[no-untyped-def]
    try:
        record = decoder.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a NIXL {what}: {exc}") from None
    if record.version != WIRE_VERSION:
        raise ProtocolError(f"NIXL {what} has wire version {record.version}, this build speaks {WIRE_VERSION}")
    return record

"""Control messages: one msgspec tagged union, an explicit protocol version, a size limit.

Index arrays travel packed (little-endian int32/int64 bytes), never as msgpack lists. Every decoded
message is validated here (version, size, field ranges) before anything acts on it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec
import numpy as np

from kvbridge.backends.base import RemoteBuffers
from kvbridge.errors import GeometryError, KVBridgeError, ProtocolError
from kvbridge.geometry import PoolLayout

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20        # a frame larger than this is rejected before decoding
MAX_ROOM = 2**63 - 1
_MAC_BYTES = 32


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class KVPoll(enum.IntEnum):
    """Transfer status, ordered: an engine reduces ranks with MIN. Failed is sticky."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class PackedIndices(msgspec.Struct, frozen=True, array_like=True):
    """One component's item indices: little-endian int64 bytes and the absolute position of the first."""

    data: bytes
    first: int = 0

    @classmethod
    def pack(cls, indices: np.ndarray, first: int = 0) -> PackedIndices:
        return cls(np.ascontiguousarray(indices, dtype="<i8").tobytes(), int(first))

    def unpack(self) -> np.ndarray:
        if len(self.data) % 8:
            raise ProtocolError(f"packed indices of {len(self.data)} bytes are not a whole number of int64")
        return np.frombuffer(self.data, dtype="<i8").astype(np.int64)


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """Decode rank -> prefill rank, once per pair: my layout, my endpoint, my registered buffers."""

    version: int
    agent: str
    address: str
    role: Role
    layout: PoolLayout
    backend: str
    endpoint: bytes
    buffers: tuple[RemoteBuffers, ...]


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    """Prefill rank -> decode rank: accepted (with my layout) or refused with the reason."""

    version: int
    agent: str
    address: str
    accepted: bool
    reason: str
    layout: PoolLayout | None = None
    backend: str = ""
    endpoint: bytes = b""
    buffers: tuple[RemoteBuffers, ...] = ()


class TransferRequest(msgspec.Struct, frozen=True, tag="request", forbid_unknown_fields=True):
    """Decode rank -> prefill rank, once per request: where each component goes."""

    room: int
    agent: str
    dst_rank: int
    dst_size: int
    indices: dict[str, PackedIndices]
    prefix_len: int = 0
    #: staging fast path: component -> {prefill rank: byte offset reserved for it in our staging area}
    staging: dict[str, dict[int, int]] = {}


class Notice(msgspec.Struct, frozen=True, tag="notice", forbid_unknown_fields=True):
    """A component chunk landed (sent by the backend with the data, or by the control plane after it)."""

    room: int
    sender: int
    component: str
    chunk: int
    last: bool
    nbytes: int = 0
    first: int = 0          # for chunked components: index of the chunk's first item in the request
    count: int = 0          # and how many items it carries
    staged: bool = False    # the bytes sit in the receiver's staging area: scatter before counting


class StatusPush(msgspec.Struct, frozen=True, tag="status", forbid_unknown_fields=True):
    """Prefill -> decode: the room failed on the sender (with its reason)."""

    room: int
    agent: str
    status: KVPoll
    reason: str = ""


class Abort(msgspec.Struct, frozen=True, tag="abort", forbid_unknown_fields=True):
    """Either side aborts a room. ``quiesced``: the sender guarantees no write of it is in flight."""

    room: int
    agent: str
    reason: str
    quiesced: bool = False


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True):
    agent: str
    address: str
    seq: int


class Goodbye(msgspec.Struct, frozen=True, tag="goodbye", forbid_unknown_fields=True):
    agent: str


Message = Hello | Welcome | TransferRequest | Notice | StatusPush | Abort | Heartbeat | Goodbye


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    body: Message


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Envelope)


class Codec:
    """Encode/decode control frames; with a secret, every frame carries an HMAC-SHA256 tag."""

    def __init__(self, secret: bytes | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._secret = secret
        self.max_bytes = max_bytes

    def encode(self, message: Message) -> bytes:
        body = _ENCODER.encode(Envelope(PROTOCOL_VERSION, message))
        if len(body) > self.max_bytes:
            raise ProtocolError(f"{type(message).__name__} of {len(body)} bytes exceeds the {self.max_bytes}-byte limit")
        if self._secret is None:
            return body
        return hmac.new(self._secret, body, hashlib.sha256).digest() + body

    def decode(self, frame: bytes) -> Message:
        if len(frame) > self.max_bytes + (_MAC_BYTES if self._secret else 0):
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {self.max_bytes}-byte limit")
        if self._secret is not None:
            tag, frame = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
            if not hmac.compare_digest(tag, hmac.new(self._secret, frame, hashlib.sha256).digest()):
                raise ProtocolError("frame rejected: bad or missing HMAC (is the shared secret the same?)")
        version = _peek_version(frame)
        if version is not None and version != PROTOCOL_VERSION:
            raise VersionMismatch(version, msgspec.msgpack.decode(frame))
        try:
            envelope = _DECODER.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed frame: {exc}") from None
        except KVBridgeError as exc:   # a received layout that fails validation (GeometryError names the field)
            raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None
        _check_ranges(envelope.body)
        return envelope.body


class VersionMismatch(ProtocolError):
    """A well-formed frame of another protocol version; ``peer_version`` and the raw body are kept so a
    handshake can still be refused (or its refusal read) with the reason."""

    def __init__(self, peer_version: int, raw: object) -> None:
        self.peer_version, self.raw = peer_version, raw
        super().__init__(f"unknown protocol version {peer_version} (this side speaks {PROTOCOL_VERSION})")

    def field(self, name: str) -> object:
        body = self.raw[1] if isinstance(self.raw, list) and len(self.raw) > 1 else None
        return body.get(name) if isinstance(body, dict) else None


def _peek_version(frame: bytes) -> int | None:
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], int):
        return raw[0]
    return None


def _check_ranges(message: Message) -> None:
    room = getattr(message, "room", None)
    if room is not None and not 0 <= room <= MAX_ROOM:
        raise ProtocolError(f"room {room} is outside the 63-bit range")
    if isinstance(message, TransferRequest):
        if message.dst_size <= 0 or not 0 <= message.dst_rank < message.dst_size:
            raise ProtocolError(f"request for room {message.room}: rank {message.dst_rank} outside TP {message.dst_size}")
        if message.prefix_len < 0:
            raise ProtocolError(f"request for room {message.room}: negative prefix length {message.prefix_len}")
    if isinstance(message, Notice) and min(message.chunk, message.sender, message.nbytes, message.first,
                                           message.count) < 0:
        raise ProtocolError(f"notice for room {message.room}: negative chunk, sender, size or item range")
    if isinstance(message, (Hello, Welcome)):
        for buffers in message.buffers:
            for i, region in enumerate(buffers.regions):
                try:
                    region.region()
                except GeometryError as exc:
                    raise ProtocolError(f"{type(message).__name__} from {message.agent!r}: buffers of "
                                        f"{buffers.component!r} region {i}: {exc}") from None
    if isinstance(message, TransferRequest):
        for component, offsets in message.staging.items():
            if any(rank < 0 or offset < 0 for rank, offset in offsets.items()):
                raise ProtocolError(f"request for room {message.room}: negative staging offset for {component}")

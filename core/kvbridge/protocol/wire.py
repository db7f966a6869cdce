"""Control messages: one msgspec tagged union, an explicit protocol version, a size limit.

Index arrays travel packed (little-endian int32/int64 bytes), never as msgpack lists. Every decoded
message is validated here (version, size, field ranges) before anything acts on it.
"""

from __future__ import annotations

import enum
import hmac
import math
import threading
from typing import Annotated

import msgspec
import numpy as np

from kvbridge.errors import GeometryError, KVBridgeError, ProtocolError
from kvbridge.geometry import MAX_COMPONENTS, MAX_ITEM_DIMS, MAX_LAYOUT_BUFFERS, MAX_SHARD_GROUPS, PoolLayout
from kvbridge.protocol.records import RemoteBuffers
from kvbridge.sealing import TAG_BYTES, tag

# 9: TransferRequest carries the request's length in tokens, when the decode's engine knows it; 8: TransferRequest
# carries the decode room's trace context; 7: Abort names the request's nonce, Welcome the
# writer's lease; 6: Welcome names the writer's liveness listener (0.2.0); 5: digests, credits name the request
# (3dddad1, the end of wave 2); 4: staging rings; 3: layers, offsets
PROTOCOL_VERSION = 9
#: the oldest version this release still speaks (the releases before it: 0.2.0's 6 and wave 2's 5): an agent
#: negotiates the highest version both speak at the handshake and refuses anything older, naming both versions
#: (docs/integrity.md, "Version skew")
MIN_PROTOCOL_VERSION = 5
MAX_MESSAGE_BYTES = 16 << 20        # a frame larger than this is rejected before decoding
MAX_HANDSHAKE_BYTES = 4 << 20       # a Hello or Welcome larger than this is refused before decoding
MAX_ROOM = 2**63 - 1
MAX_TRACEPARENT = 128     # a W3C traceparent is 55 characters
_MAC_BYTES = TAG_BYTES


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


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello", forbid_unknown_fields=True):
    """Decode rank -> prefill rank, once per pair: my layout, my endpoint, my registered buffers."""

    version: int
    agent: str
    address: str
    role: Role
    layout: PoolLayout
    backend: str
    endpoint: bytes
    buffers: tuple[RemoteBuffers, ...]


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag="welcome", forbid_unknown_fields=True):
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
    liveness: str = ""          # host:port a decode connects to and holds: EOF there proves the writer exited
    writer_lease_s: float = 0.0  # 7: the prefill posts no write to this decode once this long passed since the
    #                              sent_at of its last heartbeat the decode echoed (0: no lease, as before 7)
    lease_epoch: int = 0        # 7: grows with every lease this prefill grants: a decode whose lease on this
    #                             writer ran out admits it again only through a Welcome of a newer epoch


def _without(message: type[msgspec.Struct], name: str, newer: frozenset[str], tag: str) -> type[msgspec.Struct]:
    """``message`` as an older protocol spells it: every field but ``newer`` (its decoders refuse unknown
    fields), so an older peer can read what we send it."""
    fields: list[tuple[str, object] | tuple[str, object, object]] = []
    for f in msgspec.structs.fields(message):
        if f.name not in newer:
            fields.append((f.name, f.type) if f.default is msgspec.NODEFAULT else (f.name, f.type, f.default))
    return msgspec.defstruct(name, fields, kw_only=True, frozen=True, tag=tag, forbid_unknown_fields=True)


#: protocol 6 (0.2.0): no write lease; protocol 5 (wave 2): no liveness listener either
_WelcomeV6 = _without(Welcome, "_WelcomeV6", frozenset({"writer_lease_s", "lease_epoch"}), "welcome")
_WelcomeV5 = _without(Welcome, "_WelcomeV5", frozenset({"writer_lease_s", "lease_epoch", "liveness"}), "welcome")


_SPEAKS = "this prefill speaks protocol "


def speaks_note() -> str:
    """The ``reason`` of an accepted Welcome this release sends in an older version (an accepted Welcome of 5
    leaves it unread): a decode that fell back only because of a refusal in that version learns the refusal was
    not this prefill's (a replayed or forged one) and says Hello again in its own version."""
    return f"{_SPEAKS}{PROTOCOL_VERSION}"


def noted_version(reason: str) -> int:
    """The version an accepted Welcome's ``reason`` says its prefill speaks (:func:`speaks_note`), else 0."""
    number = reason[len(_SPEAKS):] if reason.startswith(_SPEAKS) else ""
    return int(number) if number.isdigit() and len(number) < 6 else 0


def spoken_as(message: Message, version: int) -> msgspec.Struct:
    """``message`` as protocol ``version`` spells it (a Hello's or Welcome's own ``version`` field says it too).
    Versions 5 to 8 differ from 9 in the TransferRequest, which has no ``tokens`` before 9 and no ``trace`` before
    8; 5 and 6 differ from 7 in the Abort, which has no ``nonce`` before 7, and in the Welcome, which has no
    ``writer_lease_s`` before 7 and no ``liveness`` before 6 (their decoders refuse unknown fields); every other
    message is the same at 5 to 9."""
    if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise ProtocolError(f"cannot speak protocol version {version} (this side speaks {MIN_PROTOCOL_VERSION} "
                            f"to {PROTOCOL_VERSION})")
    if version < 6 and isinstance(message, Welcome):
        fields = {f: getattr(message, f) for f in _WelcomeV5.__struct_fields__}
        return _WelcomeV5(**{**fields, "version": version})
    if version < 7 and isinstance(message, Welcome):
        fields = {f: getattr(message, f) for f in _WelcomeV6.__struct_fields__}
        return _WelcomeV6(**{**fields, "version": version})
    if version < 8 and isinstance(message, TransferRequest):
        return _TransferRequestV7(**{f: getattr(message, f) for f in _TransferRequestV7.__struct_fields__})
    if version < 9 and isinstance(message, TransferRequest):
        return _TransferRequestV8(**{f: getattr(message, f) for f in _TransferRequestV8.__struct_fields__})
    if version < 7 and isinstance(message, Abort):
        return _AbortV6(**{f: getattr(message, f) for f in _AbortV6.__struct_fields__})
    if isinstance(message, (Hello, Welcome)) and message.version != version:
        return msgspec.structs.replace(message, version=version)
    return message


class TransferRequest(msgspec.Struct, frozen=True, kw_only=True, tag="request", forbid_unknown_fields=True):
    """Decode rank -> prefill rank, once per request: where each component goes."""

    room: int
    agent: str
    dst_rank: int
    dst_size: int
    indices: dict[str, PackedIndices]
    prefix_len: int = 0
    #: staging fast path: component -> {prefill rank: byte offset reserved for it in our staging area}
    staging: dict[str, dict[int, int]] = {}
    #: component -> {prefill rank: bytes reserved at that offset} where that is less than the whole slice: a
    #: ring the sender reuses piece by piece, as :class:`Credit` frees its slots (absent: the whole slice)
    staging_bytes: dict[str, dict[int, int]] = {}
    #: digest every write: notices carry a checksum of each (buffer, item) slice this rank receives
    digests: bool = False
    #: drawn at random per request: the request's credits carry it, so a credit of an earlier request that
    #: reused the room number frees no slot of this one
    nonce: int = 0
    #: the W3C ``traceparent`` of the decode room's span (protocol 8; "" when not traced): kvbridge.tracing
    trace: Annotated[str, msgspec.Meta(max_length=MAX_TRACEPARENT)] = ""
    #: the request's length in tokens, cached prefix included (protocol 9; 0: the decode's engine did not say): the
    #: prefill checks that its last chunk ends in the request's last page, on every rank of either page size
    tokens: int = 0


class Notice(msgspec.Struct, frozen=True, kw_only=True, tag="notice", forbid_unknown_fields=True):
    """A part of a component landed (sent by the backend with the data, or by the control plane after it).

    It completes the destination items ``[first, first + count)`` of the request in the component's layers
    ``[layer_first, layer_first + layer_count)`` (``layer_count == 0``: every layer). ``chunk`` numbers the
    notices of one (sender rank, component) from 0; the one marked ``last`` has the highest number.
    """

    room: int
    sender: int
    component: str
    chunk: int
    last: bool
    nbytes: int = 0
    first: int = 0          # index of the first destination item it completes, in the request's list
    count: int = 0          # and how many items
    staged: bool = False    # the bytes sit in the receiver's staging area: scatter before counting
    offset: int = 0         # staged: where, in bytes inside the receiver's reservation for (sender, component)
    layer_first: int = 0
    layer_count: int = 0    # 0: every layer of the component
    #: when the request asked for them: uint64 little-endian digests of the slice each (buffer, item) moved,
    #: buffer by buffer (the layers' buffers in layer order), item by item (``kvbridge.digests``)
    digests: bytes = b""


class Credit(msgspec.Struct, frozen=True, kw_only=True, tag="credit", forbid_unknown_fields=True):
    """Decode -> prefill rank: the staged piece ``chunk`` of ``component`` was scattered out of the ring, so
    the slot it used may be written again. Naming the piece makes a duplicate or a replay harmless."""

    room: int
    agent: str
    component: str
    chunk: int
    nonce: int = 0                             # the request's (TransferRequest.nonce)


class StatusPush(msgspec.Struct, frozen=True, kw_only=True, tag="status", forbid_unknown_fields=True):
    """Prefill -> decode: the room failed on the sender (with its reason)."""

    room: int
    agent: str
    status: KVPoll
    reason: str = ""


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort", forbid_unknown_fields=True):
    """Either side aborts a room. ``quiesced``: the sender guarantees no write of it is in flight. ``nonce``: the
    request it is about (``TransferRequest.nonce``; 0 from a peer of protocol 5 or 6): an acknowledgement of an
    earlier request that used the same room number must not fence the next one."""

    room: int
    agent: str
    reason: str
    quiesced: bool = False
    nonce: int = 0


_TransferRequestV7 = _without(TransferRequest, "_TransferRequestV7", frozenset({"trace", "tokens"}), "request")
_TransferRequestV8 = _without(TransferRequest, "_TransferRequestV8", frozenset({"tokens"}), "request")


class _AbortV6(msgspec.Struct, frozen=True, kw_only=True, tag="abort", forbid_unknown_fields=True):
    """An Abort as protocols 5 and 6 spell it (no ``nonce``: their decoders refuse unknown fields)."""

    room: int
    agent: str
    reason: str
    quiesced: bool = False


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", forbid_unknown_fields=True):
    """``sent_at``: the sender's monotonic clock when sent; ``echo``: the ``sent_at`` of the last heartbeat the
    sender got from the recipient, received ``echo_held`` seconds ago: the recipient's round trip is
    ``now - echo - echo_held`` on its own clock (no clocks compared across hosts)."""

    agent: str
    address: str
    seq: int
    sent_at: float = 0.0
    echo: float = 0.0
    echo_held: float = 0.0


class Goodbye(msgspec.Struct, frozen=True, kw_only=True, tag="goodbye", forbid_unknown_fields=True):
    agent: str


Message = Hello | Welcome | TransferRequest | Notice | Credit | StatusPush | Abort | Heartbeat | Goodbye


class Envelope(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """What travels around every message: who sent it (name, reply address, incarnation), which
    incarnation of the recipient it is for (0 only in a Hello, before the sender knows it), and the
    sender's sequence number towards that recipient. With a secret all of it is under the MAC."""

    version: int
    sender: str
    address: str
    incarnation: int
    to_incarnation: int
    seq: int
    body: Message


class _OutEnvelope(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """:class:`Envelope` as encoded: the body as the negotiated version spells it."""

    version: int
    sender: str
    address: str
    incarnation: int
    to_incarnation: int
    seq: int
    body: msgspec.Struct


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Envelope)
HANDSHAKES = frozenset({"hello", "welcome"})


class _Version(msgspec.Struct, array_like=True):
    """The first field of any version's envelope (the rest is skipped, not decoded)."""

    version: int


class Head(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """An envelope with its body left undecoded: who sent it, where to answer, and the body's bytes."""

    version: int
    sender: str
    address: str
    incarnation: int
    to_incarnation: int
    seq: int
    body: msgspec.Raw


class _Kind(msgspec.Struct):
    type: str = ""


# typed decoders built once (``msgspec.msgpack.decode(frame, type=T)`` looks its decoder up per call)
_VERSION = msgspec.msgpack.Decoder(_Version)
_HEAD = msgspec.msgpack.Decoder(Head)
_KIND = msgspec.msgpack.Decoder(_Kind)


# The shape of a handshake's layout and buffers: counts only (integers and raw items are decoded in C, no
# Python object per buffer), to refuse a layout above the bounds before it is built and validated.
class _ShardShape(msgspec.Struct):
    groups: list[msgspec.Raw] = []


class _BufferShape(msgspec.Struct):
    item_shape: list[msgspec.Raw] = []
    shard: _ShardShape | None = None


class _ComponentShape(msgspec.Struct):
    buffers: list[_BufferShape] = []


class _LayoutShape(msgspec.Struct):
    components: list[_ComponentShape] = []


class _RemoteShape(msgspec.Struct):
    regions: list[msgspec.Raw] = []


class _HandshakeShape(msgspec.Struct):
    layout: _LayoutShape | None = None
    buffers: list[_RemoteShape] = []


_SHAPE_DECODER = msgspec.msgpack.Decoder(_HandshakeShape)


def _check_handshake_shape(kind: str, body: bytes) -> None:
    """Refuse a Hello/Welcome whose layout or buffer list is larger than the bounds, before decoding it."""
    try:
        shape = _SHAPE_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {kind}: {exc}") from None
    comps = shape.layout.components if shape.layout is not None else []
    buffers = sum(len(c.buffers) for c in comps)
    regions = sum(len(b.regions) for b in shape.buffers)
    if len(comps) > MAX_COMPONENTS or buffers > MAX_LAYOUT_BUFFERS:
        raise ProtocolError(f"its layout has {len(comps)} components of {buffers} buffers: at most {MAX_COMPONENTS} "
                            f"components and at most {MAX_LAYOUT_BUFFERS} buffers per layout")
    if len(shape.buffers) > MAX_COMPONENTS + 1 or regions > MAX_LAYOUT_BUFFERS + 1:
        raise ProtocolError(f"it registers {regions} regions in {len(shape.buffers)} components: at most "
                            f"{MAX_LAYOUT_BUFFERS} buffers per layout")
    for c in comps:
        for b in c.buffers:
            if len(b.item_shape) > MAX_ITEM_DIMS or (b.shard is not None and len(b.shard.groups) > MAX_SHARD_GROUPS):
                raise ProtocolError(f"a buffer's item_shape has {len(b.item_shape)} axes (at most {MAX_ITEM_DIMS}) or "
                                    f"its shard more than {MAX_SHARD_GROUPS} groups")


class Sealed(msgspec.Struct, frozen=True, kw_only=True):
    """A frame whose size, MAC and version were checked (``Codec.check``) but whose body is not decoded yet."""

    head: Head
    kind: str              # the body's tag ("hello", "notice", ...)
    frame: bytes           # the envelope's bytes, without the MAC


class RefusedHandshake(ProtocolError):
    """A Hello or Welcome that cannot be used (above a bound, or its layout fails validation): the head says
    where to send the refusal, ``reason`` says why."""

    def __init__(self, head: Head, kind: str, reason: str) -> None:
        self.head, self.kind, self.reason = head, kind, reason
        super().__init__(f"{kind.capitalize()} from {head.sender!r} at {head.address!r} refused: {reason}")


class ReplayWindow:
    """Sequence numbers seen from one sender incarnation: the highest and a bitmap of the 1,024 below it.

    Frames may arrive out of order (the engine's notification channel and the control link race), so a
    window, not a strict counter; anything older than the window or seen before is a replay.
    """

    SIZE = 1024

    def __init__(self) -> None:
        self._top = 0
        self._seen = 0        # bit i: top - i was seen

    @property
    def top(self) -> int:
        """The highest sequence number seen (0: none)."""
        return self._top

    def accept(self, seq: int) -> bool:
        if seq <= 0:
            return False
        if seq > self._top:
            shift = seq - self._top
            self._seen = ((self._seen << shift) | 1) & ((1 << self.SIZE) - 1) if shift < self.SIZE else 1
            self._top = seq
            return True
        offset = self._top - seq
        if offset >= self.SIZE or self._seen >> offset & 1:
            return False
        self._seen |= 1 << offset
        return True


class Codec:
    """Encode/decode control frames for one agent; with a secret, every frame carries an HMAC-SHA256 tag
    over the recipient's address and the whole envelope (sender, incarnations, sequence, message).

        codec = Codec(b"secret", sender="decode-0", address="tcp://10.0.0.2:5000", incarnation=7)
        frame = codec.encode(hello, to="tcp://10.0.0.1:5000")
        envelope = peer_codec.open(frame)           # raises ProtocolError unless authentic and well-formed
    """

    def __init__(self, secret: bytes | None = None, max_bytes: int = MAX_MESSAGE_BYTES, *, sender: str = "",
                 address: str = "", incarnation: int = 0) -> None:
        self._secret = secret
        self.max_bytes = max_bytes
        self.sender, self.address, self.incarnation = sender, address, incarnation
        self._seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        # (address, incarnation) -> the protocol version negotiated with that peer, where below ours
        self._versions: dict[tuple[str, int], int] = {}

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def speak(self, address: str, incarnation: int, version: int) -> None:
        """Frames for that peer incarnation use protocol ``version`` (negotiated at its handshake)."""
        spoken_as(Goodbye(agent=""), version)       # refuses a version this side cannot speak
        if version == PROTOCOL_VERSION:
            self._versions.pop((address, incarnation), None)
        else:
            self._versions[(address, incarnation)] = version

    def forget(self, address: str, incarnation: int) -> None:
        self._versions.pop((address, incarnation), None)

    def version_for(self, address: str, incarnation: int) -> int:
        return self._versions.get((address, incarnation), PROTOCOL_VERSION)

    def last_seq(self, to: str) -> int:
        """The sequence number of the latest frame encoded for the agent at ``to`` (0: none yet)."""
        with self._seq_lock:
            return self._seq.get(to, 0)

    def encode(self, message: Message, *, to: str = "", to_incarnation: int = 0, version: int | None = None) -> bytes:
        """One frame for the agent listening at ``to`` (its incarnation if known), in ``version`` (default: the
        version negotiated with that peer incarnation, else ours)."""
        if version is None:
            version = self._versions.get((to, to_incarnation), PROTOCOL_VERSION)
        spoken = spoken_as(message, version)
        with self._seq_lock:
            seq = self._seq[to] = self._seq.get(to, 0) + 1
        body = _ENCODER.encode(_OutEnvelope(version=version, sender=self.sender, address=self.address,
                                            incarnation=self.incarnation, to_incarnation=to_incarnation, seq=seq,
                                            body=spoken))
        if len(body) > self.max_bytes:
            raise ProtocolError(f"{type(message).__name__} of {len(body)} bytes exceeds the "
                                f"{self.max_bytes}-byte limit")
        if self._secret is None:
            return body
        return self._tag(to, body) + body

    def _tag(self, recipient: str, body: bytes) -> bytes:
        assert self._secret is not None
        return tag(self._secret, recipient.encode(), body)      # kvbridge.sealing: purpose = the recipient

    def open(self, frame: bytes) -> Envelope:
        """Check size, MAC (bound to our address), version and field ranges; the whole envelope."""
        return self.unseal(self.check(frame))

    def check(self, frame: bytes) -> Sealed:
        """The cheap checks, before the body is decoded: size, MAC, version, the body's kind, and for a
        handshake its size (``MAX_HANDSHAKE_BYTES``) and the size of its layout (``kvbridge.geometry``'s
        bounds). A handshake above a bound raises :class:`RefusedHandshake` (the caller may answer it)."""
        if len(frame) > self.max_bytes + (_MAC_BYTES if self._secret else 0):
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {self.max_bytes}-byte limit")
        if self._secret is not None:
            got, frame = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
            if not hmac.compare_digest(got, self._tag(self.address, frame)):
                raise ProtocolError("frame rejected: bad or missing HMAC (is the shared secret the same, and "
                                    "was the frame meant for this agent?)")
        version = _peek_version(frame)
        if version is not None and not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raw = msgspec.msgpack.decode(frame) if len(frame) <= MAX_HANDSHAKE_BYTES else None
            raise VersionMismatch(version, raw)
        try:
            head = _HEAD.decode(frame)
            kind = _KIND.decode(head.body).type
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed frame: {exc}") from None
        if kind in HANDSHAKES:
            if len(frame) > MAX_HANDSHAKE_BYTES:
                raise RefusedHandshake(head, kind, f"{kind.capitalize()} of {len(frame)} bytes exceeds the "
                                                   f"{MAX_HANDSHAKE_BYTES}-byte limit of a handshake")
            try:
                _check_handshake_shape(kind, head.body)
            except ProtocolError as exc:
                raise RefusedHandshake(head, kind, str(exc)) from None
        return Sealed(head=head, kind=kind, frame=frame)

    def unseal(self, sealed: Sealed) -> Envelope:
        """Decode and validate a checked frame (the expensive part: may run without any lock held)."""
        try:
            envelope = _DECODER.decode(sealed.frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if sealed.kind in HANDSHAKES:
                raise RefusedHandshake(sealed.head, sealed.kind, f"malformed frame: {exc}") from None
            raise ProtocolError(f"malformed frame: {exc}") from None
        except KVBridgeError as exc:   # a received layout that fails validation (GeometryError names the field)
            why = f"malformed frame: {type(exc).__name__}: {exc}"
            if sealed.kind in HANDSHAKES:
                raise RefusedHandshake(sealed.head, sealed.kind, why) from None
            raise ProtocolError(why) from None
        try:
            _check_ranges(envelope.body)
            if envelope.version < 6 and isinstance(envelope.body, Welcome) and envelope.body.liveness:
                raise ProtocolError(f"Welcome of protocol {envelope.version} names a liveness listener (a field "
                                    "of 6)")
            if envelope.version < 7 and isinstance(envelope.body, Welcome) and (envelope.body.writer_lease_s
                                                                                or envelope.body.lease_epoch):
                raise ProtocolError(f"Welcome of protocol {envelope.version} names a writer lease (a field of 7)")
            if envelope.version < 8 and isinstance(envelope.body, TransferRequest) and envelope.body.trace:
                raise ProtocolError(f"TransferRequest of protocol {envelope.version} names a trace (a field of 8)")
            if envelope.version < 9 and isinstance(envelope.body, TransferRequest) and envelope.body.tokens:
                raise ProtocolError(f"TransferRequest of protocol {envelope.version} names its length (a field of 9)")
            if isinstance(envelope.body, (Hello, Welcome)) and envelope.body.version != envelope.version:
                raise ProtocolError(f"{type(envelope.body).__name__} says version {envelope.body.version} in a "
                                    f"frame of version {envelope.version}")
        except ProtocolError as exc:
            if sealed.kind in HANDSHAKES:
                raise RefusedHandshake(sealed.head, sealed.kind, str(exc)) from None
            raise
        agent = getattr(envelope.body, "agent", None)
        if agent is not None and agent != envelope.sender:
            raise ProtocolError(f"{type(envelope.body).__name__} names agent {agent!r} but comes from "
                                f"{envelope.sender!r}")
        return envelope

    def kind(self, frame: bytes) -> str:
        """The body's tag of a frame, unauthenticated and without decoding the body ("" if unreadable): only
        for deciding where a frame is decoded, never for acting on it."""
        body = frame[_MAC_BYTES:] if self._secret is not None else frame
        try:
            head = _HEAD.decode(body)
            return _KIND.decode(head.body).type
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):   # garbage: bytes that are not UTF-8
            return ""

    def decode(self, frame: bytes) -> Message:
        """The message of a frame (see ``open`` for the checks)."""
        return self.open(frame).body


class VersionMismatch(ProtocolError):
    """A well-formed frame of another protocol version; ``peer_version`` and the raw body are kept so a
    handshake can still be refused (or its refusal read) with the reason."""

    def __init__(self, peer_version: int, raw: object) -> None:
        self.peer_version, self.raw = peer_version, raw
        super().__init__(f"unknown protocol version {peer_version} (this side speaks {MIN_PROTOCOL_VERSION} to "
                         f"{PROTOCOL_VERSION})")

    def field(self, name: str) -> object:
        body = self.raw[-1] if isinstance(self.raw, list) and len(self.raw) > 1 else None
        return body.get(name) if isinstance(body, dict) else None


def _peek_version(frame: bytes) -> int | None:
    """The envelope's first field if it is an integer (nothing after it is decoded)."""
    try:
        return _VERSION.decode(frame).version
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError):
        return None


def _check_ranges(message: Message) -> None:
    room = getattr(message, "room", None)
    if room is not None and not 0 <= room <= MAX_ROOM:
        raise ProtocolError(f"room {room} is outside the 63-bit range")
    if isinstance(message, TransferRequest):
        if message.dst_size <= 0 or not 0 <= message.dst_rank < message.dst_size:
            raise ProtocolError(f"request for room {message.room}: rank {message.dst_rank} outside TP "
                                f"{message.dst_size}")
        if message.prefix_len < 0:
            raise ProtocolError(f"request for room {message.room}: negative prefix length {message.prefix_len}")
        if message.tokens < 0 or (message.tokens and message.prefix_len > message.tokens):
            raise ProtocolError(f"request for room {message.room}: a {message.tokens}-token request with a prefix of "
                                f"{message.prefix_len} tokens")
    if isinstance(message, Notice) and min(message.chunk, message.sender, message.nbytes, message.first,
                                           message.count, message.offset, message.layer_first,
                                           message.layer_count) < 0:
        raise ProtocolError(f"notice for room {message.room}: negative chunk, sender, size, item, layer or "
                            "offset field")
    if isinstance(message, Welcome) and message.lease_epoch < 0:
        raise ProtocolError(f"Welcome from {message.agent!r}: negative lease epoch {message.lease_epoch}")
    if isinstance(message, Welcome) and not 0 <= message.writer_lease_s < math.inf:
        raise ProtocolError(f"Welcome from {message.agent!r}: writer lease {message.writer_lease_s!r} s is not a "
                            "finite number >= 0")
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

"""The one sealing scheme: everything kvbridge authenticates with the shared secret is tagged here.

A tag is HMAC-SHA256 over a **purpose** (what the bytes are for, so bytes sealed for one use are refused in
another) followed by the parts that bind it (the body, and for example the key or the request's nonce), each
part after a zero byte. Freshness comes in two forms: a stream numbers its frames (the agent codec: a per-sender
sequence in the sealed envelope, checked by the peer table), and single requests carry a **nonce and a time**,
accepted once and only inside the clock window (:class:`FreshnessGuard`).

Who uses which purpose:

=======================  ===========================================  ==============================
sealed bytes             purpose                                      bound to
=======================  ===========================================  ==============================
agent control frame      the recipient's address (protocol 5 layout)  body (sequence inside)
ZMQ bootstrap request    ``bootstrap-request``                        body (nonce, time inside)
ZMQ bootstrap answer     ``bootstrap-answer``                         body (the request's nonce inside)
discovery record         ``kvbridge-discovery-record``                store key, body
SGLang HTTP request      ``kvbridge-sglang-request``                  method, path, nonce, time, body
SGLang HTTP answer       ``kvbridge-sglang-answer``                   the request's nonce, body
=======================  ===========================================  ==============================

Example::

    >>> sealed = seal(b"k" * 32, b"bootstrap-request", b"body")
    >>> unseal(b"k" * 32, b"bootstrap-request", sealed)
    b'body'
    >>> unseal(b"k" * 32, b"bootstrap-answer", sealed)
    Traceback (most recent call last):
    ...
    kvbridge.sealing.BadTag: bad or missing HMAC (is the shared secret the same?)
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections import OrderedDict

__all__ = ["NONCE_BYTES", "TAG_BYTES", "BadTag", "Busy", "FreshnessGuard", "Replayed", "Stale", "matches",
           "new_nonce", "seal", "tag", "unseal"]

TAG_BYTES = 32
NONCE_BYTES = 16


class BadTag(ValueError):
    """The bytes were not sealed with this secret for this purpose (forged, altered or misdirected)."""


class Stale(ValueError):
    """An authentic request whose time lies outside the clock window (clock skew, or a replay from long ago)."""

    def __init__(self, offset_s: float, window_s: float) -> None:
        super().__init__(f"request time is {offset_s:+.1f} s off this clock, outside the {window_s:g} s window")
        self.offset_s = offset_s
        self.window_s = window_s


class Replayed(ValueError):
    """A request whose nonce was already accepted (or that has none)."""


class Busy(ValueError):
    """The guard holds as many live nonces as it may: a new request is refused rather than a nonce forgotten
    while its request could still be replayed."""


def tag(secret: bytes, purpose: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``purpose``, then each part after a zero byte."""
    mac = hmac.new(secret, purpose, hashlib.sha256)
    for part in parts:
        mac.update(b"\0")
        mac.update(part)
    return mac.digest()


def matches(secret: bytes, purpose: bytes, got: bytes, *parts: bytes) -> bool:
    """Whether ``got`` is the tag of ``parts`` for ``purpose`` (constant-time comparison)."""
    return len(got) == TAG_BYTES and hmac.compare_digest(got, tag(secret, purpose, *parts))


def seal(secret: bytes | None, purpose: bytes, body: bytes, *bound: bytes) -> bytes:
    """``tag + body`` (``body`` unchanged without a secret); ``bound`` parts are tagged but not carried."""
    return body if secret is None else tag(secret, purpose, *bound, body) + body


def unseal(secret: bytes | None, purpose: bytes, sealed: bytes, *bound: bytes) -> bytes:
    """The body of :func:`seal`'s bytes; raises :class:`BadTag` when the tag does not match."""
    if secret is None:
        return sealed
    got, body = sealed[:TAG_BYTES], sealed[TAG_BYTES:]
    if not matches(secret, purpose, got, *bound, body):
        raise BadTag("bad or missing HMAC (is the shared secret the same?)")
    return body


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class FreshnessGuard:
    """Accept each request nonce once, and only while the request's time is inside ``window_s`` of ``now``.

    Pure: the caller passes its clock's ``now``. A nonce is remembered until its request would be refused as stale
    anyway (its time plus the window); at most ``capacity`` are held, and when that many are live a new request
    is refused (:class:`Busy`) instead of forgetting one that could still be replayed.

        >>> guard = FreshnessGuard(window_s=60.0)
        >>> guard.admit(b"n" * 16, sent_at=1000.0, now=1001.0)
        >>> guard.admit(b"n" * 16, sent_at=1000.0, now=1002.0)
        Traceback (most recent call last):
        ...
        kvbridge.sealing.Replayed: replayed request (its nonce was already accepted)
    """

    def __init__(self, *, window_s: float, capacity: int = 1 << 16) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.window_s = window_s
        self.capacity = capacity
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def admit(self, nonce: bytes, *, sent_at: float, now: float) -> None:
        """Raise :class:`Replayed` (no nonce, or one seen before), :class:`Stale` or :class:`Busy`; else remember
        ``nonce`` until ``sent_at + window_s``."""
        if len(nonce) < NONCE_BYTES:
            raise Replayed(f"unnumbered request (a nonce of {len(nonce)} bytes, {NONCE_BYTES} needed)")
        offset = sent_at - now
        if not abs(offset) <= self.window_s:                # NaN too
            raise Stale(offset, self.window_s)
        if nonce in self._seen:
            raise Replayed("replayed request (its nonce was already accepted)")
        while self._seen and next(iter(self._seen.values())) < now:      # expired: would be refused as stale
            self._seen.popitem(last=False)
        if len(self._seen) >= self.capacity:
            raise Busy(f"{len(self._seen)} requests inside the {self.window_s:g} s window already: refused, try "
                       "again shortly")
        self._seen[nonce] = sent_at + self.window_s

    def __len__(self) -> int:
        return len(self._seen)

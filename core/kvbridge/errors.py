"""The error taxonomy. Every error names the thing that is wrong (buffer, plugin, peer, room)."""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base of every error kvbridge raises on purpose."""


class GeometryError(KVBridgeError, ValueError):
    """A buffer or component description is inconsistent (names the buffer)."""


class UnsupportedTopology(KVBridgeError):
    """The prefill/decode TP sizes (or the model's head count) cannot be resharded exactly."""


class PluginError(KVBridgeError):
    """Base of registry / plugin loading problems."""


class PluginConflictError(PluginError):
    """Two different plugins claim one backend or state-type name."""


class PluginUnavailableError(PluginError):
    """A plugin is installed but cannot run here (missing native library, hardware...)."""

    def __init__(self, name: str, reason: str, hint: str = "") -> None:
        self.name, self.reason, self.hint = name, reason, hint
        text = f"plugin {name!r} is unavailable: {reason}"
        super().__init__(f"{text} (hint: {hint})" if hint else text)


class UnknownPluginError(PluginError, LookupError):
    """No plugin of that name is registered."""


class RegionError(KVBridgeError):
    """A descriptor points outside every registered memory region."""


class TransferError(KVBridgeError):
    """A transfer failed; carries the room and the engine's reason."""

    def __init__(self, room: int, reason: str) -> None:
        self.room, self.reason = room, reason
        super().__init__(f"room {room}: {reason}")


class IncompatiblePeer(KVBridgeError):
    """The peer's pool layout or protocol cannot be paired with ours (the message says why)."""


class ProtocolError(KVBridgeError):
    """A control message is malformed, oversize, of an unknown version or out of range."""


class Draining(KVBridgeError):
    """The agent is draining (``TransferAgent.drain``): it takes no new rooms; route the request elsewhere."""


class InsecureSetup(KVBridgeError, ValueError):
    """A control endpoint that other hosts can reach, without a shared secret and without ``allow_insecure``."""

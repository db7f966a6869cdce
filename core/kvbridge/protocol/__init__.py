"""The protocol layer: the state machines of rooms, writes and peers (``kvbridge.protocol.states``)."""

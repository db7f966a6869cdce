"""The protocol layer: what travels between ranks and the state machines that act on it.

* ``kvbridge.protocol.wire``: the control messages (one msgspec tagged union), the codec, the version;
* ``kvbridge.protocol.records``: the buffer records a Hello/Welcome carries and a backend receives
  (``RegionWire``, ``RemoteBuffers``, ``PeerInfo``; plugins import them from ``kvbridge.plugin``);
* ``kvbridge.protocol.states``: the state machines of rooms, writes and peers;
* ``kvbridge.protocol.events``: the room events an engine takes.
"""

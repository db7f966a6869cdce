"""One rank's transfer agent, and the per-request Sender (prefill) and Receiver (decode).

    hub = LocalHub()
    prefill = TransferAgent(layout=p_layout, buffers=p_arrays, role=Role.PREFILL, link=hub.link("p0"),
                            instance="llama")
    decode = TransferAgent(layout=d_layout, buffers=d_arrays, role=Role.DECODE, link=hub.link("d0"))
    decode.connect("llama")                              # handshake with the ranks the TP mapping assigns
    receiver = decode.receiver(room=42, instance="llama")
    receiver.send_metadata({"kv": dst_pages})
    sender = prefill.sender(room=42)
    sender.send(src_pages, last=True)
    while receiver.poll() < KVPoll.Success: ...          # Failed (0) < ... < Success (4)
    for event in decode.events(): ...                    # or: rooms finished / failed / safe since last call

Modules, one concern each (all internal except the names exported here):

- ``transfer_agent``: lifecycle and the progress loop; composes the parts below
- ``peers``: admission of every frame (incarnations, replays), Hello/Welcome, heartbeats, silence, death,
  release of departed peers
- ``handshake``: a typed record per ``connect()``, refusal reasons, the Hello rate limit
- ``prefill``: send rooms, decode requests (early queue), completion of writes, acknowledgements
- ``posting``: a chunk validated for every component and decode rank, then posted (staged or planned)
- ``send_room``: the records of a prefill room and its writes in flight
- ``decode``: receive rooms, requests to prefill ranks, notices, coverage, staged scatter, fences
- ``handles``: ``Sender`` / ``Receiver``, thin over the role objects
- ``buffers``: registration, byte views, the staging area
- ``plans``: per (peer, component) slice / buffer-pair / staging-row caches
- ``layers``: which buffers hold which model layer (layer-wise sends)
- ``context``: what the parts share (identity, layout, backend, link, codec, lock)
- ``config``: ``AgentConfig`` and protocol constants

Room, write and peer states change only through the transition tables of ``kvbridge.protocol.states``;
``RoomEvent`` s come from ``kvbridge.protocol.events``.
"""

from kvbridge.agent.config import AgentConfig
from kvbridge.agent.handles import Receiver, Sender
from kvbridge.agent.handshake import Handshake
from kvbridge.agent.transfer_agent import TransferAgent
from kvbridge.links import LocalHub
from kvbridge.protocol.events import RoomEvent, RoomEventKind
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.settings import Settings, load_settings
from kvbridge.zmq_link import BootstrapServer, ZmqLink

# What an engine needs, from this one public module: the agent and its handles, the poll states and roles,
# the control links (ZMQ, or the in-process hub for tests) and the settings loader.
__all__ = ["AgentConfig", "BootstrapServer", "Handshake", "KVPoll", "LocalHub", "Receiver", "Role", "RoomEvent",
           "RoomEventKind", "Sender", "Settings", "TransferAgent", "ZmqLink", "load_settings"]

"""The decode manager's recheck of a prefill server's topology, in one process against real bootstrap servers started
one after another at the same port (agents and kvbridge receivers are stand-ins): an unreachable server changes
nothing until it failed SGLang's heartbeat count in a row, then only its ranks kvbridge also found silent past their
write lease (or, without one, the peer timeout) are declared gone; a healthy one is never taken for a restart, a new
server life retires the old agents once (also while its ranks are still registering), its complete topology is
cached (another TP size included), an unusable one is refused with the reason; a receiver that never reached the old
server reopens, one in flight fails with the reason; retired agents close only once idle. Runs in .venv-sglang
(SGLang's base classes)."""

from __future__ import annotations

from _rig import need_sglang, run_script

SCRIPT = r'''
import socket, sys, threading, time
sys.path.insert(0, "adapters/sglang/tests")
from _cpu_torch import allow_cpu_torchvision
allow_cpu_torchvision()        # torchvision's CPU operator schemas, before SGLang imports it
from kvbridge.errors import KVBridgeError
from kvbridge.protocol.wire import KVPoll
from kvbridge_sglang import bootstrap
from kvbridge_sglang.bootstrap import TopologyServer
from kvbridge_sglang.conn import KVBridgeKVManager, KVBridgeKVReceiver
from kvbridge_sglang.settings import Settings

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
addr = f"127.0.0.1:{port}"

def row(tp_rank, tp_size, page=4):
    return {"dp_rank": 0, "pp_rank": 0, "tp_rank": tp_rank, "dp_size": 1, "pp_size": 1, "tp_size": tp_size,
            "start_layer": 0, "end_layer": 2, "page_size": page, "kv_cache_dtype": "bfloat16",
            "instance": "sglang-dp0-pp0", "backend": "loopback"}

class Rooms:
    def __init__(self): self.rooms = {}
class Peers:
    def __init__(self): self.peers = {}
class Context:
    def __init__(self):
        self.lock, self.now = threading.RLock(), 1000.0
        self.config = type("Config", (), {"peer_timeout_s": 10.0})()
    def clock(self): return self.now
class Agent:
    def __init__(self, name):
        self.name, self.decode, self.closed = name, Rooms(), False
        self.peers, self.context, self.declared = Peers(), Context(), []
    def close(self): self.closed = True
    def declare_gone(self, agent): self.declared.append(agent)
class Rx:
    """A kvbridge Receiver stand-in."""
    def __init__(self, status): self.status, self.aborted, self.cleared, self.safe_to_reuse = status, "", False, True
    def poll(self): return self.status
    def abort(self, reason): self.aborted = reason
    def clear(self): self.cleared = True
    failure_reason = "old server gone"

mgr = KVBridgeKVManager.__new__(KVBridgeKVManager)
mgr.settings = Settings.from_env(env={"KVBRIDGE_BACKEND": "loopback", "KVBRIDGE_TOPOLOGY_RECHECK_S": "0.2",
                                      "KVBRIDGE_BOOTSTRAP_TIMEOUT_S": "30"})
mgr._lock, mgr._closed, mgr._stop, mgr._watcher = threading.RLock(), False, threading.Event(), None
mgr.agents, mgr.topologies, mgr.prefill_info_table, mgr.epochs, mgr.retired = {}, {}, {}, {}, {}
mgr.restarts, mgr.page_size, mgr.pp_size, mgr.failure_records = 0, 4, 1, {}
mgr._unreachable = {}
import weakref
mgr._receivers = weakref.WeakValueDictionary()
mgr._watch = lambda: None       # the test drives _recheck itself

# life A: TP 1, complete
a = TopologyServer("127.0.0.1", port)
bootstrap.register(addr, row(0, 1))
assert mgr.try_ensure_parallel_info(addr) and mgr.prefill_info_table[addr].attn_tp_size == 1
old = mgr.agents[(addr, 0, 0)] = Agent("old")
for _ in range(5):                                   # a healthy server is never taken for a restart
    mgr._recheck(addr)
assert mgr.restarts == 0 and mgr.agents[(addr, 0, 0)] is old and addr in mgr.prefill_info_table

def receiver(room, status, metadata=False):
    rx = KVBridgeKVReceiver.__new__(KVBridgeKVReceiver)
    rx.kv_mgr, rx.bootstrap_addr, rx.bootstrap_room, rx.prefill_dp_rank = mgr, addr, room, 0
    rx._parts, rx.bootstrap_infos = [(None, old, Rx(status))], [None]
    rx._reason, rx._failed, rx._metadata, rx.abort_notified, rx.conclude_state = "", False, metadata, False, None
    rx._restarts, rx._reopen_by = mgr.restarts, None
    mgr._receivers[room] = rx
    return rx
waiting = receiver(1, KVPoll.Bootstrapping)                  # never reached the old server
flight = receiver(2, KVPoll.Transferring, metadata=True)     # the old server was writing it
old_rx_waiting, old_rx_flight = waiting._parts[0][2], flight._parts[0][2]
old.decode.rooms = {1: 1, 2: 2}

# the server is gone: nothing changes but SGLang's heartbeat count; once it failed twice in a row (SGLang's
# default), the ranks kvbridge also found silent past their write lease are declared gone, no other
from types import SimpleNamespace
from kvbridge.protocol.states import PeerState
now = old.context.now
old.peers.peers = {
    "talking": SimpleNamespace(agent="talking", state=PeerState.ALIVE, last_seen=now - 0.5, writer_lease_s=20.0),
    "in-lease": SimpleNamespace(agent="in-lease", state=PeerState.SILENT, last_seen=now - 15.0, writer_lease_s=20.0),
    "past": SimpleNamespace(agent="past", state=PeerState.SILENT, last_seen=now - 25.0, writer_lease_s=20.0),
    "no-lease": SimpleNamespace(agent="no-lease", state=PeerState.SILENT, last_seen=now - 11.0, writer_lease_s=0.0)}
a.close()
mgr._recheck(addr)
assert mgr.restarts == 0 and mgr.agents.get((addr, 0, 0)) is old and addr in mgr.prefill_info_table
assert old.declared == [] and mgr._unreachable[addr] == 1, (old.declared, mgr._unreachable)
mgr._recheck(addr)
assert sorted(old.declared) == ["no-lease", "past"], old.declared
assert mgr.restarts == 0 and mgr.agents.get((addr, 0, 0)) is old
old.peers.peers, old.declared = {}, []

# life B at the same port, its ranks still registering: the old agents are retired once, the cache dropped
b = TopologyServer("127.0.0.1", port)
bootstrap.register(addr, row(0, 2))
mgr._recheck(addr)
assert addr not in mgr._unreachable            # reachable again: the count starts over
mgr._recheck(addr)
assert mgr.restarts == 1 and old in mgr.retired and not mgr.agents, (mgr.restarts, mgr.retired, mgr.agents)
assert addr not in mgr.prefill_info_table and "restarted" in mgr.retired[old][0]
assert not mgr.try_ensure_parallel_info(addr)                # incomplete: SGLang's loop waits
# receivers: the one in flight fails with the reason; the other waits to reopen on the new server
assert flight.poll() == 0 and "restarted" in flight._reason and "in flight" in flight._reason, flight._reason
assert old_rx_flight.aborted and not old_rx_flight.cleared
opened = []
def fake_open():
    opened.append((mgr.prefill_info_table[addr].attn_tp_size, waiting.prefill_dp_rank))
    waiting._parts.append((None, Agent("new"), Rx(KVPoll.WaitingForInput)))
waiting._open = fake_open
waiting.prefill_dp_rank = 3        # routed for the old server's DP size: the new one has DP 1
assert waiting.poll() == 1 and not waiting._failed and old_rx_waiting.cleared and not waiting._parts
old.decode.rooms = {2: 2}
# the old agent keeps a room (fenced, not cleared): not closed
mgr._close_retired(idle_only=True)
assert not old.closed and old in mgr.retired

# life B complete with TP 2: cached by the recheck, no second retirement
bootstrap.register(addr, row(1, 2))
mgr._recheck(addr)
assert mgr.restarts == 1 and mgr.prefill_info_table[addr].attn_tp_size == 2
assert waiting.poll() == 2 and opened == [(2, 0)], (opened, waiting._reason)
mgr.agents[(addr, 0, 0)] = Agent("b")
for _ in range(3):
    mgr._recheck(addr)
assert mgr.restarts == 1 and mgr.agents[(addr, 0, 0)].name == "b"

# the room is cleared: the retired agent closes once idle (not before one recheck interval)
old.decode.rooms = {}
time.sleep(0.25)
mgr._close_retired(idle_only=True)
assert old.closed and old not in mgr.retired

# life C with another page size: a restart like any other (kvbridge pairs pages of two sizes, or its handshake
# refuses, naming why, a page it cannot cut): the old agents retired, the new topology cached with its page size
b.close()
c = TopologyServer("127.0.0.1", port)
bootstrap.register(addr, row(0, 1, page=16))
mgr._recheck(addr)
assert mgr.restarts == 2 and not mgr.agents, (mgr.restarts, mgr.agents)
assert mgr.try_ensure_parallel_info(addr) and mgr.prefill_info_table[addr].page_size == 16
c.close()
print("ok")
'''


def test_recheck_finds_a_restarted_server_and_nothing_else() -> None:
    need_sglang()
    rc, output = run_script(SCRIPT, timeout_s=240)
    assert rc == 0 and output.strip().endswith("ok"), output[-6000:]

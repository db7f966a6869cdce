"""How kvbridge-sglang lets a request go. SGLang's scheduler calls a sender's clear() (or abort()) once, whatever the
room's state; the adapter once kept such senders for a reaper thread of its own, which raced the scheduler's clear()
and died silently on the error (deferred clears stopped for good). Now the room goes to kvbridge's
``clear_when_safe()`` exactly once and the adapter keeps the final status: no thread, nothing to race. The end-to-end
check (rooms let go are gone from the agent, no adapter thread) is in test_adversary_abort. Runs in .venv-sglang."""

from __future__ import annotations

from _rig import need_sglang, run_script

SCRIPT = r'''
import sys
sys.path.insert(0, "adapters/sglang/tests")
from _cpu_torch import allow_cpu_torchvision
allow_cpu_torchvision()        # torchvision's CPU operator schemas, before SGLang imports it
from sglang.srt.disaggregation.base.conn import KVPoll
from kvbridge.protocol.wire import KVPoll as Status
from kvbridge_sglang.conn import KVBridgeKVManager, KVBridgeKVSender

class Room:
    """A kvbridge Sender stand-in that records what the adapter asks of it."""
    def __init__(self, status):
        self.status, self.calls, self.failure_reason = status, [], ""
        self.stats = (0, 0)
    def poll(self):
        self.calls.append("poll")
        return self.status
    def abort(self, reason=""):
        self.calls.append("abort")
        self.status, self.failure_reason = Status.Failed, reason
    def clear_when_safe(self):
        self.calls.append("clear_when_safe")
    def clear(self):
        raise AssertionError("the adapter must not clear a room itself")

def sender(room):
    s = KVBridgeKVSender.__new__(KVBridgeKVSender)
    s.kv_mgr = KVBridgeKVManager.__new__(KVBridgeKVManager)
    s._sender, s._cleared, s._final, s._reason, s._posted = room, False, None, "", False
    s._t_first = s._t_done = None
    s.bootstrap_room, s.conclude_state = 7, None
    return s

assert not hasattr(KVBridgeKVManager, "_reap_loop") and not hasattr(KVBridgeKVManager, "defer_clear")

# 1. abort() then clear(), as SGLang's abort path does: handed over once, Failed from then on, nothing asked after
room = Room(Status.Transferring)
s = sender(room)
s.abort()
s.clear()
s.clear()
assert room.calls.count("clear_when_safe") == 1 and room.calls.count("abort") == 1, room.calls
asked = len(room.calls)
assert s.poll() == int(KVPoll.Failed) and len(room.calls) == asked, room.calls

# 2. clear() of a room still transferring: aborted first (nothing will send the rest), then handed over
room = Room(Status.Transferring)
s = sender(room)
s.clear()
assert room.calls.count("abort") == 1 and room.calls[-1] == "clear_when_safe", room.calls
assert "released by SGLang before it ended" in room.failure_reason
assert s.poll() == int(KVPoll.Failed)

# 3. clear() after Success: Success stays the answer, handed over once, never aborted
room = Room(Status.Success)
s = sender(room)
s.clear()
assert "abort" not in room.calls and room.calls.count("clear_when_safe") == 1, room.calls
assert s.poll() == int(KVPoll.Success)
print("ok")
'''


def test_a_sender_is_handed_to_clear_when_safe_once_and_keeps_its_final_status() -> None:
    need_sglang()
    rc, output = run_script(SCRIPT, timeout_s=240)
    assert rc == 0 and output.strip().endswith("ok"), output[-6000:]

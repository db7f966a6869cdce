"""The deferred clears of kvbridge-sglang: the scheduler's clear() and the manager's reaper thread may both
try to clear one sender (once both cleared it, the second raised on the cleared room and the reaper thread
died silently: deferred clears stopped for good). Runs in .venv-sglang (SGLang's base classes)."""

from __future__ import annotations

from _rig import need_sglang, run_script

SCRIPT = r'''
import sys, threading, time
sys.path.insert(0, "adapters/sglang/tests")
from _cpu_torch import allow_cpu_torchvision
allow_cpu_torchvision()        # torchvision's CPU operator schemas, before SGLang imports it
from kvbridge_sglang.conn import KVBridgeKVManager, KVBridgeKVSender

class Room:
    """A kvbridge Sender stand-in: clear() twice raises, as a cleared room does."""
    def __init__(self):
        self.cleared = 0
        self.safe_to_reuse = True
        self.failure_reason = ""
    def clear(self):
        time.sleep(0.01)             # widen the window between the check and the clear
        self.cleared += 1
        if self.cleared > 1:
            raise RuntimeError("room 7 was cleared")

mgr = KVBridgeKVManager.__new__(KVBridgeKVManager)
mgr._lock, mgr._reap, mgr._closed = threading.RLock(), [], False

def sender(room):
    s = KVBridgeKVSender.__new__(KVBridgeKVSender)
    s.kv_mgr, s._sender, s._cleared, s._final, s._reason = mgr, room, False, None, ""
    s.bootstrap_room = 7
    s.poll = lambda: 4
    return s

# 1. clear() from the scheduler and the reaper at once: one clear, no exception
room = Room()
s = sender(room)
errors = []
def clear():
    try:
        s._try_clear()
    except Exception as exc:
        errors.append(exc)
threads = [threading.Thread(target=clear) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join(5)
assert room.cleared == 1 and not errors, (room.cleared, errors)

# 2. a sender whose clear raises does not stop the reaper: the next deferred sender is still cleared
class Broken:
    bootstrap_room = 8
    def _try_clear(self):
        raise RuntimeError("broken")
reaper = threading.Thread(target=mgr._reap_loop, daemon=True)
reaper.start()
good = Room()
mgr.defer_clear(Broken())
time.sleep(0.5)
mgr.defer_clear(sender(good))
deadline = time.monotonic() + 5
while good.cleared == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
assert reaper.is_alive() and good.cleared == 1, (reaper.is_alive(), good.cleared)
mgr._closed = True
print("ok")
'''


def test_a_sender_is_cleared_once_and_the_reaper_survives_errors() -> None:
    need_sglang()
    rc, output = run_script(SCRIPT, timeout_s=240)
    assert rc == 0 and output.strip().endswith("ok"), output[-6000:]

"""A _faultrig rank process with three additions for tests/test_adversary_wave3.py.

* ``job["port"]``: the ZmqLink binds exactly that port (a same-address restart); ``job["grace_s"]``:
  ``AgentConfig.writer_exit_grace_s``.
* Once its agent runs, the child says ``liveness`` (its listener's address, prefill) and a thread drains
  ``agent.events()`` every 2 ms, saying ``roomevent`` for each (room, kind, time).
* Every emitted room event is also checked at the moment it is emitted (under the agent lock): the state
  the room is in then, and whether the room is known at all (an event for a cleared room). ``held`` (ping
  answer ``pong2``): connections the prefill's liveness listener holds, the decode's liveness watches.

Everything else (jobs, commands, pools in /dev/shm made by the test) is tests/_faultrig.py's.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _faultrig
from _faultrig import _say

_AGENT: list[Any] = []
_JOB: dict[str, Any] = {}


def _patch() -> None:
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.protocol.events import RoomEventKind, RoomEvents
    from kvbridge.zmq_link import ZmqLink

    real_config, real_link = _faultrig._config, _faultrig._link

    def config(job: dict[str, Any]) -> Any:
        _JOB.update(job)
        base = real_config(job)
        if "grace_s" not in job:
            return base
        fields = {f: getattr(base, f) for f in AgentConfig.__dataclass_fields__}
        fields["writer_exit_grace_s"] = job["grace_s"]
        return AgentConfig(**fields)

    def link(job: dict[str, Any]) -> Any:
        if not job.get("port"):
            return real_link(job)
        return ZmqLink(bootstrap=job["bootstrap"], port_range=(job["port"], job["port"]),
                       republish_s=job.get("republish_s") or 2.0)

    _faultrig._config, _faultrig._link = config, link

    real_start = TransferAgent.start

    def start(self: Any, *args: Any, **kw: Any) -> None:
        real_start(self, *args, **kw)
        _AGENT.append(self)
        listener = getattr(self, "_liveness", None)
        _say("liveness", address=listener.address if listener is not None else "", link=self.link.address,
             incarnation=self.incarnation)
        threading.Thread(target=_drain, args=(self,), daemon=True).start()

    TransferAgent.start = start  # type: ignore[method-assign]

    real_emit = RoomEvents.emit

    def emit(self: RoomEvents, room: int, kind: RoomEventKind, reason: str = "") -> None:
        state, known = "", True
        if _AGENT:
            agent = _AGENT[0]
            side = agent.decode if agent.decode is not None else agent.prefill
            rec = side.rooms.get(room) if side is not None else None
            known = rec is not None
            state = rec.state.value if rec is not None else ""
            scattering = bool(getattr(rec, "scattering", [])) if rec is not None else False
            if kind is RoomEventKind.SAFE_TO_REUSE:
                _say("emit-safe", room=room, state=state, known=known, scattering=scattering, t=time.monotonic())
            else:
                _say("emit", room=room, kind=kind.value, state=state, known=known, t=time.monotonic())
        real_emit(self, room, kind, reason)

    RoomEvents.emit = emit  # type: ignore[method-assign]


def _drain(agent: Any) -> None:
    stop = agent._stop
    while not stop.is_set():
        try:
            for event in agent.events():
                _say("roomevent", room=event.room, kind=event.kind.value, reason=event.reason[:120],
                     t=time.monotonic())
            with agent.context.lock:
                listener = getattr(agent, "_liveness", None)
                held = listener.held if listener is not None else -1
                watch = agent.peers.liveness
                watches = len(watch._keys) if watch is not None else -1
                gone = len(agent.peers._declared_gone)
                peers = len(agent.peers.peers)
            _say_state(held, watches, gone, peers)
        except Exception as exc:  # noqa: BLE001 - reported; the agent may be closing
            _say("drain-error", text=repr(exc))
            return
        time.sleep(0.002)


_LAST: list[tuple[int, int, int, int]] = []


def _say_state(held: int, watches: int, gone: int, peers: int) -> None:
    now = (held, watches, gone, peers)
    if not _LAST or _LAST[-1] != now:
        _LAST[:] = [now]
        _say("held", held=held, watches=watches, declared_gone=gone, peers=peers, t=time.monotonic())


if __name__ == "__main__":
    _patch()
    sys.exit(_faultrig._child_main())

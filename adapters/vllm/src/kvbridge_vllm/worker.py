"""The worker side of the connector on kvbridge's agent, without vLLM: one instance per vLLM worker (TP rank).

A prefill worker opens a ``Sender`` per request once the step that computed its last prompt token has run
(``wait_for_save``) and sends the whole request at once (``from_start``): kvbridge holds it until the decode's
request arrives (maybe while the engine is idle) and posts every block after the decode's prefix then, on its
own progress thread; the worker reports the request done once ``safe_to_reuse`` and vLLM has finished it. A decode
worker starts a handshake with a prefill instance the first time a request names it (never blocking the
engine's step: the room waits until the handshake completes, and fails if it is refused or times out),
opens a ``Receiver`` per request, and reports it done on Success, or its blocks as load errors on Failure
(once no write can still land in them).

Layer-wise: the room opens at the first layer the step that completes the prompt writes (``begin_save``); if
the decode's request is already there (it asked first, as with a router that sends both at once), each layer
is posted from ``save_kv_layer`` as soon as the forward pass wrote it, and ``wait_for_save`` posts the rest.
Otherwise (vLLM's usual order: decode asks after prefill returned) the whole request is held until it asks.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.agent import Handshake, Receiver, Sender, TransferAgent
from kvbridge.errors import KVBridgeError
from kvbridge.links import Link
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.zmq_link import ZmqLink
from kvbridge_vllm.layout import KV_COMPONENT, KVPool
from kvbridge_vllm.settings import Settings

log = logging.getLogger("kvbridge.vllm")
_FINISHED_EARLY = 4096      # finished request ids remembered in case their save comes after (odd order)
_SWEEP_S = 1.0              # every request is looked at this often, events or not (a missed one is logged)

__all__ = ["LoadSpec", "SaveSpec", "WorkerSide"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSpec:
    """A prefill request whose KV is complete: send it to the decode that asks for ``room``."""

    room: int
    block_ids: tuple[int, ...]
    delay_s: float = 0.0         # test hook: hold the send this long after the decode's request arrived (it goes
    #                              at the first engine step, ``finished()``, past that)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """A decode request: receive blocks ``block_ids`` (positions from ``prefix_len // block_size``) of a request of
    ``tokens`` tokens (its prompt; 0: not given). With the length, a prefill that sends fewer or more blocks than
    the prompt fills is refused on both sides, naming both counts."""

    room: int
    instance: str
    block_ids: tuple[int, ...]
    prefix_len: int
    flip_layer: int = -1         # test hook: corrupt this layer of the arrived blocks
    tokens: int = 0


@dataclass(slots=True)
class _Sending:
    sender: Sender
    blocks: np.ndarray
    sent: bool = False
    finished: bool = False       # vLLM finished the request (its blocks wait for us)
    delay_s: float = 0.0
    ready_at: float = 0.0
    computed: bool = True        # False while the forward pass that completes the prompt still runs
    layers_posted: int = 0       # layers already posted (layer-wise, while the forward pass ran)
    written: set[int] = field(default_factory=set)   # layers save_layer reported written (any order)
    groups: list[tuple[int, int]] = field(default_factory=list)   # the layer groups posted, for the test hook


@dataclass(slots=True)
class _Receiving:
    receiver: Receiver | None
    blocks: np.ndarray
    instance: str = ""
    failed: str = ""
    flip_layer: int = -1
    abandoned: bool = False      # vLLM finished (aborted) the request before its KV arrived


class WorkerSide:
    """Owns the agents of one worker. ``link_factory`` builds each agent's control link (tests pass a
    ``LocalHub``'s); by default a ``ZmqLink`` to the settings' bootstrap server on ``zmq_context``."""

    def __init__(self, *, settings: Settings, pool: KVPool, produce: bool, consume: bool, instance: str,
                 link_factory: Any = None, zmq_context: Any = None) -> None:
        self.settings, self.pool, self.instance = settings, pool, instance
        self.block_size = pool.layout.page_size
        make_link = link_factory or (lambda: ZmqLink(bootstrap=settings.bootstrap, host=settings.host,
                                                     secret=settings.secret_bytes, context=zmq_context,
                                                     allow_insecure=settings.allow_insecure))
        self._sending: dict[str, _Sending] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._unsendable: set[str] = set()       # prefill requests whose room could not be opened
        self._finished_early: OrderedDict[str, None] = OrderedDict()   # named finished before any save of theirs
        self._shakes: dict[str, tuple[Handshake, float]] = {}    # prefill instance -> (handshake, deadline)
        self._load_errors: set[int] = set()
        # each step looks only at the requests whose room had an event (agent.events()), vLLM finished, or that
        # wait on something no event announces (a send not made yet, a handshake under way); all once a second
        self._send_rooms: dict[int, str] = {}    # room -> request, prefill side
        self._recv_rooms: dict[int, str] = {}    # room -> request, decode side
        self._send_watch: set[str] = set()       # sends not made yet (held for a layer group, the delay hook)
        self._recv_watch: set[str] = set()       # loads still bootstrapping (their handshake may fail) or failed
        self._sweep_at = 0.0
        self.missed_events = 0                   # requests the sweep ended that no event had pointed at
        self._lock = threading.Lock()      # vLLM's calls against close()
        self.prefill: TransferAgent | None = None
        self.decode: TransferAgent | None = None
        try:
            if produce:
                self.prefill = self._agent(Role.PREFILL, make_link(), instance)
            if consume:
                self.decode = self._agent(Role.DECODE, make_link(), "")
        except BaseException:
            self.close()
            raise

    def _agent(self, role: Role, link: Link, instance: str) -> TransferAgent:
        try:
            agent = TransferAgent(layout=self.pool.layout, buffers=self.pool.buffers, role=role, link=link,
                                  backend=self.settings.backend, instance=instance,
                                  config=self.settings.agent_config())
        except BaseException:
            link.close()       # the agent owns its link once it exists
            raise
        agent.start()
        return agent

    # ------------------------------------------------------------------ prefill
    def begin_save(self, req_id: str, spec: SaveSpec) -> None:
        """The step whose forward pass completes the prompt starts: open the room now, so that a decode
        request that is already there lets ``save_layer`` post each layer as the forward pass writes it."""
        if self.prefill is None:
            raise KVBridgeError(f"request {req_id}: this worker does not produce KV (kv_role)")
        with self._lock:
            if req_id not in self._sending and req_id not in self._unsendable:
                sender = self._open_sender(req_id, spec)
                if sender is not None:
                    self._track_send(req_id, _Sending(sender=sender, delay_s=spec.delay_s, computed=False,
                                                      blocks=np.asarray(spec.block_ids, dtype=np.int64),
                                                      finished=self._was_finished(req_id)))

    def _track_send(self, req_id: str, state: _Sending) -> _Sending:
        self._sending[req_id] = state
        self._send_rooms[state.sender.room] = req_id
        self._send_watch.add(req_id)
        return state

    def _track_load(self, req_id: str, recv: _Receiving) -> None:
        self._receiving[req_id] = recv
        if recv.receiver is not None:
            self._recv_rooms[recv.receiver.room] = req_id
        self._recv_watch.add(req_id)

    def _was_finished(self, req_id: str) -> bool:
        """vLLM already named this request finished (before its first save: not vLLM's order, but then it will
        not name it again, and its blocks would wait forever)."""
        if req_id in self._finished_early:
            del self._finished_early[req_id]
            return True
        return False

    def _open_sender(self, req_id: str, spec: SaveSpec) -> Sender | None:
        """The room's sender; None (logged, and the request reported done once vLLM finished it) when the room
        cannot be opened, e.g. another request of this worker holds it: never an exception in the forward pass."""
        assert self.prefill is not None
        try:
            return self.prefill.sender(spec.room)
        except KVBridgeError as exc:
            log.error("kvbridge: request %s: cannot send its KV: %s", req_id, exc)
            self._unsendable.add(req_id)
            return None

    def save_layer(self, req_id: str, layer: int) -> None:
        """Layer ``layer`` (wire order) of every block of the request is written: post the layers up to it
        that have not gone yet, if the decode's request has arrived (else the whole request goes later)."""
        with self._lock:
            state = self._sending.get(req_id)
            if state is None or state.sent or state.computed or state.delay_s or layer < state.layers_posted:
                return
            state.written.add(layer)
            upto = state.layers_posted
            while upto in state.written:                 # only layers written with every layer before them
                upto += 1
            if upto == state.layers_posted or state.sender.poll() < KVPoll.WaitingForInput:
                return
            self._post_layers(req_id, state, range(state.layers_posted, upto))

    def _post_layers(self, req_id: str, state: _Sending, layers: range) -> None:
        skip = state.sender.decode_prefix_len // self.block_size
        last = layers.stop == len(self.pool.layers)
        try:
            state.sender.send(state.blocks[skip:], last=last, layers=layers)
        except KVBridgeError as exc:
            state.sent = True
            log.warning("kvbridge: request %s (room %d): layer-wise send failed: %s", req_id, state.sender.room, exc)
            return
        state.layers_posted = layers.stop
        state.groups.append((layers.start, layers.stop))
        state.sent = last
        if last:
            self.dump_groups(state)

    def save(self, req_id: str, spec: SaveSpec) -> None:
        """The forward pass that completes the prompt has run (``wait_for_save``): the request's KV is whole."""
        if self.prefill is None:
            raise KVBridgeError(f"request {req_id}: this worker does not produce KV (kv_role)")
        with self._lock:
            state = self._sending.get(req_id)
            if state is None:
                sender = None if req_id in self._unsendable else self._open_sender(req_id, spec)
                if sender is None:
                    return
                state = self._track_send(req_id, _Sending(sender=sender, delay_s=spec.delay_s,
                                                          blocks=np.asarray(spec.block_ids, dtype=np.int64),
                                                          finished=self._was_finished(req_id)))
            elif state.computed:
                return
            state.computed = True
            self.dump(f"prefill-room{spec.room}", state.blocks)
            log.debug("kvbridge: request %s (room %d): %d blocks computed (%d layers posted during the forward "
                      "pass)", req_id, spec.room, len(state.blocks), state.layers_posted)
            self._advance_send(req_id, state)

    def _advance_send(self, req_id: str, state: _Sending) -> None:
        """Send what the request has left: the layers a layer-wise send has not posted yet, else the whole
        request from position 0, which kvbridge holds until the decode's request came (then drops the decode's
        cached prefix). Only the test hook's delay waits here, for a later engine step."""
        if state.sent or not state.computed:
            return
        status = state.sender.poll()
        if status == KVPoll.Failed:
            state.sent = True
            log.warning("kvbridge: request %s (room %d) failed before sending: %s", req_id, state.sender.room,
                        state.sender.failure_reason)
            return
        if state.delay_s:
            if status < KVPoll.WaitingForInput:
                return
            state.ready_at = state.ready_at or time.monotonic() + state.delay_s
            if time.monotonic() < state.ready_at:
                return
        if state.layers_posted:       # layer-wise: the layers the forward pass wrote after the last post
            self._post_layers(req_id, state, range(state.layers_posted, len(self.pool.layers)))
            return
        state.sent = True
        log.debug("kvbridge: request %s (room %d): sending %d blocks (%s)", req_id, state.sender.room,
                  len(state.blocks), "held until the decode asks" if status < KVPoll.WaitingForInput else "now")
        try:
            state.sender.send(state.blocks, last=True, from_start=True)
        except KVBridgeError as exc:
            log.warning("kvbridge: request %s (room %d): send failed: %s", req_id, state.sender.room, exc)

    # ------------------------------------------------------------------ decode
    def load(self, req_id: str, spec: LoadSpec) -> None:
        if self.decode is None:
            raise KVBridgeError(f"request {req_id}: this worker does not consume KV (kv_role)")
        blocks = np.asarray(spec.block_ids, dtype=np.int64)
        log.debug("kvbridge: request %s (room %d): loading %d blocks from %r after a %d-token prefix", req_id,
                  spec.room, len(blocks), spec.instance, spec.prefix_len)
        try:
            self._handshake(spec.instance)
            receiver = self.decode.receiver(spec.room, spec.instance)
            receiver.send_metadata({KV_COMPONENT: blocks}, prefix_len=spec.prefix_len, tokens=spec.tokens or None)
        except (KVBridgeError, TimeoutError) as exc:
            log.warning("kvbridge: request %s (room %d) from %r cannot load: %s", req_id, spec.room,
                        spec.instance, exc)
            self._track_load(req_id, _Receiving(receiver=None, blocks=blocks, failed=str(exc)))
            return
        self._track_load(req_id, _Receiving(receiver=receiver, blocks=blocks, instance=spec.instance,
                                            flip_layer=spec.flip_layer))

    def _handshake(self, instance: str) -> None:
        """Start a handshake with ``instance`` unless one is under way or done. It never blocks vLLM's step:
        the agent's progress thread completes it while the request's room waits (Bootstrapping)."""
        assert self.decode is not None
        with self.decode.context.lock:
            current = self._shakes.get(instance)
            if current is not None and current[0].refused is None and (
                    current[0].done or time.monotonic() < current[1]):
                return
        timeout = self.settings.connect_timeout_s
        shake = self.decode.connect_async(instance, timeout_s=timeout)
        self._shakes[instance] = (shake, time.monotonic() + timeout)

    def _handshake_failure(self, instance: str) -> str:
        """Why the handshake with ``instance`` cannot complete ("" while it can)."""
        assert self.decode is not None
        entry = self._shakes.get(instance)
        if entry is None:
            return ""
        shake, deadline = entry
        with self.decode.context.lock:
            if shake.done:
                return ""
            refused = shake.refused
            if refused is not None:
                return f"prefill instance {instance!r} refused the handshake: {refused.reason}"
        if time.monotonic() > deadline:
            return (f"handshake with prefill instance {instance!r} did not complete in "
                    f"{self.settings.connect_timeout_s} s")
        return ""

    # ------------------------------------------------------------------ every step
    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(requests whose source blocks vLLM may free, requests whose load ended, well or not). Looks at the
        requests whose room had an event since the last step, those vLLM finished, and those waiting on
        something no event announces; at every request once a second (logging any that ended unannounced)."""
        finished_req_ids = set(finished_req_ids)
        now = time.monotonic()
        sweep = now >= self._sweep_at
        if sweep:
            self._sweep_at = now + _SWEEP_S
        sends = self._touched(self.prefill, self._send_rooms)
        loads = self._touched(self.decode, self._recv_rooms)
        with self._lock:
            done_sending = self._finished_sends(finished_req_ids, sends, sweep)
        for req_id in finished_req_ids:      # aborted while loading: tell the prefill, free once nothing lands
            recv = self._receiving.get(req_id)
            if recv is not None and recv.receiver is not None and not recv.abandoned:
                recv.abandoned = True
                if recv.receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                    recv.receiver.abort("vLLM finished the request before its KV arrived")
        return done_sending, self._finished_loads(loads | (finished_req_ids & self._receiving.keys()), sweep)

    @staticmethod
    def _touched(agent: TransferAgent | None, rooms: Mapping[int, str]) -> set[str]:
        """The requests whose room had an event since the last step."""
        if agent is None:
            return set()
        return {req for event in agent.events() if (req := rooms.get(event.room)) is not None}

    def _missed(self, req_id: str, room: int, side: str) -> None:
        self.missed_events += 1
        log.warning("kvbridge: %s request %s (room %d) ended with no room event pointing at it (found by the "
                    "once-a-second sweep)", side, req_id, room)

    def _finished_sends(self, finished_req_ids: Iterable[str], touched: set[str], sweep: bool) -> set[str]:
        done_sending: set[str] = set()
        for req_id in finished_req_ids:
            if req_id in self._sending:      # saves are posted in the step that completes the prompt,
                self._sending[req_id].finished = True    # always before vLLM finishes the request
            elif req_id in self._unsendable:
                self._unsendable.discard(req_id)
                done_sending.add(req_id)
            elif self.prefill is not None and req_id not in self._receiving:   # a save may still come (odd order)
                self._finished_early[req_id] = None
                while len(self._finished_early) > _FINISHED_EARLY:
                    self._finished_early.popitem(last=False)
        pointed = touched | set(finished_req_ids) | self._send_watch
        for req_id in list(self._sending) if sweep else [r for r in pointed if r in self._sending]:
            state = self._sending[req_id]
            self._advance_send(req_id, state)
            if state.sent:
                self._send_watch.discard(req_id)
            status = state.sender.poll()
            if state.finished and status in (KVPoll.Success, KVPoll.Failed) and state.sender.safe_to_reuse:
                if status == KVPoll.Failed:
                    log.warning("kvbridge: request %s (room %d) not delivered: %s", req_id, state.sender.room,
                                state.sender.failure_reason)
                if req_id not in pointed:
                    self._missed(req_id, state.sender.room, "prefill")
                state.sender.clear()
                del self._sending[req_id]
                self._send_rooms.pop(state.sender.room, None)
                self._send_watch.discard(req_id)
                done_sending.add(req_id)
        return done_sending

    def _finished_loads(self, touched: set[str], sweep: bool) -> set[str]:
        done_recving: set[str] = set()
        pointed = touched | self._recv_watch
        for req_id in list(self._receiving) if sweep else [r for r in pointed if r in self._receiving]:
            recv = self._receiving[req_id]
            if recv.receiver is None:
                self._load_errors.update(int(b) for b in recv.blocks)
                done_recving.add(req_id)
                del self._receiving[req_id]
                self._recv_watch.discard(req_id)
                continue
            status = recv.receiver.poll()
            if status == KVPoll.Bootstrapping:
                reason = self._handshake_failure(recv.instance)
                if reason:
                    recv.receiver.abort(reason)
                    status = recv.receiver.poll()
            else:
                self._recv_watch.discard(req_id)     # its room's events announce what comes next
            if status == KVPoll.Success:
                log.debug("kvbridge: request %s (room %d): loaded", req_id, recv.receiver.room)
                self.dump(f"decode-room{recv.receiver.room}", recv.blocks)
                self.flip(recv.blocks, recv.flip_layer)
            elif status == KVPoll.Failed:
                if not recv.receiver.safe_to_reuse:
                    continue
                if recv.abandoned:           # nothing will read these blocks: no load error to report
                    log.debug("kvbridge: request %s (room %d): load abandoned: %s", req_id, recv.receiver.room,
                              recv.receiver.failure_reason)
                else:
                    log.warning("kvbridge: request %s (room %d) failed to load: %s", req_id, recv.receiver.room,
                                recv.receiver.failure_reason)
                    self._load_errors.update(int(b) for b in recv.blocks)
            else:
                continue
            if req_id not in pointed:
                self._missed(req_id, recv.receiver.room, "decode")
            recv.receiver.clear()
            del self._receiving[req_id]
            self._recv_rooms.pop(recv.receiver.room, None)
            self._recv_watch.discard(req_id)
            done_recving.add(req_id)
        return done_recving

    def dump(self, what: str, blocks: np.ndarray) -> None:
        """Test hook (``dump_dir``): every buffer's bytes of ``blocks``, as uint8 ``[buffers, blocks, bytes]``."""
        if not self.settings.dump_dir or not blocks.size:
            return
        import torch

        index = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
        rows = [t[index].contiguous().view(-1).view(dtype=torch.uint8).reshape(len(blocks), -1).numpy()
                for t in self.pool.buffers[KV_COMPONENT]]
        rank = self.pool.layout.tp_rank
        np.save(f"{self.settings.dump_dir}/{what}-rank{rank}.npy", np.stack(rows))

    def dump_groups(self, state: _Sending) -> None:
        """Test hook (``dump_dir``): the layer groups a layer-wise request was posted in, as JSON."""
        if self.settings.dump_dir and state.sent:
            rank = self.pool.layout.tp_rank
            with open(f"{self.settings.dump_dir}/prefill-room{state.sender.room}-rank{rank}.json", "w") as f:
                json.dump({"layer_groups": state.groups, "layers": len(self.pool.layers)}, f)

    def flip(self, blocks: np.ndarray, layer: int) -> None:
        """Test hook: negate every value of buffer ``layer`` in the arrived ``blocks`` (its sign bits)."""
        if layer < 0 or not blocks.size:
            return
        tensor = self.pool.buffers[KV_COMPONENT][layer]
        for b in np.asarray(blocks, dtype=np.int64).tolist():     # test-only path: the sign bit of every value
            tensor[b].neg_()

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def busy(self) -> Mapping[str, int]:
        return {"sending": len(self._sending), "receiving": len(self._receiving)}

    def close(self) -> None:
        """vLLM's shutdown: each agent drains (rooms in flight get ``drain_timeout_s`` to finish, the rest fail
        cleanly and the peers hear it), then closes."""
        for agent in (self.prefill, self.decode):
            if agent is not None:
                try:
                    report = agent.drain(self.settings.drain_timeout_s, "vLLM shut down")
                    log.info("kvbridge: %s drained: %s", agent.name, report)
                except Exception:   # teardown goes on for the other agent
                    log.exception("kvbridge: draining agent %s", agent.name)
                    agent.close()

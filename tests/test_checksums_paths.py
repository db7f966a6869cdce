"""Adversarial: with checksums on, any byte that differs at the destination from the source fails the room
("checksum mismatch"), never Success, on every path: plain descriptors, staged pieces, staging rings, hetero
TP 2 -> 1 and 1 -> 2, layer-wise and chunked sends, and state components (Mamba / SWA).

Corruptions (each planted exactly once, into the target room only):
  src       a source byte of the write's slice flipped after the write was posted (digests taken) and before
            its bytes were copied (plain: before the backend's send; staged: before the piece's gather)
  dst       a landed byte flipped after landing and before verification (last run byte, middle item)
  short     the write is short (plain: its last descriptor dropped; staged: the piece's bytes halved)
  misdirect the write lands at the wrong place (plain: one item goes to a page outside the request; staged:
            the piece lands 64 bytes further into the decode's staging area)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from test_staging_paths import LAYERS, POOL, World, check, open_room, wait, worlds

from kvbridge.agent import AgentConfig
from kvbridge.agent import decode as decode_module
from kvbridge.agent import posting as posting_module
from kvbridge.errors import KVBridgeError
from kvbridge.planner import TransferPlan
from kvbridge.protocol.wire import KVPoll
from kvbridge.staging import STAGING
from kvbridge.testkit import reference as ref

make_world = pytest.fixture(worlds, name="make_world")

PLAIN = AgentConfig(staging="never", checksums=True)
STAGED = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=12 << 10, checksums=True)
RING_P = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=16 << 10)
RING_D = AgentConfig(staging="always", staging_bytes=160 << 10, staging_piece_bytes=16 << 10, checksums=True)
PRE_NO = AgentConfig(staging="never")                    # a prefill that did not turn checksums on itself
PRE_ST = AgentConfig(staging="always", staging_bytes=1 << 20, staging_piece_bytes=12 << 10)

# name: (kind, pt, dt, prefill, decode, layers, pages, style)
PATHS: dict[str, tuple[str, int, int, AgentConfig, AgentConfig, int, int, str]] = {
    "plain-1-1": (ref.TOKEN_MAJOR, 1, 1, PRE_NO, PLAIN, LAYERS, 9, "chunks"),
    "plain-2-1": (ref.TOKEN_MAJOR, 2, 1, PRE_NO, PLAIN, LAYERS, 9, "chunks"),
    "plain-1-2": (ref.HEAD_MAJOR, 1, 2, PRE_NO, PLAIN, LAYERS, 9, "chunks"),
    "staged-2-1": (ref.TOKEN_MAJOR, 2, 1, PRE_ST, STAGED, LAYERS, 9, "chunks"),
    "staged-1-2": (ref.HEAD_MAJOR, 1, 2, PRE_ST, STAGED, LAYERS, 9, "chunks"),
    "ring-1-1": (ref.TOKEN_MAJOR, 1, 1, RING_P, RING_D, LAYERS + 1, 20, "chunks"),
    "ring-2-1": (ref.TOKEN_MAJOR, 2, 1, RING_P, RING_D, LAYERS + 1, 20, "chunks"),
    "layers-plain-2-1": (ref.TOKEN_MAJOR, 2, 1, PRE_NO, PLAIN, LAYERS, 9, "layers"),
    "layers-staged-1-2": (ref.TOKEN_MAJOR, 1, 2, PRE_ST, STAGED, LAYERS, 9, "layers"),
    "layers-ring-2-1": (ref.TOKEN_MAJOR, 2, 1, RING_P, RING_D, LAYERS + 1, 20, "layers"),
}


def send_all(senders: list[Any], pages: np.ndarray, style: str, layers: int) -> None:
    """Three chunks (the last marked), each whole or one layer at a time; a failed room stops the sender."""
    bounds = [0, len(pages) // 3, 2 * len(pages) // 3, len(pages)]
    for s in senders:
        try:
            for i in range(3):
                chunk, final = pages[bounds[i]: bounds[i + 1]], i == 2
                if style == "chunks":
                    s.send(chunk, last=final)
                else:
                    for g in range(layers):
                        s.send(chunk, last=final and g == layers - 1, layers=range(g, g + 1))
        except KVBridgeError:      # the decode already failed the room: its reason is what is checked
            pass


def open_world(make_world: Callable[..., World], path: str) -> tuple[World, int, str]:
    kind, pt, dt, pre, dec, layers, n, style = PATHS[path]
    return make_world("loopback", kind, pt, dt, prefill=pre, decode=dec, layers=layers), n, style


def start_room(world: World, room: int, n: int, seed: int = 5) -> tuple[list[Any], list[Any], np.ndarray,
                                                                           np.ndarray]:
    rng = np.random.default_rng(room)
    src_pages, dst_pages = rng.permutation(POOL)[:n], rng.permutation(POOL)[:n]
    senders, receivers = open_room(world, room, src_pages, dst_pages, seed)
    return senders, receivers, src_pages, dst_pages


def settle(receivers: list[Any], timeout_s: float = 30.0) -> list[KVPoll]:
    """Wait until every receiver ended (Success or Failed), bounded; their states."""
    wait(lambda: all(r.poll() in (KVPoll.Success, KVPoll.Failed) for r in receivers), timeout_s)
    return [r.poll() for r in receivers]


def assert_mismatch(receivers: list[Any]) -> None:
    states = settle(receivers)
    reasons = [r.failure_reason for r in receivers if r.poll() == KVPoll.Failed]
    assert KVPoll.Success not in states or KVPoll.Failed in states, states
    assert any("checksum mismatch" in why for why in reasons), (states, reasons)


# ------------------------------------------------------------------------------------------- corruptions
class Planted:
    def __init__(self, room: int) -> None:
        self.room, self.done = room, False
        self.where: Any = None


def plant_dst(monkeypatch: pytest.MonkeyPatch, planted: Planted, component: str | None = None) -> None:
    real = decode_module.DecodeSide._verified

    def corrupt(self: Any, room: Any, notice: Any, layers: range) -> bool:
        if (not planted.done and room.room == planted.room and notice.count
                and (component is None or notice.component == component)):
            agent = room.targets[notice.sender]
            peer = self._peers.get(agent)
            comp_index = self._ctx.layout.component_names.index(notice.component)
            buffers = self._plans.sliced_buffers(peer, comp_index, layers)
            if buffers:
                b = buffers[-1]
                items = room.indices[notice.component][notice.first: notice.first + notice.count]
                item = int(items[len(items) // 2])
                byte = int(self._plans.run_bytes(peer, comp_index, b, "dst").index[-1])
                self._ctx.buffers.views[notice.component][b][item, byte] ^= 0x10
                planted.done, planted.where = True, (notice.component, b, item, byte)
        return real(self, room, notice, layers)

    monkeypatch.setattr(decode_module.DecodeSide, "_verified", corrupt)


def plant_src(monkeypatch: pytest.MonkeyPatch, planted: Planted) -> None:
    real_send, real_gather = posting_module.Poster._send, posting_module.Poster._gather

    def flip(self: Any, peer: Any, comp_index: int, item: int, buffers: list[int]) -> None:
        comp = self._ctx.layout.components[comp_index]
        for b in buffers:
            runs = self._plans.run_bytes(peer, comp_index, b, "src")
            if runs.nbytes:
                self._ctx.buffers.views[comp.name][b][item, int(runs.index[runs.nbytes // 2])] ^= 0x21
                planted.done, planted.where = True, (comp.name, b, item)
                return

    def send(self: Any, room: Any, transfer: Any, agent: str, notice: Any, frame: bytes, staging: Any,
             **kw: Any) -> None:
        if (not planted.done and room.room == planted.room and transfer.component != STAGING
                and len(transfer.src_items)):
            comp_index = self._ctx.layout.component_names.index(transfer.component)
            peer = self._peers[agent]
            group = range(notice.layer_first, notice.layer_first + notice.layer_count) if notice.layer_count \
                else self._plans.layers(comp_index).all
            flip(self, peer, comp_index, int(transfer.src_items[-1]),
                 self._plans.sliced_buffers(peer, comp_index, group))
        real_send(self, room, transfer, agent, notice, frame, staging, **kw)

    def gather(self: Any, p: Any) -> Any:     # decided under the lock; the copy runs after it, from the flipped byte
        if not planted.done and p.notice.room == planted.room and p.piece is not None and len(p.piece.src):
            peer = self._peers[p.peer]
            flip(self, peer, p.piece.comp_index, int(p.piece.src[-1]),
                 self._plans.sliced_buffers(peer, p.piece.comp_index, p.piece.layers))
        return real_gather(self, p)

    monkeypatch.setattr(posting_module.Poster, "_send", send)
    monkeypatch.setattr(posting_module.Poster, "_gather", gather)


def plant_transfer(monkeypatch: pytest.MonkeyPatch, planted: Planted, how: str) -> None:
    """Bend the plan of one write (the backend then moves the wrong bytes): ``short`` or ``misdirect``."""
    real_send = posting_module.Poster._send

    def send(self: Any, room: Any, transfer: Any, agent: str, notice: Any, frame: bytes, staging: Any,
             **kw: Any) -> None:
        if not planted.done and room.room == planted.room and len(transfer.plan):
            plan = transfer.plan
            if transfer.component == STAGING:
                if how == "short":
                    plan = TransferPlan(plan.src_addr, plan.dst_addr, plan.nbytes // np.uint64(2), plan.buffer)
                else:
                    plan = TransferPlan(plan.src_addr, plan.dst_addr + np.uint64(64), plan.nbytes, plan.buffer)
            elif how == "short":
                keep = len(plan) - 1 if len(plan) > 1 else 1
                nbytes = plan.nbytes[:keep].copy()
                if len(plan) == 1:
                    nbytes[0] //= np.uint64(2)
                plan = TransferPlan(plan.src_addr[:keep], plan.dst_addr[:keep], nbytes, plan.buffer[:keep])
            else:       # one item to a page outside the request
                comp = transfer.component
                comp_index = self._ctx.layout.component_names.index(comp)
                peer = self._peers[agent]
                requested = room.requests[agent].indices[comp].unpack()
                stray = int(np.setdiff1d(np.arange(POOL), requested)[0])
                d_idx = transfer.dst_items.copy()
                d_idx[-1] = stray
                group = range(notice.layer_first, notice.layer_first + notice.layer_count) if notice.layer_count \
                    else self._plans.layers(comp_index).all
                pairs, _ = self._plans.layer_pairs(peer, comp_index, self._plans.slice_for(peer, comp_index), group)
                plan = posting_module.plan_transfer(pairs, transfer.src_items, d_idx)
            transfer = dataclasses.replace(transfer, plan=plan)
            planted.done = True
        real_send(self, room, transfer, agent, notice, frame, staging, **kw)

    monkeypatch.setattr(posting_module.Poster, "_send", send)


def plant(monkeypatch: pytest.MonkeyPatch, planted: Planted, how: str) -> None:
    if how == "dst":
        plant_dst(monkeypatch, planted)
    elif how == "src":
        plant_src(monkeypatch, planted)
    else:
        plant_transfer(monkeypatch, planted, how)


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("path", list(PATHS))
def test_no_false_positive(make_world: Callable[..., World], path: str) -> None:
    """Every path, untouched: Success and byte-exact with checksums on (the baseline of the tests below)."""
    world, n, style = open_world(make_world, path)
    senders, receivers, src_pages, dst_pages = start_room(world, 40, n)
    send_all(senders, src_pages, style, world.layers)
    assert settle(receivers) == [KVPoll.Success] * len(receivers), [r.failure_reason for r in receivers]
    wait(lambda: all(s.safe_to_reuse for s in senders))
    check(world, 5, dst_pages)


@pytest.mark.parametrize("how", ["src", "dst", "short", "misdirect"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_corrupted_byte_fails_the_room(make_world: Callable[..., World], monkeypatch: pytest.MonkeyPatch,
                                         path: str, how: str) -> None:
    world, n, style = open_world(make_world, path)
    planted = Planted(41)
    plant(monkeypatch, planted, how)
    senders, receivers, src_pages, _ = start_room(world, 41, n)
    send_all(senders, src_pages, style, world.layers)
    states = settle(receivers)
    assert planted.done, "the corruption was never planted"
    assert KVPoll.Failed in states, f"{path}/{how}: Success although {planted.where or how} was corrupted"
    assert_mismatch(receivers)


# ------------------------------------------------------------------------------------------- state components
@pytest.fixture
def hybrid() -> Iterator[Callable[..., Any]]:
    import test_layerwise as tl

    from kvbridge.registry import Registry

    made: list[Any] = []
    registry = Registry.build()

    def make(pt: int, dt: int, config: AgentConfig) -> Any:
        made.append(tl._build(registry, pt, dt, "loopback", config))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _hybrid_room(h: Any, index: int, layerwise: bool) -> tuple[list[Any], list[Any]]:
    import test_hybrid as th
    import test_layerwise as tl

    req = th.request(index, 23, 0, th.P)
    src, dst = th.allocate(h, req, 1), th.allocate(h, req, 2)
    for r in range(h.pt):
        for m in h.models:
            m.fill(h.src[r][m.name], h.pt, r, req, src[m.name])
    state = {m.name: (src[m.name], m.span(req)[0]) for m in h.models if not m.chunked}
    senders, receivers = th.start(h, req, dst)
    kv = src["kv"]
    for s in senders:
        try:
            half = len(kv) // 2
            for chunk, final in ((kv[:half], False), (kv[half:], True)):
                if not layerwise:
                    s.send(chunk, last=final, state=state if final else None)
                    continue
                for g in range(tl.LAYERS4):
                    end = final and g == tl.LAYERS4 - 1
                    s.send(chunk, last=end, layers=range(g, g + 1), state=state if end else None)
        except KVBridgeError:
            pass
    return senders, receivers


@pytest.mark.parametrize("component", [None, "mamba", "swa"])
@pytest.mark.parametrize("pt, dt, mode, layerwise", [(2, 1, "never", False), (1, 2, "always", True)])
def test_state_components_are_verified(hybrid: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
                                       component: str | None, pt: int, dt: int, mode: str, layerwise: bool) -> None:
    """KV + SWA + Mamba pool: no false positive untouched (component None); a byte planted into a landed
    Mamba slot or SWA page fails the room naming that component."""
    h = hybrid(pt, dt, AgentConfig(staging=mode, staging_bytes=1 << 20, checksums=True))
    planted = Planted(1000)
    if component is not None:
        plant_dst(monkeypatch, planted, component)
    _, receivers = _hybrid_room(h, 0, layerwise)
    states = settle(receivers)
    if component is None:
        assert states == [KVPoll.Success] * len(receivers), [r.failure_reason for r in receivers]
        return
    assert planted.done
    assert KVPoll.Failed in states, f"{component} slot corrupted, yet {states}"
    reasons = [r.failure_reason for r in receivers if r.poll() == KVPoll.Failed]
    assert any(f"checksum mismatch: {component} buffer" in why for why in reasons), reasons

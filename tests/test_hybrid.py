"""Pools with several state components, in one process over the in-process hub.

``[kv, swa, mamba]`` (GQA KV + sliding-window pages + GDN slots) and ``[kv, nsa]`` (MLA + indexer pages)
move between prefill and decode instances of different TP sizes, both directions. Every byte of every
decode buffer is compared with what it must hold: the background it started with, except the
request's destination items, which must equal the independent numpy reference of the demo's component
models (logical pattern, cut per rank with ``reference.shard_axis``; no kvbridge slicing involved). Each
pool runs a fresh request, a decode prefix hit whose SWA window reaches into the prefix (and NSA still
sends from position 0), and a full prefix hit (only state travels). Also: the SWA window is paired by
position (a prefill margin page is left out, a window decode's list does not cover is refused with the
reason), a padding Mamba slot is refused, and the handshake refuses a peer whose component order differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import Receiver, Sender, TransferAgent
from kvbridge.demo.model import RequestShape
from kvbridge.demo.presets import KVModel
from kvbridge.errors import GeometryError, IncompatiblePeer
from kvbridge.geometry import PoolLayout
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.testkit import reference as ref

MambaModel = pytest.importorskip("kvbridge_mamba.demo").MambaModel     # the state types' demo models
SWAModel = pytest.importorskip("kvbridge_swa.demo").SWAModel
NSAModel = pytest.importorskip("kvbridge_nsa.demo").NSAModel

P = 4          # GQA pool: 4-token pages, SWA window of 10 tokens = 2.5 pages
KV = KVModel(name="kv", layout=ref.TOKEN_MAJOR, total_heads=4, head_dim=8, layers=2, page_size=P)
SWA = SWAModel(name="swa", layers=(1, 3), page_size=P, kv_heads=4, head_dim=8, window=10)
MAMBA = MambaModel(name="mamba", layers=(0, 2), key_dim=8, value_dim=16, kernel=4, heads=4, head_k_dim=2,
                   head_v_dim=4)
MLA = KVModel(name="kv", layout=ref.MLA, total_heads=1, head_dim=8, layers=2, page_size=64)
NSA = NSAModel(name="nsa", layers=(0, 1), kv_page_size=64, page_size=64, bytes_per_token=132)
ITEMS = {"kv": 24, "swa": 12, "mamba": 5, "nsa": 12}

GQA_POOL = (KV, SWA, MAMBA)
MLA_POOL = (MLA, NSA)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.build()


def layout(models: Sequence[Any], tp: int, rank: int) -> PoolLayout:
    return PoolLayout(components=tuple(m.component(tp, ITEMS[m.name]) for m in models), tp_size=tp,
                      tp_rank=rank, page_size=models[0].page_size, model="hybrid")


def background(seed: int, models: Sequence[Any], tp: int, rank: int) -> dict[str, list[np.ndarray]]:
    """Fresh buffers, uint8 ``[items, item bytes]``, each filled with a pattern no transfer produces."""
    out = {}
    for c, comp in enumerate(layout(models, tp, rank).components):
        out[comp.name] = [ref.background(seed, 1000 * c + b, (g.num_items, g.item_nbytes))
                          for b, g in enumerate(comp.buffers)]
    return out


@dataclass
class Hybrid:
    models: tuple[Any, ...]
    pt: int
    dt: int
    prefill: list[TransferAgent]
    decode: list[TransferAgent]
    src: list[dict[str, list[np.ndarray]]]
    dst: list[dict[str, list[np.ndarray]]]
    want: list[dict[str, list[np.ndarray]]] = field(default_factory=list)   # what every decode byte must hold

    def close(self) -> None:
        for agent in self.prefill + self.decode:
            agent.close()


def build_hybrid(registry: Registry, models: tuple[Any, ...], pt: int, dt: int, *, backend: str = "loopback",
                 decode_models: tuple[Any, ...] | None = None, connect: bool = True) -> Hybrid:
    """Prefill ranks (TP ``pt``, progress threads running) and decode ranks (TP ``dt``) in this process, on a
    LocalHub, over ``backend``; their buffers hold patterns no transfer produces."""
    hub = LocalHub()
    d_models = decode_models or models
    src = [background(11 + r, models, pt, r) for r in range(pt)]
    dst = [background(97 + r, d_models, dt, r) for r in range(dt)]
    pre = [TransferAgent(layout=layout(models, pt, r), buffers=src[r], role=Role.PREFILL, link=hub.link(f"p{r}"),
                         instance="hy", registry=registry, backend=backend) for r in range(pt)]
    dec = [TransferAgent(layout=layout(d_models, dt, r), buffers=dst[r], role=Role.DECODE, link=hub.link(f"d{r}"),
                         registry=registry, backend=backend) for r in range(dt)]
    want = [{k: [b.copy() for b in v] for k, v in bufs.items()} for bufs in dst]
    h = Hybrid(models, pt, dt, pre, dec, src, dst, want)
    for a in pre:
        a.start()
    if connect:
        for d in dec:
            d.connect("hy", timeout_s=10)
    return h


@pytest.fixture
def make_hybrid(registry: Registry) -> Iterator[Callable[..., Hybrid]]:
    made: list[Hybrid] = []

    def make(models: tuple[Any, ...], pt: int, dt: int, *, decode_models: tuple[Any, ...] | None = None,
             connect: bool = True) -> Hybrid:
        made.append(build_hybrid(registry, models, pt, dt, decode_models=decode_models, connect=connect))
        return made[-1]

    yield make
    for h in made:
        h.close()


def wait(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def request(index: int, seq_len: int, prefix_pages: int, page_size: int) -> RequestShape:
    return RequestShape(index=index, room=1000 + index, seed=7_000_003 * (index + 1), seq_len=seq_len,
                        prefix_pages=prefix_pages, num_pages=-(-seq_len // page_size))


def allocate(h: Hybrid, req: RequestShape, side: int) -> dict[str, np.ndarray]:
    """Random distinct item ids per component (never item 0); ``side`` 1 = prefill, 2 = decode."""
    rng = np.random.default_rng([req.index, side])
    return {m.name: 1 + rng.permutation(ITEMS[m.name] - 1)[: m.span(req)[1]].astype(np.int64) for m in h.models}


def start(h: Hybrid, req: RequestShape, dst: dict[str, np.ndarray]) -> tuple[list[Sender], list[Receiver]]:
    receivers = [d.receiver(req.room, "hy") for d in h.decode]
    indices: dict[str, Any] = {m.name: dst[m.name] if m.chunked else (dst[m.name], m.span(req)[0]) for m in h.models}
    for rc in receivers:
        rc.send_metadata(indices, prefix_len=req.prefix_pages * h.models[0].page_size)
    senders = [a.sender(req.room) for a in h.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    return senders, receivers


def transfer(h: Hybrid, req: RequestShape, *, state_src: dict[str, tuple[np.ndarray, int]] | None = None) -> None:
    """Fill prefill, send the KV in two chunks (state on the last), wait, and check every decode byte."""
    src, dst = allocate(h, req, 1), allocate(h, req, 2)
    for r in range(h.pt):
        for m in h.models:
            m.fill(h.src[r][m.name], h.pt, r, req, src[m.name])
    state = {m.name: (src[m.name], m.span(req)[0]) for m in h.models if not m.chunked}
    state.update(state_src or {})
    senders, receivers = start(h, req, dst)
    kv = src[h.models[0].name]
    for s in senders:
        s.send(kv[: len(kv) // 2])
        s.send(kv[len(kv) // 2:], last=True, state=state)
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))
    wait(lambda: all(s.poll() == KVPoll.Success for s in senders))
    assert all(r.safe_to_reuse for r in receivers) and all(s.safe_to_reuse for s in senders)
    assert sum(r.nbytes for r in receivers) == sum(s.stats[0] for s in senders)
    for r in range(h.dt):
        for m in h.models:
            for b, (want_items, buf) in enumerate(zip(m.expected(h.dt, r, req), h.dst[r][m.name], strict=True)):
                want = h.want[r][m.name][b]
                want[dst[m.name]] = want_items
                diff = np.flatnonzero((buf != want).any(axis=1))
                assert diff.size == 0, (f"{h.pt}->{h.dt}: decode rank {r} {m.name} buffer {b} differs in items "
                                        f"{diff.tolist()} (request items {dst[m.name].tolist()})")
    for s in senders:
        s.clear()
    for rc in receivers:
        rc.clear()


TOPOLOGIES = [(1, 1), (2, 1), (1, 4), (4, 2), (2, 4), (8, 2), (1, 8)]


@pytest.mark.parametrize("pt, dt", TOPOLOGIES)
def test_kv_swa_mamba_pool_is_byte_exact(make_hybrid: Callable[..., Hybrid], pt: int, dt: int) -> None:
    h = make_hybrid(GQA_POOL, pt, dt)
    fresh = request(0, 23, 0, P)               # KV pages 0..5; SWA tokens 13.. -> pages 3..5
    assert SWA.span(fresh) == (3, 3)
    transfer(h, fresh)
    hit = request(1, 30, 7, P)                 # decode holds pages 0..6: KV page 7 only; SWA 5..7 reaches the prefix
    assert SWA.span(hit) == (5, 3) and len(hit.positions) == 1
    transfer(h, hit)
    full = request(2, 17, 5, P)                # full hit: an empty last chunk, SWA pages 1..4 and the slot travel
    assert SWA.span(full) == (1, 4) and len(full.positions) == 0
    transfer(h, full)


@pytest.mark.parametrize("pt, dt", [(1, 2), (4, 1), (2, 8), (4, 4), (8, 2)])
def test_kv_nsa_pool_is_byte_exact_and_nsa_starts_at_position_0(make_hybrid: Callable[..., Hybrid], pt: int,
                                                                 dt: int) -> None:
    h = make_hybrid(MLA_POOL, pt, dt)
    transfer(h, request(0, 150, 0, 64))        # 3 pages of both
    hit = request(1, 300, 3, 64)               # KV delta: pages 3..4; indexer: pages 0..4
    assert NSA.span(hit) == (0, 5) and hit.positions.tolist() == [3, 4]
    transfer(h, hit)
    transfer(h, request(2, 130, 3, 64))        # full hit: only the indexer pages 0..2 travel


def test_swa_margin_page_of_prefill_is_left_out(make_hybrid: Callable[..., Hybrid]) -> None:
    h = make_hybrid(GQA_POOL, 2, 4)
    req = request(3, 30, 0, P)                 # window pages 5..7
    src = allocate(h, req, 1)
    spare = np.setdiff1d(np.arange(1, ITEMS["swa"]), src["swa"])[:1]
    margin = np.concatenate([spare, src["swa"]])       # prefill also lists page 4 (a page of background bytes)
    transfer(h, req, state_src={"swa": (margin, 4)})


def test_swa_window_not_covered_by_prefill_fails_with_positions(make_hybrid: Callable[..., Hybrid]) -> None:
    h = make_hybrid(GQA_POOL, 2, 1)
    req = request(4, 30, 0, P)                 # decode expects SWA pages 5..7
    src, dst = allocate(h, req, 1), allocate(h, req, 2)
    senders, receivers = start(h, req, dst)
    with pytest.raises(GeometryError, match=r"not covered.*prefill sent positions \[6, 9\), decode expects \[5, 8\)"):
        senders[0].send(src["kv"], last=True, state={"swa": (src["swa"], 6), "mamba": src["mamba"]})
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "not covered" in receivers[0].failure_reason
    for s in senders[1:]:
        s.abort("test over")
    wait(lambda: receivers[0].safe_to_reuse)


def test_padding_mamba_slot_is_refused(make_hybrid: Callable[..., Hybrid]) -> None:
    h = make_hybrid(GQA_POOL, 1, 1)
    req = request(5, 9, 0, P)
    src, dst = allocate(h, req, 1), allocate(h, req, 2)
    dst["mamba"] = np.array([0])
    senders, receivers = start(h, req, dst)
    with pytest.raises(GeometryError, match="padding"):
        senders[0].send(src["kv"], last=True, state={"swa": (src["swa"], SWA.span(req)[0]), "mamba": src["mamba"]})
    wait(lambda: receivers[0].poll() == KVPoll.Failed)
    assert "slot 0" in receivers[0].failure_reason


@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 4)])
def test_handshake_refuses_a_different_component_order(make_hybrid: Callable[..., Hybrid], pt: int, dt: int) -> None:
    h = make_hybrid(GQA_POOL, pt, dt, decode_models=(KV, MAMBA, SWA), connect=False)
    with pytest.raises(IncompatiblePeer, match=r"component list or order differs: prefill \['kv', 'swa', 'mamba'\], "
                                               r"decode \['kv', 'mamba', 'swa'\]"):
        h.decode[0].connect("hy", timeout_s=10)


def test_handshake_refuses_a_missing_state_component(make_hybrid: Callable[..., Hybrid]) -> None:
    h = make_hybrid(GQA_POOL, 1, 1, decode_models=(KV, SWA), connect=False)
    with pytest.raises(IncompatiblePeer, match="component list or order differs"):
        h.decode[0].connect("hy", timeout_s=10)

"""Decode pipeline parallelism whose layer split differs from the prefill's (issue 24 item 2): each decode PP stage
runs one agent per prefill stage it reads from, over the layers both hold, and receives exactly its layers,
byte-exact against the reference pattern of every (model layer, K/V, position); the prefill rank's room completes
only once the decode stages together asked for all of its layers. Over the in-process hub, each topology with
chunked sends and one with layer-wise sends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, Receiver, Sender, TransferAgent
from kvbridge.errors import IncompatiblePeer
from kvbridge.geometry import PoolLayout
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.state.kv import kv_component
from kvbridge.testkit import reference as ref

H, D, P, NUM_PAGES = 4, 8, 4, 16
SPEC = ref.KVSpec(ref.TOKEN_MAJOR, total_heads=H, page_size=P, head_bytes=D * 2)


def _layout(ids: list[int], tp: int, rank: int) -> PoolLayout:
    comp = kv_component(layers=ids, page_size=P, kv_heads=H, head_dim=D, tp=tp, dtype="bfloat16",
                        num_pages=NUM_PAGES)
    return PoolLayout(components=(comp,), tp_size=tp, tp_rank=rank, page_size=P, model="m")


def _split(layers: int, stages: int) -> list[list[int]]:
    """Layer ids per stage, as even as the count allows (the earlier stages one more)."""
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    starts = np.cumsum([0, *sizes])
    return [list(range(starts[s], starts[s + 1])) for s in range(stages)]


@dataclass
class Cluster:
    hub: LocalHub = field(default_factory=LocalHub)
    prefill: list[list[TransferAgent]] = field(default_factory=list)          # [stage][tp rank]
    # (stage, rank, K or V, layer) -> the rank's array of that layer
    prefill_arrays: dict[tuple[int, int, int, int], np.ndarray] = field(default_factory=dict)
    # (stage, rank, the prefill stage it reads, its agent for it)
    decode: list[tuple[int, int, int, TransferAgent]] = field(default_factory=list)
    decode_arrays: dict[tuple[int, int, int, int], np.ndarray] = field(default_factory=dict)

    def close(self) -> None:
        for agents in self.prefill:
            for agent in agents:
                agent.close()
        for *_, agent in self.decode:
            agent.close()


def _arrays(layout: PoolLayout, store: dict[tuple[int, int, int, int], np.ndarray], stage: int) -> list[np.ndarray]:
    """The rank's array of each buffer of ``layout`` (``kv.<k|v>.<layer>``), made once per (stage, rank, K/V, layer):
    a rank's agents for several prefill stages share its memory."""
    out = []
    for g in layout.components[0].buffers:
        t, layer = "kv".index(g.name.split(".")[1]), int(g.name.split(".")[2])
        key = (stage, layout.tp_rank, t, layer)
        out.append(store.setdefault(key, np.zeros((NUM_PAGES, g.item_nbytes), np.uint8)))
    return out


def _cluster(layers: int, p_pp: int, p_tp: int, d_pp: int, d_tp: int, checksums: bool = False) -> Cluster:
    c = Cluster()
    p_stages, d_stages = _split(layers, p_pp), _split(layers, d_pp)
    for s, ids in enumerate(p_stages):
        ranks = []
        for r in range(p_tp):
            layout = _layout(ids, p_tp, r)
            agent = TransferAgent(layout=layout, buffers={"kv": _arrays(layout, c.prefill_arrays, s)},
                                  role=Role.PREFILL, link=c.hub.link(f"p{s}.{r}"), instance=f"st{s}", name=f"p{s}.{r}")
            agent.start()
            ranks.append(agent)
        c.prefill.append(ranks)
    for d, ids in enumerate(d_stages):
        for r in range(d_tp):
            for s, p_ids in enumerate(p_stages):
                both = [i for i in ids if i in p_ids]
                if not both:
                    continue
                layout = _layout(both, d_tp, r)
                agent = TransferAgent(layout=layout, buffers={"kv": _arrays(layout, c.decode_arrays, d)},
                                      role=Role.DECODE,
                                      link=c.hub.link(f"d{d}.{r}.{s}"), name=f"d{d}.{r}<-st{s}",
                                      config=AgentConfig(checksums=checksums))
                agent.start()
                agent.connect(f"st{s}", timeout_s=10)
                c.decode.append((d, r, s, agent))
    return c


def _wait(predicate: object, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.mark.parametrize("layers, p_pp, p_tp, d_pp, d_tp, layerwise, checksums", [
    (8, 2, 2, 4, 1, False, False),  # PP 2 x TP 2 -> PP 4 x TP 1: each decode stage inside one prefill stage
    (8, 2, 2, 4, 1, True, False),   # ... the prefill sending layer group by layer group
    (8, 1, 4, 2, 1, False, False),  # PP 1 x TP 4 -> PP 2 x TP 1: two decode stages ask the same prefill rank
    (8, 2, 1, 3, 2, False, True),   # PP 2 x TP 1 -> PP 3 x TP 2: the middle decode stage reads from both prefill
    #                                 stages; every write carries the digests of exactly what it lands
    (6, 3, 1, 2, 1, True, True),    # PP 3 x TP 1 -> PP 2 x TP 1: decode stages straddle prefill stages, layer-wise
], ids=["pp2tp2-pp4tp1", "pp2tp2-pp4tp1-layerwise", "pp1tp4-pp2tp1", "pp2tp1-pp3tp2-checksums",
        "pp3tp1-pp2tp1-layerwise-checksums"])
def test_each_decode_stage_receives_exactly_its_layers(layers: int, p_pp: int, p_tp: int, d_pp: int, d_tp: int,
                                                       layerwise: bool, checksums: bool) -> None:
    c = _cluster(layers, p_pp, p_tp, d_pp, d_tp, checksums)
    try:
        src_pages, dst_pages, positions = np.array([3, 9, 4, 11, 5]), np.array([14, 2, 7, 1, 8]), np.arange(5)
        for (_s, r, t, layer), array in c.prefill_arrays.items():
            ref.fill_source(array, SPEC, 11, layer, t, p_tp, r, src_pages, positions)
        room = 501
        receivers: list[Receiver] = []
        for _d, _r, s, agent in c.decode:
            receiver = agent.receiver(room, f"st{s}")
            receiver.send_metadata({"kv": dst_pages})
            receivers.append(receiver)
        senders: list[Sender] = [agent.sender(room) for agents in c.prefill for agent in agents]
        _wait(lambda: all(x.poll() >= KVPoll.WaitingForInput for x in senders))
        for stage in range(p_pp):
            n = len(_split(layers, p_pp)[stage])
            for sender in (senders[stage * p_tp + r] for r in range(p_tp)):
                sender.send(src_pages[:2])
                if layerwise:
                    for start in range(n):
                        sender.send(src_pages[2:], last=start == n - 1, layers=range(start, start + 1))
                else:
                    sender.send(src_pages[2:], last=True)
        _wait(lambda: all(x.poll() == KVPoll.Success for x in receivers))
        _wait(lambda: all(x.poll() == KVPoll.Success for x in senders))
        d_stages = _split(layers, d_pp)
        for (d, r, t, layer), array in c.decode_arrays.items():
            assert layer in d_stages[d]
            got = array.reshape(NUM_PAGES, *SPEC.local_page_shape(d_tp))[dst_pages]
            want = ref.expected_pages(SPEC, 11, layer, t, d_tp, r, positions)
            assert np.array_equal(got, want), f"decode stage {d} rank {r} layer {layer} {'kv'[t]} differs"
            others = np.setdiff1d(np.arange(NUM_PAGES), dst_pages)
            assert not array[others].any(), f"decode stage {d} rank {r} layer {layer}: bytes outside its pages"
        held = {(d, r, layer) for (d, r, _t, layer) in c.decode_arrays}
        assert held == {(d, r, i) for d, ids in enumerate(d_stages) for r in range(d_tp) for i in ids}
        assert all(x.safe_to_reuse for x in senders) and all(x.safe_to_reuse for x in receivers)
    finally:
        c.close()


def test_a_prefill_room_waits_until_the_decode_stages_asked_for_all_of_its_layers() -> None:
    """PP 1 -> PP 2: the first stage's request alone leaves the prefill's room bootstrapping (half its layers are
    not asked for); the second stage's completes it."""
    c = _cluster(4, 1, 1, 2, 1)
    try:
        first, second = c.decode[0][3], c.decode[1][3]
        a = first.receiver(9, "st0")
        a.send_metadata({"kv": np.array([1])})
        sender = c.prefill[0][0].sender(9)
        import time

        time.sleep(0.3)
        assert sender.poll() == KVPoll.Bootstrapping
        b = second.receiver(9, "st0")
        b.send_metadata({"kv": np.array([2])})
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send(np.array([5]), last=True)
        _wait(lambda: a.poll() == KVPoll.Success and b.poll() == KVPoll.Success and sender.poll() == KVPoll.Success)
    finally:
        c.close()


@pytest.mark.parametrize("decode_layers, words", [
    ([1, 2], "buffer order differs"),                   # as many layers as the prefill, one of them foreign
    ([2], "4 buffers on prefill, 2 on decode"),         # fewer, none of them the prefill's: not another split
    ([1, 2, 3], "4 buffers on prefill, 6 on decode"),
], ids=["shifted", "foreign-subset", "more"])
def test_a_decode_holding_layers_the_prefill_lacks_is_refused_with_the_reason(decode_layers: list[int],
                                                                             words: str) -> None:
    hub = LocalHub()

    def arrays(layout: PoolLayout) -> list[np.ndarray]:
        return [np.zeros((NUM_PAGES, g.item_nbytes), np.uint8) for g in layout.components[0].buffers]

    p_layout, d_layout = _layout([0, 1], 1, 0), _layout(decode_layers, 1, 0)
    pre = TransferAgent(layout=p_layout, buffers={"kv": arrays(p_layout)}, role=Role.PREFILL, link=hub.link("p"),
                        instance="st0", name="p")
    dec = TransferAgent(layout=d_layout, buffers={"kv": arrays(d_layout)}, role=Role.DECODE, link=hub.link("d"),
                        name="d")
    try:
        pre.start()
        dec.start()
        with pytest.raises(IncompatiblePeer, match=words):
            dec.connect("st0", timeout_s=10)
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize("pool, pt, dt", [("gqa", 2, 1), ("gqa", 1, 2), ("mla", 2, 1)])
def test_hybrid_state_on_some_decode_stages_only(pool: str, pt: int, dt: int) -> None:
    """Prefill PP 1 -> decode PP 2 (layers 0-1, 2-3). GQA: KV on layers 0-3, SWA on 1 and 3, Mamba on 0 and 1:
    stage 0 gets KV, SWA and Mamba of its layers, stage 1 KV and SWA only (no Mamba component at all). MLA: KV on
    0-3, the NSA indexer on 0 and 1 (stage 1 has none). A fresh request and a decode prefix hit (whose SWA window
    reaches into the prefix; the indexer travels from position 0), every byte of every decode buffer checked
    against the demo models' reference (the request's items; the rest keeps its background)."""
    import dataclasses

    from test_hybrid import ITEMS, MAMBA, NSA, SWA, background, layout, request

    from kvbridge.demo.presets import KVModel

    if pool == "gqa":
        page = 4
        kv = KVModel(name="kv", layout=ref.TOKEN_MAJOR, total_heads=4, head_dim=8, layers=4, page_size=page)
        full: tuple[Any, ...] = (kv, SWA, dataclasses.replace(MAMBA, layers=(0, 1)))
        stages: list[tuple[Any, ...]] = [
            (dataclasses.replace(kv, layers=2), dataclasses.replace(SWA, layers=(1,)),
             dataclasses.replace(MAMBA, layers=(0, 1))),
            (dataclasses.replace(kv, layers=2, first_layer=2), dataclasses.replace(SWA, layers=(3,)))]
        shapes = (request(0, 23, 0, page), request(1, 30, 7, page))
    else:
        page = 64
        kv = KVModel(name="kv", layout=ref.MLA, total_heads=1, head_dim=8, layers=4, page_size=page)
        full = (kv, NSA)
        stages = [(dataclasses.replace(kv, layers=2), NSA), (dataclasses.replace(kv, layers=2, first_layer=2),)]
        shapes = (request(0, 150, 0, page), request(1, 300, 3, page))
    hub = LocalHub()
    src = [background(11 + r, full, pt, r) for r in range(pt)]
    pre = [TransferAgent(layout=layout(full, pt, r), buffers=src[r], role=Role.PREFILL, link=hub.link(f"p{r}"),
                         instance="hy", name=f"p{r}") for r in range(pt)]
    dst = {(d, r): background(97 + 10 * d + r, models, dt, r) for d, models in enumerate(stages) for r in range(dt)}
    dec = {(d, r): TransferAgent(layout=layout(models, dt, r), buffers=dst[(d, r)], role=Role.DECODE,
                                 link=hub.link(f"d{d}.{r}"), name=f"d{d}.{r}")
           for d, models in enumerate(stages) for r in range(dt)}
    want = {key: {k: [b.copy() for b in v] for k, v in bufs.items()} for key, bufs in dst.items()}
    try:
        for agent in [*pre, *dec.values()]:
            agent.start()
        for agent in dec.values():
            agent.connect("hy", timeout_s=10)
        for req in shapes:
            rng = np.random.default_rng(req.index)
            src_items = {m.name: 1 + rng.permutation(ITEMS[m.name] - 1)[: m.span(req)[1]] for m in full}
            for r in range(pt):
                for m in full:
                    m.fill(src[r][m.name], pt, r, req, src_items[m.name])
            receivers: list[Receiver] = []
            dst_items: dict[tuple[int, int], dict[str, np.ndarray]] = {}
            for (d, r), agent in dec.items():
                items = {m.name: 1 + rng.permutation(ITEMS[m.name] - 1)[: m.span(req)[1]] for m in stages[d]}
                dst_items[(d, r)] = items
                receiver = agent.receiver(req.room, "hy")
                receiver.send_metadata({m.name: items[m.name] if m.chunked else (items[m.name], m.span(req)[0])
                                        for m in stages[d]}, prefix_len=req.prefix_pages * page)
                receivers.append(receiver)
            senders = [a.sender(req.room) for a in pre]
            _wait(lambda senders=senders: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
            state = {m.name: (src_items[m.name], m.span(req)[0]) for m in full if not m.chunked}
            for s in senders:
                s.send(src_items["kv"][:1])
                s.send(src_items["kv"][1:], last=True, state=state)
            ends = [*receivers, *senders]
            _wait(lambda ends=ends: all(x.poll() == KVPoll.Success for x in ends))
            for (d, r), items in dst_items.items():
                for m in stages[d]:
                    for b, (want_items, buf) in enumerate(zip(m.expected(dt, r, req), dst[(d, r)][m.name],
                                                              strict=True)):
                        expect = want[(d, r)][m.name][b]
                        expect[items[m.name]] = want_items
                        diff = np.flatnonzero((buf != expect).any(axis=1))
                        assert diff.size == 0, f"stage {d} rank {r} {m.name} buffer {b}: items {diff.tolist()} differ"
            for x in [*senders, *receivers]:
                x.clear()
    finally:
        for agent in [*pre, *dec.values()]:
            agent.close()


def test_decode_stages_of_different_tp_sizes_complete_the_prefill_room() -> None:
    """Prefill PP 1 x TP 1 (layers 0-3); decode stage 0 at TP 2 (layers 0-1), stage 1 at TP 1 (layers 2-3), stage 1
    asking first: once every decode rank asked, the room leaves Bootstrapping and every byte lands (an adversarial
    helper's probe: the first cut grouped requesters by TP rank alone and waited until its bootstrap timeout)."""
    hub = LocalHub()
    store_p: dict[tuple[int, int, int, int], np.ndarray] = {}
    store_d: dict[tuple[int, int, int, int], np.ndarray] = {}
    lp = _layout([0, 1, 2, 3], 1, 0)
    pre = TransferAgent(layout=lp, buffers={"kv": _arrays(lp, store_p, 0)}, role=Role.PREFILL, link=hub.link("p"),
                        instance="st0", name="p")
    decs: list[tuple[int, int, TransferAgent]] = []
    try:
        pre.start()
        for stage, ids, tp, rank in [(1, [2, 3], 1, 0), (0, [0, 1], 2, 0), (0, [0, 1], 2, 1)]:
            ld = _layout(ids, tp, rank)
            d = TransferAgent(layout=ld, buffers={"kv": _arrays(ld, store_d, stage)}, role=Role.DECODE,
                              link=hub.link(f"d{stage}.{rank}"), name=f"d{stage}.{rank}")
            d.start()
            d.connect("st0", timeout_s=10)
            decs.append((stage, tp, d))
        pages, dst, positions = np.array([4, 6]), np.array([1, 2]), np.arange(2)
        for (_s, r, t, layer), array in store_p.items():
            ref.fill_source(array, SPEC, 5, layer, t, 1, r, pages, positions)
        sender = pre.sender(5)
        receivers = []
        for _stage, _tp, d in decs:
            receivers.append(d.receiver(5, "st0"))
            receivers[-1].send_metadata({"kv": dst})
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput, 10.0)
        sender.send(pages, last=True)
        _wait(lambda: all(x.poll() == KVPoll.Success for x in [sender, *receivers]))
        for (stage, r, t, layer), array in store_d.items():
            tp = 2 if stage == 0 else 1
            got = array.reshape(NUM_PAGES, *SPEC.local_page_shape(tp))[dst]
            assert np.array_equal(got, ref.expected_pages(SPEC, 5, layer, t, tp, r, positions)), (stage, r, layer)
    finally:
        pre.close()
        for *_, d in decs:
            d.close()


@pytest.mark.parametrize("decode", ["all-kv-some-swa-no-mamba", "kv-2-3-no-swa"])
def test_a_decode_missing_state_of_the_layers_it_holds_is_refused(decode: str) -> None:
    """A decode is partial only when it holds fewer layers; it must then hold every component's buffers of those
    layers. Holding every KV layer but one SWA layer and no Mamba (an adversarial helper's probe: the first cut
    called it partial and accepted it, and its prefill room then waited for buffers nobody would ask for) and
    holding KV layers 2-3 without the SWA of layer 3 are refused, naming the component."""
    import dataclasses

    from test_hybrid import GQA_POOL, KV, SWA, build_hybrid

    from kvbridge.registry import Registry

    kv4 = dataclasses.replace(KV, layers=4)
    prefill = (kv4, dataclasses.replace(SWA, layers=(1, 3)), GQA_POOL[2])
    models = ((kv4, dataclasses.replace(SWA, layers=(1,))) if decode.startswith("all")
              else (dataclasses.replace(kv4, layers=2, first_layer=2),))
    h = build_hybrid(Registry.build(), prefill, 1, 1, decode_models=models, connect=False)
    try:
        with pytest.raises(IncompatiblePeer, match="component list or order differs|must hold exactly"):
            h.decode[0].connect("hy", timeout_s=10)
    finally:
        h.close()

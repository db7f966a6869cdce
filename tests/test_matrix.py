"""The TP matrix end to end over the loopback backend, byte-checked against the reference reshard.

Pt, Dt in {1, 2, 4, 8} x total KV heads in {1, 2, 4, 8, 16} for token-major MHA and head-major MHA,
and Pt x Dt for MLA. Every rank gets its own loopback backend from the registry; buffers are registered
and sends posted through the registry's operation facade (so hook wrappers see them), one
ComponentTransfer per (prefill rank, decode rank, chunk) built from the state type's slice and the
planner. 6 KV heads is added to prove that a head count the TP sizes do not divide is refused with
UnsupportedTopology instead of being half-planned.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from _kvcase import KVModel, post_component

from kvbridge.backends.base import TransferBackend
from kvbridge.errors import GeometryError, UnsupportedTopology
from kvbridge.geometry import Component, PoolLayout, Rank, region_of
from kvbridge.protocol.records import PeerInfo
from kvbridge.registry import Registry
from kvbridge.slicing import target_ranks
from kvbridge.testkit import reference as ref

TP_SIZES = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)
SRC_POOL, DST_POOL, REQUEST = 12, 10, 7

CASES = [(layout, h, pt, dt) for layout in (ref.TOKEN_MAJOR, ref.HEAD_MAJOR) for h in (*HEADS, 6)
         for pt in TP_SIZES for dt in TP_SIZES] + [(ref.MLA, 1, pt, dt) for pt in TP_SIZES for dt in TP_SIZES]


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The built-ins, loaded from their entry points like any plugin (other installed plugins left out)."""
    return Registry.build(allow=["loopback", "kv"], env={})


def _model(layout: str, heads: int) -> KVModel:
    dims = (24,) if layout == ref.MLA else (4, 3)  # MHA with v_head_dim != head_dim
    return KVModel(layout, heads, page_size=4, head_dims=dims, num_layers=2)


def _divides(heads: int, tp: int) -> bool:
    try:
        ref.units_held(heads, tp, 0)
    except ref.ReferenceTopologyError:
        return False
    return True


@pytest.mark.parametrize("layout, heads, pt, dt", CASES,
                         ids=[f"{lay}-H{h}-P{pt}-D{dt}" for lay, h, pt, dt in CASES])
def test_tp_matrix(registry: Registry, layout: str, heads: int, pt: int, dt: int) -> None:
    model = _model(layout, heads)
    if not (_divides(heads, pt) and _divides(heads, dt)):
        _assert_refused(registry, model, pt, dt)
        return
    rng = np.random.default_rng(zlib.crc32(f"{layout}/{heads}/{pt}/{dt}".encode()))
    src_pages = rng.permutation(SRC_POOL)[:REQUEST]
    dst_pages = rng.permutation(DST_POOL)[:REQUEST]
    dst_pages[2:5] = np.sort(dst_pages[2:5])  # a mix of scattered pages and short runs
    positions = np.arange(REQUEST)
    src_comp, dst_comp = model.component(pt, SRC_POOL), model.component(dt, DST_POOL)
    for tp, comp in ((pt, src_comp), (dt, dst_comp)):
        for rank in range(tp):
            PoolLayout(components=(comp,), tp_size=tp, tp_rank=rank, page_size=model.page_size)  # geometry is valid
    kv = registry.state_type("kv")

    src_bufs = {p: model.source_buffers(pt, p, SRC_POOL, src_pages, positions) for p in range(pt)}
    src_before = {p: [b.copy() for b in bufs] for p, bufs in src_bufs.items()}
    dst_bufs = {d: model.empty_destination(dt, d, DST_POOL) for d in range(dt)}
    backends: list[TransferBackend] = []
    try:
        prefill = {p: registry.create_backend("loopback", name=f"m-prefill-{p}") for p in range(pt)}
        decode = {d: registry.create_backend("loopback", name=f"m-decode-{d}") for d in range(dt)}
        backends += [*prefill.values(), *decode.values()]
        src_reg = {p: registry.register_buffers(prefill[p], "kv", [region_of(b) for b in src_bufs[p]])
                   for p in range(pt)}
        dst_remote = {d: registry.register_buffers(decode[d], "kv", [region_of(b) for b in dst_bufs[d]])
                      .remote() for d in range(dt)}
        writers = {d: [] for d in range(dt)}
        for d in range(dt):
            peer = PeerInfo(name=f"d{d}", endpoint=decode[d].endpoint, buffers=(dst_remote[d],))
            for p in target_ranks(pt, dt, d):
                prefill[p].add_peer(peer)
                cut = registry.slice_state(kv, src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                if cut.is_empty:
                    continue  # not the elected writer: reports success without writing
                writers[d].append(p)
                # two chunks: the request's first pages, then the rest (last=True)
                for chunk, part in enumerate((slice(0, 3), slice(3, REQUEST))):
                    post_component(registry, prefill[p], peer=f"d{d}", src=src_reg[p], dst=dst_remote[d],
                                   src_comp=src_comp, dst_comp=dst_comp, cut=cut, src_items=src_pages[part],
                                   dst_items=dst_pages[part], chunk=chunk, last=chunk == 1)
        _check_writers(model, pt, dt, writers)
        for d in range(dt):
            want = model.expected_destination(dt, d, DST_POOL, dst_pages, positions)
            for b, (got, exp) in enumerate(zip(dst_bufs[d], want)):
                where = f"decode rank {d} buffer {dst_comp.buffers[b].name}"
                assert np.array_equal(got, exp), f"{where} differs at {np.argwhere(got != exp)[:3].tolist()}"
        for p in range(pt):
            for before, after in zip(src_before[p], src_bufs[p]):
                assert np.array_equal(before, after), f"prefill rank {p}: a source buffer changed"
    finally:
        for backend in backends:
            backend.close()


def _check_writers(model: KVModel, pt: int, dt: int, writers: dict[int, list[int]]) -> None:
    """Independently of kvbridge: each decode rank is written by exactly the prefill ranks needed to
    cover its heads, one per distinct head range (replicas elected away)."""
    for d, got in writers.items():
        if model.layout == ref.MLA:
            assert len(got) == 1, f"MLA decode {d}: one elected writer, got {got}"
            continue
        need = set(ref.units_held(model.total_heads, dt, d))
        ranges = [set(ref.units_held(model.total_heads, pt, p)) for p in got]
        covered = set().union(*(r & need for r in ranges))
        assert covered == need, f"decode {d}: writers {got} miss heads of {sorted(need)}"
        assert sum(len(r & need) for r in ranges) == len(need), f"decode {d}: a head written twice by {got}"


def _assert_refused(registry: Registry, model: KVModel, pt: int, dt: int) -> None:
    """6 heads over TP 4 or 8: the layout refuses the geometry, and the slicer refuses every pair
    with UnsupportedTopology naming the head count, however the local shapes were guessed."""
    kv = registry.state_type("kv")
    comps = []
    for tp, pool in ((pt, SRC_POOL), (dt, DST_POOL)):
        if _divides(model.total_heads, tp):
            comps.append(model.component(tp, pool))
            continue
        guess = Component(name="kv", state_type="kv", buffers=tuple(model.geometry(b, tp, pool, local_heads=1)
                                             for b in range(model.num_buffers)))
        with pytest.raises(GeometryError, match=r"'k\.0'.*not divisible by TP"):
            PoolLayout(components=(guess,), tp_size=tp, tp_rank=0, page_size=model.page_size)
        comps.append(guess)
    for d in range(dt):
        for p in target_ranks(pt, dt, d):
            with pytest.raises(UnsupportedTopology, match=f"{model.total_heads} (units|replicated)"):
                registry.slice_state(kv, comps[0], comps[1], Rank(p, pt), Rank(d, dt))

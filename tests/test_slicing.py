"""TP slicing math: the worked examples of sglang-notes §3.5 (A-D), rank mapping, MLA, bad topologies.

The examples are token-major bf16 with head_dim 128 (256 B per head per token) and 16-token pages.
SGLang emits one descriptor per token; kvbridge's segments for one item must cover exactly the same
bytes, merged where both sides are contiguous.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, DType, Rank, ShardAxis
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.slicing import Segments, buffer_segments, served_ranks, target_ranks
from kvbridge.state.kv import KVState

P, HEAD_DIM, BH = 16, 128, 256  # page size, head_dim, bytes per head per token (bf16)


def token_major(total_heads: int, tp: int, *, name: str = "k.0", num_pages: int = 64) -> BufferGeometry:
    local = total_heads // tp if total_heads >= tp else 1
    return BufferGeometry(name=name, num_items=num_pages, item_shape=(P, local, HEAD_DIM), dtype=DType.BFLOAT16,
                          shard=ShardAxis(axis=1, total=total_heads))


def head_major(total_heads: int, tp: int, *, name: str = "k.0", num_pages: int = 64) -> BufferGeometry:
    local = total_heads // tp if total_heads >= tp else 1
    return BufferGeometry(name=name, num_items=num_pages, item_shape=(local, P, HEAD_DIM), dtype=DType.BFLOAT16,
                          shard=ShardAxis(axis=0, total=total_heads))


Triple = tuple[int, int, int]


def segs(src: BufferGeometry, dst: BufferGeometry, p: int, pt: int, d: int, dt: int) -> list[Triple]:
    s = buffer_segments(src, dst, Rank(p, pt), Rank(d, dt))
    return list(zip(s.src_off.tolist(), s.dst_off.tolist(), s.nbytes.tolist()))


def per_token(src_row: int, dst_row: int, src_off_h: int, dst_off_h: int, n_heads: int) -> list[Triple]:
    """SGLang's descriptors for one page pair, relative to the item starts: one per token."""
    return [(t * src_row + src_off_h * BH, t * dst_row + dst_off_h * BH, n_heads * BH) for t in range(P)]


def merge(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge consecutive pieces contiguous on both sides (the slow, obvious way)."""
    out: list[list[int]] = []
    for s, d, n in sorted(pieces):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(x) for x in out]  # type: ignore[misc]


# ------------------------------------------------------------------------------------ worked examples
def test_example_a_gather_h8_pt4_dt2() -> None:
    src, dst = token_major(8, 4), token_major(8, 2)
    assert (src.item_nbytes, dst.item_nbytes) == (8192, 16384)
    assert target_ranks(4, 2, 0) == (0, 1) and target_ranks(4, 2, 1) == (2, 3)
    dst_off_h = {0: 0, 1: 2, 2: 0, 3: 2}  # byte offsets 0, 512, 0, 512
    for p in range(4):
        d = p // 2
        want = per_token(512, 1024, 0, dst_off_h[p], 2)
        assert segs(src, dst, p, 4, d, 2) == want, f"prefill {p}"
        assert segs(src, dst, p, 4, 1 - d, 2) == [], f"prefill {p} must not write decode {1 - d}"
    # the descriptor of the notes, from p3: src = K3 + sp*8192 + t*512, dst = K1 + dp*16384 + t*1024 + 512
    k3, k1, sp, dp = 0x7000_0000, 0x9000_0000, 5, 11
    cut = buffer_segments(src, dst, Rank(3, 4), Rank(1, 2))
    plan = plan_transfer([BufferPair(src_base=k3, src_item_nbytes=8192, src_num_items=64, dst_base=k1,
                                     dst_item_nbytes=16384, dst_num_items=64, segments=cut)], np.array([sp]),
                         np.array([dp]))
    assert len(plan) == P
    for t in range(P):
        assert (int(plan.src_addr[t]), int(plan.dst_addr[t]), int(plan.nbytes[t])) == (
            k3 + sp * 8192 + t * 512, k1 + dp * 16384 + t * 1024 + 512, 512)


def test_example_a_decode_rows_hold_heads_in_order() -> None:
    """Decode rank 0 token row = [p0 heads 0-1 | p1 heads 2-3]; rank 1 = [p2 heads 4-5 | p3 heads 6-7]."""
    src, dst = token_major(8, 4), token_major(8, 2)
    row0 = {segs(src, dst, p, 4, 0, 2)[0][1] // BH: p for p in (0, 1)}
    row1 = {segs(src, dst, p, 4, 1, 2)[0][1] // BH: p for p in (2, 3)}
    assert row0 == {0: 0, 2: 1} and row1 == {0: 2, 2: 3}


def test_example_b_gqa_h2_pt8_dt4_elects_one_replica() -> None:
    src, dst = token_major(2, 8), token_major(2, 4)
    assert src.item_nbytes == dst.item_nbytes == 4096
    for d in range(4):
        first, second = target_ranks(8, 4, d)
        assert (first, second) == (2 * d, 2 * d + 1)
        assert first // 4 == second // 4 == d // 2  # both hold decode rank d's head
        # SGLang has both write the identical 256-byte row; kvbridge elects the first, whole item merged
        assert segs(src, dst, first, 8, d, 4) == merge(per_token(256, 256, 0, 0, 1)) == [(0, 0, 4096)]
        assert segs(src, dst, second, 8, d, 4) == []


def test_example_c_scatter_h8_pt2_dt4() -> None:
    src, dst = token_major(8, 2), token_major(8, 4)
    for d in range(4):
        p = d // 2
        assert target_ranks(2, 4, d) == (p,)
        src_off_h = (d * 2) % 4  # local heads 0-1 or 2-3 of the prefill rank
        assert segs(src, dst, p, 2, d, 4) == per_token(1024, 512, src_off_h, 0, 2)
        assert segs(src, dst, 1 - p, 2, d, 4) == []
    assert served_ranks(2, 4, 0) == (0, 1) and served_ranks(2, 4, 1) == (2, 3)


def test_example_d_scatter_with_decode_replication_h2_pt1_dt4() -> None:
    src, dst = token_major(2, 1), token_major(2, 4)
    heads = []
    for d in range(4):
        got = segs(src, dst, 0, 1, d, 4)
        # decode rank d holds head d//2 (the fixed formula), never the old (d*1) % 2
        assert got == per_token(512, 256, d // 2, 0, 1)
        heads.append(got[0][0] // BH)
    assert heads == [0, 0, 1, 1]


def test_head_major_fast_path_is_one_segment_per_page() -> None:
    """Example A again, head-major: a prefill rank's heads are one block of the decode page."""
    src, dst = head_major(8, 4), head_major(8, 2)
    for p in range(4):
        assert segs(src, dst, p, 4, p // 2, 2) == [(0, (p % 2) * 8192, 8192)]
    # and example C (scatter): a decode rank's heads are one block of the prefill page
    src, dst = head_major(8, 2), head_major(8, 4)
    for d in range(4):
        assert segs(src, dst, d // 2, 2, d, 4) == [((d % 2) * 8192, 0, 8192)]


# ------------------------------------------------------------------------------------ rank mapping
@pytest.mark.parametrize("pt, dt", [(a, b) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8)])
def test_target_and_served_ranks_are_inverse(pt: int, dt: int) -> None:
    for d in range(dt):
        for p in target_ranks(pt, dt, d):
            assert d in served_ranks(pt, dt, p)
    for p in range(pt):
        for d in served_ranks(pt, dt, p):
            assert p in target_ranks(pt, dt, d)
    assert sorted(p for d in range(dt) for p in target_ranks(pt, dt, d)) == sorted(
        p for p in range(pt) for _ in served_ranks(pt, dt, p))
    # every prefill rank serves someone, every decode rank has max(1, pt/dt) targets
    assert all(served_ranks(pt, dt, p) for p in range(pt))
    assert {len(target_ranks(pt, dt, d)) for d in range(dt)} == {max(1, pt // dt)}


@pytest.mark.parametrize("pt, dt", [(3, 2), (2, 3), (4, 6), (6, 4)])
def test_non_dividing_tp_sizes_are_unsupported_and_named(pt: int, dt: int) -> None:
    for call in (lambda: target_ranks(pt, dt, 0), lambda: served_ranks(pt, dt, 0),
                 lambda: buffer_segments(token_major(12, pt), token_major(12, dt), Rank(0, pt), Rank(0, dt))):
        with pytest.raises(UnsupportedTopology) as err:
            call()
        assert f"prefill TP {pt}" in str(err.value) and f"decode TP {dt}" in str(err.value)


@pytest.mark.parametrize("heads, pt, dt, bad_tp", [(6, 4, 2, 4), (6, 2, 4, 4), (3, 2, 1, 2), (2, 6, 3, 3)])
def test_heads_not_divisible_by_tp_are_unsupported(heads: int, pt: int, dt: int, bad_tp: int) -> None:
    geo = BufferGeometry(name="k.0", num_items=8, item_shape=(P, 1, HEAD_DIM), dtype=DType.BFLOAT16,
                         shard=ShardAxis(axis=1, total=heads))
    with pytest.raises(UnsupportedTopology) as err:
        buffer_segments(geo, geo, Rank(0, pt), Rank(0, dt))
    assert str(heads) in str(err.value) and f"TP {bad_tp}" in str(err.value)


def test_mismatched_head_dim_is_an_incompatible_peer_naming_the_buffer() -> None:
    src = token_major(8, 2, name="v.3")
    dst = BufferGeometry(name="v.3", num_items=64, item_shape=(P, 4, 64), dtype=DType.BFLOAT16,
                         shard=ShardAxis(axis=1, total=8))
    with pytest.raises(IncompatiblePeer, match=r"'v\.3'.*dim 2"):
        buffer_segments(src, dst, Rank(0, 2), Rank(0, 2))
    with pytest.raises(IncompatiblePeer, match="dtype"):
        buffer_segments(src, BufferGeometry(name="v.3", num_items=64, item_shape=(P, 4, HEAD_DIM), dtype=DType.FLOAT16,
                                            shard=ShardAxis(axis=1, total=8)), Rank(0, 2), Rank(0, 2))


# ------------------------------------------------------------------------------------ MLA
def mla() -> Component:
    bufs = tuple(BufferGeometry(name=f"kv.{layer}", num_items=32, item_shape=(P, 576),
                                dtype=DType.BFLOAT16) for layer in range(3))
    return Component(name="kv", state_type="kv", buffers=bufs)


@pytest.mark.parametrize("pt, dt", [(2, 1), (4, 2), (8, 2), (8, 4), (4, 1)])
def test_mla_gather_elects_one_writer_per_destination(pt: int, dt: int) -> None:
    kv, comp = KVState(), mla()
    whole = [(0, 0, P * 576 * 2)]
    for d in range(dt):
        writers = []
        for p in range(pt):
            cut = kv.slice(comp, comp, Rank(p, pt), Rank(d, dt))
            got = [list(zip(s.src_off.tolist(), s.dst_off.tolist(), s.nbytes.tolist())) for s in cut.buffers]
            if cut.is_empty:
                assert got == [[]] * 3
            else:
                assert got == [whole] * 3
                writers.append(p)
        assert writers == [target_ranks(pt, dt, d)[0]], f"decode {d}: exactly one elected writer"


@pytest.mark.parametrize("pt, dt", [(1, 2), (1, 8), (2, 4), (2, 8), (4, 8)])
def test_mla_scatter_fans_out_the_whole_latent(pt: int, dt: int) -> None:
    kv, comp = KVState(), mla()
    for p in range(pt):
        fed = [d for d in range(dt) if not kv.slice(comp, comp, Rank(p, pt), Rank(d, dt)).is_empty]
        assert fed == list(served_ranks(pt, dt, p)) and len(fed) == dt // pt
        for d in fed:
            cut = kv.slice(comp, comp, Rank(p, pt), Rank(d, dt))
            assert all(s.total_nbytes == P * 576 * 2 and len(s) == 1 for s in cut.buffers)


def test_empty_segments_plan_to_nothing() -> None:
    plan = plan_transfer([BufferPair(src_base=0x1000, src_item_nbytes=64, src_num_items=4, dst_base=0x2000,
                                     dst_item_nbytes=64, dst_num_items=4, segments=Segments.empty())], np.array([0, 1]),
                         np.array([2, 3]))
    assert len(plan) == 0

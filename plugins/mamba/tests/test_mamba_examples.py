"""Worked examples (sglang-notes §4), GDN shard groups, replicated tensors, index pairing and checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import GeometryError, IncompatiblePeer, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, Rank, ShardAxis
from kvbridge.planner import BufferPair, plan_transfer
from kvbridge.testkit.reshard import run_reshard
from kvbridge_mamba import MambaState, mamba_component

STATE = MambaState()


def segs(seg) -> list[tuple[int, int, int]]:
    return list(zip(seg.src_off.tolist(), seg.dst_off.tolist(), seg.nbytes.tolist()))


# ----------------------------------------------------------------------------- sglang-notes §4 conv example
def conv_only(tp: int, num_slots: int = 4) -> Component:
    """4096 conv channels, kernel 4, bf16 (the temporal buffer is tiny and irrelevant here)."""
    return mamba_component("m", layers=1, conv_groups=4096, kernel=4, heads=8, head_dim=1, state=1, tp=tp,
                           dtype="bfloat16", num_slots=num_slots)


def test_conv_example_gather_pt4_dt2() -> None:
    src, dst = conv_only(4), conv_only(2)
    assert src.buffers[0].item_nbytes == 1024 * 3 * 2 == 6144
    assert dst.buffers[0].item_nbytes == 12288
    # decode rank 1 = [prefill 2 | prefill 3]; prefill 3 lands at byte 6144 for 6144 bytes
    assert segs(STATE.slice(src, dst, Rank(3, 4), Rank(1, 2)).buffers[0]) == [(0, 6144, 6144)]
    assert segs(STATE.slice(src, dst, Rank(2, 4), Rank(1, 2)).buffers[0]) == [(0, 0, 6144)]
    assert STATE.slice(src, dst, Rank(0, 4), Rank(1, 2)).is_empty  # not one of decode 1's targets


def test_conv_example_addresses() -> None:
    """Address = base + slot * item + offset, for the request's one slot on each side."""
    src, dst = conv_only(4), conv_only(2)
    seg = STATE.slice(src, dst, Rank(3, 4), Rank(1, 2)).buffers[0]
    pair = BufferPair(src_base=0x1000_0000, src_item_nbytes=6144, src_num_items=4, dst_base=0x2000_0000,
                      dst_item_nbytes=12288, dst_num_items=4, segments=seg)
    s, d = STATE.pair_indices(src, np.array([2]), 0, np.array([3]), 0)
    plan = plan_transfer([pair], s, d)
    assert plan.src_addr.tolist() == [0x1000_0000 + 2 * 6144]
    assert plan.dst_addr.tolist() == [0x2000_0000 + 3 * 12288 + 6144]
    assert plan.nbytes.tolist() == [6144]


def test_conv_example_scatter_pt2_dt4() -> None:
    src, dst = conv_only(2), conv_only(4)
    for d in range(4):  # decode d reads channels (d*1024) % 2048 of prefill d // 2
        seg = STATE.slice(src, dst, Rank(d // 2, 2), Rank(d, 4)).buffers[0]
        assert segs(seg) == [((d * 1024) % 2048 * 6, 0, 6144)]
        assert STATE.slice(src, dst, Rank(1 - d // 2, 2), Rank(d, 4)).is_empty


# ----------------------------------------------------------------------------- sglang-notes §4 temporal example
def temporal_only(tp: int) -> Component:
    """32 value heads of 128x128 fp32 (conv kept minimal)."""
    return mamba_component("m", layers=1, conv_groups=8, kernel=2, heads=32, head_dim=128, state=128, tp=tp,
                           dtype="float32", num_slots=3)


def test_temporal_example_pt2_dt4() -> None:
    src, dst = temporal_only(2), temporal_only(4)
    assert src.buffers[1].item_nbytes == 16 * 65536 and dst.buffers[1].item_nbytes == 8 * 65536
    for d in range(4):  # heads starting at (d*8) % 16 = 0, 8, 0, 8 of prefill d // 2
        seg = STATE.slice(src, dst, Rank(d // 2, 2), Rank(d, 4)).buffers[1]
        assert segs(seg) == [((d * 8) % 16 * 65536, 0, 8 * 65536)]


def test_temporal_example_byte_exact_both_directions() -> None:
    run_reshard(STATE, temporal_only, 2, 4, np.array([2]), np.array([1]), seed=1).assert_exact()
    run_reshard(STATE, temporal_only, 4, 2, np.array([1]), np.array([2]), seed=2).assert_exact()


# ----------------------------------------------------------------------------- GDN [q | k | v] shard groups
def gdn(tp: int) -> Component:
    """q, k of 8 channels, v of 16, kernel 4, fp16: 6 bytes per channel."""
    return mamba_component("gdn", layers=2, conv_groups=(8, 8, 16), kernel=4, heads=4, head_dim=2, state=3,
                           tp=tp, dtype="float16", num_slots=5)


def test_gdn_gather_pt4_dt2_places_each_group() -> None:
    # prefill 3 holds q[6:8] k[6:8] v[12:16]; decode 1 holds q[4:8] k[4:8] v[8:16] as [q 4 | k 4 | v 8]
    seg = STATE.slice(gdn(4), gdn(2), Rank(3, 4), Rank(1, 2)).buffers[0]
    assert segs(seg) == [(0, 2 * 6, 2 * 6), (2 * 6, 6 * 6, 2 * 6), (4 * 6, 12 * 6, 4 * 6)]


def test_gdn_scatter_pt2_dt4_reads_each_group() -> None:
    # prefill 0 holds [q 0:4 | k 0:4 | v 0:8]; decode 1 wants q[2:4] k[2:4] v[4:8]
    seg = STATE.slice(gdn(2), gdn(4), Rank(0, 2), Rank(1, 4)).buffers[0]
    assert segs(seg) == [(2 * 6, 0, 2 * 6), (6 * 6, 2 * 6, 2 * 6), (12 * 6, 4 * 6, 4 * 6)]
    naive_contiguous = [((1 * 8) % 16 * 6, 0, 8 * 6)]  # what slicing the channels as one block would do
    assert segs(seg) != naive_contiguous


@pytest.mark.parametrize(("pt", "dt"), [(4, 2), (2, 4), (8, 1), (1, 8), (2, 8), (4, 4)])
def test_gdn_byte_exact(pt: int, dt: int) -> None:
    run_reshard(STATE, gdn, pt, dt, np.array([3]), np.array([1]), seed=pt * 10 + dt).assert_exact()


def test_gdn_channels_last_byte_exact() -> None:
    def make(tp: int) -> Component:
        return mamba_component("k", layers=1, conv_groups=(8, 8, 16), kernel=4, heads=4, head_dim=2, state=3,
                               tp=tp, dtype="bfloat16", num_slots=3, conv_channels_last=True)

    assert make(2).buffers[0].item_shape == (3, 16)
    seg = STATE.slice(make(4), make(2), Rank(3, 4), Rank(1, 2)).buffers[0]
    assert len(seg) == 3 * 3  # one segment per group per kernel row
    for pt, dt in [(4, 2), (2, 4), (1, 8)]:
        run_reshard(STATE, make, pt, dt, np.array([1]), np.array([2])).assert_exact()


# ----------------------------------------------------------------------------- replicated tensors
def with_replicated(tp: int) -> Component:
    base = mamba_component("m", layers=1, conv_groups=16, kernel=3, heads=8, head_dim=2, state=2, tp=tp,
                           dtype="float32", num_slots=4)
    extra = BufferGeometry(name="m.norm.0", num_items=4, item_shape=(5, 3), dtype=DType.FLOAT32,
                           shard=None)  # identical on every rank
    return Component(name="m", state_type="mamba", buffers=(*base.buffers, extra), index_kind=IndexKind.SLOT)


def test_replicated_one_writer_per_destination_gather() -> None:
    src, dst = with_replicated(4), with_replicated(2)
    item = dst.buffers[2].item_nbytes
    for d in range(2):
        writers = [p for p in range(4) if len(STATE.slice(src, dst, Rank(p, 4), Rank(d, 2)).buffers[2])]
        assert writers == [2 * d]  # the first of decode d's targets
        assert segs(STATE.slice(src, dst, Rank(2 * d, 4), Rank(d, 2)).buffers[2]) == [(0, 0, item)]
        # the sharded conv state still comes from both targets
        assert all(len(STATE.slice(src, dst, Rank(p, 4), Rank(d, 2)).buffers[0]) for p in (2 * d, 2 * d + 1))


def test_replicated_scatter_every_destination_gets_it() -> None:
    src, dst = with_replicated(2), with_replicated(8)
    for d in range(8):
        assert segs(STATE.slice(src, dst, Rank(d // 4, 2), Rank(d, 8)).buffers[2]) == [(0, 0, 60)]


@pytest.mark.parametrize(("pt", "dt"), [(8, 1), (4, 2), (2, 8), (1, 4), (2, 2)])
def test_replicated_byte_exact_exactly_once(pt: int, dt: int) -> None:
    run_reshard(STATE, with_replicated, pt, dt, np.array([2]), np.array([3]), seed=7).assert_exact()


# ----------------------------------------------------------------------------- topology errors
def test_indivisible_heads_raise_unsupported_topology() -> None:
    with pytest.raises(UnsupportedTopology):
        mamba_component("m", layers=1, conv_groups=12, kernel=4, heads=6, head_dim=2, state=2, tp=4,
                        dtype="float32", num_slots=3)


def test_indivisible_tp_ratio_raises_unsupported_topology() -> None:
    def make(tp: int) -> Component:
        return mamba_component("m", layers=1, conv_groups=12, kernel=4, heads=6, head_dim=2, state=2, tp=tp,
                               dtype="float32", num_slots=3)

    with pytest.raises(UnsupportedTopology, match="do not divide"):
        STATE.slice(make(2), make(3), Rank(0, 2), Rank(0, 3))


def test_mismatched_peer_dims_are_refused() -> None:
    a = mamba_component("m", layers=1, conv_groups=16, kernel=4, heads=4, head_dim=2, state=2, tp=2,
                        dtype="float32", num_slots=3)
    b = mamba_component("m", layers=1, conv_groups=16, kernel=3, heads=4, head_dim=2, state=2, tp=2,
                        dtype="float32", num_slots=3)
    with pytest.raises(IncompatiblePeer, match="item dim"):
        STATE.slice(a, b, Rank(0, 2), Rank(0, 2))


# ----------------------------------------------------------------------------- pair_indices
def test_pair_indices_one_slot_each_side() -> None:
    comp = gdn(2)
    s, d = STATE.pair_indices(comp, np.array([4], dtype=np.int32), 0, np.array([1]), 0)
    assert s.tolist() == [4] and d.tolist() == [1] and s.dtype == np.int64


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_pair_indices_rejects_padding_slot(side: str) -> None:
    good, zero = np.array([2]), np.array([0])
    args = (zero, 0, good, 0) if side == "prefill" else (good, 0, zero, 0)
    with pytest.raises(GeometryError, match=f"{side} slot 0 is the pool's padding slot"):
        STATE.pair_indices(gdn(2), *args)


@pytest.mark.parametrize("items", [np.array([], dtype=np.int64), np.array([1, 2]), np.array([[1]])])
def test_pair_indices_requires_exactly_one_slot(items: np.ndarray) -> None:
    with pytest.raises(GeometryError, match="exactly one decode slot"):
        STATE.pair_indices(gdn(2), np.array([1]), 0, items, 0)
    with pytest.raises(GeometryError, match="exactly one prefill slot"):
        STATE.pair_indices(gdn(2), items, 0, np.array([1]), 0)


def test_pair_indices_rejects_negative_and_float() -> None:
    with pytest.raises(GeometryError, match="negative"):
        STATE.pair_indices(gdn(2), np.array([-1]), 0, np.array([1]), 0)
    with pytest.raises(GeometryError, match="integer"):
        STATE.pair_indices(gdn(2), np.array([1.0]), 0, np.array([1]), 0)


# ----------------------------------------------------------------------------- check_component and builder
def test_check_component_accepts_builder_output() -> None:
    STATE.check_component(gdn(4), Rank(1, 4))


def test_check_component_requires_slot_index() -> None:
    comp = gdn(2)
    paged = Component(name=comp.name, state_type="mamba", buffers=comp.buffers, index_kind=IndexKind.PAGE)
    with pytest.raises(GeometryError, match="indexed by slot"):
        STATE.check_component(paged, Rank(0, 2))


def test_check_component_needs_a_non_padding_slot() -> None:
    comp = mamba_component("m", layers=1, conv_groups=4, kernel=2, heads=2, head_dim=1, state=1, tp=1,
                           dtype="float32", num_slots=1)
    with pytest.raises(GeometryError, match="slot 0 is padding"):
        STATE.check_component(comp, Rank(0, 1))


def test_check_component_catches_wrong_tp() -> None:
    with pytest.raises(GeometryError, match="holds 16 units but TP 4"):
        STATE.check_component(gdn(2), Rank(0, 4))


def test_builder_layout_and_names() -> None:
    comp = mamba_component("gdn", layers=[24, 25], conv_groups=(2048, 2048, 4096), kernel=4, heads=32,
                           head_dim=128, state=128, tp=8, dtype="bfloat16", ssm_dtype="float32", num_slots=9)
    assert [b.name for b in comp.buffers] == ["gdn.conv.24", "gdn.conv.25", "gdn.temporal.24", "gdn.temporal.25"]
    conv, temporal = comp.buffers[0], comp.buffers[2]
    assert conv.item_shape == (256 + 256 + 512, 3) and conv.dtype is DType.BFLOAT16
    assert conv.shard == ShardAxis(axis=0, total=8192, groups=(2048, 2048, 4096))
    assert temporal.item_shape == (4, 128, 128) and temporal.dtype is DType.FLOAT32
    assert temporal.shard == ShardAxis(axis=0, total=32)
    assert comp.index_kind is IndexKind.SLOT and comp.state_type == "mamba" and comp.num_items == 9


def test_builder_single_group_has_no_groups() -> None:
    assert conv_only(2).buffers[0].shard == ShardAxis(axis=0, total=4096)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kernel": 1}, "keeps no state"), ({"conv_groups": (8, 0)}, "must be positive"), ({"layers": 0}, "at least one"),
    ({"layers": [1, 1]}, "duplicate"), ({"tp": 0}, "TP size"), ({"dtype": "complex64"}, "unknown dtype"),
])
def test_builder_rejects(kwargs: dict, match: str) -> None:
    args = {"layers": 1, "conv_groups": 8, "kernel": 4, "heads": 2, "head_dim": 2, "state": 2, "tp": 1,
            "dtype": "float32", "num_slots": 3}
    args.update(kwargs)
    with pytest.raises(GeometryError, match=match):
        mamba_component("m", **args)

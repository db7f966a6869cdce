"""Byte-exact resharding against the independent numpy reference, over Pt, Dt in {1, 2, 4, 8}."""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbridge.errors import UnsupportedTopology
from kvbridge.geometry import Component, Rank
from kvbridge.slicing import ComponentSlice, Segments
from kvbridge.testkit.reshard import TP_SIZES, assert_identity_at_equal_tp, run_reshard, shardable
from kvbridge_mamba import MambaState, mamba_component

STATE = MambaState()
PAIRS = list(itertools.product(TP_SIZES, TP_SIZES))

# (conv groups, heads): every TP size works / heads 6 and groups of 12 only split over TP 1 and 2
GEOMETRIES = {
    "gdn": ((16, 16, 32), 8),
    "mamba2-replicated-heads": ((32,), 2),
    "gdn-six-heads": ((12, 12, 24), 6),
}


def make(groups: tuple[int, ...], heads: int, tp: int, *, channels_last: bool = False) -> Component:
    return mamba_component("m", layers=2, conv_groups=groups, kernel=4, heads=heads, head_dim=3, state=5, tp=tp,
                           dtype="bfloat16", ssm_dtype="float32", num_slots=6, conv_channels_last=channels_last)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize(("pt", "dt"), PAIRS)
def test_byte_exact_matrix(geometry: str, pt: int, dt: int) -> None:
    groups, heads = GEOMETRIES[geometry]
    totals = (*groups, heads)
    if not (shardable(totals, pt) and shardable(totals, dt)):
        bad = pt if not shardable(totals, pt) else dt
        with pytest.raises(UnsupportedTopology):
            make(groups, heads, bad)
        return
    run_reshard(STATE, partial(make, groups, heads), pt, dt, np.array([4]), np.array([1]),
                seed=pt * 8 + dt).assert_exact()


def test_harness_catches_a_wrong_slice() -> None:
    """A state type that ignores TP (copies whole items from everyone) must fail the reference check."""

    class Naive(MambaState):
        def slice(self, src: Component, dst: Component, src_rank: Rank, dst_rank: Rank) -> ComponentSlice:
            n = min(src.buffers[0].item_nbytes, dst.buffers[0].item_nbytes)
            return ComponentSlice(tuple(Segments.whole(min(s.item_nbytes, d.item_nbytes) if n else 0)
                                        for s, d in zip(src.buffers, dst.buffers)))

    with pytest.raises(AssertionError):
        run_reshard(Naive(), partial(make, (16, 16, 32), 8), 4, 2, np.array([1]), np.array([2])).assert_exact()


# ----------------------------------------------------------------------------- properties
GROUP_SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16])


@st.composite
def geometries(draw: st.DrawFn) -> dict:
    return {
        "groups": tuple(draw(st.lists(GROUP_SIZES, min_size=1, max_size=3))),
        "heads": draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        "kernel": draw(st.integers(2, 4)),
        "head_dim": draw(st.integers(1, 3)),
        "state": draw(st.integers(1, 4)),
        "layers": draw(st.integers(1, 2)),
        "dtype": draw(st.sampled_from(["uint8", "bfloat16", "float32"])),
        "ssm_dtype": draw(st.sampled_from(["bfloat16", "float32"])),
        "channels_last": draw(st.booleans()),
        "num_slots": draw(st.integers(2, 5)),
    }


def build(g: dict, tp: int) -> Component:
    return mamba_component("m", layers=g["layers"], conv_groups=g["groups"], kernel=g["kernel"], heads=g["heads"],
                           head_dim=g["head_dim"], state=g["state"], tp=tp, dtype=g["dtype"],
                           ssm_dtype=g["ssm_dtype"], num_slots=g["num_slots"],
                           conv_channels_last=g["channels_last"])


@settings(max_examples=300, deadline=None)
@given(g=geometries(), pt=st.sampled_from(TP_SIZES), dt=st.sampled_from(TP_SIZES), data=st.data())
def test_property_exactly_once_and_equal_to_reference(g: dict, pt: int, dt: int, data: st.DataObject) -> None:
    """Every destination byte is written exactly once (elected writers only) and the union is the reference;
    a geometry the reference cannot split is refused with UnsupportedTopology."""
    totals = (*g["groups"], g["heads"])
    for tp in (pt, dt):
        if not shardable(totals, tp):
            with pytest.raises(UnsupportedTopology):
                build(g, tp)
            event("refused: not shardable")
            return
    event("resharded")
    src_slot = data.draw(st.integers(1, g["num_slots"] - 1))
    dst_slot = data.draw(st.integers(1, g["num_slots"] - 1))
    s, d = STATE.pair_indices(build(g, pt), np.array([src_slot]), 0, np.array([dst_slot]), 0)
    run_reshard(STATE, partial(build, g), pt, dt, s, d, seed=src_slot).assert_exact()


def test_mixed_replication_groups_written_once() -> None:
    """conv groups (1, 2) at Pt=2: group 0 is replicated on both prefill ranks, group 1 is split. Writers
    are elected per group, so group 0 is written by prefill 0 only (found by the property above)."""
    g = {"groups": (1, 2), "heads": 1, "kernel": 2, "head_dim": 1, "state": 1, "layers": 1, "dtype": "uint8",
         "ssm_dtype": "bfloat16", "channels_last": False, "num_slots": 2}
    src, dst = build(g, 2), build(g, 1)
    p1 = STATE.slice(src, dst, Rank(1, 2), Rank(0, 1)).buffers[0]
    assert (p1.src_off.tolist(), p1.dst_off.tolist(), p1.nbytes.tolist()) == ([1], [2], [1])  # its half of group 1
    run_reshard(STATE, partial(build, g), 2, 1, np.array([1]), np.array([1])).assert_exact()
    run_reshard(STATE, partial(build, g), 2, 1, np.array([1]), np.array([1])).assert_exact()


@settings(max_examples=100, deadline=None)
@given(g=geometries(), tp=st.sampled_from(TP_SIZES))
def test_property_equal_tp_is_identity(g: dict, tp: int) -> None:
    """At TP ratio 1 rank r writes whole items to rank r only."""
    if not shardable((*g["groups"], g["heads"]), tp):
        return
    assert_identity_at_equal_tp(STATE, build(g, tp), tp)

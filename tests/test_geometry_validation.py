"""Every field of a layout is validated, built locally (GeometryError naming the field and the value) or
received from a peer (an encoded Hello whose layout was tampered with: ProtocolError, never a raw exception)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import GeometryError, ProtocolError
from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, Rank, ShardAxis
from kvbridge.protocol.wire import PROTOCOL_VERSION, Codec, Hello, Role


def _layout(**over: Any) -> PoolLayout:
    shard = ShardAxis(axis=over.get("axis", 1), total=over.get("total", 8), groups=over.get("groups", ()))
    buf = BufferGeometry(name=over.get("buffer", "k.0"), num_items=over.get("num_items", 4),
                         item_shape=over.get("item_shape", (16, 4, 8)),
                         dtype=over.get("dtype", DType.BFLOAT16), shard=shard)
    comp = Component(name=over.get("component", "kv"), state_type=over.get("state_type", "kv"), buffers=(buf,),
                     index_kind=over.get("index_kind", "page"))
    return PoolLayout(components=(comp,), tp_size=over.get("tp_size", 2), tp_rank=over.get("tp_rank", 0),
                      page_size=over.get("page_size", 16),
                      model=over.get("model", "m"))


BAD = [
    ("total", 0, r"shard axis: total=0 must be >= 1"),
    ("total", -8, r"shard axis: total=-8 must be >= 1"),
    ("total", True, r"shard axis: total=True is a bool"),
    ("total", 8.0, r"shard axis: total=8.0 is not an integer"),
    ("axis", -1, r"shard axis: axis=-1 must be in \[0, 63\]"),
    ("groups", (4, 0, 4), r"shard axis: groups\[1\]=0 must be >= 1"),
    ("groups", (4, -4, 8), r"shard axis: groups\[1\]=-4 must be >= 1"),
    ("num_items", 0, r"buffer 'k\.0': zero-length buffer \(num_items=0\)"),
    ("num_items", -3, r"buffer 'k\.0': zero-length buffer \(num_items=-3\)"),
    ("num_items", "4", r"buffer 'k\.0': num_items='4' is not an integer"),
    ("item_shape", (16, -4, 8), r"buffer 'k\.0': item shape \(16, -4, 8\) has an empty axis"),
    ("item_shape", (), r"buffer 'k\.0': item_shape=\(\) must be a non-empty sequence"),
    ("item_shape", (16, 4.0, 8), r"buffer 'k\.0': item_shape\[1\]=4\.0 is not an integer"),
    ("item_shape", (2**62, 4, 8), r"buffer 'k\.0': .* B exceed"),
    ("buffer", "", r"buffer: name='' must be 1 to 256 characters"),
    ("buffer", 7, r"buffer: name=7 is not a string"),
    ("component", "x" * 300, r"component: name='x{40}'\.\.\. must be 1 to 256 characters \(got 300\)"),
    ("state_type", "", r"component 'kv': state_type='' must be 1 to 256"),
    ("index_kind", "row", r"component 'kv': index_kind='row' is not one of \['page', 'slot'\]"),
    ("tp_size", 0, r"pool layout: tp_size=0 must be >= 1"),
    ("tp_size", -2, r"pool layout: tp_size=-2 must be >= 1"),
    ("tp_rank", -1, r"pool layout: tp_rank=-1 must be >= 0"),
    ("tp_rank", 2, r"pool layout: TP rank 2 is outside TP size 2 \(tp_rank=2, tp_size=2\)"),
    ("page_size", 0, r"pool layout: page_size=0 must be >= 1"),
    ("page_size", None, r"pool layout: page_size=None is not an integer"),
    ("model", 3, r"pool layout: model=3 is not a string"),
]


@pytest.mark.parametrize("field, value, match", BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD])
def test_a_bad_field_built_locally_names_the_field_and_the_value(field: str, value: object, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        _layout(**{field: value})


def test_the_good_layout_is_accepted_and_numpy_integers_become_ints() -> None:
    import numpy as np

    layout = _layout(num_items=np.int64(4), tp_size=np.int32(2))
    assert type(layout.tp_size) is int and type(layout.components[0].buffers[0].num_items) is int
    assert Rank(1, 2) == Rank(np.int64(1), 2)
    with pytest.raises(GeometryError, match=r"rank: rank=2 is outside size=2"):
        Rank(2, 2)


# ------------------------------------------------------------------------------- from a peer
def _hello_raw() -> list[Any]:
    hello = Hello(version=PROTOCOL_VERSION, agent="d0", address="tcp://127.0.0.1:1", role=Role.DECODE, layout=_layout(),
                  backend="loopback", endpoint=b"", buffers=())
    return msgspec.msgpack.decode(Codec(sender="d0").encode(hello))


_PATHS = {   # wire field -> how to reach it in the decoded envelope
    "total": lambda b: b["layout"]["components"][0]["buffers"][0]["shard"],
    "axis": lambda b: b["layout"]["components"][0]["buffers"][0]["shard"],
    "groups": lambda b: b["layout"]["components"][0]["buffers"][0]["shard"],
    "num_items": lambda b: b["layout"]["components"][0]["buffers"][0],
    "item_shape": lambda b: b["layout"]["components"][0]["buffers"][0],
    "name": lambda b: b["layout"]["components"][0]["buffers"][0],
    "state_type": lambda b: b["layout"]["components"][0],
    "index_kind": lambda b: b["layout"]["components"][0],
    "tp_size": lambda b: b["layout"],
    "tp_rank": lambda b: b["layout"],
    "page_size": lambda b: b["layout"],
}


def _tampered(field: str, value: object) -> bytes:
    raw = _hello_raw()
    _PATHS[field](raw[-1])[field] = value
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("field, value, match", [
    ("total", 0, r"total=0 must be >= 1"),             # was: ZeroDivisionError out of Codec.decode
    ("total", -8, r"total=-8 must be >= 1"),           # was: accepted or a misleading TP message
    ("groups", [4, 0, 4], r"groups\[1\]=0 must be >= 1"),
    ("num_items", 0, r"zero-length buffer \(num_items=0\)"),
    ("item_shape", [16, 0, 8], r"has an empty axis"),
    ("name", "", r"name='' must be 1 to 256"),
    ("tp_size", 0, r"tp_size=0 must be >= 1"),
    ("tp_rank", 5, r"TP rank 5 is outside TP size 2"),
    ("page_size", -16, r"page_size=-16 must be >= 1"),
    ("index_kind", "row", r"index_kind"),
])
def test_a_tampered_received_layout_is_a_protocol_error_naming_the_field(field: str, value: object,
                                                                        match: str) -> None:
    with pytest.raises(ProtocolError, match=rf"malformed frame: .*{match}"):
        Codec().decode(_tampered(field, value))


@given(field=st.sampled_from(sorted(_PATHS)),
       value=st.one_of(st.integers(-2**63, 2**64 - 1), st.booleans(), st.none(), st.floats(allow_nan=False),
                       st.text(max_size=300), st.lists(st.integers(-3, 3), max_size=4)))
@settings(max_examples=300, deadline=None)
def test_any_tampered_layout_field_is_either_valid_or_a_protocol_error(field: str, value: object) -> None:
    try:
        message = Codec().decode(_tampered(field, value))
    except ProtocolError:
        return
    assert isinstance(message, Hello)           # accepted: then it is a layout that re-validates
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message.layout), type=PoolLayout) == message.layout


@given(total=st.integers(-64, 64), tp=st.integers(-4, 8), heads=st.integers(-2, 16))
@settings(max_examples=300, deadline=None)
def test_any_head_count_and_tp_either_builds_or_raises_geometry_error(total: int, tp: int, heads: int) -> None:
    try:
        layout = _layout(total=total, tp_size=tp, item_shape=(16, heads, 8))
    except GeometryError:
        return
    assert total >= 1 and tp >= 1 and heads >= 1 and layout.tp_size == tp

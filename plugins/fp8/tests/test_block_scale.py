"""Block-scale geometry and refusals: the shapes SGLang's MXFP8 pool uses, and peers that must be refused."""

from __future__ import annotations

import pytest

from kvbridge.plugin import BufferGeometry, Component, DType, GeometryError, IncompatiblePeer, Rank
from kvbridge_fp8 import BlockScaleState, SWABlockScaleState, block_scale_component


def test_sglang_layouts_by_page_size() -> None:
    """SGLang stores scales interleaved for 128-token pages ([heads, 32, page // 32, dim // 32] per page), token by
    token otherwise ([page, heads, dim // 32]); a page's bytes are the same either way."""
    flat = block_scale_component("bs", layers=1, page_size=64, kv_heads=8, head_dim=128, tp=1, num_pages=4)
    inter = block_scale_component("bs", layers=1, page_size=128, kv_heads=8, head_dim=128, tp=1, num_pages=4)
    assert flat.options["layout"] == "token" and flat.buffers[0].item_shape == (64, 8, 4)
    assert inter.options["layout"] == "interleaved" and inter.buffers[0].item_shape == (8, 32, 4, 4)
    assert inter.buffers[0].item_nbytes == 128 * 8 * 4
    assert flat.buffers[0].shard is not None and flat.buffers[0].shard.axis == 1
    assert inter.buffers[0].shard is not None and inter.buffers[0].shard.axis == 0


@pytest.mark.parametrize("key, other", [("layout", "interleaved"), ("scale_block", 16), ("page_size", 32)])
def test_a_peer_with_other_scales_is_refused_naming_what_differs(key: str, other: object) -> None:
    base: dict[str, object] = dict(layers=1, page_size=64, kv_heads=4, head_dim=64, tp=1, num_pages=4)
    mine = block_scale_component("bs", **base)  # type: ignore[arg-type]
    theirs = block_scale_component("bs", **{**base, key: other})  # type: ignore[arg-type]
    with pytest.raises(IncompatiblePeer, match=f"block-scale {key}"):
        BlockScaleState().slice(mine, theirs, Rank(0, 1), Rank(0, 1))


def test_scales_that_are_not_bytes_by_kv_head_are_refused() -> None:
    good = block_scale_component("bs", layers=1, page_size=4, kv_heads=4, head_dim=64, tp=1, num_pages=4)
    wide = Component(name="bs", state_type="block_scale", index_kind=good.index_kind, options=good.options,
                     buffers=(BufferGeometry(name="bs.k.0", num_items=4, item_shape=(4, 4, 1), dtype=DType.FLOAT16,
                                             shard=good.buffers[0].shard),))
    with pytest.raises(GeometryError, match="one byte each"):
        BlockScaleState().check_component(wide, Rank(0, 1))
    replicated = Component(name="bs", state_type="block_scale", index_kind=good.index_kind, options=good.options,
                           buffers=(BufferGeometry(name="bs.k.0", num_items=4, item_shape=(4, 4, 2),
                                                   dtype=DType.UINT8),))
    with pytest.raises(GeometryError, match="sharded by KV head"):
        BlockScaleState().check_component(replicated, Rank(0, 1))
    with pytest.raises(GeometryError, match="not a whole number"):
        block_scale_component("bs", layers=1, page_size=4, kv_heads=4, head_dim=48, tp=1, num_pages=4)
    with pytest.raises(GeometryError, match="window"):
        block_scale_component("bs", layers=1, page_size=4, kv_heads=4, head_dim=64, tp=1, num_pages=4,
                              state_type="block_scale_swa")
    swa = block_scale_component("bs", layers=1, page_size=4, kv_heads=4, head_dim=64, tp=1, num_pages=4,
                                state_type="block_scale_swa", window=16)
    SWABlockScaleState().check_component(swa, Rank(0, 1))

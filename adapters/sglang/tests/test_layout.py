"""PoolLayouts from KVArgs-like records (no SGLang needed): geometry, PP sub-layouts, refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.geometry import DeviceKind
from kvbridge_sglang.layout import REFUSED, SUPPORTED, UnsupportedStateType, check_state_types, rank_pool


def kv_args(layers: range, heads: int, total: int, page: int = 4, pages: int = 8, hb: int = 16,
            state_types: list[str] | None = None) -> SimpleNamespace:
    item = page * heads * hb
    n = len(layers)
    return SimpleNamespace(
        kv_data_ptrs=[4096 * (i + 1) * 1024 for i in range(2 * n)], kv_data_lens=[item * pages] * (2 * n),
        kv_item_lens=[item] * (2 * n), kv_layer_ids=list(layers) * 2, kv_head_num=heads, total_kv_head_num=total,
        page_size=page, prefill_start_layer=layers.start, num_draft_entries=0, kv_cache_dtype_str="bfloat16",
        kv_layout=None, aux_data_ptrs=[1 << 40], aux_data_lens=[64 * 16], aux_item_lens=[64],
        state_types=state_types or [], state_data_ptrs=[], state_data_lens=[], state_item_lens=[])


def test_kv_geometry_token_major() -> None:
    pool = rank_pool(kv_args(range(2), heads=2, total=8), tp_size=4, tp_rank=1, is_mla=False)
    layout, buffers = pool.layout()
    kv = layout.component("kv")
    assert [b.name for b in kv.buffers] == ["kv.k.0", "kv.k.1", "kv.v.0", "kv.v.1"]
    assert kv.buffers[0].item_shape == (4, 2, 16) and kv.buffers[0].shard is not None
    assert kv.buffers[0].shard.total == 8 and kv.buffers[0].num_items == 8
    assert layout.component("aux").state_type == "row" and buffers["aux"][0].device is DeviceKind.CPU


def test_pp_stage_sub_layouts_match() -> None:
    """A decode holding layers 0-3 cuts, for a prefill stage of layers 2-3, exactly the stage's layout."""
    decode = rank_pool(kv_args(range(4), heads=4, total=4), tp_size=1, tp_rank=0, is_mla=False)
    stage1 = rank_pool(kv_args(range(2, 4), heads=2, total=4), tp_size=2, tp_rank=0, is_mla=False)
    d_layout, _ = decode.layout(range(2, 4), tail=True)
    p_layout, _ = stage1.layout(None, tail=True)
    for dc, pc in zip(d_layout.components, p_layout.components):
        assert dc.name == pc.name and [b.name for b in dc.buffers] == [b.name for b in pc.buffers]
    d0, _ = decode.layout(range(0, 2), tail=False)
    assert d0.component_names == ("kv",) and [b.name for b in d0.component("kv").buffers] == [
        "kv.k.0", "kv.k.1", "kv.v.0", "kv.v.1"]


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_with_name_and_reason(kind: str) -> None:
    with pytest.raises(UnsupportedStateType, match=kind) as info:
        check_state_types(["mamba", kind])
    assert REFUSED[kind] in str(info.value)


def test_supported_names() -> None:
    check_state_types(list(SUPPORTED))
    assert set(SUPPORTED) | set(REFUSED) == {"mamba", "qsa_pending", "qsa_compressed", "swa", "dsa", "dsa_tail",
                                             "minimax_index_k", "minimax_dense_kv", "swa_ring", "c128_state",
                                             "request_row", "block_scale", "block_scale_swa"}
    assert {"block_scale", "block_scale_swa"} <= set(SUPPORTED)

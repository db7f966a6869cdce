"""The data model: clear errors naming the buffer, regions and geometry of numpy / torch CPU buffers."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.errors import GeometryError, UnsupportedTopology
from kvbridge.geometry import (
    BufferGeometry,
    Component,
    DeviceKind,
    DType,
    MemoryRegion,
    PoolLayout,
    ShardAxis,
    geometry_of,
    owned_range,
    region_of,
)

HEADS8 = ShardAxis(axis=1, total=8)


def k_buffer(name: str = "k.7", *, heads: int = 4, num_items: int = 10, shard: ShardAxis | None = HEADS8
             ) -> BufferGeometry:
    return BufferGeometry(name=name, num_items=num_items, item_shape=(16, heads, 128), dtype=DType.BFLOAT16,
                          shard=shard)


# ------------------------------------------------------------------------------ invalid geometry
def test_item_size_not_dividing_the_region_names_the_buffer() -> None:
    geo = k_buffer()
    assert geo.item_nbytes == 16 * 4 * 128 * 2
    with pytest.raises(GeometryError,
                       match=r"buffer 'k\.7': item size 16384 B does not divide the region of 16385 B"):
        geo.check_region(MemoryRegion(0x10000, geo.item_nbytes + 1))
    with pytest.raises(GeometryError, match=r"'k\.7'.*holds 9 items, geometry says 10"):
        geo.check_region(MemoryRegion(0x10000, geo.item_nbytes * 9))
    geo.check_region(MemoryRegion(0x10000, geo.nbytes))  # the right size passes


@pytest.mark.parametrize("total, tp", [(6, 4), (12, 8), (3, 2)])
def test_sharded_dim_not_divisible_by_tp_names_the_buffer(total: int, tp: int) -> None:
    geo = BufferGeometry(name="v.2", num_items=4, item_shape=(16, 1, 64), dtype=DType.FLOAT16,
                         shard=ShardAxis(axis=1, total=total))
    with pytest.raises(GeometryError, match=r"buffer 'v\.2': sharded dim not divisible by TP") as err:
        geo.check_tp(tp)
    assert str(total) in str(err.value) and str(tp) in str(err.value)


def test_wrong_local_share_names_the_buffer_and_the_expected_count() -> None:
    with pytest.raises(GeometryError, match=r"'k\.7'.*holds 2 units but TP 2 of total 8.*needs 4"):
        k_buffer(heads=2).check_tp(2)
    k_buffer(heads=4).check_tp(2)
    k_buffer(heads=1).check_tp(8)
    k_buffer(heads=1, shard=ShardAxis(axis=1, total=2)).check_tp(8)  # replicated: one head per rank


def test_pool_layout_checks_every_buffer_against_its_tp() -> None:
    comp = Component(name="kv", state_type="kv", buffers=(k_buffer("k.0"), k_buffer("k.1", heads=8)))
    with pytest.raises(GeometryError, match=r"'k\.1'"):
        PoolLayout(components=(comp,), tp_size=2, tp_rank=0, page_size=16)


@pytest.mark.parametrize("dtype", ["nope", "complex64", "float128"])
def test_unknown_dtype_names_the_buffer(dtype: str) -> None:
    with pytest.raises(GeometryError, match=rf"buffer 'k\.0': unknown dtype '{dtype}'; known: .*bfloat16"):
        BufferGeometry(name="k.0", num_items=4, item_shape=(16, 2, 8), dtype=dtype)  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match=r"buffer 'k\.3': unknown dtype"):
        geometry_of("k.3", np.zeros((4, 2), dtype=np.complex64))
    with pytest.raises(GeometryError, match=r"buffer 'k\.4': unknown dtype"):
        geometry_of("k.4", torch.zeros(4, 2, dtype=torch.complex64))


def test_dtype_given_by_name_or_alias_becomes_the_enum() -> None:
    for given in ("bfloat16", "bf16", "torch.bfloat16", torch.bfloat16, DType.BFLOAT16):
        geo = BufferGeometry(name="k.0", num_items=4, item_shape=(16, 2, 8), dtype=given)  # type: ignore[arg-type]
        assert geo.dtype is DType.BFLOAT16 and geo.item_nbytes == 16 * 2 * 8 * 2
    assert DType.parse(np.dtype("float16")) is DType.FLOAT16
    assert DType.parse(torch.float8_e4m3fn) is DType.FLOAT8_E4M3


def test_zero_length_buffer_names_the_buffer() -> None:
    with pytest.raises(GeometryError, match=r"buffer 'kv\.0': zero-length buffer"):
        BufferGeometry(name="kv.0", num_items=0, item_shape=(16, 576), dtype=DType.BFLOAT16)
    with pytest.raises(GeometryError, match=r"buffer 'kv\.1': zero-length buffer"):
        geometry_of("kv.1", np.zeros((0, 16, 576), dtype=np.float16))
    with pytest.raises(GeometryError, match=r"'kv\.2': item shape \(16, 0\) has an empty axis"):
        BufferGeometry(name="kv.2", num_items=4, item_shape=(16, 0), dtype=DType.BFLOAT16)
    with pytest.raises(GeometryError, match="non-positive length"):
        region_of(np.zeros((0, 16), dtype=np.float16))


def test_other_inconsistent_geometry_is_refused() -> None:
    with pytest.raises(GeometryError, match=r"'k\.0': shard axis 3 is outside item shape"):
        BufferGeometry(name="k.0", num_items=4, item_shape=(16, 2, 8), dtype=DType.BFLOAT16,
                       shard=ShardAxis(axis=3, total=2))
    with pytest.raises(GeometryError, match=r"'conv\.0': shard groups \(2, 2\) do not sum to total 6"):
        BufferGeometry(name="conv.0", num_items=4, item_shape=(6, 3), dtype=DType.FLOAT32,
                       shard=ShardAxis(axis=0, total=6, groups=(2, 2)))
    with pytest.raises(GeometryError, match="duplicate buffer names"):
        Component(name="kv", state_type="kv", buffers=(k_buffer("k.0"), k_buffer("k.0")))
    with pytest.raises(GeometryError, match=r"disagree on num_items \[4, 10\]"):
        Component(name="kv", state_type="kv", buffers=(k_buffer("k.0"), k_buffer("k.1", num_items=4)))
    with pytest.raises(GeometryError, match="has no buffers"):
        Component(name="kv", state_type="kv", buffers=())
    with pytest.raises(GeometryError, match="TP rank 2 is outside TP size 2"):
        PoolLayout(components=(), tp_size=2, tp_rank=2, page_size=16)
    with pytest.raises(GeometryError, match="needs an item axis"):
        geometry_of("x", np.zeros(8))


def test_invalid_geometry_on_the_wire_is_a_validation_error() -> None:
    wire = msgspec.json.encode({"name": "k.0", "num_items": 0, "item_shape": [16, 2, 8], "dtype": "bfloat16"})
    with pytest.raises(msgspec.ValidationError, match="zero-length"):
        msgspec.json.decode(wire, type=BufferGeometry)


def test_geometry_round_trips_through_msgpack() -> None:
    comp = Component(name="kv", state_type="kv", buffers=(k_buffer("k.0"), k_buffer("v.0")), options={"window": 4})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(comp), type=Component)
    assert back == comp and back.buffers[0].dtype is DType.BFLOAT16


# ------------------------------------------------------------------------------ item anatomy
def test_token_major_and_head_major_item_anatomy() -> None:
    token = BufferGeometry(name="k.0", num_items=4, item_shape=(16, 2, 128), dtype=DType.BFLOAT16,
                           shard=ShardAxis(axis=1, total=8))
    head = BufferGeometry(name="k.0", num_items=4, item_shape=(2, 16, 128), dtype=DType.BFLOAT16,
                          shard=ShardAxis(axis=0, total=8))
    assert (token.outer_count, token.inner_nbytes) == (16, 256)   # 16 token rows of 256 B per head
    assert (head.outer_count, head.inner_nbytes) == (1, 16 * 256)  # one block of 4096 B per head
    latent = BufferGeometry(name="kv.0", num_items=4, item_shape=(16, 576), dtype=DType.BFLOAT16)
    assert (latent.outer_count, latent.item_nbytes, latent.nbytes) == (1, 16 * 576 * 2, 4 * 16 * 576 * 2)


def test_owned_range_is_replication_aware() -> None:
    assert [owned_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [owned_range(2, 8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [owned_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    with pytest.raises(UnsupportedTopology, match="6 units.*TP 4"):
        owned_range(6, 4, 0)
    with pytest.raises(UnsupportedTopology, match="TP 6.*4"):
        owned_range(4, 6, 0)


# ------------------------------------------------------------------------------ memory regions
def test_memory_region_is_unsigned_64_bit() -> None:
    top = MemoryRegion(2**64 - 4096, 4096, DeviceKind.CUDA, 3)
    assert top.end == 2**64 and top.device is DeviceKind.CUDA and top.device_id == 3
    with pytest.raises(GeometryError, match="unsigned 64-bit"):
        MemoryRegion(2**64, 16)
    with pytest.raises(GeometryError, match="unsigned 64-bit"):
        MemoryRegion(-1, 16)
    with pytest.raises(GeometryError, match="runs past the end of the 64-bit address space"):
        MemoryRegion(2**64 - 4096, 4097)  # its end would wrap to 0 in uint64 bounds checks


def test_region_and_geometry_of_a_numpy_array() -> None:
    arr = np.zeros((6, 16, 2, 64), dtype=np.float16)
    region = region_of(arr)
    assert (region.addr, region.nbytes, region.device) == (arr.ctypes.data, arr.nbytes, DeviceKind.CPU)
    geo = geometry_of("k.0", arr, shard=ShardAxis(axis=1, total=4))
    assert (geo.num_items, geo.item_shape, geo.dtype) == (6, (16, 2, 64), DType.FLOAT16)
    assert geo.item_nbytes == 4096
    geo.check_region(region)
    geo.check_tp(2)
    # a slice of whole items is its own contiguous region, offset by the items skipped
    assert region_of(arr[2:]).addr == arr.ctypes.data + 2 * geo.item_nbytes
    with pytest.raises(GeometryError, match="C-contiguous"):
        region_of(arr[:, :, :1])


def test_region_and_geometry_of_a_torch_cpu_tensor() -> None:
    t = torch.zeros(5, 2, 16, 32, dtype=torch.bfloat16)
    region = region_of(t)
    assert (region.addr, region.nbytes) == (t.data_ptr(), 5 * 2 * 16 * 32 * 2)
    assert (region.device, region.device_id) == (DeviceKind.CPU, 0)
    geo = geometry_of("k.0", t, shard=ShardAxis(axis=0, total=8))
    assert (geo.num_items, geo.item_shape, geo.dtype) == (5, (2, 16, 32), DType.BFLOAT16)
    assert geo.nbytes == region.nbytes
    geo.check_region(region)
    geo.check_tp(4)
    assert region_of(t[3:]).addr == t.data_ptr() + 3 * geo.item_nbytes
    with pytest.raises(GeometryError, match="contiguous"):
        region_of(t.transpose(1, 2))


def test_geometry_of_with_an_explicit_dtype_of_the_same_width() -> None:
    raw = np.zeros((4, 16, 656), dtype=np.uint8)  # fp8 data kept in a uint8 numpy array
    geo = geometry_of("idx.0", raw, dtype="float8_e4m3fn")
    assert geo.dtype is DType.FLOAT8_E4M3 and geo.nbytes == raw.nbytes


def test_region_of_refuses_other_objects() -> None:
    with pytest.raises(GeometryError, match="cannot take a memory region of list"):
        region_of([1, 2, 3])

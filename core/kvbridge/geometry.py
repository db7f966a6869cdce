"""The data model: dtypes, memory regions, buffer geometry, components, pool layouts, TP ranks.

Everything that crosses the wire in a handshake (geometry, components, layouts) is a frozen msgspec
Struct; local-only records (memory regions) are frozen dataclasses.

Example: a token-major GQA K buffer of one layer, 8 KV heads in the model, TP 2 on this side::

    k0 = BufferGeometry(name="k.0", num_items=1024, item_shape=(16, 4, 128), dtype=DType.BFLOAT16,
                        shard=ShardAxis(axis=1, total=8))
"""

from __future__ import annotations

import enum
import math
import operator
import re
from dataclasses import dataclass

import msgspec
import numpy as np

from kvbridge.errors import GeometryError, UnsupportedTopology


class DType(str, enum.Enum):
    """Element types a buffer may hold. The value is the canonical name."""

    FLOAT64 = "float64"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3 = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    INT64 = "int64"
    INT32 = "int32"
    INT16 = "int16"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, value: object) -> DType:
        """Accept a DType, its name, a numpy dtype or a torch dtype; raise a clear error otherwise."""
        if isinstance(value, DType):
            return value
        name = str(value).removeprefix("torch.")
        name = _ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            raise GeometryError(f"unknown dtype {value!r}; known: {', '.join(d.value for d in cls)}") from None


_ITEMSIZE = {
    DType.FLOAT64: 8, DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT8_E4M3: 1,
    DType.FLOAT8_E5M2: 1, DType.INT64: 8, DType.INT32: 4, DType.INT16: 2, DType.INT8: 1, DType.UINT8: 1,
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
            "float8_e4m3": "float8_e4m3fn", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

MAX_NAME = 256            # characters of a buffer, component, state-type or model name
MAX_BYTES = 2**63 - 1     # a buffer's size, in bytes, fits a signed 64-bit length
# Bounds that make a layout impossible (a peer's Hello naming one is refused with the bound): far above any
# real pool, low enough that nothing downstream sizes an allocation or a loop by a forged count.
MAX_ITEMS = 1 << 32           # pages or slots of one buffer
MAX_BUFFER_BYTES = 1 << 48    # bytes of one buffer (256 TiB)
MAX_ITEM_DIMS = 16            # axes of an item
MAX_SHARD_GROUPS = 64         # independently sharded blocks of one axis
MAX_LAYOUT_BUFFERS = 4096     # buffers of one pool layout, all components together
MAX_COMPONENTS = 64           # components of one pool layout


def checked_int(owner: str, field: str, value: object, minimum: int, maximum: int = MAX_BYTES) -> int:
    """``value`` as a plain int in ``[minimum, maximum]``, else a GeometryError naming ``owner.field`` and the value.

    Numpy integers are accepted (and become ints); bools, floats and strings are not.
    """
    if isinstance(value, bool):
        raise GeometryError(f"{owner}: {field}={value!r} is a bool, not an integer")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise GeometryError(f"{owner}: {field}={value!r} is not an integer") from None
    if not minimum <= number <= maximum:
        bound = f">= {minimum}" if maximum == MAX_BYTES else f"in [{minimum}, {maximum}]"
        raise GeometryError(f"{owner}: {field}={number} must be {bound}")
    return number


def checked_name(owner: str, field: str, value: object, *, allow_empty: bool = False) -> str:
    """A non-empty (unless ``allow_empty``) str of at most MAX_NAME characters, else a GeometryError."""
    if not isinstance(value, str):
        raise GeometryError(f"{owner}: {field}={value!r} is not a string")
    if (not value and not allow_empty) or len(value) > MAX_NAME:
        raise GeometryError(f"{owner}: {field}={value[:40]!r}{'...' if len(value) > 40 else ''} must be 1 to "
                            f"{MAX_NAME} characters (got {len(value)})")
    return value


class DeviceKind(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"


class IndexKind(str, enum.Enum):
    """What an index of a component names: a page of tokens, or a per-request slot."""

    PAGE = "page"
    SLOT = "slot"


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A span of registered memory. ``addr`` is an unsigned 64-bit address."""

    addr: int
    nbytes: int
    device: DeviceKind = DeviceKind.CPU
    device_id: int = 0

    def __post_init__(self) -> None:
        for field in ("addr", "nbytes", "device_id"):
            value = getattr(self, field)
            if isinstance(value, bool):
                raise GeometryError(f"memory region: {field}={value!r} is a bool, not an integer")
            try:
                object.__setattr__(self, field, operator.index(value))
            except TypeError:
                raise GeometryError(f"memory region: {field}={value!r} is not an integer") from None
        if not isinstance(self.device, DeviceKind):
            try:
                object.__setattr__(self, "device", DeviceKind(self.device))
            except ValueError:
                raise GeometryError(f"memory region: device={self.device!r} is not one of "
                                    f"{[d.value for d in DeviceKind]}") from None
        if self.device_id < 0:
            raise GeometryError(f"memory region: device_id={self.device_id} must be >= 0")
        if not 0 <= self.addr < 2**64:
            raise GeometryError(f"region address {self.addr:#x} is not an unsigned 64-bit value")
        if self.nbytes <= 0:
            raise GeometryError(f"region at {self.addr:#x} has non-positive length {self.nbytes}")
        if self.addr + self.nbytes > 2**64:
            raise GeometryError(f"region at {self.addr:#x} of {self.nbytes} B runs past the end of the 64-bit "
                                "address space")

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


class ShardAxis(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The TP-sharded axis of an item.

    ``total`` is the model's un-sharded size of that axis (e.g. total KV heads, all conv channels).
    ``groups`` splits the axis into independently sharded blocks, GDN-style ``[q | k | v]``; their
    global sizes must sum to ``total``. A rank of a TP group of size T holds ``total / T`` units when
    ``total >= T``, else one unit replicated on ``T / total`` ranks.
    """

    axis: int
    total: int
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "shard axis"
        msgspec.structs.force_setattr(self, "axis", checked_int(owner, "axis", self.axis, 0, 63))
        msgspec.structs.force_setattr(self, "total", checked_int(owner, "total", self.total, 1))
        if not isinstance(self.groups, (tuple, list)):
            raise GeometryError(f"{owner}: groups={self.groups!r} is not a sequence of integers")
        if len(self.groups) > MAX_SHARD_GROUPS:
            raise GeometryError(f"{owner}: {len(self.groups)} groups, at most {MAX_SHARD_GROUPS}")
        groups = tuple(checked_int(owner, f"groups[{i}]", g, 1) for i, g in enumerate(self.groups))
        msgspec.structs.force_setattr(self, "groups", groups)

    @property
    def group_totals(self) -> tuple[int, ...]:
        return self.groups or (self.total,)


def owned_range(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global units ``[lo, hi)`` of a sharded axis held by ``tp_rank`` (replication-aware).

    >>> owned_range(8, 4, 3), owned_range(2, 8, 5)
    ((6, 8), (1, 2))
    """
    if total >= tp_size:
        if total % tp_size:
            raise UnsupportedTopology(f"{total} units cannot be split evenly over TP {tp_size}")
        n = total // tp_size
        return tp_rank * n, tp_rank * n + n
    if tp_size % total:
        raise UnsupportedTopology(f"TP {tp_size} is not a multiple of {total} replicated units")
    unit = tp_rank // (tp_size // total)
    return unit, unit + 1


def local_units(total: int, tp_size: int) -> int:
    lo, hi = owned_range(total, tp_size, 0)
    return hi - lo


class BufferGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One registered tensor of a component: ``num_items`` items of ``item_shape`` elements.

    An item is a page (KV, SWA, NSA) or a slot (Mamba). ``shard`` names the TP-sharded axis of the
    item, or is None for a tensor replicated on every rank (MLA latent, NSA indexer).
    """

    name: str
    num_items: int
    item_shape: tuple[int, ...]
    dtype: DType
    shard: ShardAxis | None = None

    def __post_init__(self) -> None:
        checked_name("buffer", "name", self.name)
        owner = f"buffer {self.name!r}"
        try:
            dtype = DType.parse(self.dtype)
        except GeometryError as exc:
            raise GeometryError(f"{owner}: {exc}") from None
        if dtype is not self.dtype:  # a name given directly ("bfloat16") becomes the enum member
            msgspec.structs.force_setattr(self, "dtype", dtype)
        if isinstance(self.num_items, int) and not isinstance(self.num_items, bool) and self.num_items <= 0:
            raise GeometryError(f"{owner}: zero-length buffer (num_items={self.num_items})")
        msgspec.structs.force_setattr(self, "num_items", checked_int(owner, "num_items", self.num_items, 1, MAX_ITEMS))
        if not isinstance(self.item_shape, (tuple, list)) or not self.item_shape:
            raise GeometryError(f"{owner}: item_shape={self.item_shape!r} must be a non-empty sequence of integers")
        if len(self.item_shape) > MAX_ITEM_DIMS:
            raise GeometryError(f"{owner}: item_shape has {len(self.item_shape)} axes, at most {MAX_ITEM_DIMS}")
        if any(isinstance(d, int) and not isinstance(d, bool) and d <= 0 for d in self.item_shape):
            raise GeometryError(f"{owner}: item shape {tuple(self.item_shape)} has an empty axis")
        shape = tuple(checked_int(owner, f"item_shape[{i}]", d, 1) for i, d in enumerate(self.item_shape))
        msgspec.structs.force_setattr(self, "item_shape", shape)
        if self.nbytes > MAX_BUFFER_BYTES:
            raise GeometryError(f"{owner}: {self.num_items} items of {self.item_nbytes} B = {self.nbytes} B exceed "
                                f"the {MAX_BUFFER_BYTES}-byte bound of one buffer")
        if self.shard is not None:
            if not isinstance(self.shard, ShardAxis):
                raise GeometryError(f"{owner}: shard={self.shard!r} is not a ShardAxis")
            if not 0 <= self.shard.axis < len(self.item_shape):
                raise GeometryError(
                    f"{owner}: shard axis {self.shard.axis} is outside item shape {self.item_shape}")
            if self.shard.groups and sum(self.shard.groups) != self.shard.total:
                raise GeometryError(f"{owner}: shard groups {self.shard.groups} do not sum to total {self.shard.total}")

    @property
    def item_nbytes(self) -> int:
        return math.prod(self.item_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_items * self.item_nbytes

    @property
    def inner_nbytes(self) -> int:
        """Bytes of one unit of the sharded axis (everything inside it)."""
        axis = self.shard.axis if self.shard else -1
        return math.prod(self.item_shape[axis + 1:]) * self.dtype.itemsize

    @property
    def outer_count(self) -> int:
        """How many times the sharded axis repeats inside one item (e.g. tokens of a token-major page)."""
        return math.prod(self.item_shape[: self.shard.axis]) if self.shard else 1

    def check_tp(self, tp_size: int) -> None:
        """Raise unless the sharded axis holds exactly this rank's share for ``tp_size``."""
        if self.shard is None:
            return
        try:
            expected = sum(local_units(g, tp_size) for g in self.shard.group_totals)
        except UnsupportedTopology as exc:
            raise GeometryError(f"buffer {self.name!r}: sharded dim not divisible by TP: {exc}") from None
        got = self.item_shape[self.shard.axis]
        if got != expected:
            raise GeometryError(
                f"buffer {self.name!r}: sharded axis {self.shard.axis} holds {got} units but TP {tp_size} "
                f"of total {self.shard.total} (groups {self.shard.group_totals}) needs {expected}")

    def check_region(self, region: MemoryRegion) -> None:
        if region.nbytes % self.item_nbytes:
            raise GeometryError(f"buffer {self.name!r}: item size {self.item_nbytes} B does not divide the "
                                f"region of {region.nbytes} B")
        if region.nbytes != self.nbytes:
            raise GeometryError(f"buffer {self.name!r}: region of {region.nbytes} B holds "
                                f"{region.nbytes // self.item_nbytes} items, geometry says {self.num_items}")


class Component(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One transferable part of a pool: its state type, its buffers in wire order, and options.

    ``options`` carries state-type parameters that both sides must agree on (e.g. an SWA window).
    """

    name: str
    state_type: str
    buffers: tuple[BufferGeometry, ...]
    index_kind: IndexKind = IndexKind.PAGE
    options: dict[str, int | str | float] = {}

    def __post_init__(self) -> None:
        checked_name("component", "name", self.name)
        checked_name(f"component {self.name!r}", "state_type", self.state_type)
        if not isinstance(self.index_kind, IndexKind):
            try:
                msgspec.structs.force_setattr(self, "index_kind", IndexKind(self.index_kind))
            except ValueError:
                raise GeometryError(f"component {self.name!r}: index_kind={self.index_kind!r} is not one of "
                                    f"{[k.value for k in IndexKind]}") from None
        if not isinstance(self.buffers, (tuple, list)) or not all(isinstance(b, BufferGeometry) for b in self.buffers):
            raise GeometryError(f"component {self.name!r}: buffers={self.buffers!r} is not a sequence of "
                                "BufferGeometry")
        msgspec.structs.force_setattr(self, "buffers", tuple(self.buffers))
        if not self.buffers:
            raise GeometryError(f"component {self.name!r} has no buffers")
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise GeometryError(f"component {self.name!r} has duplicate buffer names {names}")
        counts = {b.num_items for b in self.buffers}
        if len(counts) != 1:
            raise GeometryError(f"component {self.name!r}: buffers disagree on num_items {sorted(counts)}")

    @property
    def num_items(self) -> int:
        return self.buffers[0].num_items


class PoolLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one rank holds: its components in wire order, its TP position, page size and model."""

    components: tuple[Component, ...]
    tp_size: int
    tp_rank: int
    page_size: int
    model: str = ""

    def __post_init__(self) -> None:
        owner = "pool layout"
        tp_size = checked_int(owner, "tp_size", self.tp_size, 1)
        tp_rank = checked_int(owner, "tp_rank", self.tp_rank, 0)
        if tp_rank >= tp_size:
            raise GeometryError(f"{owner}: TP rank {tp_rank} is outside TP size {tp_size} (tp_rank={tp_rank}, "
                                f"tp_size={tp_size})")
        page_size = checked_int(owner, "page_size", self.page_size, 1)
        for field, value in (("tp_size", tp_size), ("tp_rank", tp_rank), ("page_size", page_size)):
            msgspec.structs.force_setattr(self, field, value)
        checked_name(owner, "model", self.model, allow_empty=True)
        if not isinstance(self.components, (tuple, list)) or not all(isinstance(c, Component)
                                                                      for c in self.components):
            raise GeometryError(f"{owner}: components={self.components!r} is not a sequence of Component")
        msgspec.structs.force_setattr(self, "components", tuple(self.components))
        count = sum(len(c.buffers) for c in self.components)
        if len(self.components) > MAX_COMPONENTS or count > MAX_LAYOUT_BUFFERS:
            raise GeometryError(f"{owner}: {len(self.components)} components of {count} buffers; at most "
                                f"{MAX_COMPONENTS} components and at most {MAX_LAYOUT_BUFFERS} buffers per layout")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise GeometryError(f"pool has duplicate component names {names}")
        for comp in self.components:
            for buf in comp.buffers:
                buf.check_tp(self.tp_size)

    def component(self, name: str) -> Component:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"pool has no component {name!r}; it has {[c.name for c in self.components]}")

    @property
    def component_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)


class Rank(msgspec.Struct, frozen=True):
    """A position in a TP group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        size = checked_int("rank", "size", self.size, 1)
        rank = checked_int("rank", "rank", self.rank, 0)
        if rank >= size:
            raise GeometryError(f"rank: rank={rank} is outside size={size}")
        msgspec.structs.force_setattr(self, "size", size)
        msgspec.structs.force_setattr(self, "rank", rank)


_TRAILING_INT = re.compile(r"(?:^|\D)(\d+)$")


def buffer_layer(name: str) -> int | None:
    """The model layer a buffer's name ends with (``k.3``, ``kv.v.3``, ``mamba.conv.12``), or None."""
    match = _TRAILING_INT.search(name)
    return int(match.group(1)) if match else None


def region_of(array: object) -> MemoryRegion:
    """The memory region of a contiguous numpy array or torch tensor (CPU or CUDA)."""
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise GeometryError("numpy buffer must be C-contiguous")
        return MemoryRegion(array.ctypes.data, array.nbytes, DeviceKind.CPU, 0)
    data_ptr = getattr(array, "data_ptr", None)
    if data_ptr is None:
        raise GeometryError(f"cannot take a memory region of {type(array).__name__}; give a numpy array or "
                            "a torch tensor")
    if not array.is_contiguous():  # type: ignore[attr-defined]
        raise GeometryError("torch buffer must be contiguous")
    device = array.device  # type: ignore[attr-defined]
    kinds = {"cpu": DeviceKind.CPU, "cuda": DeviceKind.CUDA, "npu": DeviceKind.NPU}
    if device.type not in kinds:
        raise GeometryError(f"cannot take a memory region of a tensor on {device.type!r}; known: {sorted(kinds)}")
    kind = kinds[device.type]
    nbytes = array.numel() * array.element_size()  # type: ignore[attr-defined]
    return MemoryRegion(data_ptr(), nbytes, kind, device.index or 0)


def geometry_of(name: str, array: object, *, shard: ShardAxis | None = None,
                dtype: DType | str | None = None) -> BufferGeometry:
    """Describe a tensor whose first axis is the item axis (pages or slots).

    >>> import numpy as np
    >>> geometry_of("k.0", np.zeros((4, 16, 2, 8), np.float16), shard=ShardAxis(axis=1, total=4)).item_nbytes
    512
    """
    shape = tuple(int(d) for d in array.shape)  # type: ignore[attr-defined]
    if len(shape) < 2:
        raise GeometryError(f"buffer {name!r}: needs an item axis and an item shape, got shape {shape}")
    try:
        parsed = DType.parse(dtype if dtype is not None else array.dtype)  # type: ignore[attr-defined]
    except GeometryError as exc:
        raise GeometryError(f"buffer {name!r}: {exc}") from None
    return BufferGeometry(name=name, num_items=shape[0], item_shape=shape[1:], dtype=parsed, shard=shard)

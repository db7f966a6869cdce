"""Build the ``Component`` of a Mamba / GDN slot pool as one TP rank holds it.

Buffers come in wire order: the conv state of every layer, then the temporal (SSM) state of every layer.
Buffer names carry the model's layer id (``<name>.conv.<layer>``, ``<name>.temporal.<layer>``), so a
pipeline stage that holds layers 24..47 names them as such.

Example, Qwen3-Next-like GDN layers (q and k of 2048 channels, v of 4096, 32 value heads) at TP 4::

    >>> comp = mamba_component("gdn", layers=[0, 1, 2], conv_groups=(2048, 2048, 4096), kernel=4,
    ...                        heads=32, head_dim=128, state=128, tp=4, dtype="bfloat16",
    ...                        ssm_dtype="float32", num_slots=65)
    >>> [b.name for b in comp.buffers][:4], comp.buffers[0].item_shape, comp.buffers[3].item_shape
    (['gdn.conv.0', 'gdn.conv.1', 'gdn.conv.2', 'gdn.temporal.0'], (2048, 3), (8, 128, 128))
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.plugin import BufferGeometry, Component, DType, GeometryError, IndexKind, ShardAxis, local_units


def layer_ids(layers: int | Sequence[int]) -> tuple[int, ...]:
    """``layers`` as model layer ids: a count means ``0..count-1``."""
    ids = tuple(range(layers)) if isinstance(layers, int) else tuple(int(i) for i in layers)
    if not ids:
        raise GeometryError("a component needs at least one layer")
    if len(set(ids)) != len(ids):
        raise GeometryError(f"duplicate layer ids {ids}")
    return ids


def mamba_component(name: str, *, layers: int | Sequence[int], conv_groups: int | Sequence[int], kernel: int,
                    heads: int, head_dim: int, state: int, tp: int, dtype: DType | str, num_slots: int,
                    ssm_dtype: DType | str | None = None, conv_channels_last: bool = False) -> Component:
    """The slot-indexed Mamba component of one rank of a TP group of size ``tp``.

    ``conv_groups`` is the model's total conv channels, or their independently sharded blocks (GDN:
    ``(key_dim, key_dim, value_dim)``); ``heads`` the total SSM heads. ``num_slots`` counts the padding
    slot 0. ``ssm_dtype`` defaults to ``dtype``. ``conv_channels_last`` gives ``[kernel-1, channels]``
    conv items (Kimi-style) instead of ``[channels, kernel-1]``. Raises UnsupportedTopology when a
    group or the head count cannot be split over ``tp``.
    """
    groups = (conv_groups,) if isinstance(conv_groups, int) else tuple(int(g) for g in conv_groups)
    if not groups or min(groups) <= 0:
        raise GeometryError(f"{name}: conv groups {groups} must be positive")
    if kernel < 2:
        raise GeometryError(f"{name}: conv kernel {kernel} keeps no state (kernel - 1 = {kernel - 1})")
    if tp <= 0:
        raise GeometryError(f"{name}: TP size {tp} must be positive")
    ids = layer_ids(layers)
    conv_local = sum(local_units(g, tp) for g in groups)
    conv_shape = (kernel - 1, conv_local) if conv_channels_last else (conv_local, kernel - 1)
    conv_shard = ShardAxis(axis=1 if conv_channels_last else 0, total=sum(groups),
                           groups=groups if len(groups) > 1 else ())
    ssm_shape = (local_units(heads, tp), head_dim, state)
    conv_dtype = DType.parse(dtype)
    temporal_dtype = DType.parse(ssm_dtype if ssm_dtype is not None else dtype)
    conv = tuple(BufferGeometry(name=f"{name}.conv.{i}", num_items=num_slots, item_shape=conv_shape,
                                dtype=conv_dtype, shard=conv_shard) for i in ids)
    temporal = tuple(BufferGeometry(name=f"{name}.temporal.{i}", num_items=num_slots, item_shape=ssm_shape,
                                    dtype=temporal_dtype,
                                    shard=ShardAxis(axis=0, total=heads)) for i in ids)
    return Component(name=name, state_type="mamba", buffers=conv + temporal, index_kind=IndexKind.SLOT)

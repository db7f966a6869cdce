"""The ``mamba`` state type: one slot per request, conv state sharded on channels, SSM state on heads.

Every buffer of the component is one tensor of one layer whose item is a request's slot. The TP-sharded
axis is named by the buffer's ``ShardAxis`` and resharded by the generic rules of ``kvbridge.slicing``:

* conv state ``[channels_local, kernel-1]``, ``ShardAxis(axis=0, total=channels)``; GDN-style layouts whose
  channels are ``[q | k | v]`` sharded block by block carry ``groups=(key_dim, key_dim, value_dim)``, and
  each group is resharded on its own (a single contiguous channel range would mix q, k and v);
* channels-last conv state ``[kernel-1, channels_local]`` (``axis=1``) is supported too, one segment per row;
* SSM / temporal state ``[heads_local, head_dim, state]``, ``ShardAxis(axis=0, total=heads)``;
* a buffer without a shard axis is replicated on every rank and written whole by one elected rank.

Slot 0 is the pool's padding slot: it is never a request's slot and :meth:`MambaState.pair_indices` refuses it.

Example (sglang-notes §4 conv example: 4096 channels, kernel 4, bf16, prefill TP 4 -> decode TP 2)::

    >>> from kvbridge import Rank
    >>> from kvbridge_mamba.geometry import mamba_component
    >>> def comp(tp):
    ...     return mamba_component("m", layers=1, conv_groups=4096, kernel=4, heads=32, head_dim=128,
    ...                            state=128, tp=tp, dtype="bfloat16", num_slots=4, ssm_dtype="float32")
    >>> conv = MambaState().slice(comp(4), comp(2), Rank(3, 4), Rank(1, 2)).buffers[0]
    >>> conv.src_off.tolist(), conv.dst_off.tolist(), conv.nbytes.tolist()
    ([0], [6144], [6144])
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvbridge.plugin import Component, GeometryError, IndexKind, Rank, StateType


class MambaState(StateType):
    """Per-request slot state of Mamba / GDN / linear-attention layers; travels with the last chunk."""

    name: ClassVar[str] = "mamba"
    chunked: ClassVar[bool] = False

    def check_component(self, component: Component, tp: Rank) -> None:
        where = f"component {component.name!r}"
        if component.index_kind is not IndexKind.SLOT:
            raise GeometryError(f"{where}: mamba state is indexed by slot (one per request), "
                                f"not by {component.index_kind.value}")
        if component.num_items < 2:
            raise GeometryError(f"{where}: {component.num_items} slot(s); slot 0 is padding, so a mamba "
                                "pool needs at least 2")
        for buf in component.buffers:
            buf.check_tp(tp.size)

    def pair_indices(self, component: Component, src_items: np.ndarray, src_first: int,
                     dst_items: np.ndarray, dst_first: int) -> tuple[np.ndarray, np.ndarray]:
        """Exactly one non-padding slot on each side; positions (``*_first``) play no part.

        >>> from kvbridge_mamba.geometry import mamba_component
        >>> comp = mamba_component("m", layers=1, conv_groups=8, kernel=4, heads=2, head_dim=4, state=4,
        ...                        tp=1, dtype="float32", num_slots=8)
        >>> MambaState().pair_indices(comp, np.array([3]), 0, np.array([5]), 0)
        (array([3]), array([5]))
        """
        return _one_slot(component, src_items, "prefill"), _one_slot(component, dst_items, "decode")


def _one_slot(component: Component, items: np.ndarray, side: str) -> np.ndarray:
    arr = np.asarray(items)
    where = f"component {component.name!r}"
    if arr.ndim != 1 or arr.size != 1:
        raise GeometryError(f"{where}: mamba state takes exactly one {side} slot per request, got "
                            f"{arr.size} (shape {arr.shape})")
    if not np.issubdtype(arr.dtype, np.integer):
        raise GeometryError(f"{where}: {side} slot must be an integer, got dtype {arr.dtype}")
    slot = int(arr[0])
    if slot == 0:
        raise GeometryError(f"{where}: {side} slot 0 is the pool's padding slot, never a request's; "
                            "was the request's mamba slot allocated?")
    if slot < 0:
        raise GeometryError(f"{where}: {side} slot {slot} is negative")
    return arr.astype(np.int64, copy=False)


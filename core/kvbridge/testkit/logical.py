"""The state kit's logical model: what each buffer of a component *holds*, independent of its declared ShardAxis.

The reference reshard cuts a rank's share out of the logical (TP-1) tensor by meaning - which item axis holds
the KV heads, the conv channels or the SSM heads, and how many there are - so a buffer declared sharded along
the wrong axis disagrees with it. The kit knows the kinds of this repository (:data:`BUILTIN_KINDS`); another
state type describes its buffers itself (``StateTypeTests.logical_model``)::

    BufferMeaning(units="KV heads", axis=0)                       # [heads, blocks] scales, heads on axis 0
    BufferMeaning(units="conv channels", axis=0, groups=(4, 4, 8))  # GDN [q | k | v], each block sharded
    BufferMeaning(units="replicated")                             # the whole item on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from kvbridge.geometry import BufferGeometry, Component
from kvbridge.pattern import shard_axis

__all__ = ["BUILTIN_KINDS", "BufferMeaning", "NoLogicalModel", "builtin_model", "cut"]


@dataclass(frozen=True, kw_only=True)
class BufferMeaning:
    """What one buffer of the logical component holds.

    ``units`` names them ("KV heads"); ``axis`` is the axis of the TP-1 item that holds them (None: the whole
    item on every rank); ``groups`` splits that axis into blocks sharded one by one (global sizes summing to
    the axis; () = one block). A rank of TP T holds ``n / T`` units of a block of ``n``, or one unit shared
    by ``T / n`` ranks when ``n < T``.
    """

    units: str
    axis: int | None = None
    groups: tuple[int, ...] = ()

    def describe(self, logical: BufferGeometry) -> str:
        if self.axis is None:
            return f"{self.units}: the whole item on every rank"
        blocks = f" in blocks {self.groups}" if self.groups else ""
        return (f"{self.units}: {logical.item_shape[self.axis]} on axis {self.axis} of its TP-1 item "
                f"{logical.item_shape}{blocks}")


class NoLogicalModel(AssertionError):
    """The kit cannot tell what a buffer holds; the plugin's test must say (``logical_model``)."""


def cut(logical: np.ndarray, meaning: BufferMeaning, tp_size: int, rank: int) -> np.ndarray:
    """What ``rank`` of ``tp_size`` holds of ``logical`` (``[items, *item_shape, itemsize]`` uint8) by its
    meaning, as ``[items, local item bytes]``."""
    local = logical if meaning.axis is None else shard_axis(logical, meaning.axis + 1, tp_size, rank,
                                                            groups=meaning.groups)
    return np.ascontiguousarray(local).reshape(logical.shape[0], -1)


Builds = Mapping[int, Component]


def _shrunk(index: int, logical: BufferGeometry, builds: Builds, axes: tuple[int, ...]) -> list[int]:
    """The axes among ``axes`` that some rank's build holds fewer of than the logical item."""
    return [a for a in axes if any(c.buffers[index].item_shape[a] < logical.item_shape[a] for c in builds.values())]


def _one_axis(kind: str, index: int, logical: BufferGeometry, builds: Builds, axes: tuple[int, ...],
              units: str) -> BufferMeaning:
    """``units`` on the one axis of ``axes`` the builds shard (none sharded: every rank holds the whole item)."""
    shrunk = _shrunk(index, logical, builds, axes)
    if len(shrunk) > 1:
        raise NoLogicalModel(f"buffer {logical.name!r}: a {kind} item shards its {units} only, but the factory's "
                             f"builds shrink axes {shrunk} of {logical.item_shape}")
    if not shrunk:
        return BufferMeaning(units=f"{units} (held whole by every rank)")
    return BufferMeaning(units=units, axis=shrunk[0])


def _kv_pages(logical: Component, index: int, builds: Builds) -> BufferMeaning:
    """KV pages: ``[tokens, heads, head_dim]`` or ``[heads, tokens, head_dim]`` (heads sharded), MLA
    ``[tokens, latent]`` replicated. The token axis is the one of ``options["page_size"]`` when that tells."""
    buf = logical.buffers[index]
    if len(buf.item_shape) == 2:
        return BufferMeaning(units="MLA latent (replicated)")
    if len(buf.item_shape) != 3:
        raise NoLogicalModel(f"buffer {buf.name!r}: a {logical.state_type} page is [tokens, heads, head_dim], "
                             f"[heads, tokens, head_dim] or [tokens, latent], not {buf.item_shape}")
    page = logical.options.get("page_size")
    tokens = [a for a in (0, 1) if buf.item_shape[a] == page]
    if len(tokens) == 1:
        return BufferMeaning(units="KV heads", axis=1 - tokens[0])
    return _one_axis(f"{logical.state_type} page", index, buf, builds, (0, 1), "KV heads")


def _mamba(logical: Component, index: int, builds: Builds) -> BufferMeaning:
    """Conv state ``[channels, kernel-1]`` or ``[kernel-1, channels]``; SSM state ``[heads, head_dim, state]``.

    GDN's ``[q | k | v]`` blocks are not visible in a shape: they are read from the declared groups."""
    buf = logical.buffers[index]
    parts = buf.name.split(".")
    role = parts[-2] if len(parts) >= 3 else ""
    if role == "temporal" and len(buf.item_shape) == 3:
        return BufferMeaning(units="SSM heads", axis=0)
    if role == "conv" and len(buf.item_shape) == 2:
        meaning = _one_axis("conv state", index, buf, builds, (0, 1), "conv channels")
        declared = buf.shard.groups if buf.shard is not None else ()
        if meaning.axis is not None and sum(declared) == buf.item_shape[meaning.axis]:
            return BufferMeaning(units=meaning.units, axis=meaning.axis, groups=declared)
        return meaning
    raise NoLogicalModel(f"buffer {buf.name!r}: a mamba buffer is '<name>.conv.<layer>' ([channels, kernel-1] or "
                         f"[kernel-1, channels]) or '<name>.temporal.<layer>' ([heads, head_dim, state]); "
                         f"got item {buf.item_shape}")


def _block_scales(logical: Component, index: int, builds: Builds) -> BufferMeaning:
    """FP8 block scales (kvbridge-fp8): ``token`` pages ``[tokens, heads, blocks]``, ``interleaved`` ones
    ``[heads, 32, tokens // 32, blocks]``; the heads' axis follows from the layout option, not the ShardAxis."""
    layout = logical.options.get("layout")
    if layout not in ("token", "interleaved"):
        raise NoLogicalModel(f"component {logical.name!r}: block scales need options['layout'] ('token' or "
                             f"'interleaved'), got {layout!r}")
    return BufferMeaning(units="KV heads (their scales)", axis=1 if layout == "token" else 0)


def _replicated(logical: Component, index: int, builds: Builds) -> BufferMeaning:
    return BufferMeaning(units=f"{logical.state_type} item (replicated)")


#: the kinds the kit knows by meaning: state type -> rule for buffer ``index`` of the logical component
BUILTIN_KINDS: dict[str, Callable[[Component, int, Builds], BufferMeaning]] = {
    "kv": _kv_pages, "swa": _kv_pages, "mamba": _mamba, "nsa": _replicated, "row": _replicated,
    "block_scale": _block_scales, "block_scale_swa": _block_scales,
}


def builtin_model(logical: Component, builds: Builds) -> tuple[BufferMeaning, ...]:
    """The meaning of every buffer of ``logical`` (TP-1), for a kind the kit knows; ``builds`` maps each TP
    size the geometry can be held at to its component (which axis a rank holds less of)."""
    rule = BUILTIN_KINDS.get(logical.state_type)
    if rule is None:
        raise NoLogicalModel(
            f"the kit has no logical model of state type {logical.state_type!r} (it knows "
            f"{', '.join(sorted(BUILTIN_KINDS))}), so it cannot reshard its buffers independently of their "
            "declared ShardAxis; define logical_model(self, logical) on the test class, returning one "
            "BufferMeaning per buffer (see StateTypeTests.logical_model)")
    return tuple(rule(logical, i, builds) for i in range(len(logical.buffers)))

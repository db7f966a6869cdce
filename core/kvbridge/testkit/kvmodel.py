"""The paged KV pool the backend kit moves: token-major GQA, head-major and MLA components, tiny on purpose.

Geometry is described twice - as kvbridge ``Component``s (what the agent plans from) and as reference
``KVSpec``s (what :mod:`kvbridge.testkit.reference` computes the expected bytes from) - and the two are
only tied by the shapes written here, never by kvbridge's slicing or planner.

* ``gqa``: token-major ``[page, heads, dim]``, 2 KV heads (so TP 4 replicates each head on two ranks);
* ``headmajor``: head-major ``[heads, page, dim]``, 4 KV heads;
* ``mla``: one latent per token, replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, PoolLayout, ShardAxis
from kvbridge.testkit import reference as ref
from kvbridge.testkit.pools import GuardedBuffer

__all__ = ["KINDS", "MODEL", "NUM_PAGES", "PAGE_SIZE", "KVKind", "KVPool", "kv_layout"]

PAGE_SIZE = 4
NUM_PAGES = 12
MODEL = "kvbridge-testkit"
_DTYPE = DType.BFLOAT16


@dataclass(frozen=True, kw_only=True)
class KVKind:
    """One KV component: its reference layout, total KV heads and head dim (elements of bf16)."""

    name: str
    layout: str
    total_heads: int
    head_dim: int
    layers: int = 2

    @property
    def tensors(self) -> int:
        return 1 if self.layout == ref.MLA else 2

    def spec(self) -> ref.KVSpec:
        return ref.KVSpec(self.layout, self.total_heads, PAGE_SIZE, self.head_dim * _DTYPE.itemsize)

    def coords(self) -> list[tuple[str, int, int]]:
        """(buffer name, layer, tensor) in wire order: every layer of K, then every layer of V."""
        letters = "c" if self.tensors == 1 else "kv"
        return [(f"{letters[t]}.{layer}", layer, t) for t in range(self.tensors) for layer in range(self.layers)]

    def component(self, tp: int, num_pages: int = NUM_PAGES) -> Component:
        if self.layout == ref.MLA:
            shape: tuple[int, ...] = (PAGE_SIZE, self.head_dim)
            shard: ShardAxis | None = None
        else:
            heads = self.spec().local_heads(tp)
            if self.layout == ref.TOKEN_MAJOR:
                shape, shard = (PAGE_SIZE, heads, self.head_dim), ShardAxis(axis=1, total=self.total_heads)
            else:
                shape, shard = (heads, PAGE_SIZE, self.head_dim), ShardAxis(axis=0, total=self.total_heads)
        bufs = tuple(BufferGeometry(name=name, num_items=num_pages, item_shape=shape, dtype=_DTYPE,
                                    shard=shard) for name, _, _ in self.coords())
        return Component(name=self.name, state_type="kv", buffers=bufs, index_kind=IndexKind.PAGE)


KINDS = (KVKind(name="gqa", layout=ref.TOKEN_MAJOR, total_heads=2, head_dim=8),
         KVKind(name="headmajor", layout=ref.HEAD_MAJOR, total_heads=4, head_dim=8),
         KVKind(name="mla", layout=ref.MLA, total_heads=1, head_dim=16))


def kv_layout(tp: int, rank: int, kinds: Sequence[KVKind] = KINDS, num_pages: int = NUM_PAGES) -> PoolLayout:
    return PoolLayout(components=tuple(k.component(tp, num_pages) for k in kinds), tp_size=tp, tp_rank=rank,
                      page_size=PAGE_SIZE, model=MODEL)


class KVPool:
    """One rank's guarded buffers of every kind, with reference fill and verification."""

    def __init__(self, tp: int, rank: int, *, memory: str = "host", kinds: Sequence[KVKind] = KINDS,
                 num_pages: int = NUM_PAGES, role: str = "rank") -> None:
        self.tp, self.rank, self.kinds, self.num_pages, self.role = tp, rank, tuple(kinds), num_pages, role
        self.layout = kv_layout(tp, rank, kinds, num_pages)
        self.buffers = {c.name: [GuardedBuffer(g.nbytes, memory=memory) for g in c.buffers]
                        for c in self.layout.components}

    def arrays(self) -> dict[str, list[object]]:
        return {name: [b.data for b in bufs] for name, bufs in self.buffers.items()}

    def _key(self, k: int, b: int) -> int:
        return 1000 * k + b

    def fill(self, seed: int, background: int, pages: Sequence[int] | np.ndarray = (),
             positions: Sequence[int] | np.ndarray = ()) -> None:
        """Background everywhere; the rank's share of request ``positions`` at ``pages``."""
        for k, kind in enumerate(self.kinds):
            spec = kind.spec()
            for b, (_, layer, tensor) in enumerate(kind.coords()):
                data = ref.source_buffer(spec, seed, layer, tensor, self.tp, self.rank, self.num_pages, pages,
                                         positions, background, self._key(k, b))
                self.buffers[kind.name][b].write(data)

    def check(self, seed: int, background: int, pages: Sequence[int] | np.ndarray = (),
              positions: Sequence[int] | np.ndarray = ()) -> list[str]:
        """Differences from the reference: request pages, other pages, guard zones (empty = byte-exact)."""
        problems = []
        pages = np.asarray(pages, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        others = np.setdiff1d(np.arange(self.num_pages), pages)
        where = f"{self.role} rank {self.rank}/{self.tp}"
        for k, kind in enumerate(self.kinds):
            spec = kind.spec()
            for b, (name, layer, tensor) in enumerate(kind.coords()):
                buf = self.buffers[kind.name][b]
                want = ref.expected_buffer(spec, seed, layer, tensor, self.tp, self.rank, self.num_pages, pages,
                                           positions, background, self._key(k, b))
                got = buf.read().reshape(want.shape)
                label = f"{where}, component {kind.name!r} ({kind.layout}) buffer {name!r}"
                if pages.size:
                    diff = got[pages] != want[pages]
                    if diff.any():
                        first = np.argwhere(diff)[0]
                        problems.append(
                            f"{label}: {int(diff.sum())} of {diff.size} bytes of the request's pages differ from the "
                            f"reference reshard (first at page {int(pages[first[0]])} = request position "
                            f"{int(positions[first[0]])}, byte {int(np.ravel_multi_index(first[1:], diff.shape[1:]))})")
                if others.size:
                    stray = got[others] != want[others]
                    if stray.any():
                        first = int(others[np.argwhere(stray)[0][0]])
                        problems.append(f"{label}: {int(stray.sum())} bytes outside the request's pages changed "
                                        f"(first on page {first})")
                damage = buf.guard_damage()
                if damage:
                    problems.append(f"{label}: wrote outside registered memory: {damage}")
        return problems

    def expected_nbytes(self, pages: int) -> int:
        """Bytes a request of ``pages`` pages writes into this rank (each destination byte once)."""
        return pages * sum(g.item_nbytes for c in self.layout.components for g in c.buffers)

    def close(self) -> None:
        for bufs in self.buffers.values():
            for b in bufs:
                b.close()

"""The state-type conformance kit: ``StateTypeTests`` (hypothesis properties, then end to end over loopback).

A state-type plugin's ``tests/test_conformance.py``::

    from hypothesis import strategies as st
    from kvbridge.testkit import StateTypeTests
    from my_mamba_plugin import mamba_component     # the plugin's own component builder

    class TestMamba(StateTypeTests):
        state_type = "mamba"                 # installed by entry point (or: spec = StateTypeSpec(...))
        items_per_request = 1                # one slot per request

        def component_factory(self, draw):
            heads = draw(st.sampled_from([2, 4, 8]))
            return lambda tp, n: mamba_component("m", layers=1, conv_groups=(8, 8, 16), kernel=4, heads=heads,
                                                 head_dim=2, state=3, tp=tp, dtype="bfloat16", num_slots=n)

``component_factory`` draws one model geometry and returns ``build(tp_size, num_items)``: the component
one rank of that TP size holds, raising :class:`~kvbridge.errors.UnsupportedTopology` for TP sizes the
geometry cannot be split over. ``build(1, n)`` is the logical (un-sharded) component. The kit fills the
logical tensors with random bytes and cuts each rank's share out by what each buffer *holds*
(:meth:`StateTypeTests.logical_model`: KV heads, Mamba conv channels and SSM heads, replicated items, for
the kinds the kit knows; a plugin describes its own), never by the ``ShardAxis`` the plugin declared - so a
buffer declared sharded along the wrong axis fails the reshard property. :meth:`StateTypeTests.shard` cuts
a share by hand instead, for a geometry no :class:`~kvbridge.testkit.logical.BufferMeaning` describes.

Requests of a page-indexed component include decode prefix hits: the decode already holds the first P
tokens (none, part of a page, whole pages, ending inside a page, all but the last page), lists only the
pages from ``P // page_size`` on, and its prefix pages must come through untouched.

Properties, for generated geometries and (Pt, Dt) pairs of ``tp_sizes``:

* the slices of a destination rank's elected writers cover each destination byte exactly once;
* applying them reassembles exactly the independent reshard of the logical tensors;
* TP ratio 1 is the identity (same offsets, whole items, from the same rank);
* a pair whose sizes do not divide raises UnsupportedTopology (never a partial plan);
* slicing is pure (same inputs, same segments) and built components pass ``check_component``;
* ``check_component`` refuses invalid components: the other index kind (unless ``index_kinds`` lists
  both), whatever ``invalid_components`` lists, and (via ``Registry.compose``) a pool of the wrong TP size;
* ``chunked = True`` is consistent: page-indexed, ``pair_indices`` not overridden, requests paired by
  position from the decode's first missing page (what the agent does with a chunked component);
* end to end: TransferAgents over LocalHub with the ``loopback`` backend move a request byte-exact, sent
  in two prefill chunks (a chunked state's items split over both, other state on the last), once per
  decode prefix kind for a page-indexed component; the decode's prefix pages keep their bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from kvbridge.agent import AgentConfig
from kvbridge.errors import GeometryError, PluginError, UnsupportedTopology
from kvbridge.geometry import BufferGeometry, Component, IndexKind, PoolLayout, Rank
from kvbridge.registry import Registry
from kvbridge.slicing import ComponentSlice, target_ranks
from kvbridge.specs import PluginKind, StateTypeSpec, resolve
from kvbridge.state.base import StateType
from kvbridge.testkit import reference as ref
from kvbridge.testkit.checked import installed_registry, kit_registry
from kvbridge.testkit.kitbase import KitTests
from kvbridge.testkit.logical import BufferMeaning, builtin_model, cut
from kvbridge.testkit.pools import GuardedBuffer
from kvbridge.testkit.world import World

__all__ = ["DECODE_PREFIXES", "BufferMeaning", "ComponentFactory", "RequestItems", "StateTypeTests",
           "prefix_request", "shard_buffer"]

#: ``build(tp_size, num_items) -> Component`` (raises UnsupportedTopology for TP sizes it cannot hold)
ComponentFactory = Callable[[int, int], Component]
_ROOMS = itertools.count(20_000)
_NON_DIVIDING = ((2, 3), (3, 2), (3, 4), (4, 3), (4, 6), (6, 4), (2, 5), (6, 8))


def shard_buffer(logical: np.ndarray, buffer: BufferGeometry, tp_size: int, rank: int) -> np.ndarray:
    """The cut by the *declared* shard axis: what ``rank`` of ``tp_size`` holds if the declaration is right
    (the kit compares it with the cut by meaning; it is no reference on its own).

    ``logical`` is ``[items, *item_shape, itemsize]`` uint8 (the TP-1 tensor), ``buffer`` its TP-1
    geometry; the result is ``[items, local item bytes]``. Written with :mod:`kvbridge.testkit.reference`
    only: the buffer's shard axis (and shard groups) are cut with ``reference.shard_axis``.
    """
    if buffer.shard is None:
        local = logical
    else:
        local = ref.shard_axis(logical, buffer.shard.axis + 1, tp_size, rank, groups=buffer.shard.groups)
    return np.ascontiguousarray(local).reshape(logical.shape[0], -1)


@dataclass(frozen=True, kw_only=True)
class RequestItems:
    """One request's items: source items (and the absolute position of the first), destination items
    (and theirs), and ``pairs`` - which source item each destination item must end up holding (by
    default the k-th source item for the k-th destination item). ``prefix_len``: tokens the decode
    already holds (``decode_prefix_len``); ``held``: the decode items holding its prefix's whole pages,
    which no write may touch."""

    src: np.ndarray
    src_first: int
    dst: np.ndarray
    dst_first: int
    pairs: tuple[np.ndarray, np.ndarray] | None = None
    prefix_len: int = 0
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def expected_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        return self.pairs if self.pairs is not None else (self.src, self.dst)


#: the decode prefix hits a page-indexed request is drawn with
DECODE_PREFIXES = ("none", "part of a page", "whole pages", "inside a page", "all but the last page")


def prefix_tokens(kind: str, pages: int, page_size: int) -> int:
    """Tokens a decode holds for prefix ``kind`` of a ``pages``-page request (always fewer than it needs)."""
    half, whole = max(1, page_size // 2), max(1, pages // 2) * page_size
    tokens = {"none": 0, "part of a page": half if page_size > 1 else 0, "whole pages": whole,
              "inside a page": whole + half if page_size > 1 else whole,
              "all but the last page": (pages - 1) * page_size}[kind]
    return min(tokens, (pages - 1) * page_size)


def prefix_request(component: Component, rng: np.random.Generator, *, pages: int, prefix_len: int,
                   page_size: int, source_from_zero: bool) -> RequestItems:
    """A ``pages``-page request whose decode holds its first ``prefix_len`` tokens.

    The decode lists the pages from ``prefix_len // page_size`` on (its own prefix pages, ``held``, stay out);
    the prefill lists them too, or - ``source_from_zero`` - every page from position 0, as an engine that
    does not look at the prefix would (a chunked component's pages are then sent with ``from_start=True``;
    a positional ``pair_indices`` must leave the prefix out).
    """
    first = prefix_len // page_size
    src = 1 + rng.permutation(component.num_items - 1)[:pages].astype(np.int64)
    dst_all = 1 + rng.permutation(component.num_items - 1)[:pages].astype(np.int64)
    start = 0 if source_from_zero else first
    return RequestItems(src=src[start:], src_first=start, dst=dst_all[first:], dst_first=first,
                        pairs=(src[first:], dst_all[first:]), prefix_len=prefix_len, held=dst_all[:first])


@dataclass
class _Model:
    """A drawn geometry: the builder, its logical component, the TP sizes it can be held at, and (once
    asked for) what each buffer holds."""

    build: ComponentFactory
    logical: Component
    sizes: tuple[int, ...]
    meanings: tuple[BufferMeaning, ...] | None = None


class _StatePool:
    """One rank's guarded buffers for a single state component (for the end-to-end run)."""

    def __init__(self, component: Component, tp: int, rank: int, page_size: int) -> None:
        self.component = component
        self.layout = PoolLayout(components=(component,), tp_size=tp, tp_rank=rank, page_size=page_size,
                                 model="kvbridge-testkit-state")
        self.buffers = [GuardedBuffer(g.nbytes) for g in component.buffers]

    def arrays(self) -> dict[str, list[object]]:
        return {self.component.name: [b.data for b in self.buffers]}

    def close(self) -> None:
        for b in self.buffers:
            b.close()


class StateTypeTests(KitTests):
    """Conformance tests of one state type (see the module docstring)."""

    _kvbridge_kit_class: ClassVar[bool] = True
    #: an installed state type's name (entry points) ...
    state_type: ClassVar[str] = ""
    #: ... or its spec, for one that is not installed by entry point
    spec: ClassVar[StateTypeSpec | None] = None
    #: TP sizes pairs are drawn from (pairs whose sizes do not divide are left out)
    tp_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4, 8)
    #: items per buffer of every generated component (item 0 is never part of a request)
    num_items: ClassVar[int] = 6
    #: items per request (the default ``request_items``); 1 for slot state
    items_per_request: ClassVar[int] = 3
    #: hypothesis examples per property, and per end-to-end run
    max_examples: ClassVar[int] = 40
    e2e_examples: ClassVar[int] = 6

    _kvbridge_name_attr: ClassVar[str] = "state_type"
    #: the geometry the running example drew (set by ``_model``; the logical model is computed for it)
    _current: _Model

    # ---------------------------------------------------------------- what the plugin author provides
    def component_factory(self, draw: Callable[..., Any]) -> ComponentFactory:
        """Draw one geometry (``draw(strategy)``); return ``build(tp_size, num_items) -> Component``."""
        raise NotImplementedError(f"{type(self).__name__} must define component_factory(self, draw) returning "
                                  "build(tp_size, num_items) -> Component")

    def logical_model(self, logical: Component) -> tuple[BufferMeaning, ...]:
        """What each buffer of the logical (TP-1) component holds, in wire order: the reference reshards by
        this, never by the declared ``ShardAxis``. The kit knows the kinds ``kv``, ``swa`` (KV heads),
        ``mamba`` (conv channels, SSM heads), ``nsa`` and ``row`` (replicated); any other state type must
        override this (or :meth:`shard`), e.g. per-page FP8 scales ``[heads, blocks]`` and a replicated
        position row::

            from kvbridge.testkit import BufferMeaning

            def logical_model(self, logical):
                return (BufferMeaning(units="KV heads", axis=0),     # scales: heads on item axis 0
                        BufferMeaning(units="replicated"))           # every rank holds the whole row

        Unit counts come from the logical item's shape (``build(1, n)``); ``groups`` gives blocks sharded one
        by one (GDN ``[q | k | v]``). Write it from the model, not from the builder's ShardAxis.
        """
        builds = {tp: self._current.build(tp, self.num_items) for tp in self._current.sizes}
        return builtin_model(logical, builds)

    def shard(self, logical: np.ndarray, buffer: BufferGeometry, tp_size: int, rank: int) -> np.ndarray:
        """What ``rank`` of ``tp_size`` holds of the logical buffer ``buffer`` (``logical`` is its
        ``[items, *item_shape, itemsize]`` uint8 tensor), as ``[items, local item bytes]``. Default: the cut
        by the buffer's :meth:`logical_model` meaning; override only for a share no meaning describes."""
        return cut(logical, self._meaning(buffer), tp_size, rank)

    def request_items(self, component: Component, rng: np.random.Generator) -> RequestItems:
        """A request's items: ``items_per_request`` distinct items on each side (never item 0). A page-indexed
        component's request has a decode prefix hit of a random kind (:data:`DECODE_PREFIXES`; the end-to-end
        test runs every kind when this is not overridden), a slot's none. Override for a state type whose
        requests look otherwise (give ``prefix_len`` and ``held`` when the decode holds a prefix)."""
        kind = str(rng.choice(DECODE_PREFIXES)) if component.index_kind is IndexKind.PAGE else "none"
        return self._prefix_request(component, rng, kind)

    def _prefix_request(self, component: Component, rng: np.random.Generator, kind: str) -> RequestItems:
        k = min(self.items_per_request, component.num_items - 1)
        if component.index_kind is not IndexKind.PAGE:
            src = 1 + rng.permutation(component.num_items - 1)[:k]
            dst = 1 + rng.permutation(component.num_items - 1)[:k]
            return RequestItems(src=src.astype(np.int64), src_first=0, dst=dst.astype(np.int64), dst_first=0)
        page_size = _page_size(component)
        state = self._subject_state()
        # from position 0: a chunked component's pages sent with from_start=True (the agent drops the prefix),
        # a positional pair_indices given the whole list; the base pairing takes equal lists only
        from_zero = state is not None and (state.chunked or type(state).pair_indices is not StateType.pair_indices)
        return prefix_request(component, rng, pages=k, prefix_len=prefix_tokens(kind, k, page_size),
                              page_size=page_size, source_from_zero=from_zero and kind != "all but the last page")

    def _requests(self, component: Component, rng: np.random.Generator) -> list[tuple[str, RequestItems]]:
        """The requests of one end-to-end run: one per prefix kind when the default requests apply."""
        if self._overrides("request_items") or component.index_kind is not IndexKind.PAGE:
            return [("as given", self.request_items(component, rng))]
        return [(kind, self._prefix_request(component, rng, kind)) for kind in DECODE_PREFIXES]

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(StateTypeTests, name)

    def _subject_state(self) -> StateType | None:
        """A fresh instance of the state type under test (None when it cannot be resolved)."""
        spec = self._kvbridge_resolve()
        if not isinstance(spec, StateTypeSpec):
            return None
        instance = resolve(spec.factory)()
        return instance if isinstance(instance, StateType) else None

    def _meaning(self, buffer: BufferGeometry) -> BufferMeaning:
        """The meaning of a logical buffer of the current geometry (its logical model, computed once)."""
        model = self._current
        if model.meanings is None:
            meanings = tuple(self.logical_model(model.logical))
            if len(meanings) != len(model.logical.buffers) or \
                    not all(isinstance(m, BufferMeaning) for m in meanings):
                raise AssertionError(f"logical_model returned {len(meanings)} entries for the "
                                     f"{len(model.logical.buffers)} buffers of {model.logical.name!r}; give one "
                                     "BufferMeaning per buffer, in wire order")
            for m, b in zip(meanings, model.logical.buffers):
                if m.axis is not None and not 0 <= m.axis < len(b.item_shape):
                    raise AssertionError(f"buffer {b.name!r}: logical_model puts its {m.units} on axis {m.axis}, "
                                         f"outside its item {b.item_shape}")
                if m.axis is not None and m.groups and sum(m.groups) != b.item_shape[m.axis]:
                    raise AssertionError(f"buffer {b.name!r}: logical_model's blocks {m.groups} do not add up to "
                                         f"the {b.item_shape[m.axis]} {m.units} of axis {m.axis}")
            model.meanings = meanings
        names = [b.name for b in model.logical.buffers]
        return model.meanings[names.index(buffer.name)]

    # ---------------------------------------------------------------- subject
    @classmethod
    def _kvbridge_lookup(cls, name: str) -> StateTypeSpec | str:
        records = [r for r in installed_registry().records() if r.kind is PluginKind.STATE and r.name == name]
        if not records or not isinstance(records[0].spec, StateTypeSpec):
            return f"'{name}' is not an installed state type"
        if records[0].reason:
            return f"'{name}' is unavailable here: {records[0].reason}"
        return records[0].spec

    @classmethod
    def _kvbridge_capabilities(cls) -> frozenset[str]:
        spec = cls._kvbridge_resolve()
        return frozenset(spec.capabilities) if isinstance(spec, StateTypeSpec) else frozenset()

    @classmethod
    def _kvbridge_unavailable(cls, config: pytest.Config) -> str:
        spec = cls._kvbridge_resolve()
        return spec if isinstance(spec, str) else ""

    @pytest.fixture(scope="class")
    @classmethod
    def state_spec(cls) -> StateTypeSpec:
        """The spec under test (skips the class when the state type is unavailable)."""
        spec: StateTypeSpec = cls._kvbridge_spec_or_skip()
        return spec

    @pytest.fixture(scope="class")
    @classmethod
    def state(cls, state_spec: StateTypeSpec) -> StateType:
        instance = resolve(state_spec.factory)()
        if not isinstance(instance, StateType):
            raise PluginError(f"the factory of '{state_spec.name}' returned {type(instance).__name__}, not a StateType")
        return instance

    # ---------------------------------------------------------------- hypothesis plumbing
    def _examples(self, check: Callable[[Any], None], examples: int | None = None) -> None:
        from hypothesis import HealthCheck, given
        from hypothesis import strategies as st

        from kvbridge.testkit.plugin import kit_settings

        @kit_settings(max_examples=examples or self.max_examples, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                             HealthCheck.data_too_large])
        @given(st.data())
        def run(data: Any) -> None:
            check(data)

        run()

    def _model(self, data: Any) -> _Model:
        build = self.component_factory(data.draw)
        logical = build(1, self.num_items)
        sizes = []
        for tp in sorted({1, *self.tp_sizes, *(t for p in _NON_DIVIDING for t in p)}):
            try:
                comp = build(tp, self.num_items)
            except UnsupportedTopology:
                continue
            if len(comp.buffers) != len(logical.buffers):
                raise AssertionError(f"build({tp}) has {len(comp.buffers)} buffers, build(1) {len(logical.buffers)}")
            sizes.append(tp)
        self._current = _Model(build, logical, tuple(sizes))
        return self._current

    def _pair(self, data: Any, model: _Model) -> tuple[int, int]:
        from hypothesis import strategies as st

        sizes = [t for t in model.sizes if t in self.tp_sizes]
        pairs = [(p, d) for p in sizes for d in sizes if p % d == 0 or d % p == 0]
        assert pairs, f"the drawn geometry {model.logical} cannot be held at any of the TP sizes {self.tp_sizes}"
        return data.draw(st.sampled_from(pairs), "(Pt, Dt)")

    def _shards(self, model: _Model, logical: list[np.ndarray], tp: int) -> list[list[np.ndarray]]:
        comp = model.build(tp, self.num_items)
        out = []
        for r in range(tp):
            bufs = []
            for x, lg, g in zip(logical, model.logical.buffers, comp.buffers):
                local = self.shard(x, lg, tp, r)
                assert local.shape == (g.num_items, g.item_nbytes), (
                    f"buffer {g.name!r}: by what it holds, rank {r}/{tp} holds {local.shape[1]} bytes per item, "
                    f"build({tp}) says {g.item_nbytes} (item {g.item_shape}); the component factory and the "
                    f"logical model disagree{self._described(lg)}")
                bufs.append(local)
            out.append(bufs)
        return out

    @staticmethod
    def _logical(model: _Model, rng: np.random.Generator) -> list[np.ndarray]:
        return [rng.integers(0, 256, (b.num_items, *b.item_shape, b.dtype.itemsize), dtype=np.uint8)
                for b in model.logical.buffers]

    def _slice(self, state: StateType, src: Component, dst: Component, p: Rank, d: Rank) -> ComponentSlice:
        sl = state.slice(src, dst, p, d)
        assert isinstance(sl, ComponentSlice), f"slice returned {type(sl).__name__}, not ComponentSlice"
        assert len(sl.buffers) == len(dst.buffers), \
            f"slice of rank {p.rank}/{p.size} -> {d.rank}/{d.size} has {len(sl.buffers)} buffers, " \
            f"the component {len(dst.buffers)}"
        for seg, sg, dg in zip(sl.buffers, src.buffers, dst.buffers):
            if len(seg) == 0:
                continue
            bad = (seg.nbytes <= 0) | (seg.src_off < 0) | (seg.dst_off < 0) | \
                  (seg.src_off + seg.nbytes > sg.item_nbytes) | (seg.dst_off + seg.nbytes > dg.item_nbytes)
            assert not bad.any(), (f"buffer {dg.name!r}, rank {p.rank}/{p.size} -> {d.rank}/{d.size}: segment "
                                   f"{int(np.flatnonzero(bad)[0])} leaves the item (items of {sg.item_nbytes} -> "
                                   f"{dg.item_nbytes} B) or is empty")
        return sl

    def _described(self, logical: BufferGeometry) -> str:
        if self._overrides("shard"):
            return " (shard is overridden)"
        return f"; its logical model: {self._meaning(logical).describe(logical)}"

    def _counts(self, state: StateType, model: _Model, pt: int, dt: int) -> list[list[np.ndarray]]:
        """How many times the elected writers' slices write each byte of an item, per decode rank and buffer."""
        src_comp, dst_comp = model.build(pt, self.num_items), model.build(dt, self.num_items)
        counts = []
        for d in range(dt):
            writes = [np.zeros(g.item_nbytes + 1, np.int64) for g in dst_comp.buffers]
            for p in target_ranks(pt, dt, d):
                sl = self._slice(state, src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                for b, seg in enumerate(sl.buffers):
                    np.add.at(writes[b], seg.dst_off, 1)
                    np.add.at(writes[b], seg.dst_off + seg.nbytes, -1)
            counts.append([np.cumsum(w)[:-1] for w in writes])
        return counts

    def _assemble(self, state: StateType, model: _Model, logical: list[np.ndarray], pt: int, dt: int
                  ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
        """Apply every elected writer's slice: (assembled, expected) per decode rank and buffer."""
        src_comp, dst_comp = model.build(pt, self.num_items), model.build(dt, self.num_items)
        sources = self._shards(model, logical, pt)
        expected = self._shards(model, logical, dt)
        assembled = []
        for d in range(dt):
            got = [np.zeros_like(e) for e in expected[d]]
            for p in target_ranks(pt, dt, d):
                sl = self._slice(state, src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                for b, seg in enumerate(sl.buffers):
                    for so, do, n in zip(seg.src_off.tolist(), seg.dst_off.tolist(), seg.nbytes.tolist()):
                        got[b][:, do: do + n] = sources[p][b][:, so: so + n]
            assembled.append(got)
        return assembled, expected

    def _check_declarations(self, model: _Model, logical: list[np.ndarray]) -> None:
        """Each buffer's declared ShardAxis gives every rank what its meaning does (the slicing follows the
        declaration, so a wrong one moves the wrong units); skipped when ``shard`` is overridden."""
        if self._overrides("shard"):
            return
        for x, g in zip(logical, model.logical.buffers):
            meaning = self._meaning(g)
            for tp in model.sizes:
                for r in range(tp):
                    try:
                        share = cut(x, meaning, tp, r)
                    except (ValueError, ref.ReferenceTopologyError) as exc:
                        raise AssertionError(f"buffer {g.name!r}: build({tp}) holds it at TP {tp}, but by what it "
                                             f"holds ({meaning.describe(g)}) it cannot be: {exc}") from None
                    try:
                        declared: np.ndarray | None = shard_buffer(x, g, tp, r)
                        why = ""
                    except (ValueError, ref.ReferenceTopologyError) as exc:
                        declared, why = None, str(exc)
                    if declared is None or not np.array_equal(declared, share):
                        raise AssertionError(
                            f"buffer {g.name!r} is declared {g.shard or 'replicated (shard=None)'}, but it holds "
                            f"{meaning.describe(g)}: by that declaration rank {r} of TP {tp} holds other bytes than "
                            f"its share{f' ({why})' if why else ''}; declare the axis that holds its "
                            f"{meaning.units} (or correct logical_model)")

    # ---------------------------------------------------------------- properties
    def test_built_components_are_valid(self, state: StateType) -> None:
        """Every component the factory builds passes the state type's ``check_component`` at its TP.

        Troubleshooting: the factory must build exactly what a rank holds (local sizes of sharded axes);
        ``check_component`` must accept every geometry the plugin documents.
        """
        def check(data: Any) -> None:
            model = self._model(data)
            for tp in model.sizes:
                comp = model.build(tp, self.num_items)
                assert comp.state_type == self._kvbridge_subject(), \
                    f"the factory built a component of state type {comp.state_type!r}"
                for r in range(tp):
                    state.check_component(comp, Rank(r, tp))

        self._examples(check, max(5, self.max_examples // 4))

    def test_slices_cover_each_destination_byte_once(self, state: StateType) -> None:
        """For every decode rank, the slices of its prefill targets write each byte of its items exactly
        once (replicas are elected, nothing is left out, nothing is written twice).

        Troubleshooting: with more ranks than units of a sharded axis, only one replica may write each unit;
        with groups, each group is elected on its own.
        """
        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = self._pair(data, model)
            counts = self._counts(state, model, pt, dt)
            dst_comp = model.build(dt, self.num_items)
            for d in range(dt):
                for c, g in zip(counts[d], dst_comp.buffers):
                    wrong = np.flatnonzero(c != 1)
                    if wrong.size:
                        start = int(wrong[0])
                        times = int(c[start])
                        end = start + int(np.argmax(c[start:] != times)) if np.any(c[start:] != times) else c.size
                        raise AssertionError(
                            f"Pt {pt} -> Dt {dt}, decode rank {d}, buffer {g.name!r}: bytes [{start}, {end}) of "
                            f"each item are written {times} times (expected once); {wrong.size} of {c.size} "
                            "bytes are wrong")

        self._examples(check)

    def test_reassembly_equals_reference_reshard(self, state: StateType) -> None:
        """Applying the slices to each prefill rank's share reassembles exactly what the independent
        reference says each decode rank holds.

        The reference cuts each logical buffer by what it holds (:meth:`logical_model`), so first every
        buffer's declared ShardAxis must agree with that: a buffer declared sharded along another axis (or
        replicated while its units are split) fails here, by name.

        Troubleshooting: a mismatch with correct coverage means bytes land at the wrong place - offsets of
        shard groups, head order, or the wrong replica. "has no logical model": define ``logical_model``.
        """
        from hypothesis import strategies as st

        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = self._pair(data, model)
            seed = data.draw(st.integers(0, 2**32 - 1), "seed")
            logical = self._logical(model, np.random.default_rng(seed))
            self._check_declarations(model, logical)
            got, expected = self._assemble(state, model, logical, pt, dt)
            dst_comp = model.build(dt, self.num_items)
            for d in range(dt):
                for g, e, geom in zip(got[d], expected[d], dst_comp.buffers):
                    diff = np.flatnonzero((g != e).any(axis=0))
                    assert not diff.size, (f"Pt {pt} -> Dt {dt}, decode rank {d}, buffer {geom.name!r}: "
                                           f"{diff.size} of {e.shape[1]} bytes per item differ from the reference "
                                           f"reshard (first at byte {int(diff[0])})")

        self._examples(check)

    def test_chunked_flag_is_consistent(self, state: StateType) -> None:
        """A state type that claims ``chunked = True`` is really sent like KV pages: the agent sends its
        items with every prefill chunk, taking the chunk's *KV page ids* as its source items and the next
        entries of the decode's list as destinations, paired by position from the decode's first missing
        page. So such a state type must be indexed by page (a slot is one per request and final only after
        the last chunk), must not override ``pair_indices`` (never called for a chunked component), and its
        requests must pair the k-th source item with the k-th destination item, both lists starting at the
        same position.

        Troubleshooting: state that is final only when prefill ends (a slot, a window, a ring, an indexer)
        travels once, with the last chunk: set ``chunked = False``. Only a component whose pages are
        written once, in order, like the KV cache, is chunked.
        """
        if not state.chunked:
            return
        name = self._kvbridge_subject()
        where = f"'{name}' claims chunked = True"
        if type(state).pair_indices is not StateType.pair_indices:
            raise AssertionError(f"{where} and overrides pair_indices, which the agent never calls for a chunked "
                                 "component (it pairs chunk pages by position); a state type that needs its own "
                                 "pairing travels once, with the last chunk: set chunked = False")

        def check(data: Any) -> None:
            model = self._model(data)
            comp = model.logical
            if comp.index_kind is not IndexKind.PAGE:
                raise AssertionError(f"{where}, but its component {comp.name!r} is indexed by "
                                     f"{comp.index_kind.value}: a chunked component is sent with every chunk using "
                                     "that chunk's KV page ids, while a slot is one per request and final only "
                                     "after the last chunk; set chunked = False")
            request = self.request_items(comp, np.random.default_rng(0))
            src, dst = request.expected_pairs()
            lo = request.dst_first - request.src_first       # > 0: sent from position 0 (from_start=True)
            positional = (request.src_first in (0, request.dst_first) and lo >= 0
                          and len(request.src) - lo == len(request.dst)
                          and np.array_equal(src, request.src[lo:]) and np.array_equal(dst, request.dst))
            assert positional, (
                f"{where}, but its requests do not pair item k with item k by position (source first "
                f"{request.src_first}, destination first {request.dst_first}, {len(request.src)} source and "
                f"{len(request.dst)} destination items, pairs given: {request.pairs is not None}); chunked items "
                "are paired by position across chunks, so this pairing can only be had with chunked = False")

        self._examples(check, max(3, self.max_examples // 8))

    def invalid_components(self, build: ComponentFactory) -> list[tuple[str, Component]]:
        """Components this state type's ``check_component`` must refuse (``(why, component)``), besides the
        ones the kit derives itself (the valid component with the other index kind, unless
        ``index_kinds`` lists both). ``build`` is the drawn geometry's factory. Default: none."""
        return []

    #: the index kinds the state type accepts; None: only the one its factory builds (the kit then checks
    #: that the other kind is refused)
    index_kinds: ClassVar[tuple[IndexKind, ...] | None] = None

    def test_invalid_components_are_refused(self, state: StateType, loopback_registry: Registry) -> None:
        """``check_component`` refuses what is not a valid instance of the state type: the drawn component
        with the other index kind (a paged state given slots, or the reverse), every component of
        ``invalid_components``, and - through the path an agent takes, ``Registry.compose`` of a pool
        layout - a component built for one TP size in a pool of another. Each must raise GeometryError
        (an agent built on such a pool would move bytes to the wrong places).

        Troubleshooting: check the index kind, the options the geometry needs and the shape of every buffer
        (``BufferGeometry.check_tp`` for sharded axes) in ``check_component``. A state type that really
        accepts both index kinds sets ``index_kinds = (IndexKind.PAGE, IndexKind.SLOT)`` and lists in
        ``invalid_components`` what it refuses instead.
        """
        name = self._kvbridge_subject()

        def refused(why: str, comp: Component, rank: Rank) -> None:
            try:
                state.check_component(comp, rank)
            except GeometryError:
                return
            except Exception as exc:
                raise AssertionError(f"'{name}'.check_component raised {type(exc).__name__} ({exc}) for {why}; a "
                                     "refusal must be a GeometryError") from exc
            raise AssertionError(f"'{name}'.check_component accepted {why} (TP rank {rank.rank}/{rank.size}): "
                                 f"{comp}")

        def check(data: Any) -> None:
            model = self._model(data)
            tp = max(model.sizes)
            comp = model.build(tp, self.num_items)
            cases = [(f"the invalid component {why!r}", bad) for why, bad in self.invalid_components(model.build)]
            accepted = self.index_kinds if self.index_kinds is not None else (comp.index_kind,)
            for kind in IndexKind:
                if kind not in accepted:
                    cases.append((f"its component indexed by {kind.value} instead of {comp.index_kind.value}",
                                  msgspec.structs.replace(comp, index_kind=kind)))
            assert cases, (f"'{name}' accepts every index kind and lists no invalid_components: nothing shows that "
                           "its check_component refuses anything; list geometries it must refuse")
            for why, bad in cases:
                refused(why, bad, Rank(0, tp))
            others = [t for t in model.sizes if model.build(t, self.num_items) != comp]
            for other in others[:1]:
                try:
                    layout = PoolLayout(components=(comp,), tp_size=other, tp_rank=0, page_size=16,
                                        model="kvbridge-testkit-invalid")
                    loopback_registry.compose(layout)
                except GeometryError:
                    continue
                raise AssertionError(f"a pool of TP {other} holding '{name}' component built for TP {tp} was "
                                     "accepted by Registry.compose (its shard axes hold another rank count's share)")

        self._examples(check, max(5, self.max_examples // 4))

    def test_tp_ratio_one_is_identity(self, state: StateType) -> None:
        """With the same TP on both sides, rank r copies its whole items to rank r at the same offsets.

        Troubleshooting: equal TP needs no resharding; a split or shifted segment here is a slicing bug.
        """
        from hypothesis import strategies as st

        def check(data: Any) -> None:
            model = self._model(data)
            tp = data.draw(st.sampled_from([t for t in model.sizes if t in self.tp_sizes]), "TP")
            comp = model.build(tp, self.num_items)
            for r in range(tp):
                sl = self._slice(state, comp, comp, Rank(r, tp), Rank(r, tp))
                for seg, g in zip(sl.buffers, comp.buffers):
                    where = f"TP {tp} rank {r} buffer {g.name!r}"
                    assert np.array_equal(seg.src_off, seg.dst_off), f"{where}: offsets move bytes within the item"
                    cover = np.zeros(g.item_nbytes + 1, np.int64)
                    np.add.at(cover, seg.dst_off, 1)
                    np.add.at(cover, seg.dst_off + seg.nbytes, -1)
                    assert np.all(np.cumsum(cover)[:-1] == 1), f"{where}: does not copy the whole item exactly once"

        self._examples(check, max(5, self.max_examples // 2))

    def test_unsupported_pair_raises(self, state: StateType) -> None:
        """TP sizes that do not divide each other raise UnsupportedTopology - from the factory (the geometry
        cannot be held) or from ``slice`` - and never yield a plan.

        Troubleshooting: call ``kvbridge.slicing.check_ratio`` (or the generic slicing) before computing
        segments.
        """
        from hypothesis import strategies as st

        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = data.draw(st.sampled_from(_NON_DIVIDING), "(Pt, Dt)")
            if pt not in model.sizes or dt not in model.sizes:
                with pytest.raises(UnsupportedTopology):
                    model.build(pt, self.num_items)
                    model.build(dt, self.num_items)
                return
            src, dst = model.build(pt, self.num_items), model.build(dt, self.num_items)
            for p in range(pt):
                for d in range(dt):
                    try:
                        sl = state.slice(src, dst, Rank(p, pt), Rank(d, dt))
                    except UnsupportedTopology:
                        continue
                    raise AssertionError(f"Pt {pt} -> Dt {dt} (rank {p} -> {d}) returned a plan of "
                                         f"{sum(len(s) for s in sl.buffers)} segments instead of raising "
                                         "UnsupportedTopology")

        self._examples(check, max(5, self.max_examples // 2))

    def test_slice_is_pure(self, state: StateType) -> None:
        """The same inputs give the same segments, whatever was sliced in between.

        Troubleshooting: a state type may cache plans, but never return different ones for equal inputs.
        """
        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = self._pair(data, model)
            src, dst = model.build(pt, self.num_items), model.build(dt, self.num_items)
            pairs = [(p, d) for d in range(dt) for p in target_ranks(pt, dt, d)]
            first = [self._slice(state, src, dst, Rank(p, pt), Rank(d, dt)) for p, d in pairs]
            again = [state.slice(src, dst, Rank(p, pt), Rank(d, dt)) for p, d in reversed(pairs)][::-1]
            for (p, d), a, b in zip(pairs, first, again):
                for x, y in zip(a.buffers, b.buffers):
                    assert x.key() == y.key(), f"rank {p} -> {d}: slicing twice gave different segments"

        self._examples(check, max(5, self.max_examples // 4))

    # ---------------------------------------------------------------- end to end
    @pytest.fixture(scope="class")
    @classmethod
    def loopback_registry(cls, state_spec: StateTypeSpec) -> Registry:
        from kvbridge.backends.loopback import SPEC

        return kit_registry(SPEC, tracker=cls._kvbridge_tracker(), states=[state_spec])

    def test_end_to_end_over_loopback(self, state: StateType, loopback_registry: Registry) -> None:
        """Prefill and decode TransferAgents (in-process hub, ``loopback`` backend) move one request of
        this state type; every decode buffer equals the reference (the request's items) and its previous
        bytes (everything else), with guard bytes intact.

        Troubleshooting: if the properties pass and this fails, look at ``pair_indices`` (which items pair
        up), ``chunked`` and ``check_component``.
        """
        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = self._pair(data, model)
            self._run_e2e(state, loopback_registry, model, pt, dt, data)

        self._examples(check, self.e2e_examples)

    def _run_e2e(self, state: StateType, registry: Registry, model: _Model, pt: int, dt: int, data: Any) -> None:
        from hypothesis import strategies as st

        seed = data.draw(st.integers(0, 2**32 - 1), "seed")
        rng = np.random.default_rng(seed)
        logical = self._logical(model, rng)
        page_size = _page_size(model.logical)
        world = World(registry=registry, backend="loopback", pairs=[(pt, dt)],
                      make_pool=lambda role, tp, r: _StatePool(model.build(tp, self.num_items), tp, r, page_size),
                      config=AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=10.0, bootstrap_timeout_s=10.0,
                                         waiting_timeout_s=10.0, staging_bytes=1 << 20),
                      label=f"kit-{self._kvbridge_subject()}")
        try:
            sources, targets = self._shards(model, logical, pt), self._shards(model, logical, dt)
            for rank in world.prefill[pt]:
                for buf, share in zip(rank.pool.buffers, sources[rank.pool.layout.tp_rank]):
                    buf.write(share)
            for kind, request in self._requests(model.logical, rng):
                self._e2e_room(state, world, model, pt, dt, targets, request, f"decode prefix {kind!r}", rng)
        finally:
            world.close()

    def _e2e_room(self, state: StateType, world: World, model: _Model, pt: int, dt: int,
                  targets: list[list[np.ndarray]], request: RequestItems, kind: str, rng: np.random.Generator) -> None:
        """One room of the end-to-end run: fresh noise on the decode, the request moved, every byte checked."""
        before = []
        for rank in world.decode[dt]:
            noise = [rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in rank.pool.buffers]
            for buf, n in zip(rank.pool.buffers, noise):
                buf.write(n)
            before.append(noise)
        name = model.logical.name
        metadata: dict[str, Any] = {name: request.dst} if state.chunked else {name: (request.dst, request.dst_first)}
        room = world.open(pt, dt, next(_ROOMS), metadata, 10.0, prefix_len=request.prefix_len)
        if state.chunked:      # pages of a chunked component travel with the chunks that cover them
            cut_at = len(request.src) // 2
            chunks = [request.src[:cut_at], request.src[cut_at:]] if cut_at else [request.src]
            from_start = request.src_first < request.dst_first     # the agent drops the decode's prefix pages
            for k, pages in enumerate(chunks):
                for sender in room.senders:
                    sender.send(pages, last=k == len(chunks) - 1, from_start=from_start)
        else:                  # state travels once, with the last of the chunks
            none = np.zeros(0, np.int64)
            room.send([none, none], state={name: (request.src, request.src_first)})
        room.wait_success(10.0)
        src_items, dst_items = request.expected_pairs()
        where = (f"Pt {pt} -> Dt {dt}, {kind} ({request.prefix_len} tokens held; source positions from "
                 f"{request.src_first}, destination from {request.dst_first})")
        for rank, noise in zip(world.decode[dt], before):
            r = rank.pool.layout.tp_rank
            for buf, n, target, geom in zip(rank.pool.buffers, noise, targets[r], rank.pool.component.buffers):
                was = n.reshape(geom.num_items, geom.item_nbytes)
                got = buf.read().reshape(was.shape)
                touched = [int(i) for i in request.held if not np.array_equal(got[i], was[i])]
                assert not touched, (f"{where}, decode rank {r}, buffer {geom.name!r}: the decode's prefix page(s) "
                                     f"{touched} (positions {[request.held.tolist().index(i) for i in touched]}) "
                                     "were overwritten; only the pages after the prefix may be written")
                want = was.copy()
                want[dst_items] = target[src_items]
                bad = np.argwhere(got != want)
                assert not bad.size, (f"{where}, decode rank {r}, buffer {geom.name!r}: {len(bad)} bytes differ "
                                      f"(first: item {int(bad[0][0])}, byte {int(bad[0][1])}); the request paired "
                                      f"source items {src_items.tolist()} with destination items "
                                      f"{dst_items.tolist()}{_hint(request)}")
                assert not buf.guard_damage(), f"buffer {geom.name!r}: {buf.guard_damage()}"
        room.settle(10.0)


def _page_size(component: Component) -> int:
    """Tokens per page of the kit's pools: the component's ``page_size`` option, else 16."""
    size = component.options.get("page_size", 16)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 16


def _hint(request: RequestItems) -> str:
    if request.src_first == request.dst_first:
        return ""
    return (f" (the lists start at positions {request.src_first} and {request.dst_first}: source position p must "
            "land in destination position p, so the decode's prefix is left out)")

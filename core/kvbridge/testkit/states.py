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
logical tensors with random bytes and cuts each rank's share out with :meth:`StateTypeTests.shard` -
by default :func:`shard_buffer`, the generic rule for a buffer's ``ShardAxis`` (override it for a
geometry that is not described by its shard axis alone).

Properties, for generated geometries and (Pt, Dt) pairs of ``tp_sizes``:

* the slices of a destination rank's elected writers cover each destination byte exactly once;
* applying them reassembles exactly the independent reshard of the logical tensors;
* TP ratio 1 is the identity (same offsets, whole items, from the same rank);
* a pair whose sizes do not divide raises UnsupportedTopology (never a partial plan);
* slicing is pure (same inputs, same segments) and built components pass ``check_component``;
* ``check_component`` refuses invalid components: the other index kind (unless ``index_kinds`` lists
  both), whatever ``invalid_components`` lists, and (via ``Registry.compose``) a pool of the wrong TP size;
* ``chunked = True`` is consistent: page-indexed, ``pair_indices`` not overridden, requests paired by
  position from 0 (what the agent does with a chunked component);
* end to end: TransferAgents over LocalHub with the ``loopback`` backend move a request byte-exact, sent
  in two prefill chunks (a chunked state's items split over both, other state on the last).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
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
from kvbridge.testkit.pools import GuardedBuffer
from kvbridge.testkit.world import World

__all__ = ["ComponentFactory", "RequestItems", "StateTypeTests", "shard_buffer"]

#: ``build(tp_size, num_items) -> Component`` (raises UnsupportedTopology for TP sizes it cannot hold)
ComponentFactory = Callable[[int, int], Component]
_ROOMS = itertools.count(20_000)
_NON_DIVIDING = ((2, 3), (3, 2), (3, 4), (4, 3), (4, 6), (6, 4), (2, 5), (6, 8))


def shard_buffer(logical: np.ndarray, buffer: BufferGeometry, tp_size: int, rank: int) -> np.ndarray:
    """The generic reference shard: what ``rank`` of ``tp_size`` holds of a logical buffer.

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
    default the k-th source item for the k-th destination item)."""

    src: np.ndarray
    src_first: int
    dst: np.ndarray
    dst_first: int
    pairs: tuple[np.ndarray, np.ndarray] | None = None

    def expected_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        return self.pairs if self.pairs is not None else (self.src, self.dst)


@dataclass
class _Model:
    """A drawn geometry: the builder, its logical component, and the TP sizes it can be held at."""

    build: ComponentFactory
    logical: Component
    sizes: tuple[int, ...]


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

    # ---------------------------------------------------------------- what the plugin author provides
    def component_factory(self, draw: Callable[..., Any]) -> ComponentFactory:
        """Draw one geometry (``draw(strategy)``); return ``build(tp_size, num_items) -> Component``."""
        raise NotImplementedError(f"{type(self).__name__} must define component_factory(self, draw) returning "
                                  "build(tp_size, num_items) -> Component")

    def shard(self, logical: np.ndarray, buffer: BufferGeometry, tp_size: int, rank: int) -> np.ndarray:
        """The independent logical -> rank reshard (default: :func:`shard_buffer`)."""
        return shard_buffer(logical, buffer, tp_size, rank)

    def request_items(self, component: Component, rng: np.random.Generator) -> RequestItems:
        """A request's items: ``items_per_request`` distinct items on each side (never item 0), first 0."""
        k = min(self.items_per_request, component.num_items - 1)
        src = 1 + rng.permutation(component.num_items - 1)[:k]
        dst = 1 + rng.permutation(component.num_items - 1)[:k]
        return RequestItems(src=src.astype(np.int64), src_first=0, dst=dst.astype(np.int64), dst_first=0)

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
        return _Model(build, logical, tuple(sizes))

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
                    f"buffer {g.name!r}: the reference shard for rank {r}/{tp} has {local.shape[1]} bytes per item, "
                    f"build({tp}) says {g.item_nbytes}; the component factory and the shard function disagree")
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

    def _assemble(self, state: StateType, model: _Model, logical: list[np.ndarray], pt: int, dt: int
                  ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], list[list[np.ndarray]]]:
        """Apply every elected writer's slice: (assembled, write counts, expected) per decode rank and buffer."""
        src_comp, dst_comp = model.build(pt, self.num_items), model.build(dt, self.num_items)
        sources = self._shards(model, logical, pt)
        expected = self._shards(model, logical, dt)
        assembled, counts = [], []
        for d in range(dt):
            got = [np.zeros_like(e) for e in expected[d]]
            writes = [np.zeros(e.shape[1] + 1, np.int64) for e in expected[d]]
            for p in target_ranks(pt, dt, d):
                sl = self._slice(state, src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                for b, seg in enumerate(sl.buffers):
                    for so, do, n in zip(seg.src_off.tolist(), seg.dst_off.tolist(), seg.nbytes.tolist()):
                        got[b][:, do: do + n] = sources[p][b][:, so: so + n]
                        writes[b][do] += 1
                        writes[b][do + n] -= 1
            assembled.append(got)
            counts.append([np.cumsum(w)[:-1] for w in writes])
        return assembled, counts, expected

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
            _, counts, _ = self._assemble(state, model, self._logical(model, np.random.default_rng(0)), pt, dt)
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

        Troubleshooting: a mismatch with correct coverage means bytes land at the wrong place - offsets of
        shard groups, head order, or the wrong replica.
        """
        from hypothesis import strategies as st

        def check(data: Any) -> None:
            model = self._model(data)
            pt, dt = self._pair(data, model)
            seed = data.draw(st.integers(0, 2**32 - 1), "seed")
            got, _, expected = self._assemble(state, model, self._logical(model, np.random.default_rng(seed)), pt, dt)
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
        entries of the decode's list as destinations, paired by position from 0. So such a state type must
        be indexed by page (a slot is one per request and final only after the last chunk), must not
        override ``pair_indices`` (never called for a chunked component), and its requests must pair the
        k-th source item with the k-th destination item, both lists starting at position 0.

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
            positional = (request.src_first == 0 and request.dst_first == 0 and len(request.src) == len(request.dst)
                          and np.array_equal(src, request.src) and np.array_equal(dst, request.dst))
            assert positional, (
                f"{where}, but its requests do not pair item k with item k from position 0 (source first "
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
        request = self.request_items(model.logical, rng)
        page_size = model.logical.options.get("page_size", 16)
        page_size = page_size if isinstance(page_size, int) else 16
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
            before = []
            for rank in world.decode[dt]:
                noise = [rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in rank.pool.buffers]
                for buf, n in zip(rank.pool.buffers, noise):
                    buf.write(n)
                before.append(noise)
            name = model.logical.name
            if state.chunked:
                metadata: dict[str, Any] = {name: request.dst}
            else:
                metadata = {name: (request.dst, request.dst_first)}
            room = world.open(pt, dt, next(_ROOMS), metadata, 10.0)
            if state.chunked:      # pages of a chunked component travel with the chunks that cover them
                cut = len(request.src) // 2
                room.send([request.src[:cut], request.src[cut:]])
            else:                  # state travels once, with the last of the chunks
                none = np.zeros(0, np.int64)
                room.send([none, none], state={name: (request.src, request.src_first)})
            room.wait_success(10.0)
            src_items, dst_items = request.expected_pairs()
            for rank, noise in zip(world.decode[dt], before):
                r = rank.pool.layout.tp_rank
                for buf, n, target, geom in zip(rank.pool.buffers, noise, targets[r],
                                                rank.pool.component.buffers):
                    want = n.reshape(geom.num_items, geom.item_nbytes).copy()
                    want[dst_items] = target[src_items]
                    got = buf.read().reshape(want.shape)
                    bad = np.argwhere(got != want)
                    assert not bad.size, (f"Pt {pt} -> Dt {dt}, decode rank {r}, buffer {geom.name!r}: {len(bad)} "
                                          f"bytes differ (first: item {int(bad[0][0])}, byte {int(bad[0][1])}); the "
                                          f"request paired source items {src_items.tolist()} with destination items "
                                          f"{dst_items.tolist()}")
                    assert not buf.guard_damage(), f"buffer {geom.name!r}: {buf.guard_damage()}"
            room.settle(10.0)
        finally:
            world.close()


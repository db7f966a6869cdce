"""The backend conformance kit: ``BackendTests`` and its tiers.

A backend plugin's whole ``tests/test_conformance.py``::

    from kvbridge.testkit import BackendTests

    class TestNixl(BackendTests):
        backend = "nixl"                                  # an installed backend, by name
        known_failures = {"test_byte_exact_delivery[pt4-dt1]": "issue #12"}   # strict xfails

    class TestMoriStandIn(BackendTests):
        spec = kvbridge_mori.testing.STANDIN_SPEC          # or a spec that is not installed by entry point

Tiers (``BackendTests`` runs all four; each is also a class of its own):

* :class:`BasicBackendTests` - one process, host memory: the backend alone (register, send, poll, notify,
  bounds) and under the core's TransferAgent over an in-process hub (byte-exact TP resharding of
  token-major GQA, head-major and MLA pages for every ``tp_pairs`` entry, exactly-once completion,
  faults injected by :class:`~kvbridge.testkit.faults.FaultInjector`, a hypothesis state machine);
* :class:`MultiProcessBackendTests` - decode ranks in a real child process, control plane over ZMQ on
  127.0.0.1, and a peer killed mid-room (``requires(multi-process)``, marked ``multiprocess``);
* :class:`FenceBackendTests` - a writer (prefill) in a child process with a room in flight to a decode rank
  here, stopped (SIGSTOP: ``writer_gone`` stays False, the room unsafe) and killed (SIGKILL: ``writer_gone``
  True within the spec's ``writer_gone_bound_s``, the room safe) (``requires(writer-gone)`` and
  ``multi-process``, marked ``multiprocess``);
* :class:`HardwareBackendTests` - the byte-exact test with CUDA memory (``requires(cuda-memory)``,
  marked ``hardware("cuda")``).

What runs is decided by the spec's capabilities: a test of a capability the spec does not declare is
skipped with "'<name>' does not declare <capability>" (the basic, multi-process and fence tiers need
``host-memory``; without ``writer-gone`` the reason says what the backend loses). Knobs a subclass may set:
``options`` (handed to the factory; or override the class-scoped ``backend_options`` fixture), ``tp_pairs``,
``descriptor_tp_pairs``, ``multiprocess_tp_pairs``, ``hardware_tp_pairs``, ``waiting_timeout_s``,
``room_timeout_s``, ``spawn_timeout_s``, ``stateful_examples`` / ``stateful_steps``, and from
:mod:`~kvbridge.testkit.kitbase` ``known_failures`` and ``leak_allowed_threads``. Every bytes check compares
with :mod:`kvbridge.testkit.reference`, never with kvbridge's own slicing or planner. The backend's stated
bound for ``writer_gone`` is its spec's ``writer_gone_bound_s``.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.agent import AgentConfig
from kvbridge.backends.base import ComponentTransfer, HandleState, Poll
from kvbridge.errors import KVBridgeError, PluginError, TransferError
from kvbridge.geometry import region_of
from kvbridge.planner import BufferPair, TransferPlan, plan_transfer
from kvbridge.protocol.records import PeerInfo
from kvbridge.protocol.wire import KVPoll
from kvbridge.registry import Registry
from kvbridge.slicing import Segments
from kvbridge.specs import DEFAULT_WRITER_GONE_BOUND_S, BackendSpec, Capability
from kvbridge.testkit.checked import installed_registry, kit_registry, options_of
from kvbridge.testkit.faults import Fault, FaultInjector
from kvbridge.testkit.kitbase import KitTests
from kvbridge.testkit.kvmodel import KVPool
from kvbridge.testkit.pools import GuardedBuffer
from kvbridge.testkit.world import Room, World, wait_until

__all__ = ["ALL_PAIRS", "LARGE_DESCRIPTOR_SIZES", "BackendTests", "BasicBackendTests", "FenceBackendTests",
           "HardwareBackendTests", "MultiProcessBackendTests", "requires"]

ALL_PAIRS = tuple((p, d) for p in (1, 2, 4) for d in (1, 2, 4))
#: single-descriptor sizes of test_large_descriptors_are_exact (the agent's staged writes reach 256 MiB)
LARGE_DESCRIPTOR_SIZES = (1, 4097, (1 << 20) + 1, 64 << 20)
_NO_WRITER_GONE = (
    "the agent never asks it whether a writer is gone, so a failed room whose writer neither acknowledges the "
    "abort nor is proven dead by the core (its liveness connection, AgentConfig.prove_writer_death; or its write "
    "lease with write_flight_bound_s) stays fenced, not safe_to_reuse, until the engine calls declare_gone; the "
    "fence tier (a stopped and a killed writer) does not run")
_ROOMS = itertools.count(10_000)


def requires(capability: Capability | str) -> pytest.MarkDecorator:
    """Mark a test as needing a declared capability (skipped otherwise)."""
    return pytest.mark.kvbridge_requires(getattr(capability, "value", capability))


def _pairs(attribute: str) -> Any:
    """Parametrize ``pt_dt`` over the class attribute ``attribute`` (a sequence of (Pt, Dt))."""
    def mark(func: Any) -> Any:
        func._kvbridge_pairs = attribute
        return func
    return mark


def _seed(request: pytest.FixtureRequest) -> int:
    return zlib.crc32(request.node.nodeid.encode())


#: how long a failed byte check waits before looking again, to tell a premature DONE from wrong bytes
PREMATURE_DONE_RECHECK_S = 1.0


def _premature_done_hint(correct_now: Any, when: str) -> str:
    """Look again a moment after a byte check failed: bytes that are right by then arrived after the backend
    called the write finished - the signature of a premature DONE, which deserves its own words."""
    deadline = time.monotonic() + PREMATURE_DONE_RECHECK_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if correct_now():
            return (f"\n  PREMATURE DONE: the bytes were wrong when {when}, and right up to "
                    f"{PREMATURE_DONE_RECHECK_S:.1f} s later: the backend reported the write DONE before every "
                    "byte landed at the destination. poll() may answer DONE only once the engine confirms the "
                    "write completed at the target (not when it was posted or left the local queue); an engine "
                    "that completes asynchronously keeps the handle PENDING until then.")
    return ""


def _large_problems(src: GuardedBuffer, dst: GuardedBuffer, at_src: int, at_dst: int, nbytes: int) -> list[str]:
    """What is wrong after ``nbytes`` from ``src[at_src:]`` were written to ``dst[at_dst:]`` (dst was all zeros)."""
    out = []
    got, want = dst.data[at_dst: at_dst + nbytes], src.data[at_src: at_src + nbytes]
    bad = np.flatnonzero(got != want) if not np.array_equal(got, want) else np.zeros(0, np.int64)
    if bad.size:
        first = int(bad[0])
        cut = " (truncated: no byte from there on arrived)" if not np.any(got[first:]) else ""
        out.append(f"{bad.size} of {nbytes} bytes differ from the source, the first at offset {first}{cut}")
    if np.any(dst.data[:at_dst]) or np.any(dst.data[at_dst + nbytes:]):
        out.append("bytes outside the descriptor's destination changed")
    if dst.guard_damage():
        out.append(f"wrote outside registered memory: {dst.guard_damage()}")
    return out


class _BackendKit(KitTests):
    """Subject resolution, fixtures and helpers shared by the tiers."""

    _kvbridge_kit_class: ClassVar[bool] = True
    #: an installed backend's name (looked up in the entry-point registry) ...
    backend: ClassVar[str] = ""
    #: ... or its spec, for a backend that is not installed by entry point (e.g. a stand-in)
    spec: ClassVar[BackendSpec | None] = None
    #: options for the backend factory (str -> str); the ``backend_options`` fixture returns them
    options: ClassVar[Mapping[str, str]] = {}
    #: options added for the in-process worlds, where every rank of several TP sizes shares one process (up to
    #: 16 agents): e.g. a backend thread that polls without pause, one per agent, would starve the process
    world_options: ClassVar[Mapping[str, str]] = {}
    #: (prefill TP, decode TP) pairs the backend claims, checked byte for byte in one process
    tp_pairs: ClassVar[Sequence[tuple[int, int]]] = ALL_PAIRS
    #: how long a decode room may wait for its data before it fails (the kit's faults rely on it)
    waiting_timeout_s: ClassVar[float] = 3.0
    #: the bound on every wait of a room (open, complete, settle)
    room_timeout_s: ClassVar[float] = 15.0
    #: the pair the fault-injection tests use (must be in tp_pairs or is added to the shared world)
    fault_pair: ClassVar[tuple[int, int]] = (2, 1)

    _kvbridge_name_attr: ClassVar[str] = "backend"
    _kvbridge_capability_notes: ClassVar[Mapping[str, str]] = {Capability.WRITER_GONE.value: _NO_WRITER_GONE}

    # ---------------------------------------------------------------- subject
    @classmethod
    def _kvbridge_prime_subject(cls, request: pytest.FixtureRequest) -> None:
        """Build the class's registry and one backend (closed at once) before the class's leak baseline: an
        engine runtime that the first backend starts for the life of the process (UCX's threads and
        descriptors, say) belongs to the baseline, not to the first test."""
        if not isinstance(cls._kvbridge_resolve(), BackendSpec) or cls._kvbridge_unavailable(request.config):
            return
        try:
            registry: Registry = request.getfixturevalue("kit_registry")
            options = options_of(request.getfixturevalue("backend_options"))
            registry.create_backend(request.getfixturevalue("backend_spec").name, name="kit-prime",
                                    options=options).close()
        except (Exception, pytest.skip.Exception):  # noqa: BLE001 - the tests that need the backend report it
            pass

    @classmethod
    def _kvbridge_lookup(cls, name: str) -> BackendSpec | str:
        try:
            return installed_registry().backend_spec(name)
        except PluginError as exc:
            return str(exc)

    @classmethod
    def _kvbridge_capabilities(cls) -> frozenset[str]:
        spec = cls._kvbridge_resolve()
        return frozenset(getattr(c, "value", c) for c in spec.capabilities) if isinstance(spec, BackendSpec) \
            else frozenset()

    @classmethod
    def _kvbridge_unavailable(cls, config: pytest.Config) -> str:
        spec = cls._kvbridge_resolve()
        if isinstance(spec, str):
            return spec
        selected = config.getoption("kvbridge_backend", default=[]) or []
        if selected and spec.name not in selected:
            return f"'{spec.name}' is not selected (--kvbridge-backend {' '.join(selected)})"
        return ""

    @classmethod
    def _kvbridge_uses_cuda(cls, config: pytest.Config) -> bool:
        from kvbridge.testkit.plugin import hardware_decision

        return (Capability.CUDA_MEMORY.value in cls._kvbridge_capabilities() and not cls._kvbridge_unavailable(config)
                and hardware_decision("cuda", config.getoption("kvbridge_hardware", default=None))[0] == "run")

    @classmethod
    def pytest_generate_tests(cls, metafunc: pytest.Metafunc) -> None:
        attribute = getattr(metafunc.function, "_kvbridge_pairs", None)
        if attribute and "pt_dt" in metafunc.fixturenames:
            pairs = [tuple(p) for p in getattr(cls, attribute)]
            metafunc.parametrize("pt_dt", pairs, ids=[f"pt{p}-dt{d}" for p, d in pairs])

    # ---------------------------------------------------------------- fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def backend_spec(cls) -> BackendSpec:
        """The spec under test (skips the class when the backend is unavailable)."""
        spec: BackendSpec = cls._kvbridge_spec_or_skip()
        return spec

    @pytest.fixture(scope="class")
    @classmethod
    def backend_options(cls) -> dict[str, str]:
        """Options handed to the backend factory: ``options`` by default (override for computed ones)."""
        return options_of(cls.options)

    @pytest.fixture(scope="class")
    @classmethod
    def fault_injector(cls) -> FaultInjector:
        return FaultInjector()

    @pytest.fixture(scope="class")
    @classmethod
    def kit_registry(cls, backend_spec: BackendSpec, fault_injector: FaultInjector) -> Registry:
        return kit_registry(backend_spec, tracker=cls._kvbridge_tracker(), plugins=[fault_injector])

    @pytest.fixture
    def faults(self, fault_injector: FaultInjector) -> Iterator[FaultInjector]:
        """The injector of the shared agents, disarmed (and stalled writes released) after the test."""
        fault_injector.reset()
        yield fault_injector
        fault_injector.reset()

    @pytest.fixture
    def make_backend(self, kit_registry: Registry, backend_spec: BackendSpec,
                     backend_options: dict[str, str]) -> Iterator[Any]:
        """``make_backend(purpose)``: a new backend (a CheckedBackend), closed after the test."""
        made: list[Any] = []
        counter = itertools.count()

        def make(purpose: str = "b") -> Any:
            backend = kit_registry.create_backend(backend_spec.name, name=f"kit-{purpose}-{next(counter)}",
                                                  options=options_of(backend_options))
            made.append(backend)
            return backend

        yield make
        for backend in made:
            backend.close()

    @classmethod
    def agent_config(cls, backend_options: dict[str, str], **overrides: Any) -> AgentConfig:
        base: dict[str, Any] = {"heartbeat_interval_s": 0.1, "peer_timeout_s": max(10.0, cls.room_timeout_s),
                                "bootstrap_timeout_s": cls.room_timeout_s, "waiting_timeout_s": cls.waiting_timeout_s,
                                "staging_bytes": 1 << 20,
                                "backend_options": {**options_of(backend_options), **options_of(cls.world_options)},
                                # descriptors by default: the kit checks what the backend does with each one
                                # (staged writes are test_byte_exact_through_staging's)
                                "staging": "never"}
        base.update(overrides)
        return AgentConfig(**base)

    @pytest.fixture(scope="class")
    @classmethod
    def kv_world(cls, kit_registry: Registry, backend_spec: BackendSpec,
                 backend_options: dict[str, str]) -> Iterator[World]:
        """One prefill instance per prefill TP size and one decode instance per decode TP size, shared by
        the class's in-process agent tests (host memory, the kit's KV pool)."""
        pairs = {tuple(p) for p in cls.tp_pairs} | {tuple(cls.fault_pair)}
        world = World(registry=kit_registry, backend=backend_spec.name, pairs=pairs,  # type: ignore[arg-type]
                      make_pool=lambda role, tp, r: KVPool(tp, r, role=role.value),
                      config=cls.agent_config(backend_options), label=f"kit-{backend_spec.name}")
        yield world
        world.close()

    # ---------------------------------------------------------------- helpers
    def kv_request(self, world: World, pt: int, dt: int, seed: int, *, pages: int = 5
                   ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Fill the sources of a new request and the destinations' background: (room, src, dst, positions)."""
        rng = np.random.default_rng(seed)
        num = world.prefill[pt][0].pool.num_pages
        src = rng.permutation(num)[:pages].astype(np.int64)
        dst = rng.permutation(num)[:pages].astype(np.int64)
        positions = np.arange(pages, dtype=np.int64)
        room = next(_ROOMS)
        for rank in world.prefill[pt]:
            rank.pool.fill(seed, 100 + rank.pool.rank, src, positions)
        for rank in world.decode[dt]:
            rank.pool.fill(seed, 200 + rank.pool.rank)
        return room, src, dst, positions

    def open_kv(self, world: World, pt: int, dt: int, room: int, dst: np.ndarray) -> Room:
        return world.open(pt, dt, room, {k.name: dst for k in world.decode[dt][0].pool.kinds}, self.room_timeout_s)

    def check_kv(self, world: World, room: Room, seed: int, src: np.ndarray, dst: np.ndarray,
                 positions: np.ndarray) -> None:
        """Destinations equal the reference reshard (and nothing else changed); sources are untouched."""
        def problems() -> list[str]:
            out = []
            for rank in world.decode[room.dt]:
                out += rank.pool.check(seed, 200 + rank.pool.rank, dst, positions)
            for rank in world.prefill[room.pt]:
                out += [p.replace("bytes of the request's pages differ from the reference reshard",
                                  "source bytes changed during the send")
                        for p in rank.pool.check(seed, 100 + rank.pool.rank, src, positions)]
            return out

        found = problems()
        if found:
            found[-1] += _premature_done_hint(lambda: not problems(), "the decode ranks reported Success")
        assert not found, f"'{self._kvbridge_subject()}' delivered wrong bytes:\n  " + "\n  ".join(found)

    def check_exactly_once(self, world: World, room: Room, faults: FaultInjector, pages: int) -> None:
        counts = faults.notice_counts(room.room)
        twice = {k: n for k, n in counts.items() if n != 1}
        assert counts, f"no completion notice was recorded for room {room.room}"
        assert not twice, f"completion notified more than once: {twice}"
        for receiver, rank in zip(room.receivers, world.decode[room.dt]):
            want = rank.pool.expected_nbytes(pages)
            assert receiver.nbytes == want, (f"decode rank {rank.pool.rank} counted {receiver.nbytes} delivered bytes, "
                                             f"the request is {want} bytes: a chunk was counted twice or not at all")

    def kv_roundtrip(self, world: World, faults: FaultInjector, pt: int, dt: int, seed: int, split: int) -> None:
        """One chunked KV request (cut after ``split`` pages) from Pt to Dt ranks, checked byte for byte and
        for exactly-once completion, then settled."""
        room_id, src, dst, positions = self.kv_request(world, pt, dt, seed)
        room = self.open_kv(world, pt, dt, room_id, dst)
        room.send([src[:split], src[split:]])
        room.wait_success(self.room_timeout_s)
        self.check_kv(world, room, seed, src, dst, positions)
        self.check_exactly_once(world, room, faults, len(src))
        room.settle(self.room_timeout_s)


class BasicBackendTests(_BackendKit):
    """Basic tier: one process, host memory (see the module docstring)."""

    _kvbridge_kit_class: ClassVar[bool] = True
    _kvbridge_tier_requires: ClassVar[tuple[str, ...]] = (Capability.HOST_MEMORY.value,)
    #: examples of the hypothesis state machine (each builds two backends), and rules per example
    stateful_examples: ClassVar[int] = 8
    stateful_steps: ClassVar[int] = 20

    # ================================================================ the backend alone
    def _two_sides(self, make_backend: Any, *, items: int = 8, item_nbytes: int = 256, buffers: int = 2,
                   seed: int = 0) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        a, b = make_backend("src"), make_backend("dst")
        src = [GuardedBuffer(items * item_nbytes) for _ in range(buffers)]
        dst = [GuardedBuffer(items * item_nbytes) for _ in range(buffers)]
        for buf in src + dst:
            buf.write(rng.integers(0, 256, buf.nbytes, dtype=np.uint8))
        reg_a = a.register_buffers("kit", [region_of(x.data) for x in src])
        reg_b = b.register_buffers("kit", [region_of(x.data) for x in dst])
        peer = a.add_peer(PeerInfo("kit-dst", b.endpoint, (reg_b.remote(),)))
        return {"a": a, "b": b, "src": src, "dst": dst, "reg_a": reg_a, "reg_b": reg_b, "peer": peer, "items": items,
                "item": item_nbytes, "before": [x.read() for x in dst], "src_before": [x.read() for x in src]}

    @staticmethod
    def _whole_items(s: dict[str, Any], src_items: Sequence[int] | np.ndarray, dst_items: Sequence[int] | np.ndarray,
                     notice: bytes = b""
                     ) -> tuple[ComponentTransfer, np.ndarray, np.ndarray]:
        order = np.argsort(np.asarray(src_items), kind="stable")
        si, di = np.asarray(src_items, np.int64)[order], np.asarray(dst_items, np.int64)[order]
        whole = Segments.whole(s["item"])
        pairs = [BufferPair(src_base=region_of(x.data).addr, src_item_nbytes=s["item"],
                            src_num_items=s["items"], dst_base=region_of(y.data).addr, dst_item_nbytes=s["item"],
                            dst_num_items=s["items"], segments=whole) for x, y in zip(s["src"], s["dst"])]
        plan = plan_transfer(pairs, si, di)
        transfer = ComponentTransfer(room=7, component="kit", peer=s["peer"], chunk=0, last=True,
                                     src=s["reg_a"], dst=s["reg_b"].remote(), plan=plan, notice=notice,
                                     src_items=si, dst_items=di, segments=tuple(whole for _ in s["src"]))
        return transfer, si, di

    @staticmethod
    def _expected(s: dict[str, Any], si: np.ndarray, di: np.ndarray) -> list[np.ndarray]:
        out = []
        for before, src in zip(s["before"], s["src_before"]):
            want = before.reshape(s["items"], s["item"]).copy()
            want[di] = src.reshape(s["items"], s["item"])[si]
            out.append(want.reshape(-1))
        return out

    def _wait_handle(self, backend: Any, handle: Any, what: str) -> Poll:
        result: list[Poll] = []

        def terminal() -> bool:
            result[:] = [backend.poll(handle)]
            return result[0].state is not HandleState.PENDING

        wait_until(terminal, self.room_timeout_s, lambda: f"{what}: the handle is still PENDING")
        return result[0]

    def test_register_and_deregister(self, make_backend: Any) -> None:
        """Registration returns the regions as given (peer-visible, wire-encodable); deregistration is
        idempotent; memory registered again after deregistration works.

        Troubleshooting: ``register_buffers`` must return ``RegisteredBuffers(component, regions, descriptor)``
        with the regions unchanged and in order; ``deregister_buffers`` of an unknown registration must be a
        no-op, not an error (the agent may deregister during teardown after a failure).
        """
        import msgspec

        from kvbridge.protocol.records import RemoteBuffers

        backend = make_backend("reg")
        bufs = [GuardedBuffer(4096), GuardedBuffer(8192)]
        regions = [region_of(b.data) for b in bufs]
        first = backend.register_buffers("kit-a", regions)
        assert first.component == "kit-a" and list(first.regions) == regions, \
            f"register_buffers returned {first.component!r} {list(first.regions)}, expected the regions given"
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(first.remote()), type=RemoteBuffers)
        assert [r.region() for r in wire.regions] == regions, "the peer-visible descriptor does not round-trip"
        other = GuardedBuffer(1024)
        second = backend.register_buffers("kit-b", [region_of(other.data)])
        backend.deregister_buffers(first)
        backend.deregister_buffers(first)                  # idempotent
        again = backend.register_buffers("kit-a", regions)
        assert list(again.regions) == regions
        backend.deregister_buffers(again)
        backend.deregister_buffers(second)
        listed = getattr(backend.inner, "registered_regions", None)
        if listed is not None and not callable(listed):
            assert not list(listed), f"registered_regions still lists {list(listed)} after deregistering everything"

    def test_single_component_send_polls_to_done(self, make_backend: Any, request: pytest.FixtureRequest) -> None:
        """One send of scattered whole items reaches DONE within the bound, stays DONE, and moved exactly
        those bytes (nothing else in the destination, nothing outside it, source untouched).

        Troubleshooting: ``poll`` must be non-blocking and eventually report DONE; once terminal, it must
        keep reporting the same state until ``release``. Bytes that differ at DONE but are right a moment
        later (the report then says PREMATURE DONE) mean ``poll`` answered DONE before the engine confirmed
        the write landed - e.g. on posting, or on local completion of an asynchronous write.
        """
        s = self._two_sides(make_backend, seed=_seed(request))
        transfer, si, di = self._whole_items(s, [6, 1, 3, 4], [0, 7, 2, 5])
        assert len(transfer.plan) >= 2, "the kit meant to send several descriptors"
        handle = s["a"].send_component(transfer)
        result = self._wait_handle(s["a"], handle, "a single send")
        assert result.state is HandleState.DONE, f"a valid send ended {result.state.name}: {result.reason}"
        for _ in range(3):
            assert s["a"].poll(handle).state is HandleState.DONE, "a DONE handle changed state"
        s["a"].release(handle)
        self._assert_bytes(s, self._expected(s, si, di), "a single send")

    def _assert_bytes(self, s: dict[str, Any], want: list[np.ndarray], what: str) -> None:
        def problems() -> list[str]:
            out = []
            for b, (buf, expect) in enumerate(zip(s["dst"], want)):
                got = buf.read()
                bad = np.flatnonzero(got != expect)
                if bad.size:
                    item, off = divmod(int(bad[0]), s["item"])
                    out.append(f"destination buffer {b}: {bad.size} bytes differ (first in item {item}, byte {off})")
                if buf.guard_damage():
                    out.append(f"destination buffer {b}: wrote outside registered memory: {buf.guard_damage()}")
            for b, (buf, before) in enumerate(zip(s["src"], s["src_before"])):
                if not np.array_equal(buf.read(), before):
                    out.append(f"source buffer {b} changed")
            return out

        found = problems()
        if found:
            found[-1] += _premature_done_hint(lambda: not problems(), "the handle polled DONE")
        assert not found, f"'{self._kvbridge_subject()}' {what}:\n  " + "\n  ".join(found)

    def test_large_descriptors_are_exact(self, make_backend: Any, request: pytest.FixtureRequest) -> None:
        """Single descriptors of 1 B, 4097 B, 1 MiB + 1 and 64 MiB (``LARGE_DESCRIPTOR_SIZES``), each at odd
        offsets, arrive whole: every byte equals the source, nothing around it changed.

        Troubleshooting: an engine with a largest message or registration granule must split a descriptor
        itself (the agent's staged writes are up to ``staging_piece_bytes``, 256 MiB); "truncated" means the
        bytes from that offset on never arrived while the handle polled DONE.
        """
        size = max(LARGE_DESCRIPTOR_SIZES) + 8192
        a, b = make_backend("src"), make_backend("dst")
        src, dst = GuardedBuffer(size), GuardedBuffer(size)
        src.data[:] = np.random.default_rng(_seed(request)).integers(0, 256, size, dtype=np.uint8)
        reg_a = a.register_buffers("kit", [region_of(src.data)])
        reg_b = b.register_buffers("kit", [region_of(dst.data)])
        peer = a.add_peer(PeerInfo("kit-dst", b.endpoint, (reg_b.remote(),)))
        for chunk, nbytes in enumerate(LARGE_DESCRIPTOR_SIZES):
            at_src, at_dst = 4099 - chunk, 7 + 1000 * chunk
            plan = TransferPlan(np.array([region_of(src.data).addr + at_src], np.uint64),
                                np.array([region_of(dst.data).addr + at_dst], np.uint64),
                                np.array([nbytes], np.uint64), np.zeros(1, np.int32))
            handle = a.send_component(ComponentTransfer(room=9, component="kit", peer=peer, chunk=chunk, last=True,
                                                        src=reg_a, dst=reg_b.remote(), plan=plan))
            result = self._wait_handle(a, handle, f"a {nbytes} B descriptor")
            a.release(handle)
            assert result.state is HandleState.DONE, \
                f"a {nbytes} B descriptor ended {result.state.name}: {result.reason}"
            problems = _large_problems(src, dst, at_src, at_dst, nbytes)
            assert not problems, f"'{self._kvbridge_subject()}' a single {nbytes} B descriptor:\n  " + \
                "\n  ".join(problems)
            dst.data[at_dst: at_dst + nbytes] = 0
        b.deregister_buffers(reg_b)
        a.deregister_buffers(reg_a)

    def _assert_refused(self, backend: Any, transfer: ComponentTransfer, what: str) -> None:
        try:
            handle = backend.send_component(transfer)
        except KVBridgeError:
            return
        except Exception as exc:
            raise AssertionError(f"{what}: send_component raised {type(exc).__name__} ({exc}); a refusal must be a "
                                 "kvbridge error (RegionError)") from exc
        result = self._wait_handle(backend, handle, what)
        backend.release(handle)
        assert result.state is HandleState.FAILED, f"{what}: the send was accepted and ended {result.state.name}"

    @pytest.mark.parametrize("where", ["destination-past-end", "destination-before-start", "source-past-end"])
    def test_out_of_bounds_descriptor_is_refused(self, make_backend: Any, where: str,
                                                 request: pytest.FixtureRequest) -> None:
        """A plan with one descriptor reaching outside the registered regions is refused as a whole:
        ``send_component`` raises a kvbridge error (or its handle FAILS) and not one byte is written -
        neither the valid descriptors' targets nor the guard bytes around the buffers.

        Troubleshooting: check every descriptor against the registered regions (``check_within``) before
        posting anything; never post the valid part of a plan.
        """
        s = self._two_sides(make_backend, seed=_seed(request))
        good, _, _ = self._whole_items(s, [0, 2, 5], [1, 4, 6])
        plan = good.plan
        src_end = region_of(s["src"][0].data).end
        dst_start, dst_end = region_of(s["dst"][0].data).addr, region_of(s["dst"][0].data).end
        bad_src, bad_dst = int(plan.src_addr[0]), int(plan.dst_addr[0])
        if where == "destination-past-end":
            bad_dst = dst_end - 16
        elif where == "destination-before-start":
            bad_dst = dst_start - 16
        else:
            bad_src = src_end - 16
        u64 = np.uint64
        forged = TransferPlan(np.append(plan.src_addr, u64(bad_src)), np.append(plan.dst_addr, u64(bad_dst)),
                              np.append(plan.nbytes, u64(32)), np.append(plan.buffer, np.int32(0)))
        transfer = ComponentTransfer(room=8, component="kit", peer=s["peer"], chunk=0, last=True,
                                     src=s["reg_a"], dst=s["reg_b"].remote(), plan=forged)
        self._assert_refused(s["a"], transfer, f"a plan with a {where} descriptor")
        self._assert_bytes(s, s["before"], f"wrote although the plan was refused ({where})")

    def test_send_from_deregistered_memory_is_refused(self, make_backend: Any, request: pytest.FixtureRequest) -> None:
        """After ``deregister_buffers``, a send that reads those regions is refused and writes nothing.

        Troubleshooting: look source regions up in what is registered *now*, not in the transfer's
        ``src`` record, which the caller may hold after deregistering.
        """
        s = self._two_sides(make_backend, seed=_seed(request))
        transfer, _, _ = self._whole_items(s, [0, 1], [2, 3])
        s["a"].deregister_buffers(s["reg_a"])
        self._assert_refused(s["a"], transfer, "a send from deregistered memory")
        self._assert_bytes(s, s["before"], "wrote from deregistered memory")

    def test_notify_completion_contract(self, make_backend: Any, backend_spec: BackendSpec) -> None:
        """With ``notifications`` declared, a notice to a peer in this process is delivered exactly once;
        without it, ``notify_completion`` answers False so the control plane carries the notice.

        Troubleshooting: return True only when the backend itself will deliver the notice; a True that
        delivers nothing loses the completion and the decode room never succeeds.
        """
        s = self._two_sides(make_backend, items=2, item_nbytes=64)
        notice = b"kvbridge-testkit notice"
        delivered = s["a"].notify_completion(s["peer"], notice)
        name = backend_spec.name
        if Capability.NOTIFICATIONS not in backend_spec.capabilities:
            assert delivered is False, (f"'{name}' does not declare notifications, yet notify_completion returned "
                                        f"{delivered!r}: the control plane will not carry the notice, so it is lost")
            return
        assert delivered is True, (f"'{name}' declares notifications, but notify_completion returned {delivered!r} "
                                   "for a peer in this process")
        got: list[bytes] = []

        def drained() -> bool:
            got.extend(m for _, m in s["b"].drain_notifications())
            return notice in got

        wait_until(drained, self.room_timeout_s, lambda: f"notify_completion returned True but the peer drained "
                                                f"{got or 'nothing'}, not the notice")
        settle = time.monotonic() + 0.3
        while time.monotonic() < settle:
            got.extend(m for _, m in s["b"].drain_notifications())
            time.sleep(0.01)
        assert got.count(notice) == 1, f"one notify_completion delivered the notice {got.count(notice)} times"

    @requires(Capability.NOTIFICATIONS)
    def test_notification_visible_implies_data_visible(self, make_backend: Any, request: pytest.FixtureRequest) -> None:
        """Whenever a completion notice can be drained on the peer - the one attached to the write or the
        one sent by ``notify_completion`` after DONE - every byte of that write is already visible there.

        Troubleshooting: a notice must be ordered after the data it announces (NIXL attaches it to the
        WRITE; an engine with a separate channel must flush or fence the data first).
        """
        s = self._two_sides(make_backend, items=64, item_nbytes=4096, seed=_seed(request))
        src_items = np.arange(0, 64, 2)
        transfer, si, di = self._whole_items(s, src_items, (src_items * 7 + 3) % 64, notice=b"kit-attached")
        want = self._expected(s, si, di)
        seen_early: list[bytes] = []

        def check_now(label: str) -> None:
            for b, (buf, expect) in enumerate(zip(s["dst"], want)):
                bad = int(np.count_nonzero(buf.read() != expect))
                assert not bad, (f"'{self._kvbridge_subject()}': the notice {label} was visible while {bad} bytes of "
                                 f"destination buffer {b} were not")

        handle = s["a"].send_component(transfer)
        deadline = time.monotonic() + self.room_timeout_s
        while True:
            state = s["a"].poll(handle).state
            for _, message in s["b"].drain_notifications():
                check_now(repr(message))
                seen_early.append(message)
            if state is not HandleState.PENDING:
                break
            assert time.monotonic() < deadline, "the send is still PENDING"
            time.sleep(0.0002)
        assert state is HandleState.DONE, f"the send ended {state.name}: {s['a'].poll(handle).reason}"
        s["a"].release(handle)
        assert s["a"].notify_completion(s["peer"], b"kit-after-done") is True
        got: list[bytes] = list(seen_early)

        def arrived() -> bool:
            for _, message in s["b"].drain_notifications():
                check_now(repr(message))
                got.append(message)
            return b"kit-after-done" in got

        wait_until(arrived, self.room_timeout_s, lambda: "the notice sent after DONE never arrived")

    # ================================================================ under the TransferAgent
    @_pairs("tp_pairs")
    def test_byte_exact_delivery(self, kv_world: World, faults: FaultInjector, pt_dt: tuple[int, int],
                                 request: pytest.FixtureRequest) -> None:
        """Pt prefill ranks send a chunked request to Dt decode ranks (token-major GQA with replicated heads,
        head-major, MLA); every decode byte equals the independent reference reshard, no byte outside the
        request's pages or the registered memory changed, the sources are untouched, and every component
        chunk was notified exactly once.

        Troubleshooting: a diff in the request's pages with everything else intact usually means dropped or
        misaddressed descriptors; "outside the request's pages" means writes to the wrong item; guard damage
        means writes outside registered memory. "PREMATURE DONE" means the bytes were wrong at Success but
        right a moment later: the backend's ``poll`` reported DONE (so the completion notice went out)
        before the data had landed.
        """
        pt, dt = pt_dt
        self.kv_roundtrip(kv_world, faults, pt, dt, _seed(request), split=2)

    @_pairs("descriptor_tp_pairs")
    def test_byte_exact_without_staging(self, kit_registry: Registry, backend_spec: BackendSpec,
                                        backend_options: dict[str, str], faults: FaultInjector,
                                        pt_dt: tuple[int, int], request: pytest.FixtureRequest) -> None:
        """The same, with the agents' staging area off: every slice travels as plain descriptors.

        Troubleshooting: see test_byte_exact_delivery.
        """
        pt, dt = pt_dt
        world = World(registry=kit_registry, backend=backend_spec.name, pairs=[(pt, dt)],
                      make_pool=lambda role, tp, r: KVPool(tp, r, role=role.value),
                      config=self.agent_config(backend_options, staging_bytes=0), label="kit-nostaging")
        try:
            self.kv_roundtrip(world, faults, pt, dt, _seed(request), split=3)
        finally:
            world.close()

    @_pairs("descriptor_tp_pairs")
    def test_byte_exact_through_staging(self, kit_registry: Registry, backend_spec: BackendSpec,
                                        backend_options: dict[str, str], faults: FaultInjector,
                                        pt_dt: tuple[int, int], request: pytest.FixtureRequest) -> None:
        """The same, with every regular slice staged (``AgentConfig.staging="always"``): each chunk goes as a
        few large writes from the prefill's staging area into the decode's, scattered on arrival.

        Troubleshooting: see test_byte_exact_delivery; a backend must also write into a registered staging
        region (the component ``__staging__``) like any other.
        """
        pt, dt = pt_dt
        world = World(registry=kit_registry, backend=backend_spec.name, pairs=[(pt, dt)],
                      make_pool=lambda role, tp, r: KVPool(tp, r, role=role.value),
                      config=self.agent_config(backend_options, staging="always"), label="kit-staged")
        try:
            self.kv_roundtrip(world, faults, pt, dt, _seed(request), split=3)
        finally:
            world.close()

    descriptor_tp_pairs: ClassVar[Sequence[tuple[int, int]]] = ((2, 1), (1, 2))

    def _fault_room(self, world: World, request: pytest.FixtureRequest) -> tuple[Room, int, np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
        pt, dt = self.fault_pair
        seed = _seed(request)
        room_id, src, dst, positions = self.kv_request(world, pt, dt, seed)
        return self.open_kv(world, pt, dt, room_id, dst), seed, src, dst, positions

    def test_duplicate_delivery_completes_once(self, kv_world: World, faults: FaultInjector,
                                               request: pytest.FixtureRequest) -> None:
        """Every write posted twice and every notice delivered twice: the request still completes once,
        byte-exact, counting each delivered byte once.

        Troubleshooting: receivers must deduplicate notices per (sender, component, chunk).
        """
        room, seed, src, dst, positions = self._fault_room(kv_world, request)
        faults.arm(Fault.DUPLICATE, room=room.room)
        room.send([src[:2], src[2:]])
        room.wait_success(self.room_timeout_s)
        assert faults.injected[Fault.DUPLICATE], "no send was duplicated"
        for _ in range(5):
            assert all(r.poll() is KVPoll.Success for r in room.receivers), "Success did not stick"
            time.sleep(0.02)
        self.check_kv(kv_world, room, seed, src, dst, positions)
        for receiver, rank in zip(room.receivers, kv_world.decode[room.dt]):
            assert receiver.nbytes == rank.pool.expected_nbytes(len(src)), "a duplicated chunk was counted twice"
        room.settle(self.room_timeout_s)

    @pytest.mark.parametrize("fault", [Fault.REFUSE, Fault.FAIL])
    def test_failure_surfaces_with_its_reason(self, kv_world: World, faults: FaultInjector, fault: Fault,
                                              request: pytest.FixtureRequest) -> None:
        """A send refused by the engine, or a write that FAILS, fails the room on both sides within the
        bound, with the engine's reason in both failure reasons; afterwards both sides are safe to reuse.

        Troubleshooting: a failed write must poll FAILED with a non-empty reason (never stay PENDING), and a
        refusal must raise a kvbridge error such as TransferError or RegionError.
        """
        room, _, src, *_ = self._fault_room(kv_world, request)
        reason = f"kvbridge-testkit {fault.value} #{room.room}"
        faults.arm(fault, room=room.room, reason=reason)
        for sender in room.senders:
            try:
                sender.send(np.asarray(src, dtype=np.int64), last=True)
            except TransferError:
                pass                # refused here, or the room already failed through another rank
        room.wait_failed(self.room_timeout_s)
        for side in room.senders + room.receivers:
            assert reason in side.failure_reason, \
                f"the failure reason {side.failure_reason!r} lost the cause {reason!r}"
        room.settle(self.room_timeout_s)

    def test_late_completion_is_still_exact(self, kv_world: World, faults: FaultInjector,
                                            request: pytest.FixtureRequest) -> None:
        """Writes that complete late (0.5 s) still complete the request exactly once, byte-exact, and not
        before they completed.

        Troubleshooting: a decode rank must not report Success before every write it waits for is DONE.
        """
        room, seed, src, dst, positions = self._fault_room(kv_world, request)
        faults.arm(Fault.LATE, room=room.room, delay_s=0.5)
        started = time.monotonic()
        room.send([src])
        room.wait_success(self.room_timeout_s)
        assert time.monotonic() - started >= 0.45, "Success came before the late writes completed"
        self.check_kv(kv_world, room, seed, src, dst, positions)
        room.settle(self.room_timeout_s)

    @pytest.mark.parametrize("side", ["decode", "prefill"])
    def test_abort_waits_for_quiescence(self, kv_world: World, faults: FaultInjector, side: str,
                                        request: pytest.FixtureRequest) -> None:
        """An abort (by the decode or the prefill side) fails the room at once, but neither side reports
        its pages safe to reuse while a write of the room is still in flight (stalled); once the writes
        drain, both sides become safe within the bound.

        Troubleshooting: a sender confirms quiescence only after every handle of the room reached a terminal
        state; ``poll`` must keep reporting PENDING while the engine may still write.
        """
        room, _, src, _, _ = self._fault_room(kv_world, request)
        faults.arm(Fault.STALL, room=room.room)
        room.send([src])
        (room.receivers[0] if side == "decode" else room.senders[0]).abort(f"kvbridge-testkit {side} abort")
        room.wait_failed(self.room_timeout_s, senders=side == "prefill")
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            unsafe = [f"decode rank {i}" for i, r in enumerate(room.receivers) if r.safe_to_reuse]
            unsafe += [f"prefill rank {i}" for i, s in enumerate(room.senders) if s.safe_to_reuse]
            assert not unsafe, (f"{', '.join(unsafe)} reported its pages safe to reuse while a write of the room was "
                                f"still in flight: {room.describe()}")
            time.sleep(0.02)
        faults.release()
        room.wait_failed(self.room_timeout_s)
        room.settle(self.room_timeout_s)

    def test_lost_notice_fails_within_the_bound(self, kv_world: World, faults: FaultInjector,
                                                request: pytest.FixtureRequest) -> None:
        """Completion notices that never arrive fail the decode room within ``waiting_timeout_s`` (plus
        slack), with a reason; nothing hangs, and both sides end safe to reuse.

        Troubleshooting: this exercises the core's timeouts; a failure here with a correct backend means a
        notice reached the decode side by a path the injector could not intercept.
        """
        room, _, src, *_ = self._fault_room(kv_world, request)
        faults.arm(Fault.LOSE_NOTICE, room=room.room)
        started = time.monotonic()
        room.send([src])
        took = room.wait_failed(self.waiting_timeout_s + 5.0, senders=False)
        assert time.monotonic() - started <= self.waiting_timeout_s + 5.0, f"took {took:.1f} s to fail"
        for receiver in room.receivers:
            assert receiver.failure_reason, "the decode room failed without a reason"
        room.settle(self.room_timeout_s)

    # ================================================================ state machine
    def test_stateful_machine(self, make_backend: Any, backend_spec: BackendSpec) -> None:
        """Random sequences of register / send / poll / notify / drain / abandon / deregister on two backends,
        against a model of the expected destination bytes and the outstanding handles (hypothesis).

        Troubleshooting: the failing example replays as a script of rules; each line is one backend call.
        """
        from kvbridge.testkit.stateful import run_backend_machine

        run_backend_machine(make_backend, Capability.NOTIFICATIONS in backend_spec.capabilities,
                            examples=self.stateful_examples, steps=self.stateful_steps, bound_s=self.room_timeout_s)


class MultiProcessBackendTests(_BackendKit):
    """Multi-process tier: decode ranks in a child process, ZMQ control plane on 127.0.0.1."""

    _kvbridge_kit_class: ClassVar[bool] = True
    _kvbridge_tier_requires: ClassVar[tuple[str, ...]] = (Capability.HOST_MEMORY.value,)
    multiprocess_tp_pairs: ClassVar[Sequence[tuple[int, int]]] = ((1, 1), (2, 1), (1, 2))
    #: seconds a child process may take to start, import the engine and connect
    spawn_timeout_s: ClassVar[float] = 60.0

    @pytest.mark.kvbridge_multiprocess
    @requires(Capability.MULTI_PROCESS)
    @_pairs("multiprocess_tp_pairs")
    def test_multiprocess_byte_exact(self, backend_spec: BackendSpec, backend_options: dict[str, str],
                                     pt_dt: tuple[int, int], request: pytest.FixtureRequest) -> None:
        """Prefill ranks here, decode ranks in a child process: a chunked request arrives byte-exact (checked
        in the child against the reference) over the real control plane.

        Troubleshooting: the child's stderr is attached to the failure; a child that cannot build the backend
        usually lacks an option (``backend_options``) or the engine's environment.
        """
        from kvbridge.testkit.peer import run_remote_room

        run_remote_room(backend_spec, options_of(backend_options), *pt_dt, seed=_seed(request), mode="transfer",
                        bound_s=self.room_timeout_s, spawn_timeout_s=self.spawn_timeout_s,
                        waiting_timeout_s=self.waiting_timeout_s, tracker=self._kvbridge_tracker())

    @pytest.mark.kvbridge_multiprocess
    @requires(Capability.MULTI_PROCESS)
    def test_peer_death_fails_rooms_within_the_bound(self, backend_spec: BackendSpec,
                                                     backend_options: dict[str, str],
                                                     request: pytest.FixtureRequest) -> None:
        """The decode process is killed (SIGKILL) mid-request: every prefill room fails within the peer
        timeout (1 s) plus slack, with a reason, and is safe to reuse (a dead peer receives nothing more).

        Troubleshooting: the core detects the death from missing heartbeats; a backend call that blocks on a
        dead peer (instead of failing its handle) keeps the room from settling.
        """
        from kvbridge.testkit.peer import run_remote_room

        run_remote_room(backend_spec, options_of(backend_options), 1, 1, seed=_seed(request), mode="kill",
                        bound_s=self.room_timeout_s, spawn_timeout_s=self.spawn_timeout_s,
                        waiting_timeout_s=self.waiting_timeout_s, tracker=self._kvbridge_tracker())


class FenceBackendTests(_BackendKit):
    """Fence tier: a backend's ``writer_gone(endpoint)`` against a real writer process, stopped and killed."""

    _kvbridge_kit_class: ClassVar[bool] = True
    # writer-gone first: its skip reason (what the backend loses) is the one reported
    _kvbridge_tier_requires: ClassVar[tuple[str, ...]] = (Capability.WRITER_GONE.value, Capability.HOST_MEMORY.value,
                                                          Capability.MULTI_PROCESS.value)
    spawn_timeout_s: ClassVar[float] = 60.0

    @staticmethod
    def gone_bound_s(spec: BackendSpec) -> float:
        """The backend's stated bound (``BackendSpec.writer_gone_bound_s``, else the default)."""
        return spec.writer_gone_bound_s or DEFAULT_WRITER_GONE_BOUND_S

    @pytest.mark.kvbridge_multiprocess
    def test_stopped_writer_is_not_gone(self, backend_spec: BackendSpec, backend_options: dict[str, str],
                                        request: pytest.FixtureRequest) -> None:
        """A writer with a room in flight is stopped (SIGSTOP) past the peer timeout: the decode fails the room,
        but ``writer_gone`` for the writer's endpoint keeps answering False and the room stays not
        ``safe_to_reuse`` (watched for the stated bound after the failure); then SIGCONT, and the room settles.

        Troubleshooting: a stopped process still holds the engine's registration of the decode's memory and
        writes when it resumes; silence, a missed heartbeat or a dead connection are no proof of its exit.
        Answer True only on the kernel's word (the process is gone) or the engine's (it revoked the writer).
        """
        from kvbridge.testkit.peer import run_fenced_writer

        run_fenced_writer(backend_spec, options_of(backend_options), seed=_seed(request), stop=True,
                          gone_bound_s=self.gone_bound_s(backend_spec), bound_s=self.room_timeout_s,
                          spawn_timeout_s=self.spawn_timeout_s, tracker=self._kvbridge_tracker())

    @pytest.mark.kvbridge_multiprocess
    def test_killed_writer_is_gone_within_the_bound(self, backend_spec: BackendSpec, backend_options: dict[str, str],
                                                    request: pytest.FixtureRequest) -> None:
        """The writer is killed (SIGKILL) with a room in flight: ``writer_gone`` for its endpoint answers True
        within the spec's ``writer_gone_bound_s`` (default 5 s), and the decode room becomes safe to reuse with
        no other proof of the death (``AgentConfig.prove_writer_death`` is off on the decode).

        Troubleshooting: True must also mean that no write the dead process posted can still land; state a
        bound that covers the engine's drain of a dead peer's writes.
        """
        from kvbridge.testkit.peer import run_fenced_writer

        run_fenced_writer(backend_spec, options_of(backend_options), seed=_seed(request), stop=False,
                          gone_bound_s=self.gone_bound_s(backend_spec), bound_s=self.room_timeout_s,
                          spawn_timeout_s=self.spawn_timeout_s, tracker=self._kvbridge_tracker())


class HardwareBackendTests(_BackendKit):
    """Hardware tier: the byte-exact test with CUDA memory on both sides."""

    _kvbridge_kit_class: ClassVar[bool] = True
    hardware_tp_pairs: ClassVar[Sequence[tuple[int, int]]] = ((1, 1), (2, 1), (1, 2))

    @pytest.mark.kvbridge_hardware("cuda")
    @requires(Capability.CUDA_MEMORY)
    @_pairs("hardware_tp_pairs")
    def test_cuda_byte_exact(self, kit_registry: Registry, backend_spec: BackendSpec,
                             backend_options: dict[str, str], faults: FaultInjector, pt_dt: tuple[int, int],
                             request: pytest.FixtureRequest) -> None:
        """As test_byte_exact_delivery, with every buffer in CUDA memory (device 0).

        Troubleshooting: register VRAM with the engine's GPU memory type; regular slices go through the
        staging area, which lives on the same GPU as the buffers (gathered and scattered by torch kernels).
        """
        pt, dt = pt_dt
        world = World(registry=kit_registry, backend=backend_spec.name, pairs=[(pt, dt)],
                      make_pool=lambda role, tp, r: KVPool(tp, r, role=role.value, memory="cuda"),
                      config=self.agent_config(backend_options), label="kit-cuda")
        try:
            self.kv_roundtrip(world, faults, pt, dt, _seed(request), split=2)
        finally:
            world.close()


class BackendTests(BasicBackendTests, MultiProcessBackendTests, FenceBackendTests, HardwareBackendTests):
    """Every tier of the backend kit (see the module docstring for the ten lines a plugin writes)."""

    _kvbridge_kit_class: ClassVar[bool] = True

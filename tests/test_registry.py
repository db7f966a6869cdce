"""The registry: discovery, conflicts, allow/block lists, graded failures, wrappers, immutability, compose.

Fake third-party distributions are written as ``<dist>-<version>.dist-info`` directories (METADATA and
entry_points.txt) plus a module, in a temporary directory put on ``sys.path`` - exactly what
``importlib.metadata`` finds for an installed wheel. Every build passes ``env=`` so the caller's
environment cannot change the outcome; assertions look only at the plugins each test installs plus
the built-ins (other kvbridge plugins may be installed in the same environment).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.backends import loopback
from kvbridge.backends.base import ComponentTransfer, Poll, RegisteredBuffers
from kvbridge.errors import (
    PluginConflictError,
    PluginError,
    PluginUnavailableError,
    UnknownPluginError,
    UnsupportedTopology,
)
from kvbridge.geometry import (
    BufferGeometry,
    Component,
    DType,
    IndexKind,
    PoolLayout,
    Rank,
    ShardAxis,
    region_of,
)
from kvbridge.planner import TransferPlan
from kvbridge.plugin import hookimpl
from kvbridge.protocol.records import PeerInfo
from kvbridge.registry import Registry
from kvbridge.specs import BackendSpec, PluginKind, PluginStatus, StateTypeSpec
from kvbridge.state.base import StateType

FakeDist = Callable[..., None]


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDist]:
    """``fake_dist(dist, version, entry_points={name: module}, modules={module: source})``."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    created: list[str] = []

    def make(dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        for module, source in modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            created.append(module)
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[kvbridge]\n{lines}")

    yield make
    for module in created:
        sys.modules.pop(module, None)


BACKEND_PLUGIN = """
    from kvbridge.plugin import hookimpl
    from kvbridge.specs import BackendSpec

    @hookimpl
    def kvbridge_transfer_backends():
        return [BackendSpec(name={name!r}, factory="kvbridge.backends.loopback:LoopbackBackend",
                            description={description!r})]
"""


def backend_plugin(name: str, description: str = "") -> str:
    return BACKEND_PLUGIN.format(name=name, description=description)


def by_name(registry: Registry) -> dict[str, Any]:
    return {r.name: r for r in registry.records()}


# ------------------------------------------------------------------------------------------ discovery
def test_entry_points_give_loopback_and_kv_available() -> None:
    registry = Registry.build(env={})
    rows = by_name(registry)
    assert rows["loopback"].kind is PluginKind.BACKEND and rows["kv"].kind is PluginKind.STATE
    for name in ("loopback", "kv"):
        assert rows[name].status is PluginStatus.AVAILABLE and rows[name].distribution == "kvbridge"
        assert rows[name].as_json()["status"] == "available"
    assert "loopback" in registry.backend_names() and "kv" in registry.state_type_names()
    assert "host-memory" in rows["loopback"].capabilities
    assert registry.state_type("kv").name == "kv"
    backend = registry.create_backend("loopback", name="disc-0")
    try:
        assert backend.name == "loopback"
    finally:
        backend.close()


def test_third_party_entry_point_is_discovered_with_its_distribution(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-fastcopy", "3.1", {"fastcopy": "fake_fastcopy"},
              {"fake_fastcopy": backend_plugin("fastcopy")})
    row = by_name(Registry.build(env={}))["fastcopy"]
    assert (row.kind, row.distribution, row.version, row.status) == (
        PluginKind.BACKEND, "kvbridge-fastcopy", "3.1", PluginStatus.AVAILABLE)


class _TallyState(StateType):
    name = "tally"


class _StatesPlugin:
    """An explicit in-test plugin declaring two state types."""

    @hookimpl
    def kvbridge_state_types(self) -> list[StateTypeSpec]:
        return [StateTypeSpec(name="tally", factory=_TallyState),
                StateTypeSpec(name="other", factory=_TallyState)]


def test_explicit_plugins_without_entry_points() -> None:
    registry = Registry.build(entry_points=False, plugins=[_StatesPlugin()], env={})
    assert set(registry.state_type_names()) == {"tally", "other"}
    assert registry.backend_names() == ()
    assert {r.distribution for r in registry.records()} == {"<explicit>"}
    with pytest.raises(UnknownPluginError, match=r"no backend named 'loopback'.*known: none"):
        registry.create_backend("loopback", name="x")
    # explicit plugins come on top of entry points when both are asked for
    both = Registry.build(plugins=[_StatesPlugin(), loopback], env={})
    assert {"kv", "tally", "other"} <= set(both.state_type_names()) and "loopback" in both.backend_names()


# ------------------------------------------------------------------------------------------ conflicts
def test_two_distributions_claiming_one_name_is_an_error_naming_both(fake_dist: FakeDist) -> None:
    fake_dist("dist-alpha", "1.0", {"alpha": "fake_alpha"}, {"fake_alpha": backend_plugin("dup", "alpha's")})
    fake_dist("dist-beta", "2.5", {"beta": "fake_beta"}, {"fake_beta": backend_plugin("dup", "beta's")})
    with pytest.raises(PluginConflictError) as err:
        Registry.build(env={})
    text = str(err.value)
    assert "'dup'" in text and "dist-alpha 1.0" in text and "dist-beta 2.5" in text


def test_two_distributions_using_one_entry_point_name_still_conflict(fake_dist: FakeDist) -> None:
    """Never resolved by install order: both are loaded, and their clash is reported."""
    fake_dist("dist-one", "1.0", {"fast": "fake_one"}, {"fake_one": backend_plugin("fast", "one")})
    fake_dist("dist-two", "1.0", {"fast": "fake_two"}, {"fake_two": backend_plugin("fast", "two")})
    with pytest.raises(PluginConflictError, match=r"dist-(one|two) 1\.0.*dist-(one|two) 1\.0"):
        Registry.build(env={})


def test_builtin_name_claimed_by_a_third_party_conflicts(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-impostor", "0.1", {"impostor": "fake_impostor"},
              {"fake_impostor": backend_plugin("loopback", "not the real one")})
    with pytest.raises(PluginConflictError) as err:
        Registry.build(env={})
    assert "'loopback'" in str(err.value) and f"kvbridge {md.version('kvbridge')}" in str(err.value)
    assert "kvbridge-impostor 0.1" in str(err.value)


def test_identical_re_registration_is_accepted(fake_dist: FakeDist) -> None:
    class SameLoopback:
        @hookimpl
        def kvbridge_transfer_backends(self) -> list[BackendSpec]:
            return [loopback.SPEC]  # the very same declaration as the built-in

    fake_dist("dist-same", "1.0", {"same": "fake_same"}, {"fake_same": backend_plugin("same")})
    fake_dist("dist-same-again", "1.0", {"same2": "fake_same2"}, {"fake_same2": backend_plugin("same")})
    registry = Registry.build(plugins=[SameLoopback(), loopback, loopback], env={})
    rows = [r for r in registry.records() if r.name in ("loopback", "same")]
    assert sorted((r.name, r.status) for r in rows) == [("loopback", PluginStatus.AVAILABLE),
                                                       ("same", PluginStatus.AVAILABLE)]
    assert next(r for r in rows if r.name == "loopback").distribution == "kvbridge"


# ------------------------------------------------------------------------------------------ allow / block
@pytest.fixture
def three_plugins(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-one", "1.0", {"one": "fake_p_one"}, {"fake_p_one": backend_plugin("one")})
    fake_dist("kvbridge-two", "1.0", {"two": "fake_p_two"}, {"fake_p_two": backend_plugin("two")})
    # entry point "multi" declares a backend under another name
    fake_dist("kvbridge-multi", "1.0", {"multi": "fake_p_multi"}, {"fake_p_multi": backend_plugin("fast")})


@pytest.mark.usefixtures("three_plugins")
def test_allowlist_loads_only_the_named_plugins() -> None:
    names = set(by_name(Registry.build(env={"KVBRIDGE_PLUGINS": "loopback, one,multi"})))
    assert names == {"loopback", "one", "fast"}  # "fast" comes with its allowed plugin "multi"
    assert set(by_name(Registry.build(env={"KVBRIDGE_PLUGINS": "two"}))) == {"two"}


@pytest.mark.usefixtures("three_plugins")
def test_blocklist_skips_the_named_plugins() -> None:
    names = set(by_name(Registry.build(env={"KVBRIDGE_DISABLE_PLUGINS": "kv,two"})))
    assert {"loopback", "one", "fast"} <= names and not names & {"kv", "two"}
    # a backend can be blocked by its own name even when its plugin is loaded
    assert "fast" not in by_name(Registry.build(env={"KVBRIDGE_DISABLE_PLUGINS": "fast"}))
    assert by_name(Registry.build(env={"KVBRIDGE_DISABLE_PLUGINS": "*"})) == {}
    only = Registry.build(plugins=[_StatesPlugin()], env={"KVBRIDGE_DISABLE_PLUGINS": "*"})
    assert set(only.state_type_names()) == {"tally", "other"}  # explicit plugins are not filtered


@pytest.mark.usefixtures("three_plugins")
def test_block_wins_over_allow_and_arguments_override_env() -> None:
    env = {"KVBRIDGE_PLUGINS": "one,two", "KVBRIDGE_DISABLE_PLUGINS": "two"}
    assert set(by_name(Registry.build(env=env))) == {"one"}
    assert set(by_name(Registry.build(allow=["two"], block=[], env=env))) == {"two"}


# ------------------------------------------------------------------------------------------ graded failures
MISSING_NATIVE = """
    from kvbridge.plugin import hookimpl
    from kvbridge.specs import BackendSpec, probe_import

    @hookimpl
    def kvbridge_transfer_backends():
        return [BackendSpec(name="warpdrive", factory="kvbridge_warpdrive_native_xyz:Engine",
                            probe=lambda: probe_import("kvbridge_warpdrive_native_xyz",
                                                       "pip install warpdrive"))]
"""
BROKEN_AT_LOAD = """
    import kvbridge
    def helper():
        raise RuntimeError("broken plugin: cannot initialise")
    helper()
"""
BROKEN_DISCOVERY = """
    from kvbridge.plugin import hookimpl

    @hookimpl
    def kvbridge_state_types():
        return [1 / 0]
"""


def test_missing_native_library_is_unavailable_with_hint_and_not_fatal(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-warpdrive", "0.3", {"warpdrive": "fake_warpdrive"},
              {"fake_warpdrive": MISSING_NATIVE})
    registry = Registry.build(env={})
    row = by_name(registry)["warpdrive"]
    assert row.status is PluginStatus.UNAVAILABLE and row.kind is PluginKind.BACKEND
    assert "kvbridge_warpdrive_native_xyz" in row.reason and row.hint == "pip install warpdrive"
    assert row.as_json()["status"] == "unavailable"
    assert "warpdrive" not in registry.backend_names()
    assert "warpdrive" in registry.backend_names(available_only=False)
    with pytest.raises(PluginUnavailableError, match="hint: pip install warpdrive"):
        registry.create_backend("warpdrive", name="w")
    assert by_name(registry)["loopback"].status is PluginStatus.AVAILABLE


def test_plugin_raising_at_load_is_an_error_with_traceback_and_not_fatal(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-broken", "9.9", {"broken": "fake_broken"}, {"fake_broken": BROKEN_AT_LOAD})
    fake_dist("kvbridge-badhook", "1.0", {"badhook": "fake_badhook"}, {"fake_badhook": BROKEN_DISCOVERY})
    rows = by_name(Registry.build(env={}))
    broken = rows["broken"]
    assert (broken.status, broken.distribution, broken.version) == (
        PluginStatus.ERROR, "kvbridge-broken", "9.9")
    assert broken.reason == "RuntimeError: broken plugin: cannot initialise"
    assert "Traceback" in broken.hint and "fake_broken.py" in broken.hint and "in helper" in broken.hint
    bad = rows["badhook"]
    assert bad.status is PluginStatus.ERROR and "ZeroDivisionError" in bad.reason and "Traceback" in bad.hint
    assert rows["loopback"].status is PluginStatus.AVAILABLE and rows["kv"].status is PluginStatus.AVAILABLE


OPERATION_ANSWERER = """
    from kvbridge.plugin import hookimpl

    @hookimpl
    def kvbridge_send_component(backend, transfer):
        return "I answer every send"
"""


def test_operation_hook_without_wrapper_is_refused() -> None:
    class Answerer:
        @hookimpl
        def kvbridge_send_component(self, backend: Any, transfer: Any) -> str:
            return "hijacked"

    with pytest.raises(PluginError, match="kvbridge_send_component without wrapper=True"):
        Registry.build(plugins=[Answerer()], env={})


def test_installed_plugin_answering_an_operation_is_listed_as_error(fake_dist: FakeDist) -> None:
    fake_dist("kvbridge-hijack", "1.0", {"hijack": "fake_hijack"}, {"fake_hijack": OPERATION_ANSWERER})
    registry = Registry.build(env={})
    row = by_name(registry)["hijack"]
    assert row.status is PluginStatus.ERROR and "without wrapper=True" in row.reason
    # and it was not left registered: sends still reach the backend
    backend = _MemoBackend(name="memo-h")
    assert registry.send_component(backend, _transfer()) == Poll.done() and backend.sent == 1


# ------------------------------------------------------------------------------------------ wrappers
class _MemoBackend:
    """A tiny in-test backend: counts sends, moves nothing."""

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        self.name = "memo"
        self.endpoint = name.encode()
        self.sent = 0

    def register_buffers(self, component: str, regions: Any) -> RegisteredBuffers:
        return RegisteredBuffers(component, tuple(regions))

    def deregister_buffers(self, registered: RegisteredBuffers) -> None: ...
    def add_peer(self, peer: PeerInfo) -> str: return peer.name
    def remove_peer(self, peer_id: str) -> None: ...

    def send_component(self, transfer: ComponentTransfer) -> Poll:
        self.sent += 1
        return Poll.done()

    def poll(self, handle: Any) -> Poll: return handle
    def release(self, handle: Any) -> None: ...
    def notify_completion(self, peer_id: str, notice: bytes) -> bool: return False
    def drain_notifications(self) -> list[tuple[str, bytes]]: return []
    def close(self) -> None: ...


class _MemoPlugin:
    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="memo", factory=_MemoBackend)]


class _SendCounter:
    def __init__(self) -> None:
        self.sends: Counter[str] = Counter()
        self.results: list[Any] = []

    @hookimpl(wrapper=True)
    def kvbridge_send_component(self, backend: Any, transfer: ComponentTransfer) -> Any:
        self.sends[backend.name] += 1
        result = yield
        self.results.append(result)
        return result


def _transfer(regs: RegisteredBuffers | None = None, remote: Any = None, plan: TransferPlan | None = None,
              peer: str = "peer") -> ComponentTransfer:
    regs = regs or RegisteredBuffers("kv", ())
    return ComponentTransfer(room=1, component="kv", peer=peer, chunk=0, last=True, src=regs,
                             dst=remote if remote is not None else regs.remote(),
                             plan=plan or TransferPlan.empty())


def test_wrapper_counts_sends_on_every_backend() -> None:
    counter = _SendCounter()
    registry = Registry.build(plugins=[_MemoPlugin(), counter], env={})
    memo = registry.create_backend("memo", name="memo-0")
    src_backend = registry.create_backend("loopback", name="wrap-src")
    dst_backend = registry.create_backend("loopback", name="wrap-dst")
    try:
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
        regs = registry.register_buffers(src_backend, "kv", [region_of(src)])
        remote = registry.register_buffers(dst_backend, "kv", [region_of(dst)]).remote()
        src_backend.add_peer(PeerInfo("d0", dst_backend.endpoint, (remote,)))
        plan = TransferPlan(np.array([region_of(src).addr + 8], np.uint64),
                            np.array([region_of(dst).addr], np.uint64), np.array([16], np.uint64),
                            np.zeros(1, np.int32))
        for _ in range(3):
            assert registry.send_component(src_backend, _transfer(regs, remote, plan, "d0")) == Poll.done()
        for _ in range(2):
            registry.send_component(memo, _transfer())
        assert counter.sends == Counter({"loopback": 3, "memo": 2})
        assert memo.sent == 2  # exactly one answer per call: the selected backend's
        assert dst[:16].tolist() == list(range(8, 24)) and not dst[16:].any()
        assert counter.results == [Poll.done()] * 5
    finally:
        src_backend.close()
        dst_backend.close()


def test_operation_goes_to_the_backend_selected_by_name_not_install_order() -> None:
    first, second = Registry.build(plugins=[_MemoPlugin(), loopback], env={}), \
        Registry.build(plugins=[loopback, _MemoPlugin()], env={})
    for registry in (first, second):
        a, b = registry.create_backend("memo", name="a"), registry.create_backend("memo", name="b")
        registry.send_component(b, _transfer())
        assert (a.sent, b.sent) == (0, 1)


# ------------------------------------------------------------------------------------------ immutability
def test_registry_is_immutable() -> None:
    registry = Registry.build(env={})
    with pytest.raises(AttributeError, match="immutable"):
        registry._records = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        registry.extra = 1  # type: ignore[attr-defined]
    assert isinstance(registry.records(), tuple)
    with pytest.raises(TypeError):
        registry._backends["evil"] = None  # type: ignore[index]
    assert "evil" not in registry.backend_names(available_only=False)


# ------------------------------------------------------------------------------------------ compose
def _layout(order: list[str]) -> PoolLayout:
    comps = []
    for name in order:
        if name == "kv":
            geo = BufferGeometry(name="k.0", num_items=8, item_shape=(4, 2, 8), dtype=DType.BFLOAT16)
            comps.append(Component(name="kv", state_type="kv", buffers=(geo,)))
        else:
            geo = BufferGeometry(name=f"{name}.0", num_items=4, item_shape=(16,), dtype=DType.FLOAT32)
            comps.append(Component(name=name, state_type="tally", buffers=(geo,), index_kind=IndexKind.SLOT))
    return PoolLayout(components=tuple(comps), tp_size=1, tp_rank=0, page_size=4)


@pytest.mark.parametrize("order", [["kv", "ring"], ["ring", "kv"], ["ring", "kv", "extra"]])
def test_compose_follows_the_pool_component_order(order: list[str]) -> None:
    registry = Registry.build(plugins=[_StatesPlugin()], env={})
    types = registry.compose(_layout(order))
    assert [t.name for t in types] == ["kv" if n == "kv" else "tally" for n in order]
    assert all(isinstance(t, StateType) for t in types)


def test_compose_refuses_an_unknown_state_type_and_a_bad_component() -> None:
    registry = Registry.build(env={})
    with pytest.raises(UnknownPluginError, match="no state type named 'tally'"):
        registry.compose(_layout(["kv", "ring"]))
    slot_kv = Component(name="kv", state_type="kv",
                        buffers=(BufferGeometry(name="k.0", num_items=8, item_shape=(4,), dtype=DType.BFLOAT16),),
                        index_kind=IndexKind.SLOT)
    bad = PoolLayout(components=(slot_kv,), tp_size=1, tp_rank=0, page_size=4)
    with pytest.raises(Exception, match="indexed by page"):
        registry.compose(bad)


# ------------------------------------------------------------------------------------------ slice plan memo
class _CountingSlicer:
    """A plugin wrapping the slice hook that counts how often the hook really runs."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(wrapper=True)
    def kvbridge_slice_state(self, state_type: StateType, src: Component, dst: Component, src_rank: Rank,
                             dst_rank: Rank) -> Iterator[None]:
        self.calls += 1
        return (yield)


def _kv(heads: int, options: dict[str, int | str | float] | None = None) -> Component:
    buffers = (BufferGeometry(name="k.0", num_items=8, item_shape=(2, heads, 4), dtype=DType.BFLOAT16,
                              shard=ShardAxis(1, 4)),)
    return Component(name="kv", state_type="kv", buffers=buffers, options=options or {})


def test_slice_plans_are_memoised_per_components_and_ranks_never_shared_across_them() -> None:
    """The hook is pure, so an equal (components, ranks) question is answered from the memo; anything that
    differs (a rank, the TP size, a component's options) is sliced anew, never served another's plan."""
    counter = _CountingSlicer()
    registry = Registry.build(plugins=[counter], env={})
    kv = registry.state_type("kv")
    first = registry.slice_state(kv, _kv(4), _kv(2), Rank(0, 1), Rank(0, 2))
    again = registry.slice_state(kv, _kv(4), _kv(2), Rank(0, 1), Rank(0, 2))   # equal, not the same objects
    assert again is first and counter.calls == 1
    other_rank = registry.slice_state(kv, _kv(4), _kv(2), Rank(0, 1), Rank(1, 2))
    assert counter.calls == 2 and other_rank is not first
    assert [s.src_off.tolist() for s in other_rank.buffers] != [s.src_off.tolist() for s in first.buffers]
    registry.slice_state(kv, _kv(4, {"window": 8}), _kv(2), Rank(0, 1), Rank(0, 2))
    assert counter.calls == 3
    registry.slice_state(kv, _kv(4), _kv(2, {"window": 8}), Rank(0, 1), Rank(0, 2))
    assert counter.calls == 4
    assert registry.slice_state(kv, _kv(4), _kv(2), Rank(0, 1), Rank(0, 2)) is first and counter.calls == 4


def test_a_refused_slice_is_refused_every_time() -> None:
    """An error is never memoised as an answer: the same bad question raises again."""
    counter = _CountingSlicer()
    registry = Registry.build(plugins=[counter], env={})
    kv = registry.state_type("kv")
    odd = Component(name="kv", state_type="kv", buffers=(BufferGeometry(name="k.0", num_items=8, item_shape=(2, 3, 4),
                                                                        dtype=DType.BFLOAT16, shard=ShardAxis(1, 3)),))
    for calls in (1, 2):
        with pytest.raises(UnsupportedTopology, match="3 (units|replicated)"):
            registry.slice_state(kv, odd, odd, Rank(0, 2), Rank(0, 2))
        assert counter.calls == calls


# ------------------------------------------------------------------------------------------ backend check
class _Flaky:
    """A do-nothing backend whose instances lack their ``endpoint`` when asked to (a broken factory)."""

    name = "flaky"

    def __init__(self, *, name: str, options: dict[str, str] | None = None) -> None:
        if not (options or {}).get("broken"):
            self.endpoint = name.encode()

    def register_buffers(self, component: str, regions: Any) -> Any: ...
    def deregister_buffers(self, registered: Any) -> None: ...
    def add_peer(self, peer: Any) -> str: return ""
    def remove_peer(self, peer_id: str) -> None: ...
    def send_component(self, transfer: Any) -> Any: ...
    def poll(self, handle: Any) -> Any: ...
    def release(self, handle: Any) -> None: ...
    def notify_completion(self, peer_id: str, notice: bytes) -> bool: return False
    def drain_notifications(self) -> list[tuple[str, bytes]]: return []
    def close(self) -> None: ...


class _FlakyPlugin:
    @hookimpl
    def kvbridge_transfer_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="flaky", factory=_Flaky, description="test")]


def test_a_backend_class_once_verified_still_has_each_instance_checked() -> None:
    """The Protocol check is remembered per class, but every instance's data attributes are still checked: a
    later instance without an ``endpoint`` is refused, and objects that are no backend never pass."""
    registry = Registry.build(plugins=[_FlakyPlugin()], env={})
    good = registry.create_backend("flaky", name="f-0")
    again = registry.create_backend("flaky", name="f-1")
    try:
        with pytest.raises(PluginError, match="does not implement"):
            registry.create_backend("flaky", name="f-2", options={"broken": "1"})
    finally:
        good.close()
        again.close()

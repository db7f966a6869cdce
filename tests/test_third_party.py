"""A third-party plugin, installed with pip as a stranger would, is found and works.

``examples/ringbuffer-plugin`` (distribution ``kvbridge-example-ringbuffer``) is copied to a temporary
directory and ``pip install --no-deps --no-build-isolation --no-index --target`` puts the built wheel
into a temporary site directory, which is added to ``sys.path`` for this module only (fast, leaves the
venv and the source tree untouched). Then: the registry and a fresh ``kvbridge plugins --json`` list
the ``ringbuffer`` state type from that distribution; ring-buffer components move across TP sizes over
loopback byte for byte; the plugin's ``wrapper=True`` hook saw every send. Afterwards the site
directory is removed from ``sys.path`` and the registry no longer lists the plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from _kvcase import post_component

from kvbridge.errors import GeometryError, IncompatiblePeer
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
from kvbridge.protocol.records import PeerInfo
from kvbridge.registry import Registry
from kvbridge.slicing import target_ranks
from kvbridge.specs import PluginKind, PluginStatus
from kvbridge.testkit import reference as ref

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ringbuffer-plugin"
DIST, PACKAGE = "kvbridge-example-ringbuffer", "kvbridge_example_ringbuffer"
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS")}


def _forget_package() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _installed_here() -> bool:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("third-party")
    source, target = work / "source", work / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # Offline and fast when this venv has setuptools (Python <= 3.11 venvs do); otherwise let pip fetch
    # the build backend into an isolated build environment, as it would for any stranger.
    build = (["--no-build-isolation", "--no-index"] if importlib.util.find_spec("setuptools") is not None
             else [])
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", *build, "--disable-pip-version-check", "--quiet",
         "--target", str(target), str(source)],
        check=False, capture_output=True, text=True, timeout=240, env=CLEAN_ENV)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    # someone may have pip-installed the example into this venv by hand; then "before" and "after"
    # cannot be checked, but everything else still runs against the fresh copy (first on sys.path)
    preinstalled = _installed_here()
    _forget_package()
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        _forget_package()
        shutil.rmtree(work, ignore_errors=True)
    if not preinstalled:  # uninstalled: a new registry no longer finds it
        assert "ringbuffer" not in Registry.build(env={}).state_type_names()


@pytest.fixture
def plugin(site: Path) -> ModuleType:
    module = importlib.import_module(PACKAGE)
    module.reset()
    return module


def test_pip_installed_plugin_is_discovered(site: Path) -> None:
    dist = md.distribution(DIST)
    assert dist.version == "0.1.0"
    entry_points = [(ep.group, ep.name, ep.value) for ep in dist.entry_points]
    assert entry_points == [("kvbridge", "ringbuffer", PACKAGE)]
    registry = Registry.build(env={})
    row = next(r for r in registry.records() if r.name == "ringbuffer")
    assert (row.kind, row.distribution, row.version, row.status) == (
        PluginKind.STATE, DIST, "0.1.0", PluginStatus.AVAILABLE)
    state = registry.state_type("ringbuffer")
    assert type(state).__name__ == "RingBufferState" and state.chunked is False
    # it came from the installed copy, not from the repository's examples/ tree
    assert Path(sys.modules[type(state).__module__].__file__).is_relative_to(site)  # type: ignore[arg-type]


def test_fresh_interpreter_lists_the_plugin(site: Path) -> None:
    path = [str(site), *filter(None, [CLEAN_ENV.get("PYTHONPATH")])]
    env = dict(CLEAN_ENV, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plugins", "--json"], check=False,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(proc.stdout)}
    assert rows["state", "ringbuffer"]["distribution"] == DIST
    assert rows["state", "ringbuffer"]["status"] == "available"
    assert rows["backend", "loopback"]["status"] == rows["state", "kv"]["status"] == "available"


# ------------------------------------------------------------------------------------------ ring buffers
CAPACITY, HEADS, HEAD_DIM = 4, 4, 3


def ring_component(tp: int, num_slots: int, *, capacity: int = CAPACITY) -> Component:
    local = HEADS // tp if HEADS >= tp else 1
    return Component(name="recent", state_type="ringbuffer", buffers=(
        BufferGeometry(name="recent.hidden", num_items=num_slots, item_shape=(capacity, local, HEAD_DIM),
                       dtype=DType.BFLOAT16,
                       shard=ShardAxis(axis=1, total=HEADS)),
        BufferGeometry(name="recent.tokens", num_items=num_slots, item_shape=(capacity,), dtype=DType.INT32),
        BufferGeometry(name="recent.cursor", num_items=num_slots, item_shape=(1,), dtype=DType.INT64),
    ), index_kind=IndexKind.SLOT, options={"capacity": capacity})


def logical_rings(buffer: int) -> np.ndarray:
    """The un-sharded ring of the request in buffer ``buffer``, as bytes (one ring, shape [1, ...])."""
    shape = [(CAPACITY, HEADS, HEAD_DIM * 2), (CAPACITY * 4,), (8,)][buffer]
    coords = np.indices(shape)
    return ref.pattern(5, buffer, *coords)[None]


def rank_rings(buffer: int, tp: int, rank: int) -> np.ndarray:
    logical = logical_rings(buffer)
    return ref.shard_axis(logical, 2, tp, rank) if buffer == 0 else logical


def make_buffers(tp: int, rank: int, num_slots: int, slot: int | None, seed: int) -> list[np.ndarray]:
    out = []
    for b in range(3):
        shape = rank_rings(b, tp, rank).shape[1:]
        buf = ref.background(seed + rank, b, (num_slots, *shape))
        if slot is not None:
            buf[slot] = rank_rings(b, tp, rank)[0]
        out.append(buf)
    return out


@pytest.mark.parametrize("pt, dt", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2), (8, 4)])
def test_ring_buffers_move_across_tp_and_the_wrapper_sees_every_send(plugin: ModuleType, pt: int,
                                                                    dt: int) -> None:
    registry = Registry.build(env={})
    state = registry.state_type("ringbuffer")
    src_comp, dst_comp = ring_component(pt, 5), ring_component(dt, 3)
    for tp, comp in ((pt, src_comp), (dt, dst_comp)):
        assert registry.compose(PoolLayout(components=(comp,), tp_size=tp, tp_rank=0, page_size=16)) == (state,)
    src_slot, dst_slot = state.pair_indices(src_comp, np.array([2]), 0, np.array([1]), 0)
    src = {p: make_buffers(pt, p, 5, 2, 300) for p in range(pt)}
    dst = {d: make_buffers(dt, d, 3, None, 400) for d in range(dt)}
    backends = []
    sends = 0
    try:
        prefill = {p: registry.create_backend("loopback", name=f"ring-p{p}") for p in range(pt)}
        decode = {d: registry.create_backend("loopback", name=f"ring-d{d}") for d in range(dt)}
        backends += [*prefill.values(), *decode.values()]
        src_reg = {p: registry.register_buffers(prefill[p], "recent", [region_of(b) for b in src[p]])
                   for p in src}
        remote = {d: registry.register_buffers(decode[d], "recent", [region_of(b) for b in dst[d]]).remote()
                  for d in dst}
        for d in range(dt):
            for p in target_ranks(pt, dt, d):
                prefill[p].add_peer(PeerInfo(f"d{d}", decode[d].endpoint, (remote[d],)))
                cut = registry.slice_state(state, src_comp, dst_comp, Rank(p, pt), Rank(d, dt))
                if cut.is_empty:
                    continue
                post_component(registry, prefill[p], peer=f"d{d}", src=src_reg[p], dst=remote[d],
                               src_comp=src_comp, dst_comp=dst_comp, cut=cut, src_items=src_slot,
                               dst_items=dst_slot, room=9)
                sends += 1
    finally:
        for backend in backends:
            backend.close()
    assert sends >= dt
    assert plugin.sends_per_backend() == {"loopback": sends}
    for d in range(dt):
        want = make_buffers(dt, d, 3, 1, 400)
        for b in range(3):
            np.testing.assert_array_equal(dst[d][b], want[b], err_msg=f"decode {d} buffer {b}")


def test_ring_geometry_rules(plugin: ModuleType) -> None:
    registry = Registry.build(env={})
    state = registry.state_type("ringbuffer")
    me = Rank(0, 1)
    bad_axis = Component(name="r", state_type="ringbuffer",
                         buffers=(BufferGeometry(name="r.x", num_items=2, item_shape=(4, 8), dtype=DType.FLOAT32,
                                                 shard=ShardAxis(axis=0, total=4)),),
                         index_kind=IndexKind.SLOT, options={"capacity": 4})
    with pytest.raises(GeometryError, match=r"'r\.x'.*ring axis cannot be sharded"):
        state.check_component(bad_axis, me)
    with pytest.raises(GeometryError, match="indexed by slot"):
        state.check_component(Component(name="r", state_type="ringbuffer", buffers=ring_component(1, 2).buffers), me)
    with pytest.raises(GeometryError, match=r"capacity.*got None"):
        state.check_component(Component(name="r", state_type="ringbuffer", buffers=ring_component(1, 2).buffers,
                                        index_kind=IndexKind.SLOT), me)
    with pytest.raises(GeometryError, match=r"'recent\.hidden': ring axis holds 4 entries.*capacity is 5"):
        state.check_component(Component(name="r", state_type="ringbuffer", buffers=ring_component(1, 2).buffers,
                                        index_kind=IndexKind.SLOT, options={"capacity": 5}), me)
    with pytest.raises(IncompatiblePeer, match="capacity 4 on prefill, 8 on decode"):
        state.slice(ring_component(1, 2), ring_component(1, 2, capacity=8), me, me)
    with pytest.raises(GeometryError, match="exactly one ring slot"):
        state.pair_indices(ring_component(1, 2), np.array([0, 1]), 0, np.array([0, 1]), 0)

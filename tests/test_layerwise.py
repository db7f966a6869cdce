"""Layer-wise sends: an engine posts a chunk's pages once per layer group (``Sender.send(pages, layers=...)``).

Byte-exact against the independent reference over loopback and NIXL, equal and different TP sizes,
token-major and head-major, staged and plain, groups in any order; hybrid pools whose state components
(SWA window, Mamba slot) travel with the final group. Coverage is per (item, layer): a missing layer group
never ends in Success (a lost group times out, a group the prefill claims it sent fails at once), and the
prefill refuses a send that breaks the contract before anything moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_hybrid as th
import test_staging_paths as tsp
from test_staging_paths import BACKENDS, NIXL, POOL, World, check, fill, wait

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.agent import decode as decode_module
from kvbridge.agent.layers import buffer_layer, layer_map
from kvbridge.demo.presets import KVModel
from kvbridge.errors import GeometryError, KVBridgeError
from kvbridge.links import LocalHub
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.state.kv import kv_component
from kvbridge.testkit import reference as ref

LAYERS4 = 4
make_world = pytest.fixture(tsp.worlds, name="make_world")


def test_the_layer_map_follows_the_buffer_names() -> None:
    comp = kv_component(layers=(0, 2, 5), page_size=4, kv_heads=2, head_dim=8, tp=1, dtype="bfloat16", num_pages=3)
    lm = layer_map(comp)
    assert lm.ids == (0, 2, 5) and lm.num_layers == 3
    names = [b.name for b in comp.buffers]
    assert [names[b] for b in lm.buffers(range(1, 3))] == ["kv.k.2", "kv.v.2", "kv.k.5", "kv.v.5"]
    assert buffer_layer("kv.12") == 12 and buffer_layer("k") is None
    assert layer_map(comp.__class__(name="x", state_type="kv", buffers=comp.buffers[:1] + (
        comp.buffers[1].__class__(name="odd", num_items=3, item_shape=(4, 2, 8), dtype="bfloat16"),))).num_layers == 1
    with pytest.raises(GeometryError):
        lm.check(range(2, 4), "room 1")
    with pytest.raises(GeometryError):
        lm.check(range(1, 1), "room 1")


def _send_layerwise(senders: list[Any], pages: np.ndarray, splits: list[int], groups: list[range]) -> None:
    bounds = [0, *splits, len(pages)]
    for s in senders:
        for c in range(len(bounds) - 1):
            chunk = pages[bounds[c]: bounds[c + 1]]
            for g, layers in enumerate(groups):
                s.send(chunk, last=c == len(bounds) - 2 and g == len(groups) - 1, layers=layers)


def _open(world: World, room: int, src_pages: np.ndarray, dst_pages: np.ndarray, seed: int) -> tuple[list, list]:
    fill(world, seed, src_pages)
    receivers = [d.receiver(room, "inst") for d in world.decode]
    for rc in receivers:
        rc.send_metadata({"kv": dst_pages})
    senders = [a.sender(room) for a in world.prefill]
    wait(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders))
    return senders, receivers


GROUPS = {"one-by-one": [range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
          "uneven": [range(0, 1), range(1, 3), range(3, 4)],
          "reversed": [range(2, 4), range(0, 2)]}


def _cases() -> list[Any]:
    """Every case over loopback; over NIXL (each agent costs ~0.6 s) the uneven groups, token-major at every
    TP pair and head-major at 2 -> 1 and 1 -> 2."""
    out = []
    for kind in (ref.TOKEN_MAJOR, ref.HEAD_MAJOR):
        for pt, dt in ((1, 1), (2, 1), (1, 2), (4, 2)):
            for mode in ("always", "never"):
                for groups in GROUPS:
                    out.append(pytest.param("loopback", kind, pt, dt, mode, groups))
                    if groups == "uneven" and (kind == ref.TOKEN_MAJOR or (pt, dt) in ((2, 1), (1, 2))):
                        out.append(pytest.param("nixl", kind, pt, dt, mode, groups, marks=NIXL))
    return out


@pytest.mark.parametrize("backend, kind, pt, dt, mode, groups", _cases())
def test_layer_groups_are_byte_exact(make_world: Callable[..., World], backend: str, kind: str, pt: int, dt: int,
                                     mode: str, groups: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = AgentConfig(staging=mode, staging_bytes=1 << 20, staging_piece_bytes=12 << 10)
    world = make_world(backend, kind, pt, dt, prefill=config, decode=config, layers=LAYERS4)
    scattered: list[int] = []
    real = decode_module.scatter_rows

    def counting(*args: Any, **kwargs: Any) -> None:
        scattered.append(len(args[2]))
        real(*args, **kwargs)

    monkeypatch.setattr(decode_module, "scatter_rows", counting)
    rng = np.random.default_rng(pt * 10 + dt)
    src_pages, dst_pages = rng.permutation(POOL)[:9], rng.permutation(POOL)[:9]
    senders, receivers = _open(world, 31, src_pages, dst_pages, 3)
    _send_layerwise(senders, src_pages, [4], GROUPS[groups])
    wait(lambda: all(r.poll() == KVPoll.Success for r in receivers), 60)
    wait(lambda: all(s.safe_to_reuse for s in senders), 60)
    check(world, 3, dst_pages)
    assert sum(r.nbytes for r in receivers) == sum(s.stats[0] for s in senders)
    assert sum(scattered) == (9 * 2 * LAYERS4 * max(1, pt // dt) * dt if mode == "always" else 0)
    for rc in receivers:
        rc.clear()
    for agent in world.prefill + world.decode:
        assert agent.staging is not None and agent.staging.free_bytes == 1 << 20


def test_a_chunk_counts_only_once_every_layer_went(make_world: Callable[..., World]) -> None:
    """Loopback copies at once: after all groups but the last the decode is still Transferring."""
    config = AgentConfig(staging="always", staging_bytes=1 << 20)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=config, decode=config, layers=LAYERS4)
    rng = np.random.default_rng(1)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    senders, receivers = _open(world, 32, src_pages, dst_pages, 4)
    for s in senders:
        for g in range(LAYERS4 - 1):
            s.send(src_pages, layers=range(g, g + 1))
    wait(lambda: all(s.poll() == KVPoll.Transferring and not s._side.get(s.room).busy for s in senders))
    wait(lambda: receivers[0].poll() == KVPoll.Transferring)
    room = world.decode[0].decode.rooms[32]
    # layers 0..2 of both prefill ranks arrive and are counted (the second rank's notices may come a moment later)
    wait(lambda: all(0 < len(room.received.get(key, ())) for key in room.expected))
    assert receivers[0].poll() == KVPoll.Transferring
    for s in senders:
        s.send(src_pages, last=True, layers=range(LAYERS4 - 1, LAYERS4))
    wait(lambda: receivers[0].poll() == KVPoll.Success)
    check(world, 4, dst_pages)


# ------------------------------------------------------------------------------------------- the contract
def test_the_prefill_refuses_sends_that_break_the_layer_contract(make_world: Callable[..., World]) -> None:
    config = AgentConfig(staging_bytes=1 << 20)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 1, prefill=config, decode=config, layers=LAYERS4)
    pages = np.arange(1, 5)
    cases: list[tuple[Callable[[Any], None], type[Exception], str]] = [
        (lambda s: s.send(pages, last=True, layers=range(0, 2)), KVBridgeError, "layers [2, 3] were not sent"),
        (lambda s: (s.send(pages, layers=range(0, 2)), s.send(pages, layers=range(1, 3))), KVBridgeError,
         "layers [1] of this chunk were already sent"),
        (lambda s: (s.send(pages, layers=range(0, 2)), s.send(pages + 1, layers=range(2, 4))), KVBridgeError,
         "names other pages"),
        (lambda s: (s.send(pages, layers=range(0, 2)), s.send(pages)), KVBridgeError, "still misses layers [2, 3]"),
        (lambda s: s.send(pages, layers=range(3, 5)), GeometryError, "outside the 4 layers"),
    ]
    for room, (act, error, text) in enumerate(cases, start=40):
        senders, receivers = _open(world, room, pages, np.arange(10, 14), room)
        with pytest.raises(error, match=text.replace("[", r"\[").replace("]", r"\]")):
            act(senders[0])
        assert senders[0].poll() == KVPoll.Failed
        rc, sd = receivers[0], senders[0]
        wait(lambda rc=rc: rc.poll() == KVPoll.Failed)
        wait(lambda rc=rc, sd=sd: rc.safe_to_reuse and sd.safe_to_reuse)


def _lose_group(world: World, layer: int, keep_numbering: bool) -> None:
    """Make the prefill drop the write (and notice) of one layer group of the KV component: either lost
    in flight (its notice number is used, nothing arrives), or never sent while the numbering carries on
    (the decode then counts every notice up to the one marked last, and layer ``layer`` is missing)."""
    for agent in world.prefill:
        assert agent.prefill is not None
        poster = agent.prefill._poster
        real = poster.post

        def post(room: Any, write: Any, layers: range | None, last: bool, after: Any, real: Any = real) -> None:
            if layers is not None and layer in layers:
                if keep_numbering:
                    room.next_seq(write.peer.agent, "kv")
                return
            real(room, write, layers, last, after)

        poster.post = post  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_lost_layer_group_times_out_and_never_succeeds(make_world: Callable[..., World], mode: str) -> None:
    config = AgentConfig(staging=mode, staging_bytes=1 << 20, waiting_timeout_s=1.5)
    world = make_world("loopback", ref.TOKEN_MAJOR, 2, 1, prefill=config, decode=config, layers=LAYERS4)
    _lose_group(world, 2, keep_numbering=True)
    rng = np.random.default_rng(2)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    senders, receivers = _open(world, 51, src_pages, dst_pages, 5)
    _send_layerwise(senders, src_pages, [3], GROUPS["one-by-one"])
    seen = set()
    while (status := receivers[0].poll()) != KVPoll.Failed:
        seen.add(status)
        assert status != KVPoll.Success
    assert KVPoll.Success not in seen
    assert "waiting timeout" in receivers[0].failure_reason


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_layer_group_claimed_but_not_sent_fails_at_once(make_world: Callable[..., World], mode: str) -> None:
    config = AgentConfig(staging=mode, staging_bytes=1 << 20, waiting_timeout_s=60)
    world = make_world("loopback", ref.TOKEN_MAJOR, 1, 2, prefill=config, decode=config, layers=LAYERS4)
    _lose_group(world, 1, keep_numbering=False)
    rng = np.random.default_rng(3)
    src_pages, dst_pages = rng.permutation(POOL)[:6], rng.permutation(POOL)[:6]
    senders, receivers = _open(world, 52, src_pages, dst_pages, 6)
    _send_layerwise(senders, src_pages, [], GROUPS["uneven"])
    for rc in receivers:
        wait(lambda rc=rc: rc.poll() == KVPoll.Failed)
        assert rc.failure_reason.endswith("sent 0 of 6 kv items (layers [1, 2] missing)"), rc.failure_reason


# ------------------------------------------------------------------------------------------- hybrid pools
KV4 = KVModel(name="kv", layout=ref.TOKEN_MAJOR, total_heads=4, head_dim=8, layers=LAYERS4, page_size=th.P)
POOL_MODELS = (KV4, th.SWA, th.MAMBA)


def _build(registry: Registry, pt: int, dt: int, backend: str, config: AgentConfig) -> th.Hybrid:
    hub = LocalHub()
    src = [th.background(11 + r, POOL_MODELS, pt, r) for r in range(pt)]
    dst = [th.background(97 + r, POOL_MODELS, dt, r) for r in range(dt)]
    pre = [TransferAgent(layout=th.layout(POOL_MODELS, pt, r), buffers=src[r], role=Role.PREFILL,
                         link=hub.link(f"p{r}"), instance="hy", registry=registry, backend=backend, config=config)
           for r in range(pt)]
    dec = [TransferAgent(layout=th.layout(POOL_MODELS, dt, r), buffers=dst[r], role=Role.DECODE,
                         link=hub.link(f"d{r}"), registry=registry, backend=backend, config=config) for r in range(dt)]
    h = th.Hybrid(POOL_MODELS, pt, dt, pre, dec, src, dst, [{k: [b.copy() for b in v] for k, v in d.items()}
                                                           for d in dst])
    for a in pre + dec:
        a.start()
    for d in dec:
        d.connect("hy", timeout_s=30)
    return h


@pytest.fixture
def hybrid() -> Iterator[Callable[..., th.Hybrid]]:
    made: list[th.Hybrid] = []
    registry = Registry.build()

    def make(pt: int, dt: int, backend: str, config: AgentConfig) -> th.Hybrid:
        made.append(_build(registry, pt, dt, backend, config))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pt, dt", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("mode", ["always", "never"])
def test_hybrid_pools_send_state_with_the_final_layer_group(hybrid: Callable[..., th.Hybrid], backend: str, pt: int,
                                                            dt: int, mode: str) -> None:
    h = hybrid(pt, dt, backend, AgentConfig(staging=mode, staging_bytes=1 << 20))
    for index, (seq_len, prefix) in enumerate(((23, 0), (30, 7), (17, 5))):   # fresh, prefix hit, full hit
        req = th.request(index, seq_len, prefix, th.P)
        src, dst = th.allocate(h, req, 1), th.allocate(h, req, 2)
        for r in range(h.pt):
            for m in h.models:
                m.fill(h.src[r][m.name], h.pt, r, req, src[m.name])
        state = {m.name: (src[m.name], m.span(req)[0]) for m in h.models if not m.chunked}
        senders, receivers = th.start(h, req, dst)
        kv = src["kv"]
        for s in senders:
            half = len(kv) // 2
            for chunk, final in ((kv[:half], False), (kv[half:], True)):
                for g in range(LAYERS4):
                    end = final and g == LAYERS4 - 1
                    s.send(chunk, last=end, layers=range(g, g + 1), state=state if end else None)
        th.wait(lambda rs=receivers: all(r.poll() == KVPoll.Success for r in rs), 60)
        th.wait(lambda ss=senders: all(s.poll() == KVPoll.Success for s in ss), 60)
        assert sum(r.nbytes for r in receivers) == sum(s.stats[0] for s in senders)
        for r in range(h.dt):
            for m in h.models:
                for b, (want_items, buf) in enumerate(zip(m.expected(h.dt, r, req), h.dst[r][m.name], strict=True)):
                    want = h.want[r][m.name][b]
                    want[dst[m.name]] = want_items
                    assert np.array_equal(buf, want), f"{pt}->{dt} request {index}: rank {r} {m.name} buffer {b}"
        for s in senders:
            s.clear()
        for rc in receivers:
            rc.clear()

"""Different page sizes on the two sides (#24 item 1): P 16 -> D 64, 64 -> 16, 16 -> 128, 128 -> 16 and pairs whose
sizes do not divide each other, for token-major GQA (replicated heads at TP 4) and MLA, at the TP pairs the kit
sweeps, in chunks, with decode prefix hits that end inside a page of either side.

The reference is independent of kvbridge's sub-pages: every byte is a function of (layer, tensor, token, head,
byte) of the request, written into the prefill's pages at ``token // P`` and expected in the decode's at
``token // D``; tokens the decode holds as its prefix are there before and must stay; pages outside the
request must not change. Tokens past the request's last one in the decode's last page hold nothing (either
side's last page is partly padding).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvbridge.agent import AgentConfig, TransferAgent
from kvbridge.errors import GeometryError, IncompatiblePeer
from kvbridge.geometry import BufferGeometry, Component, DType, IndexKind, PoolLayout, ShardAxis
from kvbridge.handshake import check_compatible
from kvbridge.links import LocalHub
from kvbridge.pattern import pattern, units_held
from kvbridge.protocol.wire import KVPoll, Role
from kvbridge.registry import Registry
from kvbridge.testkit.world import Rank, Room, World, wait_until

HEAD_BYTES = 8          # one head of one token (4 bf16 elements)
GQA_HEADS = 2           # TP 4 replicates each head on two ranks
MLA_BYTES = 16
LAYERS = 2
TOKENS_IN_POOL = 1024
SEED = 11


@dataclass(frozen=True)
class Kind:
    name: str
    layout: str          # "token" (token-major GQA), "head" (head-major GQA) or "mla"

    def tensors(self) -> str:
        return "c" if self.layout == "mla" else "kv"

    def component(self, tp: int, page: int, num_pages: int, *, head_major: bool = False,
                  layers: tuple[int, ...] = tuple(range(LAYERS))) -> Component:
        if self.layout == "mla":
            shape: tuple[int, ...] = (page, MLA_BYTES // 2)
            shard = None
        else:
            heads = len(units_held(GQA_HEADS, tp, 0))
            head_major = head_major or self.layout == "head"
            shape = (heads, page, HEAD_BYTES // 2) if head_major else (page, heads, HEAD_BYTES // 2)
            shard = ShardAxis(axis=0 if head_major else 1, total=GQA_HEADS)
        bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=num_pages, item_shape=shape, dtype=DType.BFLOAT16,
                                    shard=shard) for t in self.tensors() for layer in layers)
        return Component(name=self.name, state_type="kv", buffers=bufs, index_kind=IndexKind.PAGE)

    def token_view(self, buf: np.ndarray, num_pages: int, page: int) -> np.ndarray:
        """``[pages, tokens, bytes of one token]`` over a uint8 buffer (a copy for head-major pages)."""
        if self.layout == "head":
            return buf.reshape(num_pages, -1, page, HEAD_BYTES).transpose(0, 2, 1, 3).reshape(num_pages, page, -1)
        return buf.reshape(num_pages, page, -1)

    def write(self, buf: np.ndarray, num_pages: int, page: int, page_of: np.ndarray, slot: np.ndarray,
              data: np.ndarray) -> None:
        if self.layout == "head":
            view = buf.reshape(num_pages, -1, page, HEAD_BYTES)
            view[page_of, :, slot] = data.reshape(len(data), -1, HEAD_BYTES)
        else:
            buf.reshape(num_pages, page, -1)[page_of, slot] = data


KINDS = (Kind("gqa", "token"), Kind("hm", "head"), Kind("mla", "mla"))


def token_bytes(kind: Kind, layer: int, tensor: int, tokens: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """What ``rank`` of TP ``tp`` holds of ``tokens``: uint8 ``[n, bytes of one token]`` (heads, then bytes)."""
    t = tokens.reshape(-1, 1, 1)
    if kind.layout == "mla":
        latent = pattern(SEED, layer, tensor, t, 0, np.arange(MLA_BYTES).reshape(1, 1, -1))
        return latent.reshape(len(tokens), MLA_BYTES)
    heads = np.asarray(units_held(GQA_HEADS, tp, rank)).reshape(1, -1, 1)
    return pattern(SEED, layer, tensor, t, heads, np.arange(HEAD_BYTES).reshape(1, 1, -1)).reshape(
        len(tokens), heads.size * HEAD_BYTES)


class Pool:
    """One rank's buffers (uint8 ``[pages, page bytes]``), background noise everywhere."""

    def __init__(self, tp: int, rank: int, page: int, rng: np.random.Generator, device: str | None = None,
                 layers: tuple[int, ...] = tuple(range(LAYERS))) -> None:
        self.tp, self.rank, self.page, self.device, self.layers = tp, rank, page, device, layers
        self.num_pages = TOKENS_IN_POOL // page
        self.layout = PoolLayout(components=tuple(k.component(tp, page, self.num_pages, layers=layers) for k in KINDS),
                                 tp_size=tp, tp_rank=rank, page_size=page, model="repaging")
        self.buffers = {c.name: [rng.integers(0, 256, (g.num_items, g.item_nbytes), dtype=np.uint8)
                                 for g in c.buffers] for c in self.layout.components}
        self.on_device: dict[str, list[Any]] = {}
        if device is not None:               # the registered memory is on the GPU; ``buffers`` is its host copy
            import torch

            self.on_device = {n: [torch.from_numpy(b).to(device) for b in bufs] for n, bufs in self.buffers.items()}

    def arrays(self) -> dict[str, list[object]]:
        return {name: list(bufs) for name, bufs in (self.on_device or self.buffers).items()}

    def push(self) -> None:
        for name, bufs in self.on_device.items():
            for host, dev in zip(self.buffers[name], bufs):
                dev.copy_(torch_of(host, dev.device))

    def pull(self) -> None:
        for name, bufs in self.on_device.items():
            for host, dev in zip(self.buffers[name], bufs):
                host[...] = dev.cpu().numpy()

    def tokens(self, pages: np.ndarray, first_token: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Page index and slot of each token of ``pages`` (listed from token ``first_token`` on)."""
        tokens = first_token + np.arange(len(pages) * self.page)
        return pages[(tokens - first_token) // self.page], tokens % self.page, tokens

    def write_tokens(self, pages: np.ndarray, first_token: int, upto: int | None = None) -> None:
        page_of, slot, tokens = self.tokens(pages, first_token)
        keep = tokens < upto if upto is not None else np.ones(len(tokens), bool)
        if not keep.any():
            return
        for kind in KINDS:
            for b, (t, layer) in enumerate(itertools.product(range(len(kind.tensors())), self.layers)):
                data = token_bytes(kind, layer, t, tokens[keep], self.tp, self.rank)
                kind.write(self.buffers[kind.name][b], self.num_pages, self.page, page_of[keep], slot[keep], data)

    def close(self) -> None:
        pass


def torch_of(array: np.ndarray, device: Any) -> Any:
    import torch

    return torch.from_numpy(array).to(device)


def _pages(rng: np.random.Generator, pool: Any, count: int) -> np.ndarray:
    return rng.permutation(pool.num_pages)[:count].astype(np.int64)


def run_request(world: World, pt: int, dt: int, room: int, p_page: int, d_page: int, tokens: int, prefix: int,
                chunks: int, rng: np.random.Generator, mode: str = "whole", stages: Sequence[Any] = (),
                length: bool = False) -> None:
    """One request of ``tokens`` tokens whose decode holds its first ``prefix``; checks every decode rank.
    ``mode``: "whole" chunks; "layerwise" (each chunk layer by layer); "held" (every chunk from position 0 sent
    with ``from_start=True`` before the decode asked: the core holds them and drops the decode's prefix).
    ``stages``: more decode ranks (another pipeline stage's, ``.agent`` and ``.pool``) that ask for the room too.
    ``length``: the decode gives the request's length (``send_metadata(tokens=)``)."""
    d_first = prefix // d_page                      # both sides list pages from the one holding the prefix end
    p_first = 0 if mode == "held" else prefix // p_page
    d_count = -(-tokens // d_page) - d_first
    p_count = -(-tokens // p_page) - p_first
    decode_ranks = [*world.decode[dt], *stages]
    dec_pools = [r.pool for r in decode_ranks]
    d_pages = _pages(rng, dec_pools[0], d_count)
    before = []
    for pool in dec_pools:                        # the decode's cached prefix is in place already
        pool.write_tokens(d_pages, d_first * d_page, upto=prefix)
        pool.push()
        before.append({n: [b.copy() for b in bufs] for n, bufs in pool.buffers.items()})
    p_pages = _pages(rng, world.prefill[pt][0].pool, p_count)
    for r in world.prefill[pt]:
        r.pool.write_tokens(p_pages, p_first * p_page)
        r.pool.push()
    cuts = [c for c in np.array_split(p_pages, chunks) if len(c)] or [p_pages[:0]]
    metadata = {k.name: d_pages for k in KINDS}
    senders = [p.agent.sender(room) for p in world.prefill[pt]]
    if mode == "held":
        for k, cut in enumerate(cuts):
            for sender in senders:
                sender.send(cut, last=k == len(cuts) - 1, from_start=True)
    receivers = [d.agent.receiver(room, world.instance(pt)) for d in decode_ranks]
    for receiver in receivers:
        receiver.send_metadata(metadata, prefix_len=prefix, tokens=tokens if length else None)
    opened = Room(world, pt, dt, room, senders, receivers)
    if mode != "held":
        wait_until(lambda: all(s.poll() >= KVPoll.WaitingForInput for s in senders), 10.0, opened.describe)
        if mode == "layerwise":
            for k, cut in enumerate(cuts):
                for layer in range(LAYERS):
                    for sender in opened.senders:
                        sender.send(cut, last=k == len(cuts) - 1 and layer == LAYERS - 1,
                                    layers=range(layer, layer + 1))
        else:
            opened.send(cuts)
    opened.wait_success(20.0)
    for pool in dec_pools:
        pool.pull()
    for pool, old in zip(dec_pools, before):
        page_of, slot, all_tokens = pool.tokens(d_pages, d_first * d_page)
        real = all_tokens < tokens
        others = np.setdiff1d(np.arange(pool.num_pages), d_pages)
        for kind in KINDS:
            for b, (t, layer) in enumerate(itertools.product(range(len(kind.tensors())), pool.layers)):
                got = kind.token_view(pool.buffers[kind.name][b], pool.num_pages, pool.page)
                want = token_bytes(kind, layer, t, all_tokens[real], pool.tp, pool.rank)
                bad = np.flatnonzero((got[page_of[real], slot[real]] != want).any(axis=1))
                where = (f"P {p_page} -> D {d_page}, TP {pt} -> {dt}, {tokens} tokens, prefix {prefix}, decode rank "
                         f"{pool.rank} {kind.name} buffer {b}")
                assert not bad.size, f"{where}: tokens {all_tokens[real][bad][:6].tolist()} differ"
                assert np.array_equal(pool.buffers[kind.name][b][others], old[kind.name][b][others]), \
                    f"{where}: a page outside the request changed"
    opened.settle(10.0)


def one_request_per_pair(world: World, pairs: list[tuple[int, int]], p_page: int, d_page: int,
                         rng: np.random.Generator) -> None:
    """One chunked request per TP pair with a prefix hit ending inside a page, then the world closed."""
    try:
        for room, (pt, dt) in enumerate(pairs, start=1):
            big = max(p_page, d_page)
            run_request(world, pt, dt, room, p_page, d_page, 3 * big + 7, big + 3, 2, rng)
    finally:
        world.close()


PAGE_PAIRS = [(16, 64), (64, 16), (16, 128), (128, 16), (48, 32), (24, 64)]
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 4), (4, 1), (4, 4)]   # the kit's sweep


def _world(pairs: list[tuple[int, int]], p_page: int, d_page: int, rng: np.random.Generator, backend: str = "loopback",
           devices: tuple[str, str] | None = None, decode_layers: tuple[int, ...] = tuple(range(LAYERS)),
           **config: object) -> World:
    def pool(role: Role, tp: int, r: int) -> Pool:
        prefill = role is Role.PREFILL
        return Pool(tp, r, p_page if prefill else d_page, rng, devices[0 if prefill else 1] if devices else None,
                    tuple(range(LAYERS)) if prefill else decode_layers)

    return World(registry=Registry.build(), backend=backend, pairs=pairs, make_pool=pool,
                 config=AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=10.0, bootstrap_timeout_s=10.0,
                                    waiting_timeout_s=10.0, **config),  # type: ignore[arg-type]
                 label=f"repage-{p_page}-{d_page}")


@pytest.mark.parametrize("p_page, d_page", PAGE_PAIRS, ids=[f"P{p}-D{d}" for p, d in PAGE_PAIRS])
def test_pages_of_other_sizes_arrive_byte_exact_at_every_tp_pair(p_page: int, d_page: int) -> None:
    rng = np.random.default_rng(p_page * 1000 + d_page)
    world = _world(TP_PAIRS, p_page, d_page, rng)
    room = 1
    try:
        for pt, dt in TP_PAIRS:
            big = max(p_page, d_page)
            # whole pages of both; a last page partly empty on both; prefix hits ending inside a page of either
            for tokens, prefix, chunks in ((4 * big, 0, 1), (3 * big + 5, 0, 3), (3 * big + 7, big + 3, 2),
                                           (2 * big + 1, min(p_page, d_page) + 1, 2)):
                run_request(world, pt, dt, room, p_page, d_page, tokens, prefix, chunks, rng, length=room % 2 == 0)
                room += 1
    finally:
        world.close()


@pytest.mark.parametrize("p_page, d_page", [(16, 64), (64, 16), (48, 32)], ids=["P16-D64", "P64-D16", "P48-D32"])
def test_nixl_writes_sub_pages_byte_exact(p_page: int, d_page: int) -> None:
    """The same over real NIXL (UCX, host memory): one-plane sub-pages go in NIXL's prepped form, several-plane
    ones (head-major) as listed descriptors."""
    pytest.importorskip("nixl")
    rng = np.random.default_rng(p_page + d_page)
    pairs = [(2, 1), (1, 2), (1, 1)]
    world = _world(pairs, p_page, d_page, rng, backend="nixl", staging="never",
                   backend_options={"progress_thread": "false"})
    one_request_per_pair(world, pairs, p_page, d_page, rng)


@pytest.mark.parametrize("p_page, d_page", [(16, 64), (64, 16), (48, 32)], ids=["P16-D64", "P64-D16", "P48-D32"])
def test_gpu_sub_pages_between_two_gpus_with_checksums(p_page: int, d_page: int) -> None:
    """Prefill ranks' pools on cuda:0, decode's on cuda:1 (one GPU: both on it), over NIXL: token-major, head-major
    and MLA sub-pages byte-exact, with the per-destination checksums computed on the GPUs (gathered copies of
    head-major sub-pages included). Skipped without CUDA."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kvbridge_nixl = pytest.importorskip("kvbridge_nixl")
    if not kvbridge_nixl.probe().available:
        pytest.skip("nixl unavailable")
    rng = np.random.default_rng(p_page * 3 + d_page)
    pairs = [(2, 1), (1, 2), (2, 2)]
    devices = ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    world = _world(pairs, p_page, d_page, rng, backend="nixl", devices=devices, checksums=True)
    one_request_per_pair(world, pairs, p_page, d_page, rng)


@pytest.mark.parametrize("mode", ["layerwise", "held"])
@pytest.mark.parametrize("p_page, d_page", [(16, 64), (64, 16), (48, 32)], ids=["P16-D64", "P64-D16", "P48-D32"])
def test_layer_wise_and_held_sends_with_pages_of_other_sizes(p_page: int, d_page: int, mode: str) -> None:
    """Layer-wise sends (each chunk layer by layer) and sends held from position 0 before the decode asked, with
    prefix hits ending inside a page of either side."""
    rng = np.random.default_rng(p_page + 2 * d_page)
    pairs = [(2, 1), (1, 2), (2, 4)]
    world = _world(pairs, p_page, d_page, rng)
    try:
        room = 1
        for pt, dt in pairs:
            big = max(p_page, d_page)
            for tokens, prefix in ((3 * big + 7, big + 3), (2 * big, 0), (big + 1, min(p_page, d_page) - 1)):
                run_request(world, pt, dt, room, p_page, d_page, tokens, prefix, 3, rng, mode)
                room += 1
    finally:
        world.close()


@pytest.mark.parametrize("p_page, d_page", [(16, 64), (64, 16), (48, 32)], ids=["P16-D64", "P64-D16", "P48-D32"])
def test_decode_pipeline_stages_with_pages_of_another_size(p_page: int, d_page: int) -> None:
    """Decode PP with another split: two decode stages, each holding one of the prefill's two layers, with another
    page size; each receives exactly its layer, byte-exact, in chunks and layer by layer, checksums on."""
    rng = np.random.default_rng(p_page + d_page)
    pairs = [(2, 1), (1, 2)]
    world = _world(pairs, p_page, d_page, rng, decode_layers=(0,), checksums=True)
    second: dict[int, list[Rank]] = {}
    try:
        for dt in sorted({d for _, d in pairs}):            # stage 2 of each decode instance: layer 1 only
            second[dt] = []
            for r in range(dt):
                pool = Pool(dt, r, d_page, rng, layers=(1,))
                agent = TransferAgent(layout=pool.layout, buffers=pool.arrays(), role=Role.DECODE,
                                      link=world.hub.link(f"stage2-tp{dt}-r{r}"), backend="loopback",
                                      registry=world.registry, name=f"stage2-tp{dt}-r{r}", config=world.config)
                second[dt].append(Rank(agent, pool))
                agent.start()
                for pt in sorted({p for p, d in pairs if d == dt}):
                    agent.connect(world.instance(pt), timeout_s=10.0)
        room = 1
        for pt, dt in pairs:
            big = max(p_page, d_page)
            for mode in ("whole", "layerwise"):
                run_request(world, pt, dt, room, p_page, d_page, 3 * big + 7, big + 3, 2, rng, mode, second[dt])
                room += 1
    finally:
        for ranks in second.values():
            for rank in ranks:
                rank.agent.close()
        world.close()


def test_checksums_cover_sub_pages() -> None:
    rng = np.random.default_rng(5)
    world = _world([(2, 1), (1, 2)], 64, 16, rng, checksums=True)
    try:
        run_request(world, 2, 1, 1, 64, 16, 200, 20, 2, rng)
        run_request(world, 1, 2, 2, 64, 16, 130, 0, 1, rng)
    finally:
        world.close()
    world = _world([(2, 1)], 16, 64, rng, checksums=True)
    try:
        run_request(world, 2, 1, 3, 16, 64, 200, 70, 3, rng)
    finally:
        world.close()


def test_a_prefill_that_sends_too_few_pages_fails_both_sides_with_the_reason() -> None:
    rng = np.random.default_rng(9)
    world = _world([(1, 1)], 16, 64, rng)
    try:
        d_pages = _pages(rng, world.decode[1][0].pool, 2)            # 128 tokens on the decode
        opened = world.open(1, 1, 7, {k.name: d_pages for k in KINDS}, 10.0)
        with pytest.raises(Exception, match="more than the decode's last page is missing"):
            opened.senders[0].send(np.arange(4), last=True)          # 64 tokens: a whole decode page short
        opened.wait_failed(10.0)
        assert "sent 4 of 8 sub-pages" in opened.senders[0].failure_reason
        opened.settle(10.0)
    finally:
        world.close()


@pytest.mark.parametrize("mode", ["whole", "held"])
def test_a_prefix_past_the_request_s_pages_moves_nothing_and_succeeds(mode: str) -> None:
    """P 6 -> D 4, a 50-token request whose decode holds 54 tokens: neither side lists a page; the empty last chunk
    ends the room on both sides (it named sub-pages [1, 1) of an empty list before, and the decode failed the room
    blaming the prefill while the prefill succeeded; found by an adversarial helper)."""
    rng = np.random.default_rng(36)
    world = _world([(1, 1)], 6, 4, rng)
    try:
        run_request(world, 1, 1, 1, 6, 4, 50, 54, 1, rng, mode)
        run_request(world, 1, 1, 2, 6, 4, 50, 51, 1, rng, mode)
    finally:
        world.close()


def test_decode_ranks_that_disagree_on_their_prefix_fail_the_room_naming_it() -> None:
    """Two decode ranks of one request claiming different cached prefixes (0 and 16 tokens with 64-token decode
    pages, so the same page list) cannot be served by one chunk stream that starts at one prefix: the room fails on
    every side naming the disagreement, and no decode page changes (an adversarial helper found rank 1 getting
    token t at t + 16, and Success)."""
    rng = np.random.default_rng(34)
    world = _world([(1, 2)], 16, 64, rng)
    try:
        dec = [r.pool for r in world.decode[2]]
        pages = _pages(rng, dec[0], 3)
        before = [{n: [b.copy() for b in bufs] for n, bufs in pool.buffers.items()} for pool in dec]
        receivers = [r.agent.receiver(1, world.instance(1)) for r in world.decode[2]]
        for receiver, prefix in zip(receivers, (0, 16)):
            receiver.send_metadata({k.name: pages for k in KINDS}, prefix_len=prefix)
        sender = world.prefill[1][0].agent.sender(1)
        opened = Room(world, 1, 2, 1, [sender], receivers)
        opened.wait_failed(10.0)
        for side in (sender, *receivers):
            assert "disagree on the prefix" in side.failure_reason, side.failure_reason
        opened.settle(10.0)
        for pool, old in zip(dec, before):
            for name, bufs in pool.buffers.items():
                assert all(np.array_equal(b, o) for b, o in zip(bufs, old[name])), f"{name} changed"
    finally:
        world.close()


def test_the_request_length_tells_a_missing_page_from_padding() -> None:
    """Without the request's length, a page list off by less than one page of the larger side looks like the
    padding of a last page (an adversarial helper's cases: a prefill 2 pages short, a decode listing 2 pages too
    few or too many, or listing from before its prefix page, all ended in Success). Given the length
    (``send_metadata(tokens=)``), the decode checks its own lists and succeeds only once every token landed."""
    rng = np.random.default_rng(40)
    world = _world([(1, 1)], 16, 64, rng)
    try:
        run_request(world, 1, 1, 1, 16, 64, 176, 17, 2, rng, length=True)         # honest: byte-exact
        dec = world.decode[1][0]
        receiver = dec.agent.receiver(2, world.instance(1))
        for pages, prefix in ((5, 0), (2, 0), (3, 70)):       # 176 tokens need 3 pages of 64 (2 from token 64)
            with pytest.raises(GeometryError, match=r"pages listed, a 176-token request"):
                receiver.send_metadata({k.name: _pages(rng, dec.pool, pages) for k in KINDS}, prefix_len=prefix,
                                       tokens=176)
        receiver.send_metadata({k.name: _pages(rng, dec.pool, 3) for k in KINDS}, tokens=176)
        sender = world.prefill[1][0].agent.sender(2)
        opened = Room(world, 1, 1, 2, [sender], [receiver])
        wait_until(lambda: sender.poll() >= KVPoll.WaitingForInput, 10.0, opened.describe)
        # 144 tokens of 176, 2 pages short: the length travels (protocol 9), so the prefill refuses its own last
        # chunk too (before it, the decode failed and the prefill reported Success: a split verdict)
        with pytest.raises(GeometryError, match="ends at 9 pages of 16 tokens.*176 tokens .prefix 0. needs 11"):
            sender.send(_pages(rng, world.prefill[1][0].pool, 9), last=True)
        wait_until(lambda: receiver.poll() is KVPoll.Failed and sender.poll() is KVPoll.Failed, 10.0, opened.describe)
        assert "needs 11" in receiver.failure_reason, receiver.failure_reason
        opened.settle(10.0)
        for room, (count, chunks) in enumerate(((12, 2), (13, 1)), start=3):    # one page too many, in one or two
            receiver = dec.agent.receiver(room, world.instance(1))
            receiver.send_metadata({k.name: _pages(rng, dec.pool, 3) for k in KINDS}, tokens=176)
            sender = world.prefill[1][0].agent.sender(room)
            opened = Room(world, 1, 1, room, [sender], [receiver])
            wait_until(lambda s=sender: s.poll() >= KVPoll.WaitingForInput, 10.0, opened.describe)  # type: ignore[misc]
            cuts = np.array_split(_pages(rng, world.prefill[1][0].pool, count), chunks)
            for cut in cuts[:-1]:
                sender.send(cut, last=False)
            with pytest.raises(GeometryError, match=f"ends at {count} pages"):
                sender.send(cuts[-1], last=True)
            wait_until(lambda r=receiver, s=sender: r.poll() is KVPoll.Failed and s.poll() is KVPoll.Failed,  # type: ignore[misc]
                       10.0, opened.describe)
            opened.settle(10.0)
        for mode, prefix in (("layerwise", 17), ("held", 70), ("whole", 64)):   # honest, every way of sending
            run_request(world, 1, 1, 10 + prefix, 16, 64, 176, prefix, 2, rng, mode=mode, length=True)
    finally:
        world.close()
    world = _world([(1, 1)], 64, 16, rng)
    try:
        run_request(world, 1, 1, 1, 64, 16, 100, 0, 1, rng, length=True)
        with pytest.raises(GeometryError, match="5 pages listed, a 100-token request"):
            world.decode[1][0].agent.receiver(2, world.instance(1)).send_metadata(
                {k.name: np.arange(5) for k in KINDS}, tokens=100)
    finally:
        world.close()


def _layout(page: int, *, head_major: bool = False, state_type: str = "kv", flat: bool = False) -> PoolLayout:
    comp = KINDS[0].component(1, page, 16, head_major=head_major)
    if state_type != "kv" or flat:
        import msgspec

        bufs = tuple(msgspec.structs.replace(b, item_shape=(b.item_nbytes // 2,), shard=None) for b in comp.buffers)
        comp = msgspec.structs.replace(comp, state_type=state_type, buffers=bufs if flat else comp.buffers)
    return PoolLayout(components=(comp,), tp_size=1, tp_rank=0, page_size=page, model="repaging")


def test_what_cannot_be_repaged_is_refused_naming_why() -> None:
    check_compatible(_layout(16), _layout(64))
    check_compatible(_layout(16, head_major=True), _layout(64, head_major=True))
    with pytest.raises(IncompatiblePeer, match="has no token planes its state type names"):
        check_compatible(_layout(16, flat=True), _layout(64, flat=True))       # a page of raw bytes: no planes
    with pytest.raises(IncompatiblePeer, match="state type 'ring' cannot pair pages of different sizes"):
        check_compatible(_layout(16, state_type="ring"), _layout(64, state_type="ring"))
    check_compatible(_layout(16, flat=True), _layout(16, flat=True))     # same size: as before


def test_a_decode_whose_pages_have_no_planes_is_refused_at_connect() -> None:
    hub = LocalHub()
    p_layout, d_layout = _layout(16, flat=True), _layout(32, flat=True)

    def arrays(layout: PoolLayout) -> dict[str, list[object]]:
        return {c.name: [np.zeros((g.num_items, g.item_nbytes), np.uint8) for g in c.buffers]
                for c in layout.components}

    with TransferAgent(layout=p_layout, buffers=arrays(p_layout), role=Role.PREFILL, link=hub.link("p"),
                       instance="i") as pre, \
         TransferAgent(layout=d_layout, buffers=arrays(d_layout), role=Role.DECODE, link=hub.link("d")) as dec:
        pre.start()
        with pytest.raises(IncompatiblePeer, match="no token planes"):
            dec.connect("i", timeout_s=5)


def test_prefill_ranks_of_one_instance_with_different_page_sizes_are_refused_at_connect() -> None:
    """A misconfigured prefill instance (TP 2, rank 0 with 16-token pages, rank 1 with 64): a decode rank reading
    from both is refused at connect naming each rank's size (before: connect succeeded and every request failed
    at the decode, the prefill ranks waiting out their bootstrap timeout); a decode rank reading from one rank only
    (TP 2 -> 4) pairs with it as with any page size."""
    rng = np.random.default_rng(5)

    def pool(role: Role, tp: int, r: int) -> Pool:
        return Pool(tp, r, (16, 64)[r] if role is Role.PREFILL else 32, rng)

    config = AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=10.0, bootstrap_timeout_s=10.0)
    with pytest.raises(IncompatiblePeer, match=r"different page sizes \(rank 0: 16, rank 1: 64 tokens\)"):
        World(registry=Registry.build(), backend="loopback", pairs=[(2, 1)], make_pool=pool, config=config,
              label="mixed-pages")
    world = World(registry=Registry.build(), backend="loopback", pairs=[(2, 4)], make_pool=pool, config=config,
                  label="mixed-pages-4")
    world.close()


# ---------------------------------------------------------------------------------------------------- SWA and NSA
WINDOW = 100
NSA_KEY, NSA_SCALE = 8, 4        # bytes per token: keys first, then scales (kvbridge_nsa's two planes)


class StatePool:
    """A hybrid rank: token-major KV pages, SWA window pages (head-major when asked) and NSA indexer pages."""

    def __init__(self, tp: int, rank: int, page: int, rng: np.random.Generator, head_major: bool) -> None:
        from kvbridge_nsa.geometry import nsa_component
        from kvbridge_swa.geometry import swa_component

        self.tp, self.rank, self.page, self.head_major = tp, rank, page, head_major
        self.num_pages = TOKENS_IN_POOL // page
        comps = (KINDS[0].component(tp, page, self.num_pages),
                 swa_component("swa", layers=LAYERS, page_size=page, kv_heads=GQA_HEADS, head_dim=HEAD_BYTES // 2,
                               tp=tp, dtype="bfloat16", num_pages=self.num_pages, window=WINDOW, head_major=head_major),
                 nsa_component("nsa", layers=LAYERS, page_size=page, bytes_per_token=NSA_KEY + NSA_SCALE,
                               num_pages=self.num_pages))
        self.layout = PoolLayout(components=comps, tp_size=tp, tp_rank=rank, page_size=page, model="repaging")
        self.buffers = {c.name: [rng.integers(0, 256, (g.num_items, g.item_nbytes), dtype=np.uint8)
                                 for g in c.buffers] for c in comps}

    def arrays(self) -> dict[str, list[object]]:
        return {name: list(bufs) for name, bufs in self.buffers.items()}

    def expected(self, comp: str, b: int, tokens: np.ndarray) -> np.ndarray:
        layer, tensor = b % LAYERS, b // LAYERS
        if comp == "nsa":
            return pattern(SEED, layer, 9, tokens.reshape(-1, 1), np.arange(NSA_KEY + NSA_SCALE).reshape(1, -1))
        return token_bytes(KINDS[0], layer, tensor + (0 if comp == "gqa" else 2), tokens, self.tp, self.rank)

    def cells(self, comp: str, b: int) -> tuple[np.ndarray, Callable[[np.ndarray, np.ndarray], np.ndarray]]:
        """The buffer, and a function (page, slot) -> [n, bytes of one token] reading or naming its cells."""
        buf, n, p = self.buffers[comp][b], self.num_pages, self.page
        if comp == "nsa":
            keys, scales = buf[:, : p * NSA_KEY].reshape(n, p, NSA_KEY), buf[:, p * NSA_KEY:].reshape(n, p, NSA_SCALE)
            return buf, lambda pg, sl: np.concatenate([keys[pg, sl], scales[pg, sl]], axis=1)
        if comp == "swa" and self.head_major:
            view = buf.reshape(n, -1, p, HEAD_BYTES)
            return buf, lambda pg, sl: view[pg, :, sl].reshape(len(pg), -1)
        view = buf.reshape(n, p, -1)
        return buf, lambda pg, sl: view[pg, sl]

    def write(self, comp: str, pages: np.ndarray, first_page: int, upto: int) -> None:
        tokens = first_page * self.page + np.arange(len(pages) * self.page)
        keep = tokens < upto
        pg, sl = pages[(tokens[keep] - first_page * self.page) // self.page], tokens[keep] % self.page
        for b in range(len(self.buffers[comp])):
            data = self.expected(comp, b, tokens[keep])
            buf, _ = self.cells(comp, b)
            n, p = self.num_pages, self.page
            if comp == "nsa":
                buf[:, : p * NSA_KEY].reshape(n, p, NSA_KEY)[pg, sl] = data[:, :NSA_KEY]
                buf[:, p * NSA_KEY:].reshape(n, p, NSA_SCALE)[pg, sl] = data[:, NSA_KEY:]
            elif comp == "swa" and self.head_major:
                buf.reshape(n, -1, p, HEAD_BYTES)[pg, :, sl] = data.reshape(len(data), -1, HEAD_BYTES)
            else:
                buf.reshape(n, p, -1)[pg, sl] = data

    def check(self, comp: str, pages: np.ndarray, first_page: int, lo: int, hi: int, old: list[np.ndarray],
              where: str) -> None:
        tokens = first_page * self.page + np.arange(len(pages) * self.page)
        keep = (tokens >= lo) & (tokens < hi)
        pg, sl = pages[(tokens[keep] - first_page * self.page) // self.page], tokens[keep] % self.page
        others = np.setdiff1d(np.arange(self.num_pages), pages)
        for b in range(len(self.buffers[comp])):
            buf, read = self.cells(comp, b)
            bad = np.flatnonzero((read(pg, sl) != self.expected(comp, b, tokens[keep])).any(axis=1))
            assert not bad.size, f"{where} {comp} buffer {b}: tokens {tokens[keep][bad][:6].tolist()} differ"
            assert np.array_equal(buf[others], old[b][others]), f"{where} {comp} buffer {b}: a page outside changed"

    def close(self) -> None:
        pass


def run_hybrid(world: World, pt: int, dt: int, room: int, p_page: int, d_page: int, tokens: int,
               rng: np.random.Generator) -> None:
    from kvbridge_nsa.pages import indexer_pages
    from kvbridge_swa.window import window_pages

    dec = [r.pool for r in world.decode[dt]]
    pre = [r.pool for r in world.prefill[pt]]
    kv_d, kv_p = _pages(rng, dec[0], -(-tokens // d_page)), _pages(rng, pre[0], -(-tokens // p_page))
    swa_d, swa_p = window_pages(tokens, WINDOW, d_page), window_pages(tokens, WINDOW, p_page)
    nsa_d, nsa_p = indexer_pages(tokens, d_page), indexer_pages(tokens, p_page)
    dst = {"gqa": kv_d, "swa": _pages(rng, dec[0], swa_d.count), "nsa": _pages(rng, dec[0], nsa_d.count)}
    src = {"gqa": kv_p, "swa": _pages(rng, pre[0], swa_p.count), "nsa": _pages(rng, pre[0], nsa_p.count)}
    for pool in pre:
        pool.write("gqa", src["gqa"], 0, tokens)
        pool.write("swa", src["swa"], swa_p.first, tokens)
        pool.write("nsa", src["nsa"], 0, tokens)
    before = [{n: [b.copy() for b in bufs] for n, bufs in pool.buffers.items()} for pool in dec]
    opened = world.open(pt, dt, room, {"gqa": dst["gqa"], "swa": (dst["swa"], swa_d.first), "nsa": dst["nsa"]}, 10.0)
    half = len(src["gqa"]) // 2
    opened.send([src["gqa"][:half], src["gqa"][half:]],
                state={"swa": (src["swa"], swa_p.first), "nsa": src["nsa"]})
    opened.wait_success(20.0)
    for pool, old in zip(dec, before):
        where = f"P {p_page} -> D {d_page}, TP {pt} -> {dt}, {tokens} tokens, decode rank {pool.rank}:"
        pool.check("gqa", dst["gqa"], 0, 0, tokens, old["gqa"], where)
        pool.check("swa", dst["swa"], swa_d.first, max(0, tokens - WINDOW), tokens, old["swa"], where)
        pool.check("nsa", dst["nsa"], 0, 0, tokens, old["nsa"], where)
    opened.settle(10.0)


@pytest.mark.parametrize("head_major", [False, True], ids=["swa-token-major", "swa-head-major"])
@pytest.mark.parametrize("p_page, d_page", [(16, 64), (64, 16), (48, 32), (24, 64)],
                         ids=["P16-D64", "P64-D16", "P48-D32", "P24-D64"])
def test_swa_window_and_nsa_indexer_pages_of_other_sizes_arrive_byte_exact(p_page: int, d_page: int,
                                                                           head_major: bool) -> None:
    pytest.importorskip("kvbridge_swa")
    pytest.importorskip("kvbridge_nsa")
    rng = np.random.default_rng(p_page * 7 + d_page)
    world = World(registry=Registry.build(), backend="loopback", pairs=TP_PAIRS,
                  make_pool=lambda role, tp, r: StatePool(tp, r, p_page if role is Role.PREFILL else d_page, rng,
                                                          head_major),
                  config=AgentConfig(heartbeat_interval_s=0.1, peer_timeout_s=10.0, bootstrap_timeout_s=10.0,
                                     waiting_timeout_s=10.0), label=f"hybrid-{p_page}-{d_page}")
    room = 1
    try:
        for pt, dt in TP_PAIRS:
            for tokens in (WINDOW // 2, 3 * max(p_page, d_page) + 5, 5 * max(p_page, d_page) - 1):
                run_hybrid(world, pt, dt, room, p_page, d_page, tokens, rng)
                room += 1
    finally:
        world.close()

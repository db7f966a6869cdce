"""Two or more NixlBackend instances in one process: TP reshards byte for byte, notices, bounds, leaks."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from kvbridge.backends.base import ComponentTransfer, HandleState, RegisteredBuffers
from kvbridge.errors import RegionError
from kvbridge.geometry import Rank
from kvbridge.planner import TransferPlan
from kvbridge.protocol.records import PeerInfo
from kvbridge_nixl.backend import NixlBackend
from kvbridge_nixl.options import NixlOptions
from kvbridge_nixl.testing import (
    Side,
    decode_pool,
    expected_decode,
    full_kv,
    make_transfer,
    prefill_pool,
    regions,
    request_pages,
    run_reshard,
    same_bytes,
    wait_done,
    wait_notices,
)

Factory = Callable[[str], NixlBackend]


@pytest.mark.parametrize("pt", [1, 2, 4])
@pytest.mark.parametrize("dt", [1, 2, 4])
def test_token_major_reshard(backends: Factory, pt: int, dt: int) -> None:
    run_reshard(backends, pt, dt, heads=4, seed=10 * pt + dt)


@pytest.mark.parametrize(("pt", "dt"), [(4, 2), (1, 4), (4, 1)])
def test_fewer_heads_than_ranks(backends: Factory, pt: int, dt: int) -> None:
    """Two KV heads over TP 4: replicas; one elected writer per destination."""
    run_reshard(backends, pt, dt, heads=2, seed=100 + pt + dt)


@pytest.fixture()
def pair(backends: Factory):  # type: ignore[no-untyped-def]
    """A prefill and a decode backend with one registered TP-1 pool each, peered."""
    full = full_kv(3, 4)
    src = Side(Rank(0, 1), prefill_pool(full, 1, 0), 4)
    dst = Side(Rank(0, 1), decode_pool(4, 1, 0), 4)
    pb, db = backends("prefill-0"), backends("decode-0")
    preg = pb.register_buffers("kv", regions(src.pool))
    dreg = db.register_buffers("kv", regions(dst.pool))
    info = PeerInfo("decode-0", db.endpoint, (dreg.remote(),))
    pb.add_peer(info)
    yield pb, db, src, dst, preg, info, full
    pb.remove_peer("decode-0")
    pb.deregister_buffers(preg)
    db.deregister_buffers(dreg)


def _shifted(xfer: ComponentTransfer, *, src: int = 0, dst: int = 0) -> ComponentTransfer:
    p = xfer.plan
    plan = TransferPlan(p.src_addr + np.uint64(src), p.dst_addr + np.uint64(dst), p.nbytes, p.buffer)
    return ComponentTransfer(room=xfer.room, component=xfer.component, peer=xfer.peer, chunk=0, last=True,
                             src=xfer.src, dst=xfer.dst, plan=plan, notice=xfer.notice,
                             src_items=xfer.src_items, dst_items=xfer.dst_items, segments=xfer.segments)


def test_out_of_bounds_refused(pair) -> None:  # type: ignore[no-untyped-def]
    pb, _, src, dst, preg, info, _ = pair
    src_idx = np.array([0, 19])
    dst_idx = np.array([1, 19])
    xfer = make_transfer(src, dst, preg, info.component("kv"), "decode-0", src_idx, dst_idx, 1, b"x")
    assert xfer is not None
    page = dst.pool[0][0].nbytes
    with pytest.raises(RegionError, match="destination"):
        pb.send_component(_shifted(xfer, dst=page))          # last page runs past the decode region
    with pytest.raises(RegionError, match="source"):
        pb.send_component(_shifted(xfer, src=1 << 40))
    bad_items = ComponentTransfer(room=1, component="kv", peer="decode-0", chunk=0, last=True, src=preg,
                                  dst=xfer.dst, plan=xfer.plan, notice=b"x",
                                  src_items=xfer.src_items, dst_items=xfer.dst_items + 1, segments=xfer.segments)
    with pytest.raises(RegionError, match="disagree"):
        pb.send_component(bad_items)                         # plan in bounds, structured form lies
    with pytest.raises(RegionError, match="unknown peer"):
        pb.send_component(ComponentTransfer(room=1, component="kv", peer="nobody", chunk=0, last=True,
                                            src=preg, dst=xfer.dst, plan=xfer.plan))
    foreign = RegisteredBuffers("kv", preg.regions, preg.descriptor)
    with pytest.raises(RegionError, match="not registered"):
        pb.send_component(ComponentTransfer(room=1, component="kv", peer="decode-0", chunk=0, last=True,
                                            src=foreign, dst=xfer.dst, plan=xfer.plan))
    assert all((b.view(np.uint8) == 0xA5).all() for b in dst.pool), "a refused transfer wrote bytes"
    assert pb.resources()["handles"] == 0


def test_plan_without_structured_form(pair) -> None:  # type: ignore[no-untyped-def]
    """A plan alone (third-party caller) still moves the right bytes, through one-off descriptor lists."""
    pb, db, src, dst, preg, info, full = pair
    src_idx, dst_idx = request_pages(5, 7)
    xfer = make_transfer(src, dst, preg, info.component("kv"), "decode-0", src_idx, dst_idx, 2, b"plain")
    assert xfer is not None
    bare = ComponentTransfer(room=2, component="kv", peer="decode-0", chunk=0, last=True, src=preg,
                             dst=xfer.dst, plan=xfer.plan, notice=b"plain")
    handle = pb.send_component(bare)
    wait_notices(db, {("prefill-0", b"plain")}, [(pb, handle)])
    wait_done(pb, [handle])
    pb.release(handle)
    assert same_bytes(dst.pool, expected_decode(full, 1, 0, src_idx, dst_idx))


def test_empty_plan_and_standalone_notice(pair) -> None:  # type: ignore[no-untyped-def]
    pb, db, _, _, preg, info, _ = pair
    empty = ComponentTransfer(room=3, component="kv", peer="decode-0", chunk=0, last=True, src=preg,
                              dst=info.component("kv"), plan=TransferPlan.empty(),
                              notice=b"nothing-to-move")
    handle = pb.send_component(empty)
    assert pb.poll(handle).state is HandleState.DONE
    pb.release(handle)
    assert pb.notify_completion("decode-0", b"standalone") is True
    assert pb.notify_completion("nobody", b"x") is False
    wait_notices(db, {("prefill-0", b"nothing-to-move"), ("prefill-0", b"standalone")})


def test_peer_readd_and_endpoint_refresh(backends: Factory) -> None:
    """The endpoint covers regions registered before it was taken; re-adding a peer picks up new ones."""
    db, pb = backends("decode-0"), backends("prefill-0")
    first = db.endpoint
    a = np.zeros(4096, np.uint8)
    reg = db.register_buffers("extra", regions([a]))
    assert db.endpoint != first
    info = PeerInfo("decode-0", db.endpoint, (reg.remote(),))
    assert pb.add_peer(info) == "decode-0"
    assert pb.add_peer(info) == "decode-0"   # identical re-add is a no-op
    pb.remove_peer("decode-0")
    db.deregister_buffers(reg)


def test_options() -> None:
    opts = NixlOptions.parse({"ucx_tls": "tcp", "num_threads": "2", "ucx_config": "UCX_RNDV_THRESH=8k"})
    assert opts.num_threads == 2 and opts.engine_config() == "RNDV_THRESH=8k,TLS=tcp"
    assert opts.engine_config("cuda_copy") == "RNDV_THRESH=8k,TLS=tcp,cuda_copy"
    assert opts.overridden_by_environment({"UCX_TLS": "cma"}) == {"UCX_TLS": "cma"}
    assert NixlOptions.parse({"progress_thread": "0"}).progress_thread is False
    with pytest.raises(ValueError, match="did you mean 'ucx_tls'"):
        NixlOptions.parse({"ucx_tsl": "tcp"})
    with pytest.raises(ValueError, match="num_threads='two'.*expected int >= 0"):
        NixlOptions.parse({"num_threads": "two"})
    with pytest.raises(ValueError, match="ucx_config"):
        NixlOptions.parse({"ucx_config": "TLS"})
    with pytest.raises(ValueError, match="unknown nixl option"):
        NixlOptions.parse({"ucx_tsl": "tcp"})
    with pytest.raises(ValueError, match="sync_mode"):
        NixlOptions.parse({"sync_mode": "sometimes"})


def test_ucx_options_reach_ucx_through_nixl_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """ucx_tls travels as the UCX plugin's engine_config: a transport UCX does not have makes the backend fail
    to start, and the process environment is never written; a UCX_TLS the user exported wins (NIXL's rule)."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    before = dict(os.environ)
    with pytest.raises(Exception, match="NIXL_ERR_BACKEND|No such device|UCX"):
        NixlBackend(name="bogus-tls", options={"ucx_tls": "no_such_transport"})
    assert dict(os.environ) == before
    with NixlBackend(name="tcp-only", options={"ucx_tls": "tcp"}) as backend:
        assert "UCX" in backend._agent.backends
    assert dict(os.environ) == before
    monkeypatch.setenv("UCX_TLS", "tcp")          # the user's choice beats the option
    with NixlBackend(name="env-wins", options={"ucx_tls": "no_such_transport"}) as backend:
        assert "UCX" in backend._agent.backends


def test_registry_lists_nixl() -> None:
    from kvbridge.registry import Registry

    registry = Registry.build(entry_points=True)
    assert "nixl" in registry.backend_names()
    backend = registry.create_backend("nixl", name="via-registry", options={"ucx_tls": "tcp"})
    try:
        assert backend.name == "nixl" and backend.endpoint
    finally:
        backend.close()


def test_derive_side_matches_given_item_sizes() -> None:
    """Item sizes recovered from a plan equal the geometry's (what a core field would carry)."""
    from kvbridge.slicing import buffer_segments
    from kvbridge_nixl.dlists import Pattern, derive_side

    full = full_kv(9, 4)
    src = Side(Rank(1, 2), prefill_pool(full, 2, 1), 4)
    dst = Side(Rank(0, 1), decode_pool(4, 1, 0), 4)
    segs = tuple(buffer_segments(s, d, src.rank, dst.rank) for s, d in zip(src.geometry, dst.geometry))
    pattern = Pattern.of(segs)
    src_reg = RegisteredBuffers("kv", tuple(regions(src.pool)))
    dst_reg = RegisteredBuffers("kv", tuple(regions(dst.pool))).remote()
    for n in (1, 5):
        src_idx, dst_idx = request_pages(n, 5)
        src_idx, dst_idx = src_idx[:n] * (n > 1), dst_idx[:n] * (n > 1)   # n == 1: only item 0 moves
        xfer = make_transfer(src, dst, src_reg, dst_reg, "d", src_idx, dst_idx, 1, b"")
        assert xfer is not None
        bases = np.array([r.addr for r in src_reg.regions], dtype=np.uint64)
        sizes = np.array([r.nbytes for r in src_reg.regions], dtype=np.int64)
        given = [g.item_nbytes for g in src.geometry]
        derived = derive_side(xfer.plan.src_addr, xfer.plan.nbytes, xfer.plan.buffer, bases, sizes, pattern,
                              xfer.src_items, "src")
        told = derive_side(xfer.plan.src_addr, xfer.plan.nbytes, xfer.plan.buffer, bases, sizes, pattern,
                           xfer.src_items, "src", given)
        assert told.item_nbytes.tolist() == given
        if n > 1:
            assert derived.item_nbytes.tolist() == given and derived.count.tolist() == told.count.tolist()


def test_contiguous_pages_post_the_merged_plan(pair) -> None:  # type: ignore[no-untyped-def]
    """Adjacent pages on both sides merge into one descriptor per buffer; NIXL gets those, not one
    descriptor per page (prepped lists never merge), and the bytes are the reference's."""
    pb, db, src, dst, preg, info, full = pair
    src_idx, dst_idx = np.arange(2, 14, dtype=np.int64), np.arange(6, 18, dtype=np.int64)
    xfer = make_transfer(src, dst, preg, info.component("kv"), "decode-0", src_idx, dst_idx, 4, b"merged")
    assert xfer is not None and len(xfer.plan) == len(dst.pool)       # one run per buffer
    handle = pb.send_component(xfer)
    assert handle.ndesc == len(xfer.plan)
    wait_notices(db, {("prefill-0", b"merged")}, [(pb, handle)])
    wait_done(pb, [handle])
    pb.release(handle)
    assert same_bytes(dst.pool, expected_decode(full, 1, 0, src_idx, dst_idx))
    scattered_src, scattered_dst = request_pages(8, 12)
    xfer = make_transfer(src, dst, preg, info.component("kv"), "decode-0", scattered_src, scattered_dst, 5, b"paged")
    assert xfer is not None
    handle = pb.send_component(xfer)
    assert handle.ndesc > len(dst.pool)                                # scattered pages stay prepped
    wait_notices(db, {("prefill-0", b"paged")}, [(pb, handle)])
    wait_done(pb, [handle])
    pb.release(handle)

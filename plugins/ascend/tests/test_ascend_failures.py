"""Refusals, non-blocking sends, injected failures and peer death: backend and stand-in."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvbridge.backends.base import HandleState, Poll
from kvbridge.errors import IncompatiblePeer, PluginUnavailableError, RegionError
from kvbridge.geometry import DeviceKind, MemoryRegion
from kvbridge.planner import TransferPlan
from kvbridge.testkit import connected_backends, page_plan
from kvbridge_ascend import standin
from kvbridge_ascend.backend import AscendBackend, AscendOptions, Protocol, Role
from kvbridge_ascend.codes import SmemCode
from kvbridge_ascend.testing import (
    STANDIN_STORE,
    Model,
    Rig,
    peer_info,
    standin_backend,
    transfer,
    wait,
)

MODEL = Model()


@pytest.fixture(autouse=True)
def _fresh_stores() -> Any:
    yield
    standin.reset()


@pytest.fixture
def pair() -> Any:
    """A prefill rig and a decode rig (TP 1 each), the sender already knowing the receiver."""
    with connected_backends(MODEL, lambda name: standin_backend(name=name), fill=7) as ranks:
        yield ranks
        standin.reset()   # let any held writer go before closing


# ------------------------------------------------------------------------------ backend refusals
def test_out_of_bounds_destination_is_refused_before_posting(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, peer = pair
    monkeypatch.setattr(src.backend._te, "batch_transfer_sync_write", lambda *a: pytest.fail("posted"))
    plan = page_plan(src, dst, 4)
    # every destination moved to just past the end of the highest registered region: outside all of them
    # wherever the allocator placed the arrays (a fixed shift could land in another registered region)
    beyond = max(r.addr + r.nbytes for r in dst.registered.remote().regions)
    bad = TransferPlan(plan.src_addr, plan.dst_addr - plan.dst_addr.min() + np.uint64(beyond), plan.nbytes, plan.buffer)
    with pytest.raises(RegionError, match=r"destination \(kv\) descriptor 0 .* outside every registered region"):
        src.backend.send_component(transfer(src, dst, peer, bad))


def test_unregistered_source_unknown_peer_and_foreign_memory_are_refused(pair: Any) -> None:
    src, dst, peer = pair
    with pytest.raises(RegionError, match="unknown peer 'nobody'"):
        src.backend.send_component(transfer(src, dst, "nobody", page_plan(src, dst, 4)))
    with pytest.raises(RegionError, match="cuda region"):
        src.backend.register_buffers("kv", [MemoryRegion(0x1000, 64, DeviceKind.CUDA, 0)])
    src.backend.deregister_buffers(src.registered)
    with pytest.raises(RegionError, match="not registered with this ascend backend"):
        src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))


def test_a_peer_in_another_config_store_is_refused(pair: Any) -> None:
    src, dst, _ = pair
    other = standin_backend(name="elsewhere", options={"store_url": "tcp://other:2"})
    with pytest.raises(IncompatiblePeer, match="config store 'tcp://other:2'"):
        src.backend.add_peer(peer_info("x", Rig(other, [], [], other.register_buffers("kv", []))))
    other.close()


# --------------------------------------------------------------------------- non-blocking sends
def test_send_returns_while_the_engine_write_is_still_blocked(pair: Any) -> None:
    src, dst, peer = pair
    standin.hold(src.backend.session_id)
    started = time.monotonic()
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    assert time.monotonic() - started < 0.5
    assert src.backend.poll(handle) == Poll.pending() and not dst.arrays[0].any()
    standin.release(src.backend.session_id)
    assert wait(src.backend, handle) == Poll.done()
    assert np.all(dst.arrays[0][:4] == 7)


def test_close_waits_for_a_running_write(pair: Any) -> None:
    src, dst, peer = pair
    standin.hold(src.backend.session_id)
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    src.backend.release(handle)
    threading.Timer(0.1, standin.release, (src.backend.session_id,)).start()
    src.backend.close()
    assert np.all(dst.arrays[0][:4] == 7) and handle.future.result() == 0


# ------------------------------------------------------------------- engine-side failures -> Poll
def test_injected_failure_fails_the_handle_with_the_return_code_and_is_not_sticky(pair: Any) -> None:
    src, dst, peer = pair
    standin.fail_next_writes(src.backend.session_id, 1, SmemCode.TIMEOUT)
    result = wait(src.backend, src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4))))
    assert result.state is HandleState.FAILED and "returned -2004 (SMEM_TIMEOUT)" in result.reason
    again = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    assert wait(src.backend, again) == Poll.done()


def test_dead_peer_fails_with_not_connected(pair: Any) -> None:
    src, dst, peer = pair
    standin.kill(dst.backend.session_id)
    result = wait(src.backend, src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4))))
    assert result.state is HandleState.FAILED and "SMEM_NOT_CONNECTED" in result.reason
    assert dst.backend.session_id in result.reason


def test_a_peer_that_left_the_store_fails_with_not_exist(pair: Any) -> None:
    src, dst, peer = pair
    dst.backend._te.unInitialize()
    result = wait(src.backend, src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4))))
    assert "SMEM_NOT_EXIST" in result.reason


def test_removed_peer_fails_its_pending_handles(pair: Any) -> None:
    src, dst, peer = pair
    standin.hold(src.backend.session_id)
    handle = src.backend.send_component(transfer(src, dst, peer, page_plan(src, dst, 4)))
    src.backend.remove_peer(peer)
    assert "was removed" in src.backend.poll(handle).reason
    standin.release(src.backend.session_id)


def test_notices_go_through_the_control_plane(pair: Any) -> None:
    src, dst, peer = pair
    assert src.backend.notify_completion(peer, b"room 1") is False and dst.backend.drain_notifications() == []


# ------------------------------------------------------------------------------------- options
def test_options_parse_with_env_defaults_and_refuse_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_MF_STORE_URL", "tcp://10.0.0.1:24000")
    monkeypatch.setenv("ASCEND_MF_TRANSFER_PROTOCOL", "DEVICE_RDMA")
    opts = AscendOptions.parse({"role": "decode", "device_id": "3"})
    assert (opts.store_url, opts.protocol, opts.role, opts.device_id) == (
        "tcp://10.0.0.1:24000", Protocol.DEVICE_RDMA, Role.DECODE, 3)
    with pytest.raises(ValueError, match="unknown field `devcie_id`"):
        AscendOptions.parse({"devcie_id": "3"})
    monkeypatch.delenv("ASCEND_MF_STORE_URL")
    with pytest.raises(ValueError, match="needs a config store"):
        AscendOptions.parse({})


def test_initialize_failure_is_reported_as_unavailable_with_the_code() -> None:
    first = standin_backend(name="a", options={"session_id": "10.0.0.5:7000"})
    with pytest.raises(PluginUnavailableError, match=r"initialize\(.*returned -2006 \(SMEM_DUPLICATED\)"):
        standin_backend(name="b", options={"session_id": "10.0.0.5:7000"})
    first.close()
    with pytest.raises(PluginUnavailableError, match="returned -1 .*NPU host"):   # nobody hosts this store
        AscendBackend(name="c", options={"store_url": "tcp://nowhere:9"}, api=standin)


def test_a_drawn_session_id_that_collides_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port behind a session id we pick is not held: the kernel may hand it out again while the first
    engine still holds that session in the store (a kit class failed with SMEM_DUPLICATED so)."""
    import kvbridge_ascend.backend as backend_module

    ports = iter([40001, 40001, 40001, 40002])
    monkeypatch.setattr(backend_module, "_free_port", lambda host: next(ports))
    first = standin_backend(name="a")
    second = standin_backend(name="b")
    try:
        assert (first.session_id, second.session_id) == ("127.0.0.1:40001", "127.0.0.1:40002")
    finally:
        first.close()
        second.close()
    monkeypatch.setattr(backend_module, "_free_port", lambda host: 40003)    # always taken: reported, bounded
    third = standin_backend(name="c")
    try:
        with pytest.raises(PluginUnavailableError, match=r"SMEM_DUPLICATED"):
            standin_backend(name="d")
    finally:
        third.close()


def test_host_store_creates_the_config_store_once() -> None:
    opts = {"store_url": "tcp://127.0.0.1:24111", "host_store": "true", "host": "127.0.0.1"}
    host = AscendBackend(name="h", options=opts, api=standin)
    assert "tcp://127.0.0.1:24111" in standin._STORES
    with pytest.raises(PluginUnavailableError, match=r"create_config_store.*returned -1"):
        AscendBackend(name="h2", options=opts, api=standin)
    host.close()


# ------------------------------------------------------------- the stand-in refuses directly
def test_standin_refuses_what_memfabric_refuses() -> None:
    te = standin.TransferEngine()
    assert te.get_rpc_port() == 0
    buf = np.zeros(256, np.uint8)
    base = buf.ctypes.data
    assert te.batch_register_memory([base, base + 128], [128]) == SmemCode.ERROR
    assert te.batch_register_memory([base], [128]) == 0                      # allowed before initialize
    assert te.batch_transfer_sync_write("x:1", [base], [base], [8]) == SmemCode.ERROR   # not initialised
    assert te.initialize(STANDIN_STORE, "a:1", "Bogus", 0) == SmemCode.ERROR
    assert te.initialize(STANDIN_STORE, "a:1", "Decode", 0) == 0             # Decode hosts the store by default
    assert te.get_rpc_port() == 1
    peer = standin.TransferEngine()
    assert peer.initialize(STANDIN_STORE, "b:2", "Prefill", 0, standin.TransDataOpType.DEVICE_RDMA) == 0
    assert peer.register_memory(base + 128, 128) == 0
    assert te.batch_transfer_sync_write("b:2", [base], [base + 128], [8, 8]) == SmemCode.ERROR
    assert te.batch_transfer_sync_write("c:3", [base], [base + 128], [8]) == SmemCode.NOT_EXIST
    assert te.batch_transfer_sync_write("b:2", [base + 200], [base + 128], [8]) == SmemCode.INVALID_PARAM
    assert te.batch_transfer_sync_write("b:2", [base], [base + 250], [8]) == SmemCode.INVALID_PARAM
    buf[:8] = 9
    assert te.transfer_sync_write("b:2", base, base + 128, 8) == 0 and np.all(buf[128:136] == 9)
    with pytest.raises(TypeError):
        te.initialize(STANDIN_STORE, "d:4", "Decode", 0, 8)   # an int is not a TransDataOpType
    assert te.unregister_memory(base + 1) == SmemCode.NOT_EXIST
    te.destroy()
    peer.destroy()

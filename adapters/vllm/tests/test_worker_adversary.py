"""Adversarial tests of kvbridge-vllm without vLLM: settings, and ``WorkerSide`` on a LocalHub / real ZMQ.

Each test states the promise it attacks; a failure means the promise is broken.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from kvbridge.errors import KVBridgeError  # noqa: E402
from kvbridge.links import LocalHub  # noqa: E402
from kvbridge.protocol.wire import KVPoll  # noqa: E402
from kvbridge.zmq_link import BootstrapServer  # noqa: E402
from kvbridge_vllm.layout import pool_layout  # noqa: E402
from kvbridge_vllm.settings import Settings  # noqa: E402
from kvbridge_vllm.worker import LoadSpec, SaveSpec, WorkerSide  # noqa: E402

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 2, 4, 4, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches(fill: float | None = None) -> dict[str, torch.Tensor]:
    """CPU layout ``[blocks, heads, block_size, 2*head]`` per layer, views into one allocation; with ``fill``
    every block b of layer l holds ``fill + 100*l + b`` (distinct per block and layer)."""
    whole = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    if fill is not None:
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                whole[layer, b] = fill + 100 * layer + b
    return {name: whole[i] for i, name in enumerate(NAMES)}


def pool(c: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    return pool_layout(c, kind="cpu", total_kv_heads=HEADS, tp_size=1, tp_rank=0, block_size=BLOCK)


class Rig:
    """One prefill worker (instance "p") and one decode worker on a LocalHub."""

    def __init__(self, **settings: object) -> None:
        self.hub = LocalHub()
        self.counter = itertools.count()
        # drain_timeout_s 0: closing a rig fails the rooms a test left in flight at once (no test here is about
        # the shutdown drain; it cost 10 s of teardown in each test that leaves one)
        base: dict[str, object] = {"backend": "loopback", "shm_remap": False, "peer_timeout_s": 1.0,
                                   "heartbeat_interval_s": 0.1, "drain_timeout_s": 0.0}
        self.settings = Settings.defaults(**(base | settings))
        self.src = caches(fill=1000.0)
        self.dst = caches()
        self.workers: list[WorkerSide] = []
        self.p = self.prefill()
        self.d = self.decode()

    def link(self):  # type: ignore[no-untyped-def]
        return self.hub.link(f"a{next(self.counter)}")

    def prefill(self, instance: str = "p", src: dict[str, torch.Tensor] | None = None) -> WorkerSide:
        w = WorkerSide(settings=self.settings, pool=pool(src or self.src), produce=True, consume=False,
                       instance=instance, link_factory=self.link)
        self.workers.append(w)
        return w

    def decode(self) -> WorkerSide:
        w = WorkerSide(settings=self.settings, pool=pool(self.dst), produce=False, consume=True, instance="",
                       link_factory=self.link)
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.close()
        # every request a step ended was pointed at by its room's event (or by vLLM, or was being watched): the
        # once-a-second sweep found none on its own
        assert [w.missed_events for w in self.workers] == [0] * len(self.workers)


def wait(done: Callable[[], object], what: str, timeout_s: float = 15) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        got = done()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def block_bytes(c: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [c[name][block].clone() for name in NAMES]


def assert_block_equal(src: dict[str, torch.Tensor], sb: int, dst: dict[str, torch.Tensor], db: int) -> None:
    for name in NAMES:
        torch.testing.assert_close(dst[name][db], src[name][sb], rtol=0, atol=0)


def good_transfer(rig: Rig, p: WorkerSide, req: str, room: int, src_blocks: tuple[int, ...],
                  dst_blocks: tuple[int, ...]) -> None:
    """A correct request end to end; the destination blocks must hold the source blocks, byte for byte."""
    for b in dst_blocks:
        for name in NAMES:
            rig.dst[name][b].zero_()
    p.save(req, SaveSpec(room=room, block_ids=src_blocks))
    rig.d.load(req, LoadSpec(room=room, instance=p.instance, block_ids=dst_blocks, prefix_len=0))
    wait(lambda: req in rig.d.finished([])[1], f"decode's load of {req}")
    assert rig.d.load_errors() == set(), f"{req}: a good request failed to load"
    wait(lambda: req in p.finished([req])[0], f"prefill's release of {req}")
    for s, d in zip(src_blocks, dst_blocks):
        assert_block_equal(rig.src, s, rig.dst, d)


# =============================================================================================== promise 2
@pytest.mark.parametrize("extra", [{"peer_timeout_s": "abc"}, {"heartbeat_interval_s": [1]},
                                   {"bootstrap_timeout_s": {"s": 1}}, {"waiting_timeout_s": None},
                                   {"test_hooks": "maybe"}, {"backend_options": "k=v"}])
def test_settings_wrong_type_names_the_key(extra: dict[str, object]) -> None:
    """Promise: a wrong type in kv_connector_extra_config is refused naming the key (not a bare ValueError
    / TypeError from float())."""
    key = next(iter(extra))
    with pytest.raises(Exception) as info:
        Settings.from_extra(extra)
    assert key in str(info.value), f"{type(info.value).__name__}: {info.value!s} (does not name {key!r})"


@pytest.mark.parametrize("extra", [{"bootstrap": ["tcp://127.0.0.1:1"]}, {"instance": None},
                                   {"backend": {"name": "loopback"}}])
def test_settings_string_keys_refuse_non_strings(extra: dict[str, object]) -> None:
    """Promise: wrong types are refused naming the key. A list/None/dict for a string key is str()-ed into
    a bogus value instead (an instance literally named "None", a bootstrap "['tcp://...']")."""
    key = next(iter(extra))
    with pytest.raises(Exception) as info:
        got = Settings.from_extra(extra)
        pytest.fail(f"accepted {extra} as {key}={getattr(got, key)!r}")
    assert key in str(info.value)


def test_settings_unknown_key_lists_known() -> None:
    with pytest.raises(KVBridgeError) as info:
        Settings.from_extra({"bootstrap_timeout": 5})
    text = str(info.value)
    assert "bootstrap_timeout" in text and "bootstrap_timeout_s" in text and "secret" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("p_secret", "d_secret"), [("alpha", "beta"), ("alpha", "")])
def test_secret_mismatch_refused_with_reason(caplog: pytest.LogCaptureFixture, p_secret: str,
                                             d_secret: str) -> None:
    """Promise: a secret mismatch between prefill and decode is refused with a reason, not a hang. Real
    ZMQ links and bootstrap server (the prefill's secret), decode with another (or no) secret."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    common = {"backend": "loopback", "shm_remap": False, "bootstrap": address, "connect_timeout_s": 2.0,
              "host": "127.0.0.1", "drain_timeout_s": 0.0}
    ps, ds = Settings.defaults(**common, secret=p_secret), Settings.defaults(**common, secret=d_secret)
    server = BootstrapServer(address, secret=ps.secret_bytes).start()
    workers: list[WorkerSide] = []
    try:
        p = WorkerSide(settings=ps, pool=pool(caches(1.0)), produce=True, consume=False, instance="p")
        workers.append(p)
        d = WorkerSide(settings=ds, pool=pool(caches()), produce=False, consume=True, instance="")
        workers.append(d)
        caplog.set_level(logging.WARNING)
        p.save("r", SaveSpec(room=5, block_ids=(0, 1)))
        started = time.monotonic()
        d.load("r", LoadSpec(room=5, instance="p", block_ids=(3, 4), prefix_len=0))
        wait(lambda: "r" in d.finished([])[1], "the decode to give up", timeout_s=20)
        took = time.monotonic() - started
        assert d.load_errors() == {3, 4}
        assert took < 10, f"mismatch took {took:.1f} s to fail"
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "secret" in text.lower(), f"no log names the secret as the reason:\n{text[-2000:]}"
    finally:
        for w in workers:
            w.close()
        server.close()


# =============================================================================================== promise 1
@pytest.mark.timeout(60)
def test_same_room_two_concurrent_prefill_requests_do_not_raise() -> None:
    """Promise: the same room in two concurrent requests (client-chosen "room") must not crash the worker.
    save()/begin_save() run inside vLLM's forward (wait_for_save/save_kv_layer): an exception there kills
    the engine. Both requests must come back from finished() (their blocks freed) and the other requests
    keep being served."""
    rig = Rig(bootstrap_timeout_s=1.0)
    try:
        rig.p.save("a", SaveSpec(room=77, block_ids=(0, 1)))
        try:
            rig.p.save("b", SaveSpec(room=77, block_ids=(2, 3)))
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"second request with room 77 raised from save(): {type(exc).__name__}: {exc}")
        try:
            rig.p.begin_save("c", SaveSpec(room=77, block_ids=(4, 5)))
            rig.p.save_layer("c", 0)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"third request with room 77 raised from begin_save(): {type(exc).__name__}: {exc}")
        released: set[str] = set()
        wait(lambda: released.update(rig.p.finished(["a", "b", "c"])[0]) or released == {"a", "b", "c"},
             "every request's blocks to be released")
        good_transfer(rig, rig.p, "next", 78, (6, 7), (8, 9))
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_same_room_two_concurrent_decode_requests() -> None:
    """Promise: two concurrent decode requests naming the same room: one fails with a load error (its
    blocks reported), the worker keeps serving, and the other gets the right bytes."""
    rig = Rig()
    try:
        rig.p.save("x", SaveSpec(room=21, block_ids=(0, 1)))
        rig.d.load("x", LoadSpec(room=21, instance="p", block_ids=(3, 4), prefix_len=0))
        rig.d.load("y", LoadSpec(room=21, instance="p", block_ids=(5, 6), prefix_len=0))
        done: set[str] = set()
        wait(lambda: done.update(rig.d.finished([])[1]) or done == {"x", "y"}, "both loads to end")
        assert rig.d.load_errors() == {5, 6}
        for s, d in ((0, 3), (1, 4)):
            assert_block_equal(rig.src, s, rig.dst, d)
        assert not rig.dst[NAMES[0]][5].any() and not rig.dst[NAMES[0]][6].any(), "bytes landed in y's blocks"
        good_transfer(rig, rig.p, "next", 22, (2, 3), (7, 8))
    finally:
        rig.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [LoadSpec(room=1, instance="", block_ids=(3, 4), prefix_len=0),
                                  LoadSpec(room=9, instance="nobody", block_ids=(3, 4), prefix_len=0),
                                  LoadSpec(room=424242, instance="p", block_ids=(3, 4), prefix_len=0)],
                         ids=["bad-params", "unknown-instance", "room-prefill-never-had"])
def test_bad_load_fails_with_reason_and_next_is_served(caplog: pytest.LogCaptureFixture, spec: LoadSpec) -> None:
    """Promise: a load that cannot work fails (blocks as load errors) within its timeout, with a logged
    reason, and the next good request on the same workers gets correct bytes."""
    rig = Rig(connect_timeout_s=1.0, waiting_timeout_s=1.5, bootstrap_timeout_s=1.0)
    caplog.set_level(logging.WARNING)
    try:
        started = time.monotonic()
        rig.d.load("bad", spec)
        wait(lambda: "bad" in rig.d.finished([])[1], "the bad load to fail", timeout_s=10)
        assert rig.d.load_errors() == set(spec.block_ids)
        assert time.monotonic() - started < 8
        assert any("bad" in r.getMessage() and "fail" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        assert not rig.dst[NAMES[0]][3].any(), "bytes landed in the failed request's blocks"
        good_transfer(rig, rig.p, "good", 33, (0, 1), (5, 6))
        # the prefill forgot the never-opened room's early request (bounded bookkeeping)
        wait(lambda: not rig.p.prefill.prefill._early, "the prefill to drop the early request", timeout_s=5)  # type: ignore[union-attr]
    finally:
        rig.close()


# =============================================================================================== promise 3
@pytest.mark.timeout(60)
def test_decode_never_asks_prefill_frees_after_bootstrap_timeout() -> None:
    """Promise: a finished prefill request whose decode never asks is released after bootstrap_timeout_s
    (no leak in the worker's bookkeeping or the agent's rooms)."""
    rig = Rig(bootstrap_timeout_s=1.0)
    try:
        rig.p.save("orphan", SaveSpec(room=41, block_ids=(0, 1)))
        assert rig.p.finished(["orphan"])[0] == set()
        started = time.monotonic()
        wait(lambda: "orphan" in rig.p.finished([])[0], "the orphan's blocks to be released", timeout_s=10)
        assert 0.9 <= time.monotonic() - started < 5
        assert rig.p.busy == {"sending": 0, "receiving": 0}
        assert not rig.p.prefill.prefill.rooms  # type: ignore[union-attr]
        good_transfer(rig, rig.p, "next", 42, (2, 3), (4, 5))
    finally:
        rig.close()


def _kill_silently(w: WorkerSide) -> None:
    """What SIGKILL does to a prefill worker, in-process: its threads stop without a goodbye, its backend
    goes (the loopback's liveness socket is freed, as the kernel does for a dead process)."""
    agent = w.prefill
    assert agent is not None
    agent._stop.set()
    if agent._thread is not None:
        agent._thread.join(timeout=5)
    agent.context.backend.close()
    agent.context.link.close()


@pytest.mark.timeout(60)
def test_prefill_killed_mid_transfer_decode_fails_and_serves_next() -> None:
    """Promise: prefill killed while the decode waits for its KV: the decode reports the request's blocks as
    load errors (within the peer timeout, once safe) and serves the next request from another prefill."""
    rig = Rig(peer_timeout_s=1.0, waiting_timeout_s=30.0)
    try:
        rig.p.save("r", SaveSpec(room=51, block_ids=(0, 1), delay_s=60))
        rig.d.load("r", LoadSpec(room=51, instance="p", block_ids=(3, 4), prefix_len=0))
        wait(lambda: rig.p._sending["r"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        _kill_silently(rig.p)
        started = time.monotonic()
        wait(lambda: "r" in rig.d.finished([])[1], "the decode to fail the request", timeout_s=15)
        assert rig.d.load_errors() == {3, 4}
        print(f"decode gave up {time.monotonic() - started:.1f} s after the kill")
        p2 = rig.prefill(instance="p2")
        good_transfer(rig, p2, "next", 52, (5, 6), (7, 8))
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_decode_abort_mid_load_no_bytes_after_release() -> None:
    """Promise: the decode aborts a request mid-load (vLLM passes it in finished_req_ids): once the worker
    reports it (vLLM then frees and reallocates its blocks), no byte lands in them any more."""
    rig = Rig(waiting_timeout_s=30.0)
    try:
        rig.p.save("r", SaveSpec(room=61, block_ids=(0, 1), delay_s=1.0))
        rig.d.load("r", LoadSpec(room=61, instance="p", block_ids=(3, 4), prefix_len=0))
        wait(lambda: rig.p._sending["r"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        done = rig.d.finished(["r"])[1]                       # the abort
        wait(lambda: done or "r" in rig.d.finished([])[1], "the decode to report the aborted request")
        rig.d.load_errors()
        for b in (3, 4):                                        # "reallocated" to another request
            for name in NAMES:
                rig.dst[name][b].fill_(-7.0)
        released = wait(lambda: rig.p.finished(["r"])[0], "the prefill to release the room", timeout_s=10)
        assert released == {"r"}
        time.sleep(0.3)
        for b in (3, 4):
            for name in NAMES:
                assert bool((rig.dst[name][b] == -7.0).all()), f"bytes landed in reallocated block {b}"
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_decode_abort_releases_blocks_and_prefill_room_promptly() -> None:
    """Promise: a decode abort (client disconnect) releases the prefill's room, and the decode's blocks
    come back to vLLM promptly. Here the prefill is slow (its send comes in 8 s): the abort must reach it,
    not wait for bytes nobody wants (or, with a prefill that never sends, for waiting_timeout_s)."""
    rig = Rig(waiting_timeout_s=30.0)
    try:
        rig.p.save("r", SaveSpec(room=71, block_ids=(0, 1), delay_s=8.0))
        rig.d.load("r", LoadSpec(room=71, instance="p", block_ids=(3, 4), prefix_len=0))
        wait(lambda: rig.p._sending["r"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        started = time.monotonic()
        got: set[str] = set(rig.d.finished(["r"])[1])           # vLLM: request r finished (aborted)
        deadline = time.monotonic() + 3.0
        while "r" not in got and time.monotonic() < deadline:
            got |= rig.d.finished([])[1]
            time.sleep(0.02)
        took = time.monotonic() - started
        status = rig.p._sending["r"].sender.poll() if "r" in rig.p._sending else None
        assert "r" in got, (f"aborted request not reported in {took:.1f} s: its blocks stay held until the "
                            f"prefill's data arrives (or waiting_timeout_s); prefill room status {status!r}")
    finally:
        rig.close()


# =============================================================================================== promise 4
@pytest.mark.timeout(60)
def test_wait_for_save_without_save_kv_layer_decode_first() -> None:
    """save() with no save_layer() before it, the decode already waiting: the whole request goes."""
    rig = Rig()
    try:
        rig.d.load("r", LoadSpec(room=81, instance="p", block_ids=(3, 4), prefix_len=0))
        rig.p.begin_save("r", SaveSpec(room=81, block_ids=(0, 1)))
        wait(lambda: rig.p._sending["r"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        rig.p.save("r", SaveSpec(room=81, block_ids=(0, 1)))
        wait(lambda: "r" in rig.d.finished([])[1], "decode's load")
        assert rig.d.load_errors() == set()
        for s, d in ((0, 3), (1, 4)):
            assert_block_equal(rig.src, s, rig.dst, d)
        wait(lambda: "r" in rig.p.finished(["r"])[0], "release")
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_save_layer_twice_posts_each_layer_once() -> None:
    """Layer 0 reported twice, then layer 1 twice: each layer goes once, bytes exact."""
    rig = Rig()
    try:
        rig.d.load("r", LoadSpec(room=82, instance="p", block_ids=(3, 4), prefix_len=0))
        rig.p.begin_save("r", SaveSpec(room=82, block_ids=(0, 1)))
        wait(lambda: rig.p._sending["r"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        rig.p.save_layer("r", 0)
        rig.p.save_layer("r", 0)
        assert rig.p._sending["r"].groups == [(0, 1)]
        rig.p.save_layer("r", 1)
        rig.p.save_layer("r", 1)
        assert rig.p._sending["r"].groups == [(0, 1), (1, 2)]
        rig.p.save("r", SaveSpec(room=82, block_ids=(0, 1)))
        wait(lambda: "r" in rig.d.finished([])[1], "decode's load")
        assert rig.d.load_errors() == set()
        for s, d in ((0, 3), (1, 4)):
            assert_block_equal(rig.src, s, rig.dst, d)
        wait(lambda: "r" in rig.p.finished(["r"])[0], "release")
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_save_layer_out_of_order_never_posts_unwritten_layer() -> None:
    """The last layer is reported before layer 0 was written (vLLM calls in forward order, which the pool's
    numeric layer order matches for plain decoder stacks): save_layer(n) posts every layer up to n."""
    rig = Rig()
    try:
        rig.d.load("o", LoadSpec(room=83, instance="p", block_ids=(5, 6), prefix_len=0))
        rig.p.begin_save("o", SaveSpec(room=83, block_ids=(2, 3)))
        wait(lambda: rig.p._sending["o"].sender.poll() >= KVPoll.WaitingForInput, "the decode's request")
        rig.p.save_layer("o", LAYERS - 1)
        assert all(g[0] > 0 for g in rig.p._sending["o"].groups), \
            f"layer 0 posted before it was written: groups {rig.p._sending['o'].groups}"
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_request_finished_before_its_first_layer_is_released() -> None:
    """vLLM names the request in finished_req_ids before the worker saw any layer of it (odd order): once
    its room ends, the request must still come back from finished() (else its blocks leak forever, since
    vLLM names a finished request only once)."""
    rig = Rig(bootstrap_timeout_s=1.0)
    try:
        assert rig.p.finished(["early"]) == (set(), set())
        rig.p.begin_save("early", SaveSpec(room=84, block_ids=(0, 1)))
        rig.p.save_layer("early", 0)
        rig.p.save("early", SaveSpec(room=84, block_ids=(0, 1)))
        got: set[str] = set()
        deadline = time.monotonic() + 5
        while "early" not in got and time.monotonic() < deadline:
            got |= rig.p.finished([])[0]
            time.sleep(0.02)
        assert "early" in got, f"never released; worker still tracks {list(rig.p._sending)}"
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_a_save_before_the_decode_asks_goes_without_another_prefill_step() -> None:
    """vLLM's usual order: the prefill request finishes, then the decode asks (maybe while the prefill engine is
    idle). The whole request is handed to kvbridge at save, held until the decode's request comes and posted then
    from kvbridge's own thread (the worker has no send thread, and the prefill's get_finished is never called
    here); the decode's one cached block is not sent."""
    rig = Rig()
    try:
        assert not [t for t in threading.enumerate() if t.name == "kvbridge-vllm-send"]
        for b in (5, 6):
            for name in NAMES:
                rig.dst[name][b].zero_()
        rig.p.save("r", SaveSpec(room=81, block_ids=(0, 1, 2)))
        assert rig.p._sending["r"].sender.poll() is KVPoll.Bootstrapping      # nobody asked yet: held
        rig.d.load("r", LoadSpec(room=81, instance="p", block_ids=(5, 6), prefix_len=BLOCK))
        wait(lambda: "r" in rig.d.finished([])[1], "the decode's load, with no prefill step")
        assert rig.d.load_errors() == set()
        assert_block_equal(rig.src, 1, rig.dst, 5)
        assert_block_equal(rig.src, 2, rig.dst, 6)
        assert rig.p._sending["r"].sender.stats[0] == 2 * len(NAMES) * rig.src[NAMES[0]][0].nbytes
        assert wait(lambda: rig.p.finished(["r"])[0], "the prefill's release") == {"r"}
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_the_prompt_length_refuses_a_prefill_a_block_short() -> None:
    """Promise: the decode gives kvbridge the prompt's length (``LoadSpec.tokens``, set by the connector from vLLM's
    counts), so a prefill that sends fewer blocks than the prompt fills fails on both sides, naming the counts,
    instead of the decode reporting a load of blocks that never came; a prefill sending the right count succeeds
    with the length given, a prefix hit included."""
    rig = Rig(peer_timeout_s=5.0, waiting_timeout_s=30.0)
    try:
        rig.p.save("short", SaveSpec(room=61, block_ids=(0, 1)))          # 8 tokens' worth of blocks
        rig.d.load("short", LoadSpec(room=61, instance="p", block_ids=(3, 4, 5), prefix_len=0, tokens=3 * BLOCK - 1))
        wait(lambda: "short" in rig.d.finished([])[1], "the decode to fail the short request")
        assert rig.d.load_errors() == {3, 4, 5}
        sender = rig.p._sending["short"].sender
        wait(lambda: sender.poll() == KVPoll.Failed, "the prefill to refuse its short send")
        assert "page" in sender.failure_reason and "3" in sender.failure_reason, sender.failure_reason
        good = LoadSpec(room=62, instance="p", block_ids=(7, 8), prefix_len=0, tokens=2 * BLOCK)
        rig.p.save("whole", SaveSpec(room=62, block_ids=(5, 6)))
        rig.d.load("whole", good)
        wait(lambda: "whole" in rig.d.finished([])[1], "the decode's load of a whole request")
        assert rig.d.load_errors() == set()
        for s, d in ((5, 7), (6, 8)):
            assert_block_equal(rig.src, s, rig.dst, d)
        # a prefix hit of one block and a half: the decode lists the blocks from the one holding the prefix end
        rig.p.save("hit", SaveSpec(room=63, block_ids=(9, 10, 11)))
        rig.d.load("hit", LoadSpec(room=63, instance="p", block_ids=(12, 13), prefix_len=BLOCK + 2,
                                   tokens=3 * BLOCK))
        wait(lambda: "hit" in rig.d.finished([])[1], "the decode's load after a prefix hit")
        assert rig.d.load_errors() == set()
        for s, d in ((10, 12), (11, 13)):
            assert_block_equal(rig.src, s, rig.dst, d)
    finally:
        rig.close()

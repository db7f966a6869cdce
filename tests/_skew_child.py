"""One rank of a version-skew test (tests/test_version_skew.py), run as ``python tests/_skew_child.py JOB``.

The same script runs against either release: the test starts it with ``PYTHONPATH`` pointing at a tree
extracted from git history (the previous release) or at this one, so it uses only the API both share
(``TransferAgent``, ``ZmqLink``, ``sender``/``receiver``). JOB is one JSON object; the child answers with
``SKEW {json}`` lines on stdout: ``ready`` (which kvbridge it imported, its protocol version), then
``done`` (the room's final status; a decode adds its own comparison of every destination page with the
reference and the pages' SHA-256, which the test recomputes independently). A prefill waits for stdin to
close before it closes its agent (a decode may still be reading its last notice).

The bytes are :func:`reference` pages: NumPy's seeded generator, no kvbridge code involved.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

PAGES, TOKENS, HEADS, HEAD_DIM, LAYERS = 16, 4, 2, 8, 2
ITEM_BYTES = TOKENS * HEADS * HEAD_DIM * 2          # bfloat16


def layout(tp_rank: int = 0) -> Any:
    """The pool both ranks use: TP 1, one KV component of 2 layers x (k, v)."""
    from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis

    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=PAGES, item_shape=(TOKENS, HEADS, HEAD_DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, HEADS))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1,
                      tp_rank=tp_rank, page_size=TOKENS, model="skew")


def reference(seed: int, buffer: int, count: int) -> np.ndarray:
    """``count`` pages of buffer ``buffer``: what the prefill's source pages hold, in request order."""
    rng = np.random.default_rng([seed, buffer])
    return rng.integers(0, 256, size=(count, ITEM_BYTES), dtype=np.uint8)


def shm_buffers(tag: str) -> tuple[list[np.ndarray], str]:
    """The pool's buffers in one /dev/shm segment (loopback writes across processes only into named shared
    memory); the caller unlinks the returned path when done."""
    import mmap
    import os

    path = f"/dev/shm/kvbridge-skew-{os.getpid()}-{tag}"
    count = 2 * LAYERS
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, count * PAGES * ITEM_BYTES)
        area = mmap.mmap(fd, count * PAGES * ITEM_BYTES)
    finally:
        os.close(fd)
    flat = np.frombuffer(area, np.uint8).reshape(count, PAGES, ITEM_BYTES)
    return [flat[b] for b in range(count)], path


def digests(buffers: list[np.ndarray], pages: list[int]) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(buf[pages]).tobytes()).hexdigest() for buf in buffers]


def _say(event: str, **fields: Any) -> None:
    print("SKEW " + json.dumps({"event": event, **fields}), flush=True)


def _wait_status(poll: Any, done: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    status = poll()
    while not done(status) and time.monotonic() < deadline:
        time.sleep(0.002)
        status = poll()
    return status


def main(job: dict[str, Any]) -> None:
    import os

    from kvbridge.wire import Role

    role = Role(job["role"])
    buffers, segment = shm_buffers(role.value)
    try:
        _run(job, role, buffers)
    finally:
        os.unlink(segment)


def _run(job: dict[str, Any], role: Any, buffers: list[np.ndarray]) -> None:
    import kvbridge
    from kvbridge import wire
    from kvbridge.agent import TransferAgent
    from kvbridge.wire import KVPoll, Role
    from kvbridge.zmq_link import ZmqLink

    if role is Role.PREFILL:
        for b, buf in enumerate(buffers):
            buf[job["src_pages"]] = reference(job["seed"], b, len(job["src_pages"]))
    link = ZmqLink(bootstrap=job["bootstrap"])
    agent = TransferAgent(layout=layout(), buffers={"kv": buffers}, role=role, link=link, backend=job["backend"],
                          instance=job["instance"] if role is Role.PREFILL else "", name=job["name"])
    agent.start(0.001)
    _say("ready", kvbridge=kvbridge.__file__, version=wire.PROTOCOL_VERSION, name=agent.name)
    timeout = float(job["timeout_s"])
    finished = (KVPoll.Success, KVPoll.Failed)
    if role is Role.PREFILL:
        sender = agent.sender(job["room"])
        status = _wait_status(sender.poll, lambda s: s >= KVPoll.WaitingForInput or s is KVPoll.Failed, timeout)
        if status is KVPoll.WaitingForInput:
            sender.send(np.asarray(job["src_pages"]), last=True)
            status = _wait_status(sender.poll, lambda s: s in finished, timeout)
        _say("done", status=status.name, reason=sender.failure_reason() if status is KVPoll.Failed else "")
        sys.stdin.read()                        # until the test closes it
    else:
        agent.connect(job["instance"], timeout_s=timeout)
        receiver = agent.receiver(job["room"], job["instance"])
        receiver.send_metadata({"kv": np.asarray(job["dst_pages"])})
        status = _wait_status(receiver.poll, lambda s: s in finished, timeout)
        exact = all(np.array_equal(buf[job["dst_pages"]], reference(job["seed"], b, len(job["dst_pages"])))
                    for b, buf in enumerate(buffers))
        _say("done", status=status.name, reason=receiver.failure_reason() if status is KVPoll.Failed else "",
             exact=exact, digests=digests(buffers, job["dst_pages"]))
    agent.close()


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except BaseException as exc:
        _say("error", text=f"{type(exc).__name__}: {exc}")
        raise

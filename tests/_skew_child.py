"""Ranks of a version-skew test (tests/test_version_skew.py), run as ``python tests/_skew_child.py JOB``.

The same script runs against either release: the test starts it with ``PYTHONPATH`` pointing at a tree
extracted from git history (the previous release), so it uses only the API both share (``TransferAgent``,
``AgentConfig``, ``ZmqLink``, ``sender``/``receiver``). JOB is one JSON object: ``{"bootstrap", "backend",
"timeout_s", "secret"? (hex), "config"? (AgentConfig fields), "ranks": [{"role", "name", "instance", "room",
"seed", "src_pages", "dst_pages", "model"?}, ...]}`` (a prefill and a decode may share the process: NIXL
starts once). The child answers with ``SKEW {json}`` lines on stdout: ``ready`` per rank (which kvbridge and
plugin packages it imported, its protocol version), then ``done`` per rank (the room's final status; a decode
adds its own comparison of every destination page with the reference and the pages' SHA-256, which the test
recomputes independently). Once stdin closes, each rank says ``final`` (the peers it still counts alive, the
frames it rejected) and closes (a decode may read a prefill's last notice until then).

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


def layout(tp_rank: int = 0, model: str = "skew") -> Any:
    """The pool both ranks use: TP 1, one KV component of 2 layers x (k, v)."""
    from kvbridge.geometry import BufferGeometry, Component, DType, PoolLayout, ShardAxis

    bufs = tuple(BufferGeometry(name=f"{t}.{layer}", num_items=PAGES, item_shape=(TOKENS, HEADS, HEAD_DIM),
                                dtype=DType.BFLOAT16, shard=ShardAxis(1, HEADS))
                 for t in "kv" for layer in range(LAYERS))
    return PoolLayout(components=(Component(name="kv", state_type="kv", buffers=bufs),), tp_size=1,
                      tp_rank=tp_rank, page_size=TOKENS, model=model)


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


def _wire() -> Any:
    """The wire module wherever the release keeps it (kvbridge.protocol.wire since wave 3, kvbridge.wire before)."""
    try:
        from kvbridge.protocol import wire
    except ImportError:
        from kvbridge import wire  # type: ignore[attr-defined,no-redef]
    return wire


def main(job: dict[str, Any]) -> None:
    """Start every rank of ``job["ranks"]`` (a prefill and a decode may share the process: one NIXL start),
    run each in a thread, and close them all once stdin closes."""
    import os
    import threading

    import kvbridge
    from kvbridge.agent import AgentConfig, TransferAgent
    from kvbridge.zmq_link import ZmqLink

    wire = _wire()
    Role = wire.Role

    secret = bytes.fromhex(job["secret"]) if job.get("secret") else None
    config = AgentConfig(secret=secret, **job.get("config", {}))

    agents: list[Any] = []
    segments: list[str] = []
    threads: list[threading.Thread] = []
    try:
        for rank in job["ranks"]:
            role = Role(rank["role"])
            buffers, segment = shm_buffers(rank["name"][-12:])
            segments.append(segment)
            if role is Role.PREFILL:
                for b, buf in enumerate(buffers):
                    buf[rank["src_pages"]] = reference(rank["seed"], b, len(rank["src_pages"]))
            agent = TransferAgent(layout=layout(model=rank.get("model", "skew")), buffers={"kv": buffers}, role=role,
                                  link=ZmqLink(bootstrap=job["bootstrap"], secret=secret), backend=job["backend"],
                                  instance=rank["instance"] if role is Role.PREFILL else "", name=rank["name"],
                                  config=config)
            agents.append(agent)
            agent.start()
            plugins = sorted(getattr(m, "__file__", "") or "" for n, m in list(sys.modules.items())
                             if n.startswith("kvbridge_") and "." not in n)
            _say("ready", kvbridge=kvbridge.__file__, plugins=plugins, version=wire.PROTOCOL_VERSION, name=agent.name)
            run = _serve if role is Role.PREFILL else _receive
            threads.append(threading.Thread(target=_reporting, args=(run, agent, rank, buffers, job["timeout_s"]),
                                            daemon=True))
        for thread in threads:
            thread.start()
        sys.stdin.read()                        # until the test closes it
        for thread in threads:
            thread.join(float(job["timeout_s"]))
        for agent in agents:                    # whom it still counts alive (heartbeats understood both ways)
            with agent.context.lock:
                alive = sorted(p.agent for p in agent.peers.peers.values() if p.alive)
            _say("final", name=agent.name, alive=alive, rejected=agent.rejected_frames)
    finally:
        for agent in agents:
            agent.close()
        for segment in segments:
            os.unlink(segment)


def _reporting(run: Any, agent: Any, rank: dict[str, Any], buffers: list[np.ndarray], timeout_s: float) -> None:
    try:
        run(agent, rank, buffers, float(timeout_s))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        _say("error", name=agent.name, text=f"{type(exc).__name__}: {exc}")


def _serve(agent: Any, rank: dict[str, Any], buffers: list[np.ndarray], timeout: float) -> None:
    KVPoll = _wire().KVPoll

    if rank.get("room") is None:
        return                                  # only there to answer Hellos
    sender = agent.sender(rank["room"])
    status = _wait_status(sender.poll, lambda s: s >= KVPoll.WaitingForInput or s is KVPoll.Failed, timeout)
    if status is KVPoll.WaitingForInput:
        sender.send(np.asarray(rank["src_pages"]), last=True)
        status = _wait_status(sender.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), timeout)
    _say("done", name=agent.name, status=status.name,
         reason=sender.failure_reason if status is KVPoll.Failed else "")


def _receive(agent: Any, rank: dict[str, Any], buffers: list[np.ndarray], timeout: float) -> None:
    KVPoll = _wire().KVPoll

    agent.connect(rank["instance"], timeout_s=timeout)
    receiver = agent.receiver(rank["room"], rank["instance"])
    pages = rank["dst_pages"]
    receiver.send_metadata({"kv": np.asarray(pages)})
    status = _wait_status(receiver.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed), timeout)
    exact = all(np.array_equal(buf[pages], reference(rank["seed"], b, len(pages))) for b, buf in enumerate(buffers))
    _say("done", name=agent.name, status=status.name,
         reason=receiver.failure_reason if status is KVPoll.Failed else "", exact=exact,
         digests=digests(buffers, pages))


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except BaseException as exc:
        _say("error", text=f"{type(exc).__name__}: {exc}")
        raise

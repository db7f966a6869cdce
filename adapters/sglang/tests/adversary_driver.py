"""Adversarial rank driver (no tests here): sglang_driver's pools, requests and checks, with hooks that feed the
adapter bad input, abort at chosen stages, and kill / stop a prefill rank at a chosen point.

    python adversary_driver.py '<scenario json>' <role> <dp> <pp> <tp_rank> <result.json>

``sc["adv"]`` (keys are request numbers as strings):
  rooms: {k: room}               both sides use this bootstrap room for request k
  dec:   {k: {kv|aux|slot|dp|abort}}   decode-side bad input / abort stage
  pre:   {k: {kv|aux|slot|abort}}      prefill-side bad input / abort stage
  die:   {pp, tp, k, chunk, how, gen}  the prefill rank (pp, tp) kills (SIGKILL) or stops (SIGSTOP) itself when
                                       about to send chunk ``chunk`` of request k (generation ``gen`` only)
  phase2: n                      the decode runs the last n requests only after the file <result>.go exists
  gen: 1|2                       which generation this process is: a gen-2 prefill serves only phase-2 requests
                                 (with ``serve_all``: every request), a gen-2 decode runs phase 2 at once
  dec_die: {k, gen, after_s}     the decode SIGKILLs itself after_s after send_metadata of request k (that gen)
  pre_delay: {k: seconds}        the prefill waits this long before the first chunk of request k (a slow forward)
  watch_s: seconds               after a failed room turned safe, its destination must stay unchanged this long
Every adapter call is guarded: an exception escaping one is recorded in out["raised"] (the rank goes on).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_driver as D


def _guard(out: dict[str, Any], what: str, fn: Any, *a: Any, **kw: Any) -> Any:
    try:
        return fn(*a, **kw)
    except Exception as exc:   # noqa: BLE001
        out["raised"].append(f"{what}: {type(exc).__name__}: {exc}")
        D.flush(out)
        return _RAISED


_RAISED = object()


def _reqs(sc: dict[str, Any]) -> list[dict[str, Any]]:
    reqs = D.requests(sc)
    adv = sc.get("adv", {})
    for k, room in adv.get("rooms", {}).items():
        reqs[int(k)]["room"] = int(room)
    n2 = adv.get("phase2", 0)
    for r in reqs:
        r["phase"] = 2 if r["k"] >= len(reqs) - n2 else 1
        r["pre"] = adv.get("pre", {}).get(str(r["k"]), {})
        r["dec"] = adv.get("dec", {}).get(str(r["k"]), {})
    return reqs


def _bad(kind: str, good: np.ndarray, pool: int) -> Any:
    if kind == "oob":
        return np.concatenate([good[:-1], np.array([pool + 3], dtype=good.dtype)]) if len(good) else \
            np.array([pool + 3], dtype=np.int32)
    if kind == "neg":
        return np.concatenate([np.array([-1], dtype=good.dtype), good[1:]])
    if kind == "float":
        return good.astype(np.float64) + 0.25
    if kind == "2d":
        return np.stack([good, good])
    if kind == "huge":
        return np.concatenate([good[:-1], np.array([2**40], dtype=np.int64)])
    raise ValueError(kind)


def _die(sc: dict[str, Any], pp: int, tp: int, r: dict[str, Any], chunk: int, out: dict[str, Any]) -> None:
    die = sc.get("adv", {}).get("die")
    if not die or die.get("gen", 1) != sc.get("gen", 1):
        return
    if die["pp"] == pp and die["tp"] == tp and die["k"] == r["k"] and die["chunk"] == chunk:
        out["died"] = {"k": r["k"], "chunk": chunk, "how": die["how"], "at": time.time()}
        D.flush(out)
        os.kill(os.getpid(), signal.SIGKILL if die["how"] == "kill" else signal.SIGSTOP)
        out["resumed_at"] = time.time()
        D.flush(out)


def run_prefill(sc: dict[str, Any], dp: int, pp: int, tp_rank: int, out: dict[str, Any]) -> None:
    mgr, classes, (pools, model, server, KVClassType) = D.setup(sc, "prefill", dp, pp, tp_rank)
    from sglang.srt.disaggregation.base.conn import KVPoll

    P = model.P
    addr = f"127.0.0.1:{sc['port']}"
    gen = sc.get("gen", 1)
    serve_all = sc.get("adv", {}).get("serve_all", False)
    reqs = [r for r in _reqs(sc) if r["dp"] == dp and (serve_all or (r["phase"] == 2) == (gen == 2))]
    out["gen"] = gen
    queue, inflight = [], []
    let_go: list[int] = []          # rooms the scheduler let go (abort(), clear()): kvbridge forgets each once over
    for r in reqs:
        s = _guard(out, f"room {r['room']} k {r['k']} sender()", classes[KVClassType.SENDER], mgr=mgr,
                   bootstrap_addr=addr, bootstrap_room=r["room"], req_has_disagg_prefill_dp_rank=True)
        if s is _RAISED:
            continue
        r["sender"] = s
        if r["pre"].get("abort") == "before_init":
            _guard(out, f"k {r['k']} abort", s.abort)
            let_go.append(r["room"])
        queue.append(r)
    deadline = time.monotonic() + sc.get("timeout", 120)

    def fail(r: dict[str, Any]) -> None:
        try:
            r["sender"].failure_exception()
            out["raised"].append(f"k {r['k']} failure_exception did not raise")
        except Exception as exc:   # noqa: BLE001
            out["failed"][str(r["k"])] = f"{type(exc).__name__}: {exc}"

    while (queue or inflight) and time.monotonic() < deadline:
        for r in list(queue):
            poll = _guard(out, f"k {r['k']} poll", r["sender"].poll)
            if poll is _RAISED or poll == KVPoll.Failed:
                fail(r)
                queue.remove(r)
            elif poll == KVPoll.WaitingForInput:
                queue.remove(r)
                snd = r["sender"]
                prefix = snd.pop_decode_prefix_len()
                num_pages = math.ceil((r["len"] - prefix) / P)
                aux = r["pre"].get("aux", r["aux_p"])
                _guard(out, f"k {r['k']} init", snd.init, num_pages, aux)
                if r["pre"].get("abort") == "after_init":
                    _guard(out, f"k {r['k']} abort", snd.abort)
                    let_go.append(r["room"])
                start = prefix
                bounds = [c for c in r["cuts"] if c > prefix] + [r["len"]]
                time.sleep(float(sc.get("adv", {}).get("pre_delay", {}).get(str(r["k"]), 0.0)))
                for ci, end in enumerate(bounds):
                    last = ci == len(bounds) - 1
                    stop = end if last else end - end % P
                    pos = range(start // P, math.ceil(stop / P))
                    pages = np.array(r["ppages"][pos.start:pos.stop], dtype=np.int32)
                    pools.fill_pages(r["k"], pos, pages)
                    state = None
                    if last:
                        for i, nb in enumerate(sc["aux_bytes"]):
                            pools.aux[i][r["aux_p"]] = pools.aux_row(r["k"], i, nb)
                        state = []
                        for ci2, (comp, entry) in enumerate(zip(sc.get("state", []), pools.state)):
                            for buf in entry["bufs"]:
                                buf[2][r["slot_p"]] = pools.state_item(r["k"], ci2, buf, 0, entry, comp)
                            state.append([np.array([r["pre"].get("slot", r["slot_p"])], dtype=np.int32)])
                    if "kv" in r["pre"] and len(pages) and not r.get("bad_sent"):    # the first chunk with pages
                        pages = _bad(r["pre"]["kv"], pages, model.pages)
                        r["bad_sent"] = True
                    _die(sc, pp, tp_rank, r, ci, out)
                    if stop > start or last:
                        if snd.should_send_kv_chunk(len(pages), last):
                            _guard(out, f"k {r['k']} send chunk {ci}", snd.send, pages, state if last else None,
                                   num_kv_tokens=stop - start)
                    start = stop
                inflight.append(r)
        for r in list(inflight):
            poll = _guard(out, f"k {r['k']} poll", r["sender"].poll)
            if poll == KVPoll.Success:
                out["sent"].append(r["k"])
                _guard(out, f"k {r['k']} clear", r["sender"].clear)
                let_go.append(r["room"])
                inflight.remove(r)
            elif poll is _RAISED or poll == KVPoll.Failed:
                fail(r)
                _guard(out, f"k {r['k']} clear", r["sender"].clear)
                let_go.append(r["room"])
                inflight.remove(r)
        time.sleep(0.002)
        D.flush(out)
    out["unfinished"] = [r["k"] for r in queue + inflight]
    D.flush(out)
    end = time.monotonic() + sc.get("prefill_hold_s", 3.0)
    stop_file = D.RESULT + ".stop"
    while time.monotonic() < end and not os.path.exists(stop_file):
        time.sleep(0.05)
    with mgr.agent.context.lock:     # what is left of them in the agent by now (no thread of the adapter's clears)
        out["let_go"], out["let_go_kept"] = sorted(set(let_go)), sorted(set(let_go) & set(mgr.agent.prefill.rooms))
    out["threads"] = sorted(t.name for t in threading.enumerate())
    D.flush(out)
    mgr.close()
    if server is not None:
        server.close()


def _snapshot(pools: D.Pools, r: dict[str, Any]) -> list[bytes]:
    snap = [arr[p].tobytes() for arr in pools.kv.values() for p in r["dpages"] if 0 <= p < arr.shape[0]]
    snap += [a[r["aux_d"]].tobytes() for a in pools.aux]
    snap += [buf[2][r["slot_d"]].tobytes() for e in pools.state for buf in e["bufs"]]
    return snap


def run_decode(sc: dict[str, Any], dp: int, pp: int, tp_rank: int, out: dict[str, Any]) -> None:
    mgr, classes, (pools, model, server, KVClassType) = D.setup(sc, "decode", dp, pp, tp_rank)
    from sglang.srt.disaggregation.base.conn import KVPoll

    P = model.P
    addr = f"127.0.0.1:{sc['port']}"
    reqs = _reqs(sc)
    out["status"], out["mgr_safe_vs_rx"], out["late"] = {}, [], []
    t_end = time.monotonic() + sc.get("timeout", 120)

    def fail(r: dict[str, Any], when: str) -> None:
        try:
            r["rx"].failure_exception()
            out["raised"].append(f"k {r['k']} failure_exception did not raise")
        except Exception as exc:   # noqa: BLE001
            out["failed"][str(r["k"])] = f"{type(exc).__name__}: {exc}"
        out["status"][str(r["k"])] = f"failed {when}"
        out.setdefault("failed_at", {})[str(r["k"])] = time.time()
        safe = _guard(out, f"k {r['k']} safe", r["rx"].is_abort_release_safe)
        out["safe_at_fail"][str(r["k"])] = safe if safe is not _RAISED else None
        mgr_safe = mgr.is_abort_release_safe(r["room"])
        if mgr_safe is True and safe is False:       # the unsafe direction (the manager may be more careful)
            out["mgr_safe_vs_rx"].append({"k": r["k"], "mgr": mgr_safe, "rx": safe})
        pending_safe.append(r)

    def run_phase(batch: list[dict[str, Any]]) -> None:
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > t_end:
                raise TimeoutError("prefill topology never complete")
            time.sleep(0.05)
        pending, transfer = [], []
        for r in batch:
            rx = _guard(out, f"k {r['k']} receiver()", classes[KVClassType.RECEIVER], mgr=mgr, bootstrap_addr=addr,
                        bootstrap_room=r["room"])
            if rx is _RAISED:
                continue
            r["rx"] = rx
            if r["dec"].get("abort") == "before_init":
                _guard(out, f"k {r['k']} abort", rx.abort)
            _guard(out, f"k {r['k']} init", rx.init, r["dec"].get("dp", 0))
            if r["dec"].get("abort") == "after_init":
                _guard(out, f"k {r['k']} abort", rx.abort)
            pending.append(r)
        for r in pending:       # duplicates: what the manager answers for the room vs each receiver
            mine = _guard(out, "safe", r["rx"].is_abort_release_safe)
            mgr_safe = mgr.is_abort_release_safe(r["room"])
            if mine is False and mgr_safe is True:
                out["mgr_safe_vs_rx"].append({"k": r["k"], "mgr": mgr_safe, "rx": mine, "stage": "after init"})
        phase_end = time.monotonic() + sc.get("phase_timeout", 90)
        while (pending or transfer) and time.monotonic() < min(t_end, phase_end):
            for r in list(pending):
                poll = _guard(out, f"k {r['k']} poll", r["rx"].poll)
                if poll is _RAISED or poll == KVPoll.Failed:
                    pending.remove(r)
                    fail(r, "before metadata")
                elif poll == KVPoll.WaitingForInput:
                    first = r["prefix"] // P
                    kv = np.array(r["dpages"][first:], dtype=np.int32)
                    if "kv" in r["dec"]:
                        kv = _bad(r["dec"]["kv"], kv, model.pages)
                    state = [[np.array([r["dec"].get("slot", r["slot_d"])], dtype=np.int32)]
                             for _ in sc.get("state", [])]
                    _guard(out, f"k {r['k']} send_metadata", r["rx"].send_metadata, kv, r["dec"].get("aux", r["aux_d"]),
                           state or None, decode_prefix_len=r["prefix"])
                    pending.remove(r)
                    transfer.append(r)
                    die = sc.get("adv", {}).get("dec_die")
                    if die and die["k"] == r["k"] and die.get("gen", 1) == sc.get("gen", 1):
                        time.sleep(float(die.get("after_s", 0.0)))     # the request leaves (its agent sends it)
                        out["died"] = {"k": r["k"], "at": time.time()}
                        D.flush(out)
                        os.kill(os.getpid(), signal.SIGKILL)
                    if r["dec"].get("abort") == "after_meta":
                        _guard(out, f"k {r['k']} abort", r["rx"].abort)
            for r in list(transfer):
                poll = _guard(out, f"k {r['k']} poll", r["rx"].poll)
                if poll == KVPoll.Success:
                    out["errors"] += D.verify(sc, pools, model, r)
                    out["verified"].append(r["k"])
                    out["status"][str(r["k"])] = "success"
                    out.setdefault("success_at", {})[str(r["k"])] = time.time()
                    _guard(out, f"k {r['k']} clear", r["rx"].clear)
                    transfer.remove(r)
                elif poll is _RAISED or poll == KVPoll.Failed:
                    transfer.remove(r)
                    fail(r, "in transfer")
            resolve_safe()
            time.sleep(0.002)
            D.flush(out)
        for r in pending + transfer:
            out["status"][str(r["k"])] = "unfinished"

    def resolve_safe() -> None:
        for r in list(pending_safe):
            safe = _guard(out, f"k {r['k']} safe", r["rx"].is_abort_release_safe)
            if safe is True:
                out["safe"].append(r["k"])
                out.setdefault("safe_at", {})[str(r["k"])] = time.time()
                watch.append((r, time.monotonic() + sc.get("adv", {}).get("watch_s", 3.0), _snapshot(pools, r)))
                _guard(out, f"k {r['k']} clear", r["rx"].clear)
                pending_safe.remove(r)

    def check_watch(final: bool) -> None:
        for item in list(watch):
            r, until, snap = item
            if _snapshot(pools, r) != snap:
                out["late"].append(r["k"])
                watch.remove(item)
            elif time.monotonic() >= until or final:
                watch.remove(item)

    watch: list[Any] = []
    if sc.get("gen", 1) == 2:                 # a restarted decode: the phase-2 requests, at once
        run_phase([r for r in reqs if r["phase"] == 2])
        out["phase1_done"] = True
        reqs = [r for r in reqs if r["phase"] == 2]
    else:
        run_phase([r for r in reqs if r["phase"] == 1])
    end = time.monotonic() + sc.get("safe_wait_s", 10)
    while (pending_safe or watch) and time.monotonic() < end:
        resolve_safe()
        check_watch(False)
        time.sleep(0.05)
    check_watch(True)
    out["phase1_done"] = True
    out["unsafe"] = [r["k"] for r in pending_safe]
    D.flush(out)
    if sc.get("adv", {}).get("phase2") and sc.get("gen", 1) == 1:
        go = D.RESULT + ".go"
        end = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < end:
            resolve_safe()
            time.sleep(0.05)
        run_phase([r for r in reqs if r["phase"] == 2])
    # pages no request owns, aux slots and state slots no request uses: untouched
    used = {p for r in reqs for p in r["dpages"]}
    for key, arr in pools.kv.items():
        for p in range(arr.shape[0]):
            if p not in used and not (arr[p] == 0xEE).all():
                out["errors"].append(f"kv {key} page {p} (no request's) was written")
    used_aux = {r["aux_d"] for r in reqs}
    for i, a in enumerate(pools.aux):
        for s in range(a.shape[0]):
            if s not in used_aux and not (a[s] == 0xEE).all():
                out["errors"].append(f"aux {i} slot {s} (no request's) was written")
    used_slot = {r["slot_d"] for r in reqs}
    for e in pools.state:
        for buf in e["bufs"]:
            for s in range(buf[2].shape[0]):
                if s not in used_slot and not (buf[2][s] == 0xEE).all():
                    out["errors"].append(f"state {buf[0]} layer {buf[1]} slot {s} (no request's) was written")
    out["progress_threads_alive"] = all(_alive(a) for a in mgr.agents.values())
    end = time.monotonic() + 3 * mgr.settings.topology_recheck_s + 2.0     # retired agents close once idle
    while mgr.retired and time.monotonic() < end:
        time.sleep(0.05)
    out["restarts"], out["retired_open"] = mgr.restarts, len(mgr.retired)
    mgr.close()


def _alive(agent: Any) -> bool:
    names = [t.name for t in threading.enumerate()]
    return bool(names)


pending_safe: list[dict[str, Any]] = []


def main() -> None:
    sc = json.loads(sys.argv[1])
    role, dp, pp, tp_rank = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    D.RESULT = sys.argv[6]
    out: dict[str, Any] = {"role": role, "dp": dp, "pp": pp, "tp_rank": tp_rank, "sent": [], "verified": [],
                           "failed": {}, "errors": [], "safe": [], "safe_at_fail": {}, "raised": [], "done": False}
    try:
        if role == "prefill":
            run_prefill(sc, dp, pp, tp_rank, out)
        else:
            run_decode(sc, dp, pp, tp_rank, out)
        out["done"] = True
    except Exception:   # noqa: BLE001
        out["exception"] = traceback.format_exc()
    finally:
        D.flush(out)
        D.release_shm()


if __name__ == "__main__":
    main()

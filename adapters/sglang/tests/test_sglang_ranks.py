"""SGLang 0.5.23's own classes (from its wheel) driving kvbridge-sglang in separate prefill and decode rank
processes, in the call order of its prefill and decode event loops; every byte checked on decode.

Each test starts a scenario's ranks (``sglang_driver.py`` under .venv-sglang, loopback backend through
/dev/shm) and reads their results. A decode rank checks, for each request, every byte it owns of the KV
pages after the decode's prefix (the prefix pages must keep decode's own bytes), the aux (metadata) rows
and each state component, against a hash of the coordinates computed in the driver, independently of
kvbridge's slicing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from _rig import PYTHON, Run, check_clean, need_sglang

AUX = [64, 64, 512, 128]          # SGLang-like metadata rows: output ids, cached tokens, top logprobs, topk index


def scenario(**kw: Any) -> dict[str, Any]:
    base = {"seed": 7, "page": 4, "layers": 2, "heads": 4, "head_bytes": 8, "pool_pages": 256, "requests": 6,
            "max_len": 37, "prefix_prob": 0.5, "aux_slots": 16, "aux_bytes": AUX, "timeout": 150}
    base.update(kw)
    return base


def run(sc: dict[str, Any], tmp: Path, **kw: Any) -> tuple[Run, dict[Any, dict[str, Any]]]:
    need_sglang()
    r = Run(sc, tmp, **kw)
    try:
        return r, r.wait()
    finally:
        r.kill()


def decode_results(results: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    return [res for key, res in results.items() if key[0] == "decode"]


def test_gqa_tp4_to_tp2_chunked_prefix_aux(tmp_path: Path) -> None:
    """GQA, 4 KV heads, prefill TP 4 -> decode TP 2: chunked prefill at random boundaries, decode prefix hits
    (full hits included), aux rows; every request verified on both decode ranks."""
    sc = scenario(prefill={"tp": 4}, decode={"tp": 2}, requests=8)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    for res in decode_results(results):
        assert len(res["verified"]) == 8 and not res["failed"], res
        assert res["prefill_info"] == {"tp": 4, "dp": 1, "pp": 1}
    assert all(len(res["sent"]) == 8 for key, res in results.items() if key[0] == "prefill")


@pytest.mark.parametrize("p_page, d_page, mla", [(4, 8, False), (8, 4, False), (6, 4, True), (4, 16, False)],
                         ids=["P4-D8", "P8-D4", "P6-D4-mla", "P4-D16"])
def test_pages_of_another_size_tp2_to_tp1(tmp_path: Path, p_page: int, d_page: int, mla: bool) -> None:
    """Prefill and decode with different page sizes (#24 item 1): chunked prefill, decode prefix hits of whole
    decode pages (which may end inside a prefill page), every token of every request on the decode verified."""
    sc = scenario(prefill={"tp": 2, "page": p_page}, decode={"tp": 1, "page": d_page}, mla=mla, requests=6,
                  max_len=45)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    res = decode_results(results)[0]
    assert len(res["verified"]) == 6 and not res["failed"] and not res["errors"], res


MAMBA = {"type": "mamba", "groups": [8, 8, 16], "kernel": 4, "ssm_heads": 4, "ssm_bytes": 16, "slots": 32,
         "layers": [0, 1]}


def test_gqa_replicated_tp1_to_tp4_with_mamba(tmp_path: Path) -> None:
    """2 KV heads, prefill TP 1 -> decode TP 4 (each KV head replicated on two decode ranks) plus a GDN Mamba
    slot (conv channels [q | k | v] resharded group by group, SSM heads split): every byte on every rank."""
    sc = scenario(prefill={"tp": 1}, decode={"tp": 4}, heads=2, state=[MAMBA], requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    for res in decode_results(results):
        assert len(res["verified"]) == 5 and not res["failed"], res


def test_mamba_tp2_to_tp1(tmp_path: Path) -> None:
    """Mamba + KV, prefill TP 2 -> decode TP 1 (gather of conv groups and SSM heads)."""
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, state=[MAMBA], requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    assert len(decode_results(results)[0]["verified"]) == 5


def test_swa_tp2_to_tp1(tmp_path: Path) -> None:
    """SWA + KV, prefill TP 2 -> decode TP 1: only the window's pages (10 tokens over 4-token pages, floored
    to a page, never before the decode's prefix), paired by position, head-resharded."""
    swa = {"type": "swa", "layers": [0, 1], "pages": 96}
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, state=[swa], window=10, swa_pages=96, requests=6)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    assert len(decode_results(results)[0]["verified"]) == 6


def test_dsa_with_mla_tp2_to_tp1(tmp_path: Path) -> None:
    """DSA indexer pages (132 bytes per token, replicated) with MLA latent pages (replicated), prefill TP 2 ->
    decode TP 1: one elected prefill rank writes each page; the suffix after the decode's prefix travels."""
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, mla=True, state=[{"type": "dsa"}], requests=6)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    assert len(decode_results(results)[0]["verified"]) == 6


def test_abort_on_each_side(tmp_path: Path) -> None:
    """Request 1 aborted by prefill before its last chunk, request 3 aborted by decode after send_metadata:
    both sides fail those rooms with the reason, decode releases their pages only once safe; the others
    are verified."""
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, requests=6, prefix_prob=0.0, min_len=9,
                  aborts={"1": "prefill", "3": "decode"})
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    dec = decode_results(results)[0]
    rooms = {k: req["room"] for k, req in enumerate(_requests(sc, r))}
    assert sorted(dec["verified"]) == sorted(rooms[k] for k in (0, 2, 4, 5))
    assert "abort" in dec["failed"][str(rooms[1])].lower(), dec["failed"]
    assert "abort" in dec["failed"][str(rooms[3])].lower(), dec["failed"]
    assert {rooms[1], rooms[3]} <= set(dec["safe"]), dec
    for key, res in results.items():
        if key[0] == "prefill":       # a prefill rank whose writes all completed before the abort reached it
            r3 = str(rooms[3])        # ends in Success (its room cannot fail afterwards): either is right
            assert (r3 in res["failed"] and "aborted by decode" in res["failed"][r3]) or rooms[3] in res["sent"], res
            assert str(rooms[1]) in res["failed"] and "abort" in res["failed"][str(rooms[1])].lower(), res


def _requests(sc: dict[str, Any], r: Run) -> list[dict[str, Any]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_drv_requests", Path(__file__).with_name("sglang_driver.py"))
    assert spec is not None and spec.loader is not None
    # the driver's module imports only numpy at the top (SGLang is imported inside functions)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out: list[dict[str, Any]] = mod.requests(r.sc)
    return out


def test_pp2_tp2_to_pp1_tp1(tmp_path: Path) -> None:
    """Pipeline-parallel prefill: 2 stages (layers 0-1 and 2-3) of TP 2 each -> decode PP 1, TP 1. The decode
    rank reads each stage through its own agent (that stage's layers of its pool); a request completes only
    when every stage delivered; the aux rows come from the last stage. Mamba layers split over the stages."""
    mamba = dict(MAMBA, layers=[1, 2])
    sc = scenario(prefill={"tp": 2, "pp": 2}, decode={"tp": 1}, layers=4, state=[mamba], requests=6)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    dec = decode_results(results)[0]
    assert len(dec["verified"]) == 6 and dec["prefill_info"] == {"tp": 2, "dp": 1, "pp": 2}


def test_pp4_tp1_to_pp1_tp2(tmp_path: Path) -> None:
    """Four prefill stages of one layer each (TP 1) -> decode PP 1, TP 2 (hetero TP: each decode rank takes
    half the heads of every stage); Mamba layers on stages 1 and 3; every stage counted before Success."""
    mamba = dict(MAMBA, layers=[1, 3])
    sc = scenario(prefill={"tp": 1, "pp": 4}, decode={"tp": 2}, layers=4, state=[mamba], requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    for res in decode_results(results):
        assert len(res["verified"]) == 5 and res["prefill_info"] == {"tp": 1, "dp": 1, "pp": 4}


def test_pp2_tp2_to_pp2_tp1_equal_stages(tmp_path: Path) -> None:
    """PP equal on both sides: decode stage k reads only prefill stage k (its own layers), TP 2 -> 1."""
    sc = scenario(prefill={"tp": 2, "pp": 2}, decode={"tp": 1, "pp": 2}, layers=4, requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    decs = decode_results(results)
    assert len(decs) == 2
    for res in decs:
        assert len(res["verified"]) == 5 and res["prefill_info"] == {"tp": 2, "dp": 1, "pp": 2}


def test_pp2_tp2_to_pp4_tp1_other_split(tmp_path: Path) -> None:
    """Decode PP with another layer split than the prefill's: 4 decode stages of one layer read 2 prefill stages of
    two (TP 2 -> 1), each decode stage exactly its layer; Mamba on layers 1 and 2 (one per prefill stage); a
    prefill rank's room completes once both decode stages of its layers asked."""
    mamba = dict(MAMBA, layers=[1, 2])
    sc = scenario(prefill={"tp": 2, "pp": 2}, decode={"tp": 1, "pp": 4}, layers=4, state=[mamba], requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    decs = decode_results(results)
    assert len(decs) == 4
    for res in decs:
        assert len(res["verified"]) == 5 and res["prefill_info"] == {"tp": 2, "dp": 1, "pp": 2}


def test_pp1_tp2_to_pp2_tp1_other_split(tmp_path: Path) -> None:
    """A prefill without PP feeds a decode PP 2 (TP 2 -> 1): both decode stages read the one prefill stage; the aux
    rows go to the decode's last stage."""
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1, "pp": 2}, layers=4, requests=5)
    r, results = run(sc, tmp_path)
    check_clean(r, results)
    decs = decode_results(results)
    assert len(decs) == 2
    for res in decs:
        assert len(res["verified"]) == 5 and res["prefill_info"] == {"tp": 2, "dp": 1, "pp": 1}


def test_checksums_across_tp_with_mamba_and_a_planted_byte(tmp_path: Path) -> None:
    """KVBRIDGE_CHECKSUMS=1: prefill TP 2 -> decode TP 1 with a Mamba slot, staging off so writes land in
    place; the decode flips one landed byte of its first notice: exactly that request fails naming the
    component, buffer and page, every other request verifies byte for byte (no false positive)."""
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, state=[MAMBA], requests=5, plant=True)
    r, results = run(sc, tmp_path, env={"KVBRIDGE_CHECKSUMS": "1", "KVBRIDGE_STAGING_MIB": "0"})
    check_clean(r, results)
    dec = decode_results(results)[0]
    planted = dec["planted"]
    assert list(dec["failed"]) == [str(planted["room"])], dec["failed"]
    reason = dec["failed"][str(planted["room"])]
    assert ("checksum mismatch" in reason and f"{planted['component']} buffer {planted['buffer']} " in reason
            and f"page {planted['item']} " in reason), reason
    assert len(dec["verified"]) == 4


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_tp2_to_tp1_with_mamba_over_a_transfer_engine(tmp_path: Path, backend: str) -> None:
    """The same adapter over a real transfer engine (NIXL: UCX; Mooncake: its TCP transport; between the rank
    processes, host memory): prefill TP 2 -> decode TP 1 with a Mamba slot, chunked prefill, prefix hits and aux
    rows, staged and plain writes."""
    need_sglang()
    check = f"import kvbridge_{backend} as b; print(b.probe().available)"
    probe = subprocess.run([str(PYTHON), "-c", check], capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip(f"{backend} is not usable in .venv-sglang: {probe.stdout.strip()} {probe.stderr.strip()[-200:]}")
    sc = scenario(prefill={"tp": 2}, decode={"tp": 1}, state=[MAMBA], requests=6)
    r, results = run(sc, tmp_path, env={"KVBRIDGE_BACKEND": backend, "KVBRIDGE_STAGING_MIB": "1"})
    check_clean(r, results)
    dec = decode_results(results)[0]
    assert len(dec["verified"]) == 6 and not dec["failed"], dec
    assert dec["backends"] == [backend], dec["backends"]


def test_dp_routing_by_registered_rank(tmp_path: Path) -> None:
    """Prefill with 2 attention-DP ranks that do not follow the bootstrap room: each prefill sender registers
    its DP rank at the bootstrap server, decode resolves it with SGLang's own query_prefill_dp_ranks, and
    each request is read from the DP rank that computed it. With a secret: the rank and DP-rank registrations
    and the topology fetch are sealed requests, SGLang's untagged query stays served."""
    sc = scenario(prefill={"tp": 1, "dp": 2}, decode={"tp": 1}, requests=6, lbm="round_robin")
    r, results = run(sc, tmp_path, env={"KVBRIDGE_SECRET": "dp-routing-secret-0123456789abcd"})
    check_clean(r, results)
    dec = decode_results(results)[0]
    assert len(dec["verified"]) == 6
    want = {str(req["room"]): req["dp"] for req in _requests(sc, r)}
    assert dec["routed"] == want and set(want.values()) == {0, 1}


def test_peer_failure_fences_until_quiescent(tmp_path: Path) -> None:
    """The prefill process stops (SIGSTOP) in the middle of a request: decode fails the room after the peer
    timeout, failure_exception raises with the reason, but is_abort_release_safe stays False while the
    stopped writer could still resume; once it is killed, the backend proves it gone and the pages are safe."""
    import signal
    import time

    need_sglang()
    sc = scenario(prefill={"tp": 1}, decode={"tp": 1}, requests=3, prefix_prob=0.0, min_len=20,
                  pause_prefill_after_chunks=2, safe_wait_s=60, timeout=90)
    run_ = Run(sc, tmp_path)
    try:
        dkey, pkey = ("decode", 0, 0, 0), ("prefill", 0, 0, 0)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not run_.result(dkey).get("failed"):
            time.sleep(0.5)
        dec = run_.result(dkey)
        assert dec.get("failed"), f"decode saw no failure\n{run_.log(dkey)}\n{run_.log(pkey)}"
        assert run_.result(pkey).get("paused"), run_.log(pkey)
        room, reason = next(iter(dec["failed"].items()))
        assert "KVTransferError" in reason and room in reason, reason
        assert dec["safe_at_fail"][room] is False, dec          # silence proves nothing
        time.sleep(2.0)
        assert int(room) not in run_.result(dkey).get("safe", []), "safe while the writer could still resume"
        run_.signal(pkey, signal.SIGKILL)
        results = run_.wait(200)
    finally:
        run_.kill()
    dec = results[dkey]
    assert dec.get("done"), dec.get("exception")
    assert int(room) in dec["safe"] and not dec["unsafe"], dec
    assert not dec["errors"]


def test_unsupported_state_types_refused_at_startup(tmp_path: Path) -> None:
    """Every SGLang StateType without a kvbridge state type is refused when the manager starts, naming the
    type and the reason. This rank is a fresh interpreter (not forked from the tests' zygote): the cold path
    of a deployment (SGLang's plugin loading in a new process) stays covered."""
    from kvbridge_sglang.layout import REFUSED

    need_sglang()
    sc = scenario(prefill={"tp": 1}, decode={"tp": 1}, refuse=sorted(REFUSED))
    run_ = Run(dict(sc, prefill={"tp": 0}), tmp_path, fresh=True)        # the decode rank alone
    try:
        results = run_.wait(200)
    finally:
        run_.kill()
    refused = results[("decode", 0, 0, 0)]["refused"]
    assert sorted(refused) == sorted(REFUSED)
    for kind, message in refused.items():
        assert f"SGLang state type {kind!r} is not supported" in message and REFUSED[kind] in message, message

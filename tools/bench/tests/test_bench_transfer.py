"""``kvbridge bench transfer`` (kvbridge-bench) on the CPU: the smoke run CI can afford (small sizes, seconds), its JSON
fields and its plots. No timing is asserted: only that every number exists and every byte was verified."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbridge_bench import transfer as bt
from kvbridge_bench.cli import main as cli_main
from kvbridge_bench.plots import MISSING, write_plots

PNG = b"\x89PNG\r\n\x1a\n"
# the quick run took 144 s in one CI run and over 240 s in a loaded one: its bound is a hang bound, not a speed
pytestmark = pytest.mark.timeout(900)


def _bench(*args: str, timeout: float = 600, shm_run: str | None = None,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvbridge bench ARGS`` as ``python -m kvbridge_bench ARGS`` (the same parser and code; it runs from a
    source tree too, where no entry point is installed; tests/test_bench_cli.py covers the entry point)."""
    cmd = [sys.executable, "-m", "kvbridge_bench"]
    env = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_PLUGINS", "KVBRIDGE_DISABLE_PLUGINS")}
    if shm_run:
        env["KVBRIDGE_SHM_RUN"] = shm_run       # the run tag in the names of its /dev/shm segments
    env.update(extra_env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_pools() -> dict[str, str]:
    """With torch and NIXL installed, the quick run keeps its pools in torch tensors (KVBRIDGE_BENCH_TORCH=1):
    the GPU branch (torch pools, verification, scrub, copy, matmul compute) then runs here too; the numpy
    branch runs in the loopback test."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {}
    return {bt.TORCH_ENV: "1"} if "nixl" in bt._registry(()).backend_names() else {}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    done = _bench("transfer", "--quick", "--device", "cpu", "--layerwise", "--concurrency", "3",
                  "--stream-requests", "12", "--stream-size", "1MiB", "--json", str(out / "r.json"),
                     "--plots", str(out / "plots"), extra_env=_torch_pools())
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads((out / "r.json").read_text()), out


def test_quick_run_writes_every_field(quick: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    done, result, _ = quick
    machine = result["machine"]
    assert machine["device"] == "cpu" and machine["cpus"] >= 1 and machine["cpu"]
    assert machine["date"] and machine["command"].startswith("kvbridge bench transfer --quick")
    assert "kvbridge" in machine["versions"] and "numpy" in machine["versions"]
    assert result["settings"]["backend"] in ("nixl", "loopback")
    cases = result["cases"]
    assert {(c["prefill_tp"], c["decode_tp"], c["placement"]) for c in cases} == {
        (1, 1, "scattered"), (1, 1, "contiguous"), (2, 1, "scattered")}
    for c in cases:
        assert c["error"] is None, c["error"]
        assert c["verified"] is True, c["case"]
        assert c["bytes"] == c["tokens"] * c["layers"] * 2 * bt.HEADS * bt.ROW > 0
        assert c["descriptors"] >= 1 and all(s > 0 for s in c["seconds"])
        assert len(c["seconds"]) == (1 if c.get("note") else 2)     # a warm-up over 2 s: one timed round
        assert c["gbps"] > 0 and c["copy_gbps"] > 0 and c["vs_copy"] > 0
        assert (c["raw_nixl_gbps"] is None) == (c["vs_raw_nixl"] is None)
        assert (c["per_page_gbps"] is None) == (c["vs_per_page"] is None)
        if c["raw_nixl_gbps"] is not None and c["prefill_tp"] == c["decode_tp"] == 1:
            assert c["per_page_gbps"] > 0         # the per-page-descriptor method, in the same run
        assert c["case"] in done.stdout
    contiguous = next(c for c in cases if c["placement"] == "contiguous")
    scattered = next(c for c in cases if c["placement"] == "scattered" and c["prefill_tp"] == 1)
    assert contiguous["descriptors"] < scattered["descriptors"]      # adjacent pages merge
    assert result["baselines"] and all(b["copy"]["gbps"] > 0 for b in result["baselines"])
    lat = result["latency"]
    assert lat["error"] is None and lat["tokens"] == 128 and not lat["failed"]
    assert lat["p50_ms"] > 0 and lat["control_rtt_ms"] > 0 and lat["raw_transfer_ms"] > 0
    assert lat["baseline_ms"] == pytest.approx(lat["control_rtt_ms"] + lat["raw_transfer_ms"])
    assert lat["p50_over_baseline"] == pytest.approx(lat["p50_ms"] / lat["baseline_ms"])
    assert "goals" not in result and "goal" not in done.stdout       # ratios against this run, no fixed targets
    assert "p50" in done.stdout and "kvb/raw" in done.stdout


def test_quick_run_stream(quick: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    """--concurrency: requests in flight under an engine-loop probe on each rank, every slot verified."""
    done, result, _ = quick
    [st] = result["streams"]
    assert st["error"] is None and not st["failed"] and st["verified"] is True, st
    assert st["concurrency"] == 3 and st["requests"] == 12 and st["rate"] == 0
    assert st["gbps"] > 0 and st["requests_per_s"] > 0 and 0 < st["p50_ms"] <= st["p99_ms"]
    assert (st["raw_nixl_gbps"] is None) == (st.get("vs_raw_nixl") is None)
    for side in ("prefill", "decode"):
        probe = st[side]
        assert probe["engine_steps_per_s_idle"] > 0 and probe["engine_steps_per_s_busy"] > 0
        assert probe["engine_steps_lost"] < 1
        assert probe["cpu_ms_per_request"] >= probe["engine_thread_ms_per_request"] >= 0
    assert "stream 12 x 1 MiB, 3 in flight" in done.stdout and "engine loop" in done.stdout


def test_quick_run_layerwise(quick: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    done, result, _ = quick
    lw = result["layerwise"]
    assert lw["error"] is None, lw["error"]
    assert lw["available"] is bt.layerwise_supported()
    at_end = lw["modes"]["at_end"]
    assert lw["verified_at_end"] is True and len(at_end["tail_s"]) == 2
    assert len(at_end["timeline"]["groups"]) == lw["layers"]
    assert lw["one_group_transfer_s"] > 0 and lw["compute_per_layer_s"] > 0
    if lw["available"]:
        assert lw["verified_layerwise"] is True and lw["tail_over_one_group"] > 0
        assert len(lw["modes"]["layerwise"]["timeline"]["groups"]) == lw["layers"]
    else:
        assert lw["reason"] == bt.NOT_AVAILABLE and "layer-wise: not available in this build" in done.stdout
        assert "layerwise" not in lw["modes"]


def test_quick_run_plots(quick: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    _, result, out = quick
    names = {"cpu-throughput-vs-page.png", "cpu-throughput-vs-tp.png", "cpu-layerwise-timeline.png"}
    if not _has_matplotlib():
        assert result["plots"] == [] and MISSING in result["notes"]
        return
    assert {Path(p).name for p in result["plots"]} == names
    for name in names:
        assert (out / "plots" / name).read_bytes()[:8] == PNG


def test_loopback_head_major_one_to_two(tmp_path: Path) -> None:
    """The /dev/shm path of the loopback backend, one prefill rank feeding two decode ranks, head-major."""
    tag = f"bt{secrets.token_hex(4)}"
    done = _bench("transfer", "--quick", "--device", "cpu", "--backend", "loopback", "--tp-pairs", "1-2",
                     "--layouts", "head-major", "--placements", "scattered", "--latency-requests", "5",
                     "--json", str(tmp_path / "r.json"), shm_run=tag)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    [case] = result["cases"]
    assert result["settings"]["backend"] == "loopback" and result["layerwise"] is None
    assert case["verified"] is True and (case["prefill_tp"], case["decode_tp"], case["layout"]) == (1, 2, "head-major")
    assert not list(Path("/dev/shm").glob(f"kvbridge-bench-{tag}-*"))       # every pool unlinked its segments


def test_a_sweep_over_request_sizes_is_plotted_against_size(tmp_path: Path) -> None:
    """The 2x H200 sweep of issue 22 (four sizes, in docs/results) draws throughput against request size."""
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed")
    result = json.loads((Path(__file__).resolve().parents[3] / "docs" / "results"
                         / "gpu-22-streams-2xH200-048486f.json").read_text())
    written, problem = write_plots(result, tmp_path, "gpu-")
    assert problem is None and str(tmp_path / "gpu-throughput-vs-size.png") in written
    assert (tmp_path / "gpu-throughput-vs-size.png").read_bytes()[:8] == PNG


def test_plots_without_matplotlib_say_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_plots({"machine": {}, "cases": []}, tmp_path) == ([], MISSING)


def test_transfer_flags_are_refused_by_the_other_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["planner", "--sizes", "1GiB", "--quick"]) == 2
    assert "--sizes, --quick apply to `kvbridge bench transfer` only" in capsys.readouterr().err


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["transfer", "--tp-pairs", "3-1"]) == 2
    assert "8 KV heads must split evenly" in capsys.readouterr().err
    assert cli_main(["transfer", "--layouts", "diagonal"]) == 2
    assert "choose from token-major, head-major" in capsys.readouterr().err
    assert cli_main(["transfer", "--piece-mib", "0"]) == 2
    assert "--piece-mib 0: a staged piece holds at least 1 MiB" in capsys.readouterr().err


def test_parsing_and_case_sizes() -> None:
    assert bt.parse_size("64MiB") == 64 << 20 and bt.parse_size("1GiB") == 1 << 30
    assert bt.parse_size("512k") == 512 << 10
    assert bt.parse_tp_pairs("1-1, 4-2") == ((1, 1), (4, 2))
    with pytest.raises(ValueError):
        bt.parse_size("lots")
    r = bt.resolve_options(bt.Options(sizes=(1 << 30,), page_tokens=(16, 64)), "cuda", "nixl")
    cases = bt.sweep_cases(r)
    assert len(cases) == 2 * 4 * 2 + 2 * 2       # pages x pairs x layouts scattered, + contiguous for 1-1
    assert {c.nbytes for c in cases} == {1 << 30} and all(c.layers == 32 and c.pool_tokens == 32768 for c in cases)
    assert all(c.piece_bytes is None for c in cases)               # the agent's default piece size
    piece = bt.resolve_options(bt.Options(sizes=(1 << 30,), piece_mib=64), "cuda", "nixl")
    assert {c.piece_bytes for c in bt.sweep_cases(piece)} == {64 << 20}
    src, dst = bt.placement_pages(cases[0])
    assert len(set(src.tolist())) == len(src) == cases[0].pages and dst.max() < cases[0].pool_pages


def test_gpu_link_reads_the_topology_matrix() -> None:
    topo = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV18\t0-31\t0\n"
            "GPU1\tNV18\t X \t0-31\t0\n")
    assert bt.gpu_link(topo) == "NV18" and bt.gpu_link(topo, 1, 0) == "NV18"
    assert bt.gpu_link(None) is None and bt.gpu_link("GPU0\n") is None
    run = Path(__file__).resolve().parents[3] / "docs/results/gpu-transfer-5fdff66.json"
    recorded = json.loads(run.read_text())["machine"]["topology"]
    assert recorded.startswith("\x1b[4mGPU0")          # what nvidia-smi printed on the H100 host: underlined
    assert bt.gpu_link(recorded) == "NV18" and bt.gpu_link(recorded, 1, 0) == "NV18"


def test_main_returns_non_zero_on_a_failed_case(monkeypatch: pytest.MonkeyPatch) -> None:
    result = {"cases": [{"error": "boom"}], "latency": None, "layerwise": None}
    monkeypatch.setattr(bt, "run", lambda opts, out: result)
    monkeypatch.setattr(bt, "format_report", lambda r: "")
    args = argparse.Namespace(**{name: None for name in bt.TRANSFER_ARGS}, backend=None)
    assert bt.main(args) == 1
    result["cases"] = [{"error": "skipped: past the 1 s budget"}]
    assert bt.main(args) == 0
    result["streams"] = [{"error": None, "failed": ["room 7: peer gone"], "verified": True}]
    assert bt.main(args) == 1                                  # a request of a stream failed
    result["streams"] = [{"error": None, "failed": [], "verified": False}]
    assert bt.main(args) == 1                                  # a slot's bytes differ

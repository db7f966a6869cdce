"""``kvbridge bench flood``, short: 1.5 s of bad-MAC frames at up to 2,000/s against both agents of a healthy pair
(real ZMQ on 127.0.0.1, a secret set). Prints the latency ratio; asserts only that the run works: every
healthy request succeeded, and the agents rejected the frames they received (none acted)."""

from __future__ import annotations

from kvbridge_bench.flood import bench_flood


def test_a_short_flood_is_survived_and_its_latency_ratio_printed() -> None:
    r = bench_flood(seconds=1.5, rate=2000, baseline_s=0.5)
    print(f"flood {r['frames_sent']:.0f} frames: p50 {r['baseline_p50_ms']:.2f} -> {r['flood_p50_ms']:.2f} ms "
          f"({r['p50_ratio']:.2f}x), p99 {r['baseline_p99_ms']:.2f} -> {r['flood_p99_ms']:.2f} ms "
          f"({r['p99_ratio']:.2f}x)")
    assert r["baseline_requests"] > 0 and r["flood_requests"] > 0
    assert 0 < r["frames_sent"] <= 3000
    assert r["rejected_decode"] + r["rejected_prefill"] > 0
    assert r["rejected_decode"] + r["rejected_prefill"] <= r["frames_sent"]

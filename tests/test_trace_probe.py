"""The timeline probe of issue 14's measurements (scripts/trace): a small host sweep through
scripts/probe_latency.py leaves one trace file per process, and analyze.py reads every timed request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_trace_of_a_host_sweep(tmp_path: Path) -> None:
    env = dict(os.environ, PROBE_TRACE=str(tmp_path), PROBE_SIZE_MIB="4", PROBE_STAGING_MIB="16",
               PROBE_LATENCY_REQUESTS="4",
               PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in ("scripts/trace", "core", "plugins/nixl/src")))
    done = subprocess.run([sys.executable, "scripts/probe_latency.py", "cpu", "sweep", "2", "scattered"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    files = list(tmp_path.glob("trace-*.txt"))
    assert len(files) >= 2, files                         # the prefill rank's and the decode rank's
    names = {line.split()[1] for f in files for line in f.read_text().splitlines()}
    assert {"go_whole>", "send>", "send<", "_send>", "on_notice>", "op_recv<"} <= names, names
    summary = subprocess.run([sys.executable, "scripts/trace/analyze.py", str(tmp_path), "host"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0 and summary.stdout.startswith("host: n=2 first write "), summary

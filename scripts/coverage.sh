#!/usr/bin/env bash
# Line coverage of core/ (kvbridge) by a test command, every process it starts included (pytest-xdist workers,
# demo ranks, the vLLM and SGLang venvs' engine and rank processes), after ./scripts/setup.sh.
#
#   ./scripts/coverage.sh                         # the README's test command (./scripts/test.sh)
#   ./scripts/coverage.sh .venv/bin/python -m pytest tests/test_states.py
#
# Each venv that has kvbridge gets coverage.py and a .pth line that starts it in any process when
# COVERAGE_PROCESS_START is set (coverage's documented subprocess recipe); the data of every process is
# combined into .coverage-report/ (report.txt, the total in total.txt). A process killed with SIGKILL leaves no
# data: its lines count as not run. Not part of CI (coverage slows every process down).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/.coverage-report
rm -rf "$out" && mkdir -p "$out/data"
cat > "$out/coveragerc" <<EOF
[run]
source = $root/core/kvbridge
parallel = true
sigterm = true
data_file = $out/data/cov
EOF
for venv in .venv .venv-vllm .venv-sglang; do
    [ -x "$venv/bin/python" ] || continue
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "coverage>=7.6,<8" || exit 1
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo 'import os; os.environ.get("COVERAGE_PROCESS_START") and __import__("coverage").process_startup()' \
        > "$site/kvbridge-coverage.pth"
done
[ $# -gt 0 ] || set -- ./scripts/test.sh
start=$SECONDS
COVERAGE_PROCESS_START=$out/coveragerc "$@"
rc=$?
echo "scripts/coverage.sh: the test command took $((SECONDS - start)) s (exit $rc)"
for venv in .venv .venv-vllm .venv-sglang; do          # leave the venvs as setup made them
    [ -x "$venv/bin/python" ] || continue
    rm -f "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvbridge-coverage.pth"
done
.venv/bin/python -m coverage combine -q --rcfile="$out/coveragerc" "$out/data" || exit 1
.venv/bin/python -m coverage report --rcfile="$out/coveragerc" --data-file="$out/data/cov" > "$out/report.txt"
.venv/bin/python -m coverage report --rcfile="$out/coveragerc" --data-file="$out/data/cov" --format=total \
    > "$out/total.txt"
tail -1 "$out/report.txt"
echo "line coverage of core/kvbridge: $(cat "$out/total.txt") % (report: $out/report.txt)"
exit $rc

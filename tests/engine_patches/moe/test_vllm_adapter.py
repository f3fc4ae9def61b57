"""The adapter against the installed vLLM 0.32 classes, without starting an engine."""

import pytest

pytest.importorskip("vllm")

from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from engine_patches.vllm_adapters import moe as moe_adapter


@pytest.fixture
def clean_registry():
    saved = op_registry_oot.pop(moe_adapter.OOT_NAME, None)
    yield
    op_registry_oot.pop(moe_adapter.OOT_NAME, None)
    if saved is not None:
        op_registry_oot[moe_adapter.OOT_NAME] = saved


class _Settings:
    moe_gpu_cache_gib = 1.5
    moe_mode = "cached"


def test_install_makes_vllm_build_our_method_for_every_unquantized_moe_layer(clean_registry):
    patched = moe_adapter.install(_Settings())
    assert patched == ["UnquantizedFusedMoEMethod.oot"]
    # vLLM's CustomOp.__new__ consults the out-of-tree registry: what RoutedExperts builds is ours.
    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    assert type(method).__name__ == "OffloadedFusedMoEMethod"
    assert isinstance(method, UnquantizedFusedMoEMethod)
    assert moe_adapter.RUNTIME.settings.moe_gpu_cache_gib == 1.5


def test_install_is_idempotent(clean_registry):
    moe_adapter.install(_Settings())
    cls = op_registry_oot[moe_adapter.OOT_NAME]
    assert moe_adapter.install(_Settings()) == ["UnquantizedFusedMoEMethod.oot"]
    assert op_registry_oot[moe_adapter.OOT_NAME] is cls


def test_install_leaves_another_plugins_method_alone(clean_registry):
    class Other(UnquantizedFusedMoEMethod):
        pass

    op_registry_oot[moe_adapter.OOT_NAME] = Other
    assert moe_adapter.install(_Settings()) == []
    assert op_registry_oot[moe_adapter.OOT_NAME] is Other


def test_importing_the_adapter_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, engine_patches.vllm_adapters.moe; sys.exit(1 if 'vllm' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_own_kernels_are_used_only_for_the_plain_silu_moe():
    """One-token batches may skip vLLM's kernel only where ours computes the same thing."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    def fits(x_dtype=torch.bfloat16, shared=None, config=None, backend=UnquantizedMoeBackend.TRITON, **layer):
        attrs = {"activation": MoEActivation.SILU, "apply_router_weight_on_input": False} | layer
        method = SimpleNamespace(moe=SimpleNamespace(**(config or {})), unquantized_backend=backend)
        return moe_adapter.own_kernels_fit(method, SimpleNamespace(**attrs), torch.empty(1, 8, dtype=x_dtype), shared)

    assert fits()  # Qwen3-MoE, Mixtral: silu, weights on the output, no shared experts
    assert fits(x_dtype=torch.float16)
    assert not fits(activation=MoEActivation.GELU)
    assert not fits(activation=MoEActivation.SWIGLUOAI)  # interleaved gate/up (gpt-oss)
    assert not fits(apply_router_weight_on_input=True)
    assert not fits(shared=object())  # the kernel would add the shared experts
    assert not fits(swiglu_limit=7.0)
    assert not fits(config={"swiglu_alpha": 1.7})
    assert not fits(x_dtype=torch.float32)
    # FlashInfer CUTLASS stores w13 as [up; gate], TRT-LLM in blocks, AITER shuffled.
    for other in (
        UnquantizedMoeBackend.FLASHINFER_CUTLASS,
        UnquantizedMoeBackend.FLASHINFER_TRTLLM,
        UnquantizedMoeBackend.AITER,
    ):
        assert not fits(backend=other), other
    assert not fits(backend=None)


@pytest.mark.parametrize(
    "name,next_name,fetches",
    [
        ("model.layers.4.mlp.experts", "model.layers.5.mlp.experts", True),
        ("model.layers.1.mlp.experts", "model.layers.3.mlp.experts", True),  # a dense layer between
        ("model.layers.47.mlp.experts", "mtp.layers.0.mlp.experts", False),  # a draft model's: another forward
        ("model.layers.47.mlp.experts", "model.mtp.layers.0.mlp.experts", False),
        ("model.layers.3.mlp.experts", "model.layers.1.mlp.experts", False),
        ("experts", "model.layers.1.mlp.experts", False),
    ],
)
def test_experts_are_fetched_ahead_only_for_the_next_layer_of_the_same_stack(name, next_name, fetches):
    assert moe_adapter.next_in_stack(name, next_name) is fetches


def test_the_plugin_settings_choose_the_eviction_rule_and_the_batches_planned_on_the_gpu():
    import torch

    class Lru(_Settings):
        moe_cache_policy = "lru"

    for settings, policy, in_place in ((_Settings(), "frequency", 64), (Lru(), "lru", 64)):
        runtime = moe_adapter._Runtime()
        runtime.settings = settings
        runtime.add_layer(torch.zeros(8, 6, 4), torch.zeros(8, 4, 3))
        offload = runtime.cache(torch.device("cpu"), top_k=2)
        try:
            assert offload.cache_policy == policy and offload.in_place_tokens == in_place
            assert offload.plans_on_device(torch.zeros(64, 2, dtype=torch.long))  # past the cache, on the device
            assert not offload.plans_on_device(torch.zeros(65, 2, dtype=torch.long))
        finally:
            if runtime.publisher is not None:
                runtime.publisher.stop()

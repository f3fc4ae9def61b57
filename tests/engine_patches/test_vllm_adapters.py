"""Each adapter replaces the vLLM 0.32 function it names and still calls vLLM's original."""

from __future__ import annotations

import gc
import mmap
import os
import uuid
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from engine_patches.kv_offload import OffloadRegionError
from engine_patches.pinned import PinnedAllocator
from engine_patches.vllm_adapters import kv_check, offload_region, pinning
from engine_patches.vllm_adapters.patching import unwrap_all
from tests.engine_patches.test_pinned import RecordingRegistrar


@pytest.fixture(autouse=True)
def _restore_vllm():
    yield
    unwrap_all()


def _peft_tensors():
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.ones(4, 64), f"{prefix}.lora_B.weight": torch.ones(64, 4)}
    return helper, tensors


def test_lora_loading_no_longer_pins_each_tensor(monkeypatch):
    import vllm.lora.lora_model as lora_model
    from vllm.lora.lora_model import LoRAModel

    original = LoRAModel.__dict__["from_lora_tensors"].__func__
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)  # as on a CUDA machine
    helper, tensors = _peft_tensors()
    with pytest.raises(Exception):  # noqa: B017 (stock vLLM pins each tensor: impossible without CUDA)
        LoRAModel.from_lora_tensors(1, tensors, helper, device="cpu")

    pinning.install_lora(PinnedAllocator(registrar=RecordingRegistrar()))
    assert LoRAModel.__dict__["from_lora_tensors"].__func__.__wrapped__ is original
    model = LoRAModel.from_lora_tensors(1, tensors, helper, device="cpu")  # vLLM's code ran
    lora = model.get_lora("model.layers.0.self_attn.q_proj")
    assert lora is not None and torch.equal(lora.lora_a, torch.ones(4, 64))


def test_packed_lora_pinning_goes_through_the_exact_allocator(monkeypatch):
    import vllm.lora.model_manager as model_manager
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager

    original = LoRAModelManager._create_merged_loras_inplace
    reg = RecordingRegistrar()
    alloc = PinnedAllocator(registrar=reg)
    pinning.install_lora(alloc)
    assert LoRAModelManager._create_merged_loras_inplace.__wrapped__ is original

    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    helper, tensors = _peft_tensors()
    model = LoRAModel.from_lora_tensors(1, tensors, helper, device="cpu")
    manager = SimpleNamespace(packed_modules={}, modules={})  # nothing to pack: just the pins
    LoRAModelManager._create_merged_loras_inplace(manager, model)
    lora = model.get_lora("model.layers.0.self_attn.q_proj")
    assert alloc.stats().asked_bytes == 2 * 4 * 64 * 4  # lora_a and lora_b, exact bytes
    assert len(reg.live) == 2
    assert torch.equal(lora.lora_b, 2 * torch.ones(64, 4))  # vLLM folded alpha/r = 2 into B


def test_uva_offload_is_wrapped_and_delegates():
    from vllm.model_executor.offloader.uva import UVAOffloader

    original = UVAOffloader._maybe_offload_to_cpu
    pinning.install_uva(PinnedAllocator(registrar=RecordingRegistrar()))
    assert UVAOffloader._maybe_offload_to_cpu.__wrapped__ is original
    offloader = UVAOffloader(cpu_offload_max_bytes=1 << 30)
    module = torch.nn.Linear(4, 4)
    assert UVAOffloader._maybe_offload_to_cpu(offloader, module) is module  # CPU: left alone


def _fake_config(*, cpu_bytes: int | None, dtype: str = "auto"):
    extra = {"cpu_bytes_to_use": cpu_bytes} if cpu_bytes else {}
    ktc = SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_extra_config=extra) if cpu_bytes else None
    return SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(kv_offloading_size=None, cache_dtype=dtype, block_size=16),
        parallel_config=SimpleNamespace(world_size=1),
    )


def _run_check(config, *, available: int, max_len: int = 32768, per_token: int = 131072):
    import vllm.v1.core.kv_cache_utils as utils

    kv_check._local.vllm_config = config
    try:
        utils._check_enough_kv_cache_memory(available, lambda: max_len * per_token, max_len, lambda am: am // per_token)
    finally:
        kv_check._local.vllm_config = None


def test_failed_kv_check_states_both_tiers_and_what_helps():
    import vllm.v1.core.kv_cache_utils as utils
    import vllm.v1.engine.core as core

    original_check = utils._check_enough_kv_cache_memory
    original_configs = utils.get_kv_cache_configs
    kv_check.install()
    assert utils._check_enough_kv_cache_memory.__wrapped__ is original_check
    assert utils.get_kv_cache_configs.__wrapped__ is original_configs
    assert core.get_kv_cache_configs.__wrapped__ is original_configs  # the by-name import

    gib = 1 << 30
    with pytest.raises(ValueError) as err:
        _run_check(_fake_config(cpu_bytes=64 * gib), available=2 * gib)
    msg = str(err.value)
    assert "max_model_len=32768" in msg
    assert "room for about 16384 tokens" in msg  # 2 GiB / 128 KiB per token
    assert "about 524288 tokens of prefix cache" in msg  # 64 GiB / 128 KiB
    assert "does not raise max_model_len" in msg
    assert "--kv-cache-dtype fp8" in msg and "--max-model-len (at most 16384)" in msg
    assert "--cpu-offload-params experts" in msg
    assert isinstance(err.value.__cause__, ValueError)  # vLLM's own check raised first


def test_without_kv_offload_vllms_message_is_kept():
    kv_check.install()
    with pytest.raises(ValueError) as err:
        _run_check(_fake_config(cpu_bytes=None), available=1 << 30)
    assert "prefix cache" not in str(err.value) and "max seq len" in str(err.value)


def test_a_config_that_fits_passes_untouched():
    kv_check.install()
    _run_check(_fake_config(cpu_bytes=1 << 30), available=8 << 30)  # no exception


def test_offload_region_too_large_fails_before_the_file_is_made():
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    original = SharedOffloadRegion.__init__
    offload_region.install_shm_check()
    assert SharedOffloadRegion.__init__.__wrapped__ is original
    engine_id = f"test-{uuid.uuid4().hex[:8]}"
    huge_chunks = (1 << 50) // mmap.PAGESIZE  # 1 PiB
    with pytest.raises(OffloadRegionError, match=r"needs 1048576\.00 GiB .* free"):
        SharedOffloadRegion(engine_id, huge_chunks, 0, mmap.PAGESIZE, mmap.PAGESIZE)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{engine_id}.mmap")

    region = SharedOffloadRegion(engine_id, 4, 0, mmap.PAGESIZE, mmap.PAGESIZE)  # fits
    try:
        assert region.total_size_bytes == 4 * mmap.PAGESIZE  # vLLM's constructor ran
    finally:
        region.cleanup()
        gc.collect()


def _offloading_config(extra: dict, bytes_per_block: int = 1 << 20):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="e0",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def test_num_cpu_blocks_becomes_cpu_bytes_to_use(caplog):
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    with pytest.raises(Exception, match="cpu_bytes_to_use must be specified"):
        CPUOffloadingSpec(_offloading_config({"num_cpu_blocks": 100}))  # stock vLLM 0.32
    original = CPUOffloadingSpec.__init__
    offload_region.install_config_conversion()
    assert CPUOffloadingSpec.__init__.__wrapped__ is original
    spec = CPUOffloadingSpec(_offloading_config({"num_cpu_blocks": 100}))
    assert spec.extra_config["cpu_bytes_to_use"] == 100 * (1 << 20) * 2  # 2 workers' copies
    assert spec.num_chunks == 100  # vLLM sized its region from the converted bytes
    assert "num_cpu_blocks=100" in caplog.text


def test_explicit_cpu_bytes_win_over_num_cpu_blocks():
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    offload_region.install_config_conversion()
    spec = CPUOffloadingSpec(_offloading_config({"num_cpu_blocks": 100, "cpu_bytes_to_use": 10 << 20}))
    assert spec.extra_config["cpu_bytes_to_use"] == 10 << 20

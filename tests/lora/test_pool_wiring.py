"""The CPU LoRA pool wired into vLLM 0.32's adapter loading, checked against vLLM's own path.

No engine: vLLM's real LoRAModel / PackedLoRALayerWeights / AdapterLRUCache code runs, with a
stand-in for the engine's LoRAModelManager (its packed module list and MoE layers).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from engine_patches.lora_pool import PoolFullError
from engine_patches.pinned import PinnedAllocator
from engine_patches.settings import PatchSettings
from engine_patches.vllm_adapters import lora_pool as wiring
from engine_patches.vllm_adapters.patching import unwrap_all
from tests.engine_patches.test_pinned import RecordingRegistrar
from tests.lora.peft_adapters import make_llama_adapter, make_moe_adapter
from tests.support.tiny_model import make_tiny_llama, make_tiny_qwen3_moe

LLAMA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture
def install():
    def do(**settings):
        wiring.install(PatchSettings(lora_pool=True, **settings), PinnedAllocator(registrar=RecordingRegistrar()))

    yield do
    unwrap_all()
    wiring.forget()


class StandInManager:
    """What the wiring reads from vLLM's LoRAModelManager, for a model with given MoE layers."""

    def __init__(self, experts: dict[str, list[str]] | None = None, capacity: int = 4):
        from vllm.lora.layers import FusedMoEWithLoRA

        self.packed_modules = dict(experts or {})
        # A 2D MoE LoRA layer; never run here, only checked with isinstance.
        self.modules = {name: object.__new__(FusedMoEWithLoRA) for name in self.packed_modules}
        self._enable_moe_shared_loras = False
        self._is_non_gated_moe = False
        self._enable_mixed_moe_lora_format = False
        self.lora_slots = 2
        self.lora_config = SimpleNamespace(max_cpu_loras=capacity)
        self.removed: list[int] = []

    def _restrict_to_local_experts(self, module_name, members):
        return members

    def remove_adapter(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def _helper(folder: Path):
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_local_dir(str(folder), 4096)


def _request(lora_id: int, folder: Path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"adapter-{lora_id}", lora_id, str(folder))


def _load(folder: Path, expected: set[str], lora_id: int, manager=None):
    """vLLM's from_local_checkpoint; inside a worker's load when ``manager`` is given."""
    from vllm.lora.lora_model import LoRAModel

    kwargs = dict(peft_helper=_helper(folder), lora_model_id=lora_id, device="cpu", dtype=torch.bfloat16)
    if manager is None:
        return LoRAModel.from_local_checkpoint(str(folder), expected, **kwargs)
    with wiring.loading_for(manager, _request(lora_id, folder)):
        return LoRAModel.from_local_checkpoint(str(folder), expected, **kwargs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "llama")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("m") / "moe")


def test_dense_adapter_is_read_into_pool_slots_with_vllms_values(install, llama, tmp_path):
    install(lora_pool_bytes=1 << 20)
    folder = make_llama_adapter(tmp_path / "a", llama, targets=("q_proj", "v_proj", "down_proj"))
    stock = _load(folder, LLAMA_TARGETS, 1)
    pooled = _load(folder, LLAMA_TARGETS, 2, StandInManager())
    assert set(pooled.loras) == set(stock.loras)
    for name, layer in stock.loras.items():
        mine = pooled.loras[name]
        assert torch.equal(mine.lora_a, layer.lora_a) and torch.equal(mine.lora_b, layer.lora_b)
        assert mine.scaling == layer.scaling and mine.rank == layer.rank
        assert wiring.pool().owns(mine.lora_a) and wiring.pool().owns(mine.lora_b)
    assert wiring.pool().stats().adapters_resident == 1


def _moe_layout(moe_dir: Path) -> tuple[dict[str, list[str]], set[str]]:
    """vLLM's packed expert list per MoE layer ([e0 gate, e0 down, e0 up, e1 ...]), and the
    expected module names a worker passes to from_local_checkpoint."""
    import json

    config = json.loads((moe_dir / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    order = ("gate_proj", "down_proj", "up_proj")
    packed = {
        f"model.layers.{layer}.mlp.experts": [
            f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(experts) for proj in order
        ]
        for layer in range(config["num_hidden_layers"])
    }
    expected = {"q_proj", "v_proj", "experts"} | {f"experts.{e}.{p}" for e in range(experts) for p in order}
    return packed, expected


def test_moe_experts_land_in_the_stacked_layout_vllm_would_build(install, moe, tmp_path):
    from vllm.lora.lora_weights import PackedLoRALayerWeights

    install(lora_pool_bytes=4 << 20)
    folder = make_moe_adapter(tmp_path / "m", moe, rank=8, alpha=32)  # scaling 4: folded in B
    packed, expected = _moe_layout(moe)
    stock = _load(folder, expected, 1)
    pooled = _load(folder, expected, 2, StandInManager(packed))
    for layer_name, members in packed.items():
        want = PackedLoRALayerWeights.pack_moe([stock.loras[m] for m in members], layer_name)
        want.optimize()
        got = pooled.loras[layer_name]
        assert not any(m in pooled.loras for m in members), "no per-expert copies left behind"
        for i in range(3):
            assert got.lora_a[i].shape == want.lora_a[i].shape  # [experts, rank, in]
            assert torch.equal(got.lora_a[i], want.lora_a[i])
            assert torch.equal(got.lora_b[i], want.lora_b[i])
            assert wiring.pool().owns(got.lora_a[i]) and wiring.pool().owns(got.lora_b[i])
        assert got.optimize().scaling == [1, 1, 1]


def test_full_pool_evicts_through_vllms_cache_but_never_the_batch_being_set_up(install, llama, tmp_path):
    from vllm.lora.worker_manager import WorkerLoRAManager

    folder = make_llama_adapter(tmp_path / "a", llama)
    one_adapter = sum(
        t.numel() * t.element_size()
        for layer in _load(folder, LLAMA_TARGETS, 9).loras.values()
        for t in (layer.lora_a, layer.lora_b)
    )
    install(lora_pool_bytes=one_adapter + one_adapter // 2)  # room for one adapter
    manager = StandInManager()
    _load(folder, LLAMA_TARGETS, 1, manager)
    _load(folder, LLAMA_TARGETS, 2, manager)  # evicts 1, and vLLM is told to drop it
    assert manager.removed == [1]
    assert wiring.pool().stats().evictions == 1

    # While vLLM sets up a batch using adapter 2, loading 3 for the same batch cannot evict 2.
    def apply_adapters(requests):
        _load(folder, LLAMA_TARGETS, 3, manager)

    worker = SimpleNamespace(_apply_adapters=apply_adapters, _adapter_manager=manager)
    with pytest.raises(PoolFullError, match="current batch"):
        WorkerLoRAManager.set_active_adapters(worker, {_request(2, folder), _request(3, folder)}, None)
    assert manager.removed == [1]
    assert len(wiring.pool().resident()) == 1  # the failed load gave its slots back


def test_an_adapter_vllm_drops_gives_its_slots_back(install, llama, tmp_path):
    from vllm.lora.model_manager import AdapterLRUCache

    install(lora_pool_bytes=1 << 20)
    folder = make_llama_adapter(tmp_path / "a", llama)
    cache = AdapterLRUCache(2, lambda lora_id: None)  # vLLM's CPU LoRA cache, max_cpu_loras 2
    for lora_id in (1, 2, 3):  # the third pushes the first out
        cache[lora_id] = _load(folder, LLAMA_TARGETS, lora_id, StandInManager())
    assert len(wiring.pool().resident()) == 2
    cache.pop(2)
    assert len(wiring.pool().resident()) == 1
    cache.clear()
    assert wiring.pool().stats().used_bytes == 0


def test_an_adapter_too_big_for_the_pool_gets_a_clear_error(install, llama, tmp_path):
    install(lora_pool_bytes=1024)
    folder = make_llama_adapter(tmp_path / "a", llama, rank=16)
    with pytest.raises(ValueError, match="CPU LoRA pool holds .* raise lora_pool_bytes"):
        _load(folder, LLAMA_TARGETS, 1, StandInManager())


def test_many_load_evict_cycles_do_not_grow_rss(install, tmp_path):
    from vllm.lora.model_manager import AdapterLRUCache

    from bench.lora_shapes import malloc_trim, rss_bytes

    # A 2048-wide model: each adapter is 16 layers x q,v x rank 16 = 4 MiB of bf16.
    big = make_tiny_llama(tmp_path / "wide", layers=16)
    import json

    cfg = json.loads((big / "config.json").read_text())
    cfg.update(hidden_size=2048, num_attention_heads=64, num_key_value_heads=64)
    (big / "config.json").write_text(json.dumps(cfg))
    folders = [make_llama_adapter(tmp_path / f"a{i}", big, rank=16, seed=i) for i in range(3)]
    install(lora_pool_bytes=10 << 20)  # two adapters fit, so every third load evicts
    manager = StandInManager()
    cache = AdapterLRUCache(4, lambda lora_id: None)

    def cycles(start, stop):
        for i in range(start, stop):
            lora_id = i + 1
            cache[lora_id] = _load(folders[i % 3], LLAMA_TARGETS, lora_id, manager)
            for gone in manager.removed:  # what vLLM's remove_adapter does with an evicted id
                cache.pop(gone, None)
            manager.removed.clear()

    cycles(0, 20)
    malloc_trim()
    before = rss_bytes()
    cycles(20, 200)
    malloc_trim()
    assert wiring.pool().stats().evictions > 100
    assert wiring.pool().stats().reserved_bytes <= 10 << 20
    assert rss_bytes() - before < 4 << 20  # less than one adapter

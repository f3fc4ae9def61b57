"""An adapter is checked against its model config before it enters the registry."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from manager.errors import Invalid
from manager.lora.checks import check_adapter, known_modules
from manager.schemas.model_config import ModelConfig
from tests.lora.peft_adapters import make_llama_adapter


def _config(model, **kw) -> ModelConfig:
    return ModelConfig(name="tiny", model=str(model), enable_lora=True, max_lora_rank=16, **kw)


def test_a_matching_adapter_passes_with_its_rank(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama, rank=8)
    check = check_adapter(str(folder), _config(tiny_llama))
    assert check.rank == 8 and check.targets == ("q_proj", "v_proj") and check.note is None


def test_a_folder_without_adapter_config_is_refused(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(Invalid, match="no adapter_config.json"):
        check_adapter(str(folder), _config(tiny_llama))


def test_a_missing_folder_is_refused(tiny_llama, tmp_path):
    with pytest.raises(Invalid, match="not a folder"):
        check_adapter(str(tmp_path / "nope"), _config(tiny_llama))


def test_rank_above_max_lora_rank_is_refused_with_the_fix(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama, rank=32)
    with pytest.raises(Invalid, match="rank 32 is above .* max_lora_rank 16: raise max_lora_rank"):
        check_adapter(str(folder), _config(tiny_llama))


def test_rank_pattern_counts_toward_the_rank(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama, rank=8)
    peft = json.loads((folder / "adapter_config.json").read_text())
    peft["rank_pattern"] = {"v_proj": 24}
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    with pytest.raises(Invalid, match="rank 24"):
        check_adapter(str(folder), _config(tiny_llama))


def test_unknown_target_modules_are_refused(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama)
    peft = json.loads((folder / "adapter_config.json").read_text())
    peft["target_modules"] = ["q_proj", "query_key_value"]  # a GPT-NeoX adapter's target
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    with pytest.raises(Invalid, match="does not have: query_key_value"):
        check_adapter(str(folder), _config(tiny_llama))


def test_a_config_without_lora_is_refused(tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama)
    config = ModelConfig(name="tiny", model=str(tiny_llama), enable_lora=False)
    with pytest.raises(Invalid, match="enable_lora off"):
        check_adapter(str(folder), config)


def test_module_names_come_from_the_weights_when_the_folder_has_them(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "something_new"}))
    assert known_modules(str(folder)) is None  # unknown type, no weights: nothing to check
    save_file(
        {"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 2), "transformer.h.0.attn.c_proj.bias": torch.zeros(2)},
        str(folder / "model.safetensors"),
    )
    assert known_modules(str(folder)) == {"c_attn", "c_proj"}


def test_unknown_model_type_is_said_not_refused(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "something_new"}))
    adapter = make_llama_adapter(tmp_path / "a", tiny_llama)
    check = check_adapter(str(adapter), _config(folder))
    assert check.note and "not checked" in check.note

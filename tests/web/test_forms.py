"""Form text to the API's schemas and back, without a web server."""

from __future__ import annotations

from manager.schemas.model_config import ModelConfigCreate
from manager.schemas.offload_profile import OffloadProfileCreate
from manager.web.forms import FORM_LEVEL, FormErrors, parse_form, to_text, validate


def _submit(form: dict, schema=ModelConfigCreate):
    errors = FormErrors()
    return validate(schema, parse_form(form, schema, errors), errors), errors


def test_a_filled_form_becomes_the_same_config_the_api_would_store():
    config, errors = _submit({
        "name": "tiny", "model": "/models/tiny", "gpu_ids": "0, 1", "tensor_parallel_size": "2",
        "gpu_memory_utilization": "0.5", "extra_args": "--load-format dummy --chat-template 'a b'",
        "env": "VLLM_LOGGING_LEVEL=DEBUG\n\nHF_HUB_OFFLINE=1", "enforce_eager": "on",
    })  # fmt: skip
    assert not errors
    assert config.gpu_ids == [0, 1]
    assert config.extra_args == ["--load-format", "dummy", "--chat-template", "a b"]
    assert config.env == {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "1"}
    assert config.enforce_eager is True and config.autostart is False  # unticked: not sent
    assert config.max_model_len is None  # empty optional field: the default


def test_each_schema_message_lands_on_its_field():
    config, errors = _submit({"name": "no spaces please", "model": "m", "gpu_memory_utilization": "2",
                              "max_model_len": "many"})  # fmt: skip
    assert config is None
    assert "less than or equal to 1" in errors.get("gpu_memory_utilization")[0]
    assert "integer" in errors.get("max_model_len")[0]
    assert errors.get("name")
    assert not errors.get("model")


def test_text_the_form_cannot_split_is_reported_on_its_field():
    config, errors = _submit({"name": "x", "model": "m", "extra_args": "--chat-template 'open",
                              "env": "JUST_A_NAME"})  # fmt: skip
    assert config is None
    assert "quotes" in errors.get("extra_args")[0]
    assert "KEY=VALUE" in errors.get("env")[0]


def test_a_rule_about_two_fields_is_shown_above_the_form():
    profile, errors = _submit(
        {"name": "p", "kv_offload_gib": "4", "kv_offload_num_cpu_blocks": "100"}, OffloadProfileCreate
    )
    assert profile is None
    assert "not both" in errors.get(FORM_LEVEL)[0]


def test_stored_values_show_as_the_text_that_parses_back_to_them():
    fields = ModelConfigCreate.model_fields
    stored = {"gpu_ids": [0, 2], "extra_args": ["--chat-template", "a b"], "env": {"A": "1"},
              "enable_prefix_caching": False, "max_model_len": None}  # fmt: skip
    form = {name: to_text(value, fields[name].annotation) for name, value in stored.items()}
    assert form["enable_prefix_caching"] == "false" and form["max_model_len"] == ""
    config, errors = _submit({"name": "n", "model": "m", **form})
    assert not errors
    assert config.gpu_ids == [0, 2] and config.extra_args == ["--chat-template", "a b"]
    assert config.env == {"A": "1"} and config.enable_prefix_caching is False


def test_front_door_fields_in_the_form():
    config, errors = _submit({"name": "q", "model": "m", "aliases": "qwen  q-small", "idle_timeout_s": "600",
                              "persistent": "on", "sleep_level": "1"})  # fmt: skip
    assert not errors
    assert config.aliases == ["qwen", "q-small"] and config.idle_timeout_s == 600
    assert config.persistent is True and config.sleep_level == 1
    off, errors = _submit({"name": "q", "model": "m", "aliases": "", "sleep_level": ""})
    assert not errors and off.aliases == [] and off.sleep_level is None and off.persistent is False
    bad, errors = _submit({"name": "q", "model": "m", "sleep_level": "3"})
    assert bad is None and "less than or equal to 2" in errors.get("sleep_level")[0]
    assert to_text(["qwen", "q-small"], ModelConfigCreate.model_fields["aliases"].annotation) == "qwen q-small"

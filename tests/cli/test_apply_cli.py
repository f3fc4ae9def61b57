"""`vllm-manager apply FILE [--prune]`, `models set` and `models edit`: the store made equal to what the
user wrote, and what changed printed."""

from __future__ import annotations

import json

import yaml

from tests.cli.test_cli import _run


def _write(path, models, profiles=()):
    path.write_text(yaml.safe_dump({"profiles": list(profiles), "models": list(models)}))
    return str(path)


def test_apply_creates_changes_leaves_alone_and_prunes(tmp_path):
    data, file = tmp_path / "data", tmp_path / "stack.yaml"
    a = {"name": "a", "model": "org/a", "max_model_len": 2048, "offload_profile": "kv"}
    b = {"name": "b", "model": "org/b"}
    kv = {"name": "kv", "kv_offload_gib": 4}
    first = _run(["apply", _write(file, [a, b], [kv])], data)
    assert first.returncode == 0, first.stderr
    assert "created   model a" in first.stdout and "3 created, 0 changed, 0 removed, 0 unchanged" in first.stdout
    stamp = json.loads(_run(["models", "show", "a"], data).stdout)["updated_at"]

    again = _run(["apply", str(file)], data)
    assert "0 created, 0 changed, 0 removed, 3 unchanged" in again.stdout
    assert json.loads(_run(["models", "show", "a"], data).stdout)["updated_at"] == stamp  # left alone

    changed = _run(["apply", _write(file, [{**a, "max_model_len": 4096}], [kv])], data)
    assert "changed   model a" in changed.stdout and "0 removed" in changed.stdout
    assert json.loads(_run(["models", "show", "a"], data).stdout)["max_model_len"] == 4096
    assert _run(["models", "show", "b"], data).returncode == 0  # not in the file, kept without --prune

    pruned = _run(["apply", str(file), "--prune"], data)
    assert "removed   model b" in pruned.stdout and "1 removed, 2 unchanged" in pruned.stdout
    assert _run(["models", "show", "b"], data).returncode == 1

    bad = _run(["apply", _write(file, [{"name": "c", "model": "org/m", "max_model_length": 1}])], data)
    assert bad.returncode == 1 and "max_model_length" in bad.stderr
    assert _run(["models", "show", "c"], data).returncode == 1  # nothing stored from a bad file


def test_models_set_changes_one_field_and_names_a_misspelled_one(tmp_path):
    data = tmp_path / "data"
    _run(["apply", _write(tmp_path / "m.yaml", [{"name": "a", "model": "org/a", "aliases": ["x"]}])], data)
    done = _run(["models", "set", "a", "max_model_len=8192", "enforce_eager=true"], data)
    assert done.returncode == 0, done.stderr
    assert "max_model_len, enforce_eager changed" in done.stdout
    shown = json.loads(_run(["models", "show", "a"], data).stdout)
    assert shown["max_model_len"] == 8192 and shown["enforce_eager"] is True and shown["aliases"] == ["x"]
    typo = _run(["models", "set", "a", "max_model_length=1"], data)
    assert typo.returncode == 1 and "did you mean max_model_len?" in typo.stderr
    invalid = _run(["models", "set", "a", "gpu_memory_utilization=3"], data)
    assert invalid.returncode == 1 and "gpu_memory_utilization" in invalid.stderr
    assert json.loads(_run(["models", "show", "a"], data).stdout)["gpu_memory_utilization"] == 0.9


def test_models_edit_saves_what_the_editor_wrote(tmp_path):
    data = tmp_path / "data"
    _run(["apply", _write(tmp_path / "m.yaml", [{"name": "a", "model": "org/a", "max_model_len": 2048}])], data)
    edited = _run(["models", "edit", "a"], data, EDITOR="sed -i s/max_model_len:.2048/max_model_len:\\ 1024/")
    assert edited.returncode == 0, edited.stderr
    assert "max_model_len changed" in edited.stdout
    assert json.loads(_run(["models", "show", "a"], data).stdout)["max_model_len"] == 1024
    broken = _run(["models", "edit", "a"], data, EDITOR="sed -i s/max_model_len:.1024/max_model_len:\\ -5/")
    assert broken.returncode == 1 and "max_model_len" in broken.stderr
    assert json.loads(_run(["models", "show", "a"], data).stdout)["max_model_len"] == 1024


def test_models_set_takes_min_residency_and_refuses_a_negative_one(tmp_path):
    data = tmp_path / "data"
    _run(["apply", _write(tmp_path / "m.yaml", [{"name": "a", "model": "org/a"}])], data)
    done = _run(["models", "set", "a", "min_residency_s=20"], data)
    assert done.returncode == 0, done.stderr
    assert json.loads(_run(["models", "show", "a"], data).stdout)["min_residency_s"] == 20
    refused = _run(["models", "set", "a", "min_residency_s=-1"], data)
    assert refused.returncode == 1 and "min_residency_s" in refused.stderr
    assert json.loads(_run(["models", "show", "a"], data).stdout)["min_residency_s"] == 20

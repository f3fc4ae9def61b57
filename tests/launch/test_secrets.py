"""What counts as a secret in a model config, and how it is hidden in argvs, environments and text."""

from __future__ import annotations

import pytest

from manager.errors import Invalid
from manager.launch.command import LaunchCommand
from manager.launch.secrets import Redactor, hide_flag_values, keep_stored, without_secrets
from manager.schemas.common import MARKER
from manager.schemas.model_config import ModelConfigPublic

KEY = "sk-abc123def456"
HF = "hf_secretTOKEN0123456789"


def test_both_flag_forms_are_hidden_and_the_flags_stay():
    argv = ["--api-key", KEY, "sk-second", "--max-model-len", "64", f"--hf-token={HF}", "--enforce-eager"]
    assert hide_flag_values(argv) == [
        "--api-key", MARKER, MARKER, "--max-model-len", "64", f"--hf-token={MARKER}", "--enforce-eager",
    ]  # fmt: skip


def test_spellings_vllm_accepts_for_a_secret_flag_are_hidden_too():
    # vLLM reads --api_key as --api-key and takes an unambiguous prefix (--api-k) for the whole flag.
    assert hide_flag_values(["--api_key", KEY]) == ["--api_key", MARKER]
    assert hide_flag_values(["--api-k", KEY]) == ["--api-k", MARKER]
    assert hide_flag_values(["--auth-token", "t0k3n-value", "--db-password=pw123456"]) == [
        "--auth-token", MARKER, f"--db-password={MARKER}",
    ]  # fmt: skip


def test_flags_that_only_mention_tokens_keep_their_values():
    argv = ["--max-num-batched-tokens", "2048", "--tokenizer", "/models/tok", "--long-prefill-token-threshold", "8"]
    assert hide_flag_values(argv) == argv
    # --hf-token alone (use the cached login) has no value: the next flag is not taken for one.
    assert hide_flag_values(["--hf-token", "--max-model-len", "64"]) == ["--hf-token", "--max-model-len", "64"]


def test_text_hides_every_occurrence_even_inside_other_text():
    secrets = Redactor(["--api-key", KEY], {"HF_TOKEN": HF})
    line = f"non-default args: {{'api_key': ['{KEY}'], 'hf': '{HF}'}} Bearer {KEY}xyz"
    shown = secrets.text(line)
    assert KEY not in shown and HF not in shown
    assert shown == f"non-default args: {{'api_key': ['{MARKER}'], 'hf': '{MARKER}'}} Bearer {MARKER}xyz"
    assert secrets.text("nothing secret here") == "nothing secret here"


def test_a_secret_inside_a_longer_one_does_not_leave_the_rest_in_view():
    secrets = Redactor(env={"SHORT_TOKEN": "abcd1234", "LONG_TOKEN": "abcd1234-and-more"})
    assert secrets.text("x abcd1234-and-more y abcd1234 z") == f"x {MARKER} y {MARKER} z"


def test_regex_characters_in_a_secret_are_taken_literally():
    secrets = Redactor(["--api-key", "a.b*c+d(e)"])
    assert secrets.text("key a.b*c+d(e) and aXbbbcd(e)") == f"key {MARKER} and aXbbbcd(e)"


def test_empty_and_short_values_do_not_hide_the_whole_line():
    secrets = Redactor(["--api-key="], {"EMPTY_TOKEN": "", "VLLM_USE_X": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    line = "WARNING 11-21 [core.py:1] loaded 1 model in 12.1 s"
    assert secrets.text(line) == line
    assert hide_flag_values(["--api-key="]) == ["--api-key="]


def test_settings_stay_readable_in_log_lines_and_credentials_do_not():
    # An error naming the cache folder is what a user reads the log for; the token is not.
    secrets = Redactor(env={"HF_HOME": "/srv/hf-cache-2", "HF_TOKEN": HF})
    shown = secrets.text(f"cannot write /srv/hf-cache-2/hub with token {HF}")
    assert shown == f"cannot write /srv/hf-cache-2/hub with token {MARKER}"


def test_env_hides_the_configs_own_variables_only():
    secrets = Redactor(env={"HF_TOKEN": HF})
    shown = secrets.env({"HF_TOKEN": HF, "CUDA_VISIBLE_DEVICES": "0", "VLLM_PLUGINS": "offload_patches"})
    assert shown == {"HF_TOKEN": MARKER, "CUDA_VISIBLE_DEVICES": "0", "VLLM_PLUGINS": "offload_patches"}


def test_a_command_keeps_its_shape_and_loses_its_secrets():
    cmd = LaunchCommand(["py", "-m", "vllm", "--api-key", KEY], {"HF_TOKEN": HF, "X": "1"}, ["a note"])
    shown = Redactor(["--api-key", KEY], {"HF_TOKEN": HF}).command(cmd)
    assert shown.argv == ["py", "-m", "vllm", "--api-key", MARKER]
    assert shown.env == {"HF_TOKEN": MARKER, "X": "1"} and shown.notes == ["a note"]
    assert cmd.argv[-1] == KEY  # the command that runs is untouched


def test_event_data_strings_are_hidden_at_any_depth():
    secrets = Redactor(["--api-key", KEY])
    data = {"argv": ["--api-key", KEY], "nested": {"why": f"refused {KEY}"}, "pid": 12}
    assert secrets.value(data) == {"argv": ["--api-key", MARKER], "nested": {"why": f"refused {MARKER}"}, "pid": 12}


def test_a_config_for_readers_without_the_token():
    public = ModelConfigPublic.model_validate(
        {
            "name": "m",
            "model": "/models/m",
            "extra_args": ["--api-key", KEY, "--max-num-seqs", "4"],
            "env": {"HF_TOKEN": HF, "VLLM_LOGGING_LEVEL": "INFO"},
            "created_at": "2025-01-01T00:00:00",
            "updated_at": "2025-01-01T00:00:00",
        }
    )
    shown = without_secrets(public)
    assert shown.extra_args == ["--api-key", MARKER, "--max-num-seqs", "4"]
    assert shown.env == {"HF_TOKEN": MARKER, "VLLM_LOGGING_LEVEL": MARKER}
    assert KEY not in shown.model_dump_json() and HF not in shown.model_dump_json()


def test_markers_sent_back_keep_the_stored_values_and_new_values_replace_them():
    stored_args = ["--api-key", KEY, "sk-second", f"--hf-token={HF}"]
    stored_env = {"HF_TOKEN": HF, "OTHER": "x"}
    args, env = keep_stored(
        ["--api-key", "sk-new", MARKER, f"--hf-token={MARKER}", "--max-num-seqs", "4"],
        {"HF_TOKEN": MARKER, "OTHER": "y"},
        stored_args,
        stored_env,
    )
    assert args == ["--api-key", "sk-new", "sk-second", f"--hf-token={HF}", "--max-num-seqs", "4"]
    assert env == {"HF_TOKEN": HF, "OTHER": "y"}


def test_a_marker_with_nothing_stored_behind_it_is_refused():
    with pytest.raises(Invalid, match="env: NEW_TOKEN is <hidden>.*type the value"):
        keep_stored([], {"NEW_TOKEN": MARKER}, [], {})
    with pytest.raises(Invalid, match="extra_args: the value of --api-key is <hidden>"):
        keep_stored(["--api-key", MARKER], {}, [], {})


SHORT = "Q7z"  # a key too short to search for everywhere in a log
URL = "https://hub-user:pw-Secret9@hub.example.com/models"


def test_a_short_key_is_hidden_where_text_shows_it_as_a_flags_value():
    secrets = Redactor(["--api-key", SHORT])
    for line, shown in [
        (f"non-default args: --api-key {SHORT} --seed 7", f"non-default args: --api-key {MARKER} --seed 7"),
        (f"--api-key={SHORT}", f"--api-key={MARKER}"),
        (f"argv: ['--api-key', '{SHORT}', '--seed']", f"argv: ['--api-key', '{MARKER}', '--seed']"),
        (f"--hf-token --api_key {SHORT}", f"--hf-token --api_key {MARKER}"),
    ]:
        assert secrets.text(line) == shown
    # Other flags' values, and a flag named in a message, stay as they are.
    assert secrets.text("--max-num-batched-tokens 2048 --seed 7") == "--max-num-batched-tokens 2048 --seed 7"
    assert secrets.text("argument --api-key: expected one") == "argument --api-key: expected one"


def test_the_user_part_of_a_url_is_hidden_wherever_a_url_is_shown():
    hidden_url = f"https://{MARKER}@hub.example.com/models"
    line = f"GET {URL} failed; see https://docs.example.com/a?b=c@d"
    assert Redactor().text(line) == f"GET {hidden_url} failed; see https://docs.example.com/a?b=c@d"
    # A password holding an "@" does not leave its end in view.
    assert Redactor().text("http://u:p@ss@host/x") == f"http://{MARKER}@host/x"
    assert hide_flag_values(["--otlp-traces-endpoint", URL]) == ["--otlp-traces-endpoint", hidden_url]
    assert Redactor().env({"HF_ENDPOINT": URL}) == {"HF_ENDPOINT": hidden_url}


def test_the_engines_key_is_hidden_in_the_environment_it_is_moved_to():
    shown = Redactor(["--api-key", SHORT]).env({"VLLM_API_KEY": SHORT, "VLLM_PLUGINS": "offload_patches"})
    assert shown == {"VLLM_API_KEY": MARKER, "VLLM_PLUGINS": "offload_patches"}


def test_a_url_shown_without_its_user_part_and_sent_back_keeps_the_stored_one():
    stored = ["--otlp-traces-endpoint", URL, "--seed", "7"]
    shown = hide_flag_values(stored)
    assert URL not in shown
    args, _ = keep_stored([*shown[:3], "8"], {}, stored, {})
    assert args == ["--otlp-traces-endpoint", URL, "--seed", "8"]
    with pytest.raises(Invalid, match="extra_args: .* where a URL's user and password stood"):
        keep_stored(["--otlp-traces-endpoint", f"https://{MARKER}@elsewhere.example.com"], {}, stored, {})

"""What is secret in a model config, and hiding it wherever a command, an environment or an engine's
output is shown.

Secrets are every value of the config's environment (HF_TOKEN and the like go there), the values of
engine flags that carry credentials (vLLM's --api-key and --hf-token, and flags named like them), and
the user part of any URL (``https://user:password@host``). Where a config is shown for editing (the
API, the config pages), readers without the token see ``MARKER`` instead, and a marker sent back
unchanged keeps the stored value. Event texts and engine log lines hide them from everyone: they are
broadcast and stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from manager.errors import Invalid
from manager.launch.command import LaunchCommand
from manager.launch.engine_key import ENV_NAME
from manager.launch.flags import flag_name
from manager.schemas.common import MARKER
from manager.schemas.model_config import ModelConfigFields

# vLLM 0.32's flags that carry a credential: --api-key takes one or more keys, --hf-token one (or none:
# then the cached login is used).
KNOWN_SECRET_FLAGS = ("--api-key", "--hf-token")
# A flag or variable whose name ends in one of these words holds a credential (--auth-token,
# --db-password, WANDB_API_KEY). --max-num-batched-tokens and --long-prefill-token-threshold do not.
CREDENTIAL_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"})

# Which values are searched for in free text (log lines, event texts) wherever they stand. A credential
# shorter than this would hide every "x" or "abc" of the log: it is hidden where text shows it as a
# secret flag's value (--api-key abc) only.
MIN_CREDENTIAL = 4
# A flag and its value in free text: "--api-key abc", "--api-key=abc", "'--api-key', 'abc'" (a list's repr).
_FLAG_IN_TEXT = re.compile(r"""(--[A-Za-z0-9][\w-]*)(=|(?:\s+|['"],\s*['"])(?!-))([^\s'",\])]+)""")
# The user part of a URL, password and all, up to its last "@" before the host.
_URL_USER = re.compile(r"""(\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#'"<>]+@""")
# Other environment values are not searched in free text: the environment allow-list leaves only
# settings there (HF_HOME=/data/hf, PYTORCH_CUDA_ALLOC_CONF=...), and hiding every mention of a path
# or a setting would hide the very lines (errors naming a folder) a user reads the log for.

ConfigT = TypeVar("ConfigT", bound=ModelConfigFields)


def _flag_key(flag: str) -> str | None:
    """The secret flag that `flag` sets (in its --dashed form), or None. vLLM's parser reads --api_key
    as --api-key and accepts any unambiguous prefix (--api-k)."""
    if not flag.startswith("--"):
        return None
    name = "--" + flag[2:].replace("_", "-").lower()
    for known in KNOWN_SECRET_FLAGS:
        if known.startswith(name) and len(name) > 4:
            return known
    return name if name[2:].split("-")[-1] in CREDENTIAL_WORDS else None


def _is_credential_name(env_name: str) -> bool:
    return env_name.lower().split("_")[-1] in CREDENTIAL_WORDS


def _secret_values(argv: Sequence[str]) -> Iterator[tuple[int, str, int, str]]:
    """(index in argv, secret flag, n-th value given to that flag, value) of each secret flag value.

    ``--flag=value`` holds its value at its own index; ``--flag v1 v2`` at the arguments that follow,
    up to the next flag (vLLM's parser takes no value that starts with '-').
    """
    counts: dict[str, int] = {}
    taking: str | None = None
    for i, arg in enumerate(argv):
        flag = flag_name(arg)
        if flag is None:
            if taking is not None:
                counts[taking] = counts.get(taking, 0) + 1
                yield i, taking, counts[taking] - 1, arg
            continue
        taking = _flag_key(flag)
        if taking is not None and "=" in arg:
            value = arg.split("=", 1)[1]
            counts[taking] = counts.get(taking, 0) + 1
            yield i, taking, counts[taking] - 1, value
            taking = None


def hide_url_users(text: str) -> str:
    """``text`` with the user part of every URL in it (``user:password@``) replaced by the marker."""
    return _URL_USER.sub(lambda m: m.group(1) + MARKER + "@", text) if "://" in text else text


def _hide_flags_in_text(text: str) -> str:
    def hidden(m: re.Match[str]) -> str:
        return m.group(1) + m.group(2) + MARKER if _flag_key(m.group(1)) else m.group(0)

    return _FLAG_IN_TEXT.sub(hidden, text) if "--" in text else text


def hide_flag_values(argv: Sequence[str]) -> list[str]:
    """The argv with every secret flag's value, and the user part of every URL, replaced by the marker."""
    shown = [hide_url_users(arg) for arg in argv]
    for i, _, _, value in _secret_values(argv):
        if value:
            shown[i] = shown[i].split("=", 1)[0] + "=" + MARKER if flag_name(shown[i]) else MARKER
    return shown


def without_secrets(config: ConfigT) -> ConfigT:
    """A config as a reader without the token sees it: environment values and secret flag values hidden."""
    return config.model_copy(
        update={"env": {name: MARKER for name in config.env}, "extra_args": hide_flag_values(config.extra_args)}
    )


def keep_stored(
    extra_args: list[str], env: dict[str, str], stored_args: Sequence[str], stored_env: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """A submitted config's extra_args and env with each marker (a hidden value sent back as shown)
    replaced by the stored value it stands for. A marker with no stored value is refused."""
    env = dict(env)
    for name, value in env.items():
        if value == MARKER:
            if name not in stored_env:
                raise Invalid(
                    f"env: {name} is {MARKER}, which stands for a stored value, and this config stores none for "
                    f"{name}; type the value",
                    field="env",
                )
            env[name] = stored_env[name]
    stored = {(flag, nth): value for _, flag, nth, value in _secret_values(stored_args)}
    args = list(extra_args)
    for i, flag, nth, value in _secret_values(extra_args):
        if value != MARKER:
            continue
        if (flag, nth) not in stored:
            raise Invalid(
                f"extra_args: the value of {flag} is {MARKER}, which stands for a stored value, and this config "
                f"stores none there; type the value",
                field="extra_args",
            )
        args[i] = args[i].split("=", 1)[0] + "=" + stored[flag, nth] if flag_name(args[i]) else stored[flag, nth]
    # An argument shown with a URL's user part hidden stands for the stored argument shown so.
    unused = list(stored_args)
    for i, arg in enumerate(args):
        if f"://{MARKER}@" not in arg:
            continue
        same = next((j for j, old in enumerate(unused) if hide_url_users(old) == arg), None)
        if same is None:
            raise Invalid(
                f"extra_args: {arg!r} holds {MARKER} where a URL's user and password stood, and this config "
                "stores no such argument; type the URL",
                field="extra_args",
            )
        args[i] = unused.pop(same)
    return args, env


class Redactor:
    """Hides one model config's secrets in an argv, an environment and lines of text.

    Built once per start of a worker: the search pattern for its log lines is compiled here.
    """

    def __init__(self, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        env = env or {}
        self._env_names = frozenset(env)
        credentials = {value for _, _, _, value in _secret_values(extra_args)}
        credentials |= {value for name, value in env.items() if _is_credential_name(name)}
        findable = {value for value in credentials if len(value) >= MIN_CREDENTIAL}
        # Longest first: a value that is part of another must not leave the rest of the other in view.
        ordered = sorted(findable, key=lambda value: (-len(value), value))
        self._pattern = re.compile("|".join(re.escape(value) for value in ordered)) if ordered else None

    @classmethod
    def of_config(cls, config: ModelConfigFields, cmdline: Sequence[str] = ()) -> Redactor:
        """For a config; ``cmdline``: the argv of an engine started by hand, whose own flags count too."""
        return cls([*config.extra_args, *cmdline], config.env)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return hide_flag_values(argv)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment with the config's own variables and the engine's key hidden (the settings
        the manager adds stay)."""
        return {
            name: MARKER if name in self._env_names or name == ENV_NAME else hide_url_users(value)
            for name, value in env.items()
        }

    def command(self, cmd: LaunchCommand) -> LaunchCommand:
        return LaunchCommand(argv=self.argv(cmd.argv), env=self.env(cmd.env), notes=list(cmd.notes))

    def text(self, line: str) -> str:
        """The line with the config's credentials hidden wherever they stand, and any secret flag's value
        and URL's user part hidden whatever they are."""
        if self._pattern is not None:
            line = self._pattern.sub(MARKER, line)
        return hide_url_users(_hide_flags_in_text(line))

    def value(self, value: object) -> object:
        """Every string in a JSON-like value (an event's data) through ``text``; a list of strings (an
        argv) loses its secret flags' values first."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list | tuple):
            if all(isinstance(item, str) for item in value):
                value = hide_flag_values(value)
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        return value

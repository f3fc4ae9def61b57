"""Make the CPU demo's tiny model: a real Llama config and tokenizer, no weights, no downloads.

vLLM serves it with `--load-format dummy` (random weights), so its answers are gibberish, but
every part of the manager (start, health, metrics, dashboard, stop) works on it as on a real
model. Head size 32, because vLLM's CPU backend has no kernels below 32.

Usage: python3 make_tiny_model.py FOLDER   (does nothing when FOLDER already holds the model)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
WORDS = (
    "hello world the a model token cache offload gpu cpu memory fast slow one two three "
    "yes no and or is of to in"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# Files vLLM needs to serve the folder; their presence means an earlier start finished.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _write_model(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    ).save_pretrained(folder)

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )
    # With a chat template the dashboard's chat box (/v1/chat/completions) works too.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(folder)


def make_tiny_model(folder: Path) -> bool:
    """Create the model in `folder`; False when it was already there."""
    if is_complete(folder):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Built next to its final place and renamed, so a start killed half-way leaves no half model.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; workers of another user may read it
    try:
        _write_model(staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_tiny_model.py FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    made = make_tiny_model(folder)
    print(f"demo model {'made' if made else 'found'} at {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

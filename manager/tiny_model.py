"""Tiny models made locally, for tests and the CPU demo: a real config and tokenizer, no weights.

vLLM serves them with ``--load-format dummy``. Nothing is downloaded. vLLM's CPU backend supports head
sizes of 32 and up, so every model here uses head_dim 32.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "hello",
    "world",
    "the",
    "a",
    "model",
    "token",
    "cache",
    "offload",
    "gpu",
    "cpu",
    "memory",
    "fast",
    "slow",
    "one",
    "two",
    "three",
    "yes",
    "no",
    "and",
    "or",
    "is",
    "of",
    "to",
    "in",
]


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    # A chat template lets /v1/chat/completions work on the tiny model too.
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(folder)


def _shape(layers: int, vocab_size: int) -> dict:
    """What every tiny model shares: hidden 128, 4 heads of 32 (vLLM's CPU minimum), 2 KV heads."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )


def make_tiny_llama(folder: Path, *, layers: int = 2, vocab_size: int = 1024) -> Path:
    """A Llama with hidden 128, 4 heads of 32, 2 KV heads; a few MB of dummy weights."""
    from transformers import LlamaConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Without `architectures` vLLM may resolve a pooling model.
    LlamaConfig(architectures=["LlamaForCausalLM"], **_shape(layers, vocab_size)).save_pretrained(folder)
    _save_tokenizer(folder, vocab_size)
    return folder


def make_tiny_qwen3_moe(folder: Path, *, layers: int = 2, vocab_size: int = 1024) -> Path:
    """A Qwen3-MoE with 8 experts of intermediate 64, top-2, otherwise shaped like the tiny Llama."""
    from transformers import Qwen3MoeConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        **_shape(layers, vocab_size),
    ).save_pretrained(folder)
    _save_tokenizer(folder, vocab_size)
    return folder


REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def ensure_tiny_llama(folder: Path) -> bool:
    """Make the demo model in `folder` unless a complete one is there; False when it was already there.

    It is built next to its final place and renamed, so a start killed half-way leaves no half model.
    """
    import shutil
    import tempfile

    folder = Path(folder)
    if all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; engines of another user may read it
    try:
        make_tiny_llama(staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def main(argv: list[str]) -> int:
    import sys

    if len(argv) != 1:
        print("usage: python -m manager.tiny_model FOLDER", file=sys.stderr)
        return 2
    made = ensure_tiny_llama(Path(argv[0]))
    print(f"demo model {'made' if made else 'found'} at {argv[0]}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

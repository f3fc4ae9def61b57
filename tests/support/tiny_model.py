"""Tiny models made locally for tests: a real transformers config and a real tokenizer, no weights.

vLLM serves them with ``--load-format dummy``. Nothing is downloaded. vLLM's CPU backend supports head
sizes of 32 and up, so every model here uses head_dim 32.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "hello", "world", "the", "a", "model", "token", "cache", "offload", "gpu", "cpu", "memory",
    "fast", "slow", "one", "two", "three", "yes", "no", "and", "or", "is", "of", "to", "in",
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
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(folder)


def make_tiny_llama(folder: Path, *, layers: int = 2, vocab_size: int = 1024) -> Path:
    """A Llama with hidden 128, 4 heads of 32, 2 KV heads; a few MB of dummy weights."""
    from transformers import LlamaConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
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
    ).save_pretrained(folder)
    _save_tokenizer(folder, vocab_size)
    return folder


def make_tiny_qwen3_moe(folder: Path, *, layers: int = 2, vocab_size: int = 1024) -> Path:
    """A Qwen3-MoE with 8 experts, top-2, hidden 128, head_dim 32."""
    from transformers import Qwen3MoeConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    _save_tokenizer(folder, vocab_size)
    return folder

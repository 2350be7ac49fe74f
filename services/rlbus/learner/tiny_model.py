"""A tiny random-init causal LM and word-level tokenizer, built locally.

Tests and the CPU demo need a model that loads like any real one
(`AutoModelForCausalLM.from_pretrained(folder)`, `AutoTokenizer.from_pretrained(folder)`)
without downloading anything. The vocabulary is the numbers 0..MAX_NUMBER and every word
of the demo's tasks (:data:`TASK_WORDS`), one token each, so a completion "7" is one token
and the policy's action space stays small enough to learn from scratch with RL; a user's
task adds its own words (``words=``, ``rlbus model init --words``).

Token format: the tokenizer never adds special tokens (no BOS, no EOS), so the ids of a
prompt, of each completion and of each observation concatenate exactly as the agent loop
appends them. `<eos>` ends a completion (the model learns to emit it); `<pad>` pads batches.
Decoding joins words with single spaces, so every task text round-trips exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
MAX_NUMBER = 99

# hidden, layers, heads, intermediate. "tiny" (90k parameters) is the cheapest per step.
# "small" (~0.7M) needed the fewest episodes in an in-process GRPO sweep on guess_number:
# one wide layer with 8 heads beat deeper, narrower models of similar cost.
# "h64": head_dim 64, the smallest shape vLLM's CPU attention kernels accept (the demo on
# RLBUS_ENGINE=vllm, and the hf engine beside it on the same shape).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (64, 2, 4, 128),
    "small": (256, 1, 8, 512),
    "h64": (128, 2, 2, 256),
}


TASK_WORDS = frozenset({
    "guess", "a", "number", "from", "to", ":", "higher", "lower", "correct", "invalid",  # guess
    "+", "=", "wrong",  # addition
    "synthetic", "task", "ok", "done",  # synthetic
})
"""Every word the texts of guess_number, addition and synthetic contain (a test plays them)."""


def vocabulary(words: Iterable[str] = ()) -> list[str]:
    """Special tokens first (stable ids 0..3), then numbers, then the task words, sorted,
    then ``words`` not already in, sorted: extra words never move the ids of the others."""
    numbers = [str(n) for n in range(MAX_NUMBER + 1)]
    base = sorted(TASK_WORDS - set(numbers))
    extra = sorted(set(words) - set(base) - set(numbers) - set(SPECIAL_TOKENS))
    return SPECIAL_TOKENS + numbers + base + extra


def build_tokenizer(folder: str | Path, words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocabulary(words)`, saved to `folder` and returned."""
    bad = [w for w in words if not w or any(c.isspace() for c in w)]
    if bad:
        raise ValueError(f"vocabulary words must be non-empty and without spaces: {bad[:5]}")
    vocab = {word: i for i, word in enumerate(vocabulary(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split on whitespace only: task texts separate every token by a space, and "-" or "."
    # inside a word must not be silently split into known pieces.
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tokenizer.save_pretrained(str(folder))
    _portable_tokenizer_class(Path(folder))
    return tokenizer


def _portable_tokenizer_class(folder: Path) -> None:
    """Name the class transformers 4.x also knows (vLLM may pin 4.x); 5.x aliases it."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_tiny_model(folder: str | Path, size: str = "tiny", seed: int = 0,
                     words: Iterable[str] = (), embedding_std: float | None = None) -> Path:
    """Save a random-init Llama and its tokenizer (with ``words`` added) to `folder`.
    ``embedding_std``: the (tied) embedding's init std instead of the config's 0.02: a
    LoRA adapter trains neither the embedding nor the output head, and at 0.02 the head
    keeps every logit within about ±1.3 of the others whatever the layers below do (the
    final norm fixes the hidden state's length), so no adapter can make a sharp policy."""
    folder = Path(folder)
    tokenizer = build_tokenizer(folder, words)
    hidden, layers, heads, intermediate = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=True,  # halves the parameters of a model this small
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_random_init(LlamaForCausalLM, config, tokenizer, folder, seed, embedding_std)


def save_random_init(model_cls: Any, config: Any, tokenizer: Any, folder: Path,
                     seed: int, embedding_std: float | None = None) -> Path:
    """A random-init ``model_cls(config)`` (seeded; the input embedding drawn with
    ``embedding_std`` if given), its generation config's pad/eos the tokenizer's, saved to
    ``folder``; returns the folder."""
    torch.manual_seed(seed)
    model = model_cls(config)
    if embedding_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, embedding_std)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(folder))
    return folder

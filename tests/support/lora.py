"""A tiny Qwen2 built from its config (no tokenizer: the learner and the hf engine load only
the model) and LoRA adapters over it, published as the learner publishes them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbus.client.tensors import AdapterWeights, prepare, write_version
from rlbus.learner import lora
from rlbus.learner.settings import LoraSettings


def tiny_qwen2(folder: Path, seed: int = 0) -> Path:
    """A random-init two-layer Qwen2 (hidden 32, vocabulary 64) saved to ``folder``."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=None, eos_token_id=1)
    Qwen2ForCausalLM(config).save_pretrained(str(folder))
    return folder


def random_adapter(base: Path, rank: int = 4, seed: int = 0,
                   targets: list[str] | None = None) -> tuple[Any, AdapterWeights]:
    """The base model wrapped as the learner wraps it, its adapter set to random values
    (a fresh one is zero: it would change nothing); the wrapped model and what a publish
    sends."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    settings = LoraSettings(rank=rank, target_modules=targets or ["all-linear"])
    wrapped, adapter = lora.wrap(model, settings)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return wrapped.eval(), lora.adapter_weights(wrapped, adapter)


def publish(weights: AdapterWeights, store: Path, version: int) -> tuple[str, str]:
    """(uri, checksum) of ``weights`` written as version ``version`` by the store's writer."""
    folder, digest = write_version(prepare(weights.tensors), store, version, keep=3,
                                   prefer=set(), adapter_config=weights.config)
    return str(folder), digest


def merged(wrapped: Any, folder: Path) -> Path:
    """``wrapped``'s adapter merged into a copy of its base, saved to ``folder``."""
    copy.deepcopy(wrapped).merge_and_unload().save_pretrained(str(folder))
    return folder

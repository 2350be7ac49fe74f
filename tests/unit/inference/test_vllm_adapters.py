"""The vllm engine's check of a LoRA adapter before it loads one (no vLLM needed): the
adapter folder must agree with its WeightVersion and fit the base model tensor by tensor,
and an engine started without a LoRA slot refuses every adapter. vLLM itself is exercised
in tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rlbus.errors import WeightsMismatchError
from rlbus.inference.vllm_engine import VLLMEngine, _lora_args, _spans, adapter_misfit
from rlbus.messages import LoraAdapter

BASE = {"model.layers.0.self_attn.q_proj.weight": (32, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 64),
        "model.norm.weight": (16,)}
TARGETS = ["q_proj", "down_proj"]
SHAPE = LoraAdapter(rank=4, alpha=8, target_modules=TARGETS)


def write(folder: Path, rank: int = 4, config: dict[str, Any] | None = None,
          skew: str | None = None) -> Path:
    """A PEFT adapter folder over BASE; ``skew``: the tensor given one column too many."""
    tensors = {}
    for key, shape in BASE.items():
        module = key.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out, inp = shape
        stem = f"base_model.model.{module}"
        tensors[f"{stem}.lora_A.weight"] = torch.zeros(rank, inp)
        tensors[f"{stem}.lora_B.weight"] = torch.zeros(out, rank)
    if skew is not None:
        t = tensors[skew]
        tensors[skew] = torch.zeros(t.shape[0], t.shape[1] + 1)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": TARGETS,
         **(config or {})}))
    return folder


def test_an_adapter_that_fits_passes(tmp_path: Path) -> None:
    assert adapter_misfit(write(tmp_path / "a"), SHAPE, BASE, 8) is None


@pytest.mark.parametrize(("kind", "expected"), [
    ("rank", "r 4, announced rank 8"),
    ("targets", "target_modules"),
    ("over_max", "over this member's RLBUS_VLLM_MAX_LORA_RANK 2"),
    ("dora", "use_dora True is not served"),
    ("shape", "q_proj.lora_A.weight: shape [4, 17], the model needs [4, 16]"),
    ("module", "target module down_proj: the model has no such linear layer"),
    ("unreadable", "unreadable"),
])
def test_a_misfit_says_why(tmp_path: Path, kind: str, expected: str) -> None:
    folder, adapter, base, max_rank = tmp_path / "a", SHAPE, BASE, 8
    if kind == "rank":
        adapter = SHAPE.model_copy(update={"rank": 8})
        write(folder)
    elif kind == "targets":
        adapter = SHAPE.model_copy(update={"target_modules": ["q_proj"]})
        write(folder)
    elif kind == "over_max":
        write(folder)
        max_rank = 2
    elif kind == "dora":
        write(folder, config={"use_dora": True})
    elif kind == "shape":
        write(folder, skew="base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    elif kind == "module":
        write(folder)
        base = {k: v for k, v in BASE.items() if "down_proj" not in k}
    else:
        write(folder)
        (folder / "adapter_config.json").write_text("{not json")
    why = adapter_misfit(folder, adapter, base, max_rank)
    assert why is not None and expected in why


def test_an_engine_without_a_lora_slot_refuses_adapters(tmp_path: Path) -> None:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: only the refusal runs
    engine.max_lora_rank = None
    with pytest.raises(WeightsMismatchError, match="LoRA is off"):
        asyncio.run(engine.load_adapter(str(write(tmp_path / "a")), "x", 3, SHAPE))


def test_vllm_slot_ranks_and_version_spans() -> None:
    class Span:
        def __init__(self, version: str, start: int, end: int) -> None:
            self.version, self.start, self.end = version, start, end

    assert _lora_args(None) == {}
    assert [_lora_args(r)["max_lora_rank"] for r in (1, 4, 8, 9, 300)] == [1, 8, 8, 16, 320]
    assert _spans(None) is None
    assert _spans([Span("default", 0, 3), Span("7", 3, 10)]) == [(0, 3), (7, 7)]

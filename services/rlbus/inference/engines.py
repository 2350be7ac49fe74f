"""Inference engines: token ids in, token ids and per-token logprobs out.

Every engine reports logprobs of the sampled tokens under the distribution they were
sampled from: log-softmax of logits / T, renormalised over the top-p nucleus when
top_p < 1 (temperature 0, greedy, reports the unmodified policy's). The learner's prompts
ask for top_p 1 and recompute logits / T at the same temperature (``RLBUS_TEMPERATURE``),
so the importance ratio is exactly 1 for an on-policy sample and measures staleness
otherwise. The model folder's own sampling defaults (``generation_config.json``: top_k,
repetition_penalty, ...) are ignored: a request samples exactly as its ``Sampling`` says.
Weights are swapped only between batches (``load``), never inside a generation.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import random
import sys
import zlib
from pathlib import Path
from typing import Any

from rlbus.inference.engine import Completion, Engine
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import Sampling
from rlbus.weights import verified_weights

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- hf


class HFEngine(Engine):
    """transformers + torch, any local causal LM folder; CPU or GPU."""

    def __init__(self, settings: InferenceSettings) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if settings.model_path is None:
            raise ValueError("the hf engine needs RLBUS_MODEL_PATH (a Hugging Face model folder)")
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        # Replicas of one tier must not draw the same samples for the same prompt.
        torch.manual_seed(settings.seed + zlib.crc32(settings.instance.encode()))
        self.torch = torch
        self.device = torch.device(settings.device)
        # safetensors only: a pickled checkpoint (pytorch_model.bin) can run code on load
        model: Any = AutoModelForCausalLM.from_pretrained(
            settings.model_path, dtype=getattr(torch, settings.dtype), use_safetensors=True
        )
        self.model = model.to(self.device)
        self.model.eval()
        gen = self.model.generation_config
        self.pad_id = _first(gen.pad_token_id, self.model.config.pad_token_id, 0)
        eos = _first(gen.eos_token_id, self.model.config.eos_token_id)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # Only the request decides how to sample: generate() would otherwise merge in the
        # folder's defaults (a Qwen's repetition_penalty, top_k) even over explicit kwargs.
        from transformers import GenerationConfig

        self._base = GenerationConfig(  # type: ignore[no-untyped-call]
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids) or None,
            return_dict_in_generate=True, output_scores=True)
        self.model.generation_config = self._base  # generate() merges in its unset fields

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        return await asyncio.to_thread(self._generate, prompts, sampling)

    def _generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        torch = self.torch
        input_ids, attention = self._left_pad(prompts)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                      generation_config=self._config(sampling))
        new = out.sequences[:, input_ids.shape[1] :]  # (B, N)
        # The scores are the logits as sampled: / T, -inf outside the top-p nucleus (raw
        # when greedy). One step's (B, V) at a time, never a stacked (B, N, V) tensor.
        logp = torch.stack([  # (B, N)
            step.float().log_softmax(-1).gather(-1, new[:, i : i + 1]).squeeze(-1)
            for i, step in enumerate(out.scores)
        ], dim=1)
        return [self._trim(new[i].tolist(), logp[i].tolist()) for i in range(len(prompts))]

    def _config(self, sampling: Sampling) -> Any:
        """The whole generation config of one request. Fields are set after construction:
        the constructor warns about top_k 0 (off; unset would mean 50) and generate()
        about configs mixed with keyword arguments."""
        config = copy.deepcopy(self._base)
        config.max_new_tokens = sampling.max_new_tokens
        if sampling.temperature > 0.0:
            config.do_sample = True
            config.temperature, config.top_p, config.top_k = sampling.temperature, sampling.top_p, 0
        return config

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _trim(self, ids: list[int], logprobs: list[float]) -> Completion:
        for i, tok in enumerate(ids):
            if tok in self.eos_ids:
                return Completion(ids[: i + 1], logprobs[: i + 1], "stop")
        return Completion(ids, logprobs, "length")

    async def load(self, uri: str, checksum: str, version: int) -> None:
        path = await asyncio.to_thread(verified_weights, uri, checksum)
        await asyncio.to_thread(self._load_file, path)
        self.version = version

    def _load_file(self, path: Path) -> None:
        from safetensors.torch import load_model

        load_model(self.model, str(path), device=str(self.device))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# --------------------------------------------------------------------------- synthetic


class SyntheticEngine(Engine):
    """No model: waits as long as the latency model says and returns uniform tokens."""

    reads_weight_files = False

    def __init__(self, settings: InferenceSettings) -> None:
        self.cfg = settings.synthetic
        self.rng = random.Random(settings.seed)

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        n = min(self.cfg.completion_tokens, sampling.max_new_tokens)
        await asyncio.sleep((self.cfg.base_ms + self.cfg.per_token_ms * n) / 1000)
        lp = -math.log(self.cfg.vocab_size)
        vocab = self.cfg.vocab_size
        return [
            Completion([self.rng.randrange(vocab) for _ in range(n)], [lp] * n, "stop")
            for _ in prompts
        ]

    async def load(self, uri: str, checksum: str, version: int) -> None:
        self.version = version  # nothing to load; the version still flows through


def make_engine(settings: InferenceSettings) -> Engine:
    if settings.engine == "hf":
        return HFEngine(settings)
    if settings.engine == "synthetic":
        return SyntheticEngine(settings)
    return _vllm_engine(settings)


def _vllm_engine(settings: InferenceSettings) -> Engine:
    """vLLM pins its own torch, so it lives in a virtualenv of its own (.venv-vllm)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"RLBUS_ENGINE=vllm needs vLLM, which this Python ({sys.executable}) cannot "
            f"import ({exc}); build its virtualenv with `make vllm-env` and run the service "
            "with .venv-vllm/bin/python -m rlbus.inference"
        ) from None
    from rlbus.inference.vllm_engine import VLLMEngine

    return VLLMEngine(settings)

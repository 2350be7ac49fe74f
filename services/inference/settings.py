"""Settings of the inference tier (env prefix ``RLBUS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlbus.settings import ServiceSettings


class SyntheticEngineSettings(BaseModel):
    """Latency model of the ``synthetic`` engine (load tests; no weights)."""

    model_config = ConfigDict(extra="forbid")

    base_ms: float = 5.0
    """Fixed cost of one batch (a forward pass over the prompt)."""
    per_token_ms: float = 0.5
    """Cost of each generated token of a batch (decode steps run in lockstep)."""
    completion_tokens: int = 8
    """Tokens each completion has (capped by max_new_tokens)."""
    vocab_size: int = 1000
    """Token ids are drawn uniformly below this."""


class InferenceSettings(ServiceSettings):
    """One inference replica: a consumer of steps that answers with completions."""

    engine: Literal["hf", "synthetic", "vllm"] = "hf"
    """hf: transformers + torch (CPU or GPU); synthetic: latency only; vllm: reserved for
    vLLM's async engine (not implemented yet: refused at start with that message)."""
    model_path: Path | None = None
    """Folder of a Hugging Face causal LM (config, safetensors, tokenizer); not for synthetic."""
    model_name: str = "policy"
    """Key of this model's WeightVersion events; only those are loaded."""
    device: str = "cpu"
    """torch device of the hf engine, e.g. cpu or cuda:0."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype of the hf/vllm engine; bfloat16 on GPUs."""
    torch_threads: int | None = 1
    """torch intra-op threads (CPU); 1 leaves cores for the other services of a one-box run."""
    max_batch_size: int = Field(default=64, ge=1)
    """Most step requests in one engine batch."""
    batch_wait_ms: float = Field(default=2.0, ge=0)
    """After the first request arrives, how long to wait for more to fill the batch."""
    version_wait_s: float = Field(default=60.0, ge=0)
    """Longest wait for the weights a request's min_version asks for before serving it
    with older ones (and counting it)."""
    seed: int = 0
    """Sampling seed; each replica mixes in its instance name for a stream of its own."""
    synthetic: SyntheticEngineSettings = SyntheticEngineSettings()
    """synthetic engine latency model."""

"""Settings of the inference tier (env prefix ``RLBUS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

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

    service: ClassVar[str] = "rlbus.inference.service:Inference"

    engine: Literal["hf", "synthetic", "vllm"] = "hf"
    """hf: transformers + torch (CPU or GPU); synthetic: latency only; vllm: vLLM's async
    engine (continuous batching; needs the vLLM virtualenv, ``make vllm-env``)."""
    model_path: Path | None = None
    """Folder of a Hugging Face causal LM (config, safetensors, tokenizer); not for synthetic."""
    model_name: str = "policy"
    """Key of this model's WeightVersion events; only those are loaded."""
    weights_dir: Path | None = None
    """The weight store the learner publishes to (its ``RLBUS_WEIGHTS_DIR``, at the same
    path here): a WeightVersion whose uri lies outside it is dead-lettered, never loaded.
    None: any local path is loaded (logged at start); set it wherever the weights topic
    could carry a version from anyone but the learner."""
    device: str = "cpu"
    """torch device of the hf engine, e.g. cpu or cuda:0."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype of the hf/vllm engine; bfloat16 on GPUs."""
    torch_threads: int | None = 1
    """torch intra-op threads (CPU); 1 leaves cores for the other services of a one-box run."""
    max_batch_size: int = Field(default=64, ge=1)
    """Most step requests in one engine batch."""
    batch_wait_ms: float = Field(default=2.0, ge=0)
    """Longest a request waits for others to fill its batch, counted from when it was sent:
    a request that already waited that long (queued behind a running batch) is served with
    the next batch at once."""
    version_wait_s: float = Field(default=60.0, ge=0)
    """Longest wait for the weights a request's min_version asks for before serving it
    with older ones (and counting it)."""
    served_report_s: float = Field(default=5.0, gt=0)
    """How often this member reports the weights version it serves on weights.served
    (besides at once after each load): what a trainer's ``wait_served`` reads."""
    inflight_updates: bool = False
    """hf and vllm (and synthetic, as a latency model): apply a newly announced weight
    version between decode steps of a running batch, not only between batches
    (PipelineRL-style partial rollouts); every token records the version that produced it
    (``StepResult.version_spans``). hf: the engine decodes with a loop of its own, in place
    of transformers' ``generate``. vllm: a load pauses vLLM's scheduler with mode "keep"
    (``AsyncLLM.pause_generation``), swaps the weights and resumes; running requests
    continue where they were (docs/off-policy.md, "In-flight updates on vLLM"). Off by
    default: with ``inflight_kv`` keep, tokens after a switch come from new weights over a
    cache computed by the old ones, and a completion's behaviour policy is a mixture
    (docs/internals.md, "Partial rollouts and in-flight updates")."""
    inflight_kv: Literal["keep", "recompute"] = "keep"
    """hf and vllm with ``inflight_updates``: what happens to the KV cache of a running batch
    when new weights land. keep (PipelineRL): the cache computed by the old weights stays,
    only later tokens see the new ones, no extra work; recompute: the whole sequence so far
    is prefilled again with the new weights, so every later token is exactly what a fresh
    engine with the new weights would give for that prefix (vllm: the pause clears the
    cache, which preempts every running request; each is prefilled again on resume)."""
    seed: int = 0
    """Sampling seed; each replica mixes in its instance name for a stream of its own."""
    synthetic: SyntheticEngineSettings = SyntheticEngineSettings()
    """synthetic engine latency model."""
    vllm_gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """vllm: share of the GPU's memory vLLM may take (weights + KV cache); on the CPU
    backend, despite the name, the share of the machine's memory it checks is free at
    start (set ``vllm_kv_cache_gib`` and lower this on a shared CPU machine)."""
    vllm_kv_cache_gib: float | None = Field(default=None, gt=0)
    """vllm: GiB for the KV cache, fixed; None: sized by vLLM (GPU: from
    ``vllm_gpu_memory_utilization``; CPU backend: VLLM_CPU_KVCACHE_SPACE or its default)."""
    vllm_max_model_len: int | None = Field(default=None, ge=1)
    """vllm: longest prompt + completion in tokens; None takes the model config's."""
    vllm_max_num_seqs: int = Field(default=256, ge=1)
    """vllm: most sequences the engine schedules at once (its continuous-batch width)."""
    vllm_enforce_eager: bool = False
    """vllm: no CUDA graphs / torch.compile (faster start, slower decode); tests set it."""
    vllm_enable_prefix_caching: bool = True
    """vllm: reuse the KV cache of shared prompt prefixes (multi-turn episodes); the cache
    is reset on every weight load, so no prefix outlives the weights that computed it."""
    vllm_max_lora_rank: int | None = Field(default=None, ge=1, le=512)
    """vllm: serve LoRA adapters (a WeightVersion with ``adapter``) up to this rank; None: LoRA
    is off and an adapter version is refused (the member keeps serving what it served). vLLM
    sizes its adapter slot at start from this, so it cannot change while running."""

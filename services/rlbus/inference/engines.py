"""Inference engines: token ids in, token ids and per-token logprobs out.

Every engine reports logprobs of the sampled tokens under the distribution they were
sampled from: log-softmax of logits / T, renormalised over the top-p nucleus when
top_p < 1 (temperature 0, greedy, reports the unmodified policy's). The learner's prompts
ask for top_p 1 and recompute logits / T at the same temperature (``RLBUS_TEMPERATURE``),
so the importance ratio is exactly 1 for an on-policy sample and measures staleness
otherwise. The model folder's own sampling defaults (``generation_config.json``: top_k,
repetition_penalty, ...) are ignored: a request samples exactly as its ``Sampling`` says.
Weights are swapped only between batches (``load``), never inside a generation, unless
the hf engine runs with ``inflight_updates``: then it decodes with a loop of its own, a
``load`` inside :meth:`HFEngine.step_boundary` lands between two decode steps of a running
batch, and each completion records which version produced which token
(docs/internals.md, "Partial rollouts and in-flight updates").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import inspect
import logging
import math
import random
import struct
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rlbus.errors import WeightsMismatchError
from rlbus.inference.adapters import adapter_problems, read_adapter
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.settings import InferenceSettings
from rlbus.inference.weight_load import adapter_plan, copy_in, load_in_place
from rlbus.messages import LoraAdapter, Sampling, spans_of
from rlbus.weights import safetensors_index, verified_mapping

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
        self.adapter: LoraAdapter | None = None
        """The LoRA adapter shape served (None: the plain model)."""
        self._linears: dict[str, tuple[int, int]] | None = None
        self.inflight_updates = settings.inflight_updates
        self.inflight_kv = settings.inflight_kv
        # In-flight updates: a decode step runs holding _step; a holder of step_boundary
        # takes _turnstile first, so the decode loop stops at its next step boundary
        # instead of racing it back to _step.
        self._step = threading.Lock()
        self._turnstile = threading.Lock()
        self.decode_steps = 0
        """Decode steps taken by the in-flight loop since start (forward passes)."""
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache (in and out); 4.x has the old name
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._last_logits: dict[str, int] = {"logits_to_keep": 1} if "logits_to_keep" in params \
            else {}

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        if self.inflight_updates:
            return await asyncio.to_thread(self._decode, prompts, sampling)
        return await asyncio.to_thread(self._generate, prompts, sampling)

    @contextlib.asynccontextmanager
    async def step_boundary(self) -> AsyncIterator[None]:
        if not self.inflight_updates:
            yield
            return
        await _acquire(self._turnstile)
        try:
            await _acquire(self._step)
            try:
                yield
            finally:
                self._step.release()
        finally:
            self._turnstile.release()

    def _decode(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """Generate with a decode loop of our own (in-flight updates): one forward pass per
        token, each under the weights loaded at that moment, with the KV cache kept across
        a switch (``inflight_kv`` keep) or recomputed by the new weights (recompute).
        Samples and reports logprobs exactly as :meth:`_generate` does."""
        torch = self.torch
        seq, mask = self._left_pad(prompts)  # (B, T)
        batch = len(prompts)
        ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        done = [False] * batch
        past: Any = None
        cache_version = -1
        with torch.inference_mode():
            for _ in range(sampling.max_new_tokens):
                with self._turnstile:  # a pending load goes first
                    pass
                with self._step:
                    version = self.version
                    if past is None or (version != cache_version
                                        and self.inflight_kv == "recompute"):
                        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
                        out = self.model(input_ids=seq, attention_mask=mask,
                                         position_ids=positions, use_cache=True,
                                         **self._last_logits)
                    else:
                        positions = mask.sum(-1, keepdim=True) - 1  # (B, 1)
                        out = self.model(input_ids=seq[:, -1:], attention_mask=mask,
                                         position_ids=positions, use_cache=True,
                                         **{self._cache_arg: past})
                    past, cache_version = getattr(out, self._cache_arg), version
                    token, logp = self._pick(out.logits[:, -1, :].float(), sampling)  # (B,)
                    self.decode_steps += 1
                # finished rows go on decoding a pad, as generate() does; it is not kept
                token = torch.where(torch.tensor(done, device=self.device),
                                    torch.full_like(token, self.pad_id), token)
                seq = torch.cat([seq, token[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                for i, (tok, lp) in enumerate(zip(token.tolist(), logp.tolist(), strict=True)):
                    if done[i]:
                        continue
                    ids[i].append(tok)
                    logprobs[i].append(lp)
                    versions[i].append(version)
                    done[i] = tok in self.eos_ids
                if all(done):
                    break
        completions: list[Completion] = []
        for i in range(batch):
            c = self._trim(ids[i], logprobs[i])
            spans = spans_of(versions[i][: len(c.completion_ids)])
            completions.append(Completion(c.completion_ids, c.logprobs, c.finish_reason, spans))
        return completions

    def _pick(self, logits: Any, sampling: Sampling) -> tuple[Any, Any]:
        """The next token of each row and its logprob under the distribution it was drawn
        from: greedy on the raw logits, or logits / T, top-p filtered as transformers'
        TopPLogitsWarper does (at least one token kept)."""
        torch = self.torch
        if sampling.temperature <= 0.0:
            token = logits.argmax(-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        scores = logits / sampling.temperature  # (B, V)
        if sampling.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative <= (1 - sampling.top_p)
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
        logp = scores.log_softmax(-1)
        token = torch.multinomial(logp.exp(), 1).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

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
        await asyncio.to_thread(self._load_verified, uri, checksum)
        self.version = version

    async def load_adapter(self, uri: str, checksum: str, version: int,
                           adapter: LoraAdapter) -> None:
        await asyncio.to_thread(self._load_adapter, uri, checksum, version, adapter)
        self.version = version

    def _load_adapter(self, uri: str, checksum: str, version: int, adapter: LoraAdapter) -> None:
        """Check the adapter folder against the message and the base model, verify its
        file, then copy its tensors into the LoRA layers: injected (through peft) the first
        time, the same ones every later version (no re-wrapping, no new memory). An adapter
        of another shape than the one served is refused: the learner's shape is fixed for
        its run."""
        try:
            config, specs = read_adapter(Path(uri.removeprefix("file://")))
        except (ValueError, struct.error) as exc:  # not JSON, not safetensors
            raise WeightsMismatchError(f"adapter v{version}: unreadable: {exc}") from None
        problems = adapter_problems(config, specs, adapter, self._linear_shapes())
        if self.adapter is not None and adapter != self.adapter:
            problems.append(f"its shape {adapter} is not the served adapter's {self.adapter}")
        if problems:
            raise WeightsMismatchError(f"adapter v{version} does not fit the served model: "
                                       + "; ".join(problems[:8]))
        mapping = verified_mapping(uri, checksum)
        try:
            index = safetensors_index(mapping, uri)
            if self.adapter is None:
                self._inject(adapter)
            copy_in(adapter_plan(self.model, index, uri), mapping)
        finally:
            mapping.close()
        self.adapter = adapter

    def _linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of the base model, but its output head
        (the layers PEFT's ``all-linear`` wraps); the base layer of one peft wrapped."""
        if self._linears is None:
            head = self.model.get_output_embeddings()
            nn = self.torch.nn
            self._linears = {name.removesuffix(".base_layer"): (m.in_features, m.out_features)
                             for name, m in self.model.named_modules()
                             if isinstance(m, nn.Linear) and m is not head
                             and ".lora_" not in name}
        return self._linears

    def _inject(self, adapter: LoraAdapter) -> None:
        """LoRA layers of ``adapter``'s shape in the served model, in place (the model
        keeps its class: generate and the in-flight decode loop run as they did)."""
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha,  # type: ignore[arg-type]
                            target_modules=list(adapter.target_modules), lora_dropout=0.0)
        inject_adapter_in_model(config, self.model)
        self.model.eval()

    def _load_verified(self, uri: str, checksum: str) -> None:
        """Map the file, verify the mapping, copy it into the model's own parameters
        (:mod:`rlbus.inference.weight_load`): one read of the file, one copy."""
        mapping = verified_mapping(uri, checksum)
        try:
            load_in_place(self.model, mapping, uri)
        finally:
            mapping.close()


async def _acquire(lock: threading.Lock) -> None:
    """Take a thread lock from the event loop without blocking it. Cancellable: a try
    that took the lock after its caller was cancelled gives it back."""
    while True:
        attempt = asyncio.ensure_future(asyncio.to_thread(lock.acquire, True, 0.05))
        try:
            if await asyncio.shield(attempt):
                return
        except asyncio.CancelledError:
            if await attempt:
                lock.release()
            raise


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# --------------------------------------------------------------------------- synthetic


class SyntheticEngine(Engine):
    """No model: waits as long as the latency model says and returns uniform tokens.

    With ``inflight_updates`` it models the hf engine's in-flight path: a load may land
    while a batch sleeps, and each token reports the version held when its decode step
    began (a prefill of ``base_ms``, then one step of ``per_token_ms`` per token), so a
    load test sees the same ``version_spans`` a real engine would report, at no change to
    the latency model."""

    reads_weight_files = False

    def __init__(self, settings: InferenceSettings) -> None:
        self.cfg = settings.synthetic
        self.rng = random.Random(settings.seed)
        self.inflight_updates = settings.inflight_updates
        self._loads: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        """(monotonic time, version) of the latest loads, for the versions of a batch's
        tokens."""

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        n = min(self.cfg.completion_tokens, sampling.max_new_tokens)
        began, version = time.monotonic(), self.version
        await asyncio.sleep((self.cfg.base_ms + self.cfg.per_token_ms * n) / 1000)
        spans = self._spans(began, version, n) if self.inflight_updates else None
        lp = -math.log(self.cfg.vocab_size)
        vocab = self.cfg.vocab_size
        return [
            Completion([self.rng.randrange(vocab) for _ in range(n)], [lp] * n, "stop", spans)
            for _ in prompts
        ]

    def _spans(self, began: float, version: int, n: int) -> list[tuple[int, int]]:
        """The version of each of ``n`` tokens of a batch that began at ``began`` holding
        ``version``: the latest one loaded before the token's decode step started."""
        versions = []
        for i in range(n):
            step = began + (self.cfg.base_ms + self.cfg.per_token_ms * i) / 1000
            versions.append(max([version, *(v for t, v in self._loads if t <= step)]))
        return spans_of(versions)

    async def load(self, uri: str, checksum: str, version: int) -> None:
        self.version = version  # nothing to load; the version still flows through
        self._loads.append((time.monotonic(), version))


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

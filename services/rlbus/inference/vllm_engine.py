"""The ``vllm`` engine: vLLM's async engine (AsyncLLM), token ids in, ids and logprobs out.

Each prompt is one vLLM request, so a batch joins vLLM's continuous batch and finishes
request by request. Logprobs are vLLM's ``processed_logprobs``: of the sampled token under
the distribution it was sampled from (logits / T, renormalised over the top-p nucleus;
greedy: unmodified), as the other engines report them (see :mod:`.engines`).

Weights are reloaded in place, never by restarting the engine: the front end verifies the
sha256, then every worker reads the safetensors file and loads it through the model's own
``load_weights`` (:class:`WeightLoader`, injected into vLLM's worker as its extension class),
and the prefix cache is reset so that no KV block computed by old weights is reused. The
weight store's file keeps only one name of tied tensors (``lm_head.weight`` for a tied Qwen2,
from ``safetensors.save_model``), which vLLM's loader maps onto the shared parameter; but the
CPU backend multiplies by the output head through a packed copy of its weight that an
in-place reload leaves stale when the head is tied, so the loader rebuilds it
(:meth:`WeightLoader._repack_embeddings`).

In-flight updates (``inflight_updates``): a load pauses vLLM's scheduler with mode "keep"
(``AsyncLLM.pause_generation``: running requests stay where they are), swaps the weights,
labels them with the version (``AsyncLLM.update_weight_version``) and resumes. vLLM stamps
every engine step's output with the label of the weights that computed it and reports the
spans on a request's final output (``CompletionOutput.weight_versions``), so
``Completion.version_spans`` is exact per token without streaming. With ``inflight_kv``
keep, the running requests' KV cache stays (clear_cache=False); the prefix cache cannot be
reset while they hold blocks, so its reset waits for the next ``generate`` that finds the
engine idle: until then a new request could reuse a prefix computed by the old weights, which
the service never sends (it generates one batch at a time). With recompute, the pause clears
the cache, which preempts every running request (vLLM's ``reset_prefix_cache`` with
``reset_running_requests``): on resume each is prefilled again, prompt and tokens so far,
by the new weights. The pause is taken after the file is verified, around the swap alone:
hashing never stalls decoding, so ``step_boundary`` itself holds nothing.

LoRA (``vllm_max_lora_rank``): vLLM starts with one adapter slot of that rank. A version with
an ``adapter`` is checked (:func:`adapter_misfit`: checksum, its config against the message,
every tensor against the base model's own shapes), then loaded into that slot under one
fixed id with ``load_inplace``: vLLM loads the new adapter before it evicts the old, so a
load that fails leaves the old one served, and memory holds one adapter whatever the number
of versions. Every request from then on names that id; a running request (in-flight
updates) continues on the new adapter, like on new full weights. A full-weights version
drops the adapter (it is whole: what it names is the policy).

vLLM starts its engine core with ``spawn``: every entry point that builds this engine must
be import-safe (``if __name__ == "__main__"``), as ``python -m rlbus.inference`` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rlbus.client.tensors import folder_specs
from rlbus.errors import WeightsMismatchError
from rlbus.inference.adapters import adapter_problems, read_adapter
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import FinishReason, LoraAdapter, Sampling
from rlbus.weights import ADAPTER_FILE, verified_weights

log = logging.getLogger(__name__)

_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}
LORA_ID = 1
"""vLLM's id of the served adapter: the same for every version (replaced in place)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The slot ranks vLLM accepts (``max_lora_rank``); a setting between two takes the next."""


class VLLMEngine(Engine):
    """AsyncLLM in this process, its engine core in a child process."""

    def __init__(self, settings: InferenceSettings) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM

        if settings.model_path is None:
            raise ValueError("the vllm engine needs RLBUS_MODEL_PATH (a Hugging Face model folder)")
        self._params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._ids = itertools.count()
        self._prefix = f"{settings.instance}-"
        self.inflight_updates = settings.inflight_updates
        self.inflight_kv = settings.inflight_kv
        self.max_lora_rank = settings.vllm_max_lora_rank
        self._lora: Any = None  # the LoRARequest every request names; None: the base alone
        self._base_shapes: dict[str, tuple[int, ...]] = {}
        if self.max_lora_rank is not None:
            self._base_shapes = {name: spec.shape for name, spec
                                 in folder_specs(settings.model_path).items()}
        self._stale_prefixes = False  # a load could not reset the prefix cache yet
        t0 = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(_engine_args(AsyncEngineArgs, settings))
        log.info("vllm engine up in %.1fs", time.perf_counter() - t0)

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        params = self._params(
            temperature=sampling.temperature,
            top_p=1.0 if sampling.temperature == 0.0 else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's only
            output_kind=self._final_only,
        )
        if self._stale_prefixes and self.llm.get_num_unfinished_requests() == 0:
            self._stale_prefixes = not await self.llm.reset_prefix_cache()
        # vLLM's own input path for token ids (it checks them against max_model_len)
        inputs = await self.llm.renderer.render_cmpl_async(
            [{"prompt_token_ids": p} for p in prompts])
        lora = self._lora
        # Cancelling this gather cancels each request's generator, which aborts it in vLLM.
        return list(await asyncio.gather(*(self._one(x, params, lora) for x in inputs)))

    async def _one(self, prompt: Any, params: Any, lora: Any) -> Completion:
        request_id = f"{self._prefix}{next(self._ids)}"
        final = None
        async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
            final = out
        assert final is not None and final.finished, request_id
        gen = final.outputs[0]
        if gen.finish_reason not in _FINISH:
            raise RuntimeError(f"vllm request {request_id} ended with {gen.finish_reason!r}")
        ids = list(gen.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(gen.logprobs or [], ids, strict=True)]
        return Completion(ids, logprobs, _FINISH[gen.finish_reason], _spans(gen.weight_versions))

    async def load(self, uri: str, checksum: str, version: int) -> None:
        path = await asyncio.to_thread(verified_weights, uri, checksum)
        async with self._swap(version):
            await self.llm.collective_rpc("rlbus_load_safetensors", args=(str(path),))
            self._lora = None

    async def load_adapter(self, uri: str, checksum: str, version: int,
                           adapter: LoraAdapter) -> None:
        if self.max_lora_rank is None:
            raise WeightsMismatchError(
                f"v{version} is a LoRA adapter and this member serves none: LoRA is off "
                "(set RLBUS_VLLM_MAX_LORA_RANK at start to serve adapters)")
        folder = Path(uri.removeprefix("file://"))
        await asyncio.to_thread(verified_weights, str(folder / ADAPTER_FILE), checksum)
        why = await asyncio.to_thread(adapter_misfit, folder, adapter, self._base_shapes,
                                      self.max_lora_rank)
        if why is not None:
            raise WeightsMismatchError(f"adapter v{version} ({folder}) does not fit: {why}")
        from vllm.lora.request import LoRARequest

        name = f"rlbus-v{version}"
        async with self._swap(version):
            try:
                await self.llm.add_lora(LoRARequest(name, LORA_ID, str(folder),
                                                    load_inplace=True))
            except Exception as exc:  # vLLM's own checks; the old adapter stays loaded
                raise WeightsMismatchError(
                    f"adapter v{version} ({folder}): vLLM refused it: {exc}") from exc
            # what requests name: without load_inplace, or every step would reload it
            self._lora = LoRARequest(name, LORA_ID, str(folder))

    @contextlib.asynccontextmanager
    async def _swap(self, version: int) -> AsyncIterator[None]:
        """Hold generation (in-flight updates) while the body changes the weights, then
        label them ``version`` and keep stale KV blocks from being reused."""
        held = self.inflight_updates
        recompute = self.inflight_kv == "recompute"
        if held:
            # keep: the running requests stay scheduled; clear_cache preempts them too
            await self.llm.pause_generation(mode="keep", clear_cache=recompute)
        try:
            yield
            await self.llm.update_weight_version(str(version))
            self.version = version
            if not (held and recompute):  # recompute: cleared at the pause, nothing since
                idle = self.llm.get_num_unfinished_requests() == 0
                self._stale_prefixes = not (idle and await self.llm.reset_prefix_cache())
        finally:
            if held:
                await self.llm.resume_generation()

    async def close(self) -> None:
        self.llm.shutdown()


def _engine_args(cls: Any, settings: InferenceSettings) -> Any:
    kv_bytes = None if settings.vllm_kv_cache_gib is None else int(
        settings.vllm_kv_cache_gib * 2**30)
    return cls(
        model=str(settings.model_path),
        load_format="safetensors",  # never a pickled checkpoint: unpickling can run code
        dtype=settings.dtype,
        # Replicas of one tier must not draw the same samples for the same prompt.
        seed=settings.seed + zlib.crc32(settings.instance.encode()),
        max_model_len=settings.vllm_max_model_len,
        max_num_seqs=settings.vllm_max_num_seqs,
        gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=kv_bytes,
        enforce_eager=settings.vllm_enforce_eager,
        enable_prefix_caching=settings.vllm_enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{__name__}.WeightLoader",
        disable_log_stats=True,
        **_lora_args(settings.vllm_max_lora_rank),
    )


def _lora_args(rank: int | None) -> dict[str, Any]:
    """vLLM's LoRA arguments: none when LoRA is off (vLLM's defaults); else one adapter
    slot (one adapter is served at a time) of the smallest rank vLLM accepts that fits."""
    if rank is None:
        return {}
    return {"enable_lora": True, "max_loras": 1,
            "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank)}


def _spans(labels: Any) -> list[tuple[int, int]] | None:
    """vLLM's weight version spans (labels are our versions as text; vLLM's own
    "default" before the first load is version 0) as ``(version, count)`` runs."""
    if not labels:
        return None
    return [(int(s.version) if s.version.isdigit() else 0, s.end - s.start)
            for s in labels if s.end > s.start]


def adapter_misfit(folder: Path, adapter: LoraAdapter, base: dict[str, tuple[int, ...]],
                   max_rank: int) -> str | None:
    """Why the PEFT adapter in ``folder`` must not be served over the base model whose
    tensor shapes are ``base`` (None: it fits): its rank is over ``max_rank``, or
    :func:`rlbus.inference.adapters.adapter_problems` finds a misfit (its config against
    the message, DoRA and the like, a tensor that does not fit the layer it adapts), the
    same check as the hf engine's. vLLM itself pads an adapter narrower than its slot
    without a word, hence the shape check here."""
    if adapter.rank > max_rank:
        return f"rank {adapter.rank} is over this member's RLBUS_VLLM_MAX_LORA_RANK {max_rank}"
    try:
        config, specs = read_adapter(folder)
    except (OSError, ValueError, WeightsMismatchError) as exc:
        return f"unreadable: {exc}"
    problems = adapter_problems(config, specs, adapter, _linear_layers(base))
    return "; ".join(problems) or None


def _linear_layers(base: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """The base model's linear layers as (in_features, out_features), from its tensor
    shapes: every 2-D weight but the embedding and the output head."""
    out = {}
    for key, shape in base.items():
        module = key.removesuffix(".weight")
        if (key.endswith(".weight") and len(shape) == 2 and "embed" not in module
                and module.rsplit(".", 1)[-1] != "lm_head"):
            out[module] = (shape[1], shape[0])
    return out


class WeightLoader:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in every worker."""

    model_runner: Any
    reload_weights: Any  # vLLM's Worker.reload_weights: in place, under the worker's config

    def rlbus_load_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            self.reload_weights(weights_iterator=((k, f.get_tensor(k)) for k in names))
        self._repack_embeddings()

    def _repack_embeddings(self) -> None:
        """The packed copy is made once after loading; the reload re-processes the layers
        it loaded, but not a head whose parameter is the input embedding's, so every
        embedding-like layer is processed again (a no-op off the CPU backend)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)

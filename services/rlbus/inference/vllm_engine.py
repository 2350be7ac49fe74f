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

vLLM starts its engine core with ``spawn``: every entry point that builds this engine must
be import-safe (``if __name__ == "__main__"``), as ``python -m rlbus.inference`` is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib
from typing import Any

from rlbus.inference.engine import Completion, Engine
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import FinishReason, Sampling
from rlbus.weights import verified_weights

log = logging.getLogger(__name__)

_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}


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
        # vLLM's own input path for token ids (it checks them against max_model_len)
        inputs = await self.llm.renderer.render_cmpl_async(
            [{"prompt_token_ids": p} for p in prompts])
        # Cancelling this gather cancels each request's generator, which aborts it in vLLM.
        return list(await asyncio.gather(*(self._one(x, params) for x in inputs)))

    async def _one(self, prompt: Any, params: Any) -> Completion:
        request_id = f"{self._prefix}{next(self._ids)}"
        final = None
        async for out in self.llm.generate(prompt, params, request_id):
            final = out
        assert final is not None and final.finished, request_id
        gen = final.outputs[0]
        if gen.finish_reason not in _FINISH:
            raise RuntimeError(f"vllm request {request_id} ended with {gen.finish_reason!r}")
        ids = list(gen.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(gen.logprobs or [], ids, strict=True)]
        return Completion(ids, logprobs, _FINISH[gen.finish_reason])

    async def load(self, uri: str, checksum: str, version: int) -> None:
        path = await asyncio.to_thread(verified_weights, uri, checksum)
        await self.llm.collective_rpc("rlbus_load_safetensors", args=(str(path),))
        await self.llm.reset_prefix_cache()
        self.version = version

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
    )


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

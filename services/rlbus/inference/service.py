"""Inference: a stateless consumer group over steps that answers with completions.

Delivery contract: at-least-once. A step request is acked (and its offset committed) only
after its result is acknowledged by the broker, so a replica killed mid-batch leaves its
requests to another replica; the requester drops the duplicate answer by ``request_id``.
Weights are reloaded between batches, never mid-sequence; every result carries the version
that produced all of its tokens. With ``inflight_updates`` (an engine that supports them:
hf, vllm), a new version is also loaded while a batch generates, at its next decode step
boundary, and a result whose tokens came from several versions says which produced which
(``StepResult.version_spans``; ``policy_version`` is then the oldest). A version with an
``adapter`` goes to ``Engine.load_adapter``; one the engine refuses (no LoRA, or an adapter
that does not fit) is handled like weights that fail verification. The member reports
the version it serves on weights.served (:class:`rlbus.messages.WeightsServed`) once it
starts serving, after every load or refusal, every ``served_report_s`` in between and when
it leaves: what a trainer's ``wait_served`` waits on.

The batch loop only generates and hands the results to the producer: waiting for the
broker's acks, acking the requests and committing happen in the background (at most
``MAX_UNSETTLED`` batches behind; commits every ``COMMIT_EVERY_S``), so the next batch does
not wait two broker round trips for the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from typing import Any

from rlbus import telemetry
from rlbus.errors import Refusal, WeightsMismatchError
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.engines import make_engine
from rlbus.inference.settings import InferenceSettings
from rlbus.limits import check_step
from rlbus.messages import Sampling, StepRequest, StepResult, WeightsServed, WeightVersion
from rlbus.service import Service
from rlbus.transport import Bus, Consumer, Delivery, Producer
from rlbus.weights import ChecksumMismatchError, WeightsOutsideStoreError, inside_store

log = logging.getLogger(__name__)

MAX_UNSETTLED = 8
"""Batches whose replies may still await the broker's acks; the loop waits beyond this."""
COMMIT_EVERY_S = 0.2
"""How often the offsets of answered (acked) requests are committed."""
IDLE_POLL_S = 0.5
"""Longest one poll for requests lasts when none come."""
RELOAD_CHECK_S = 0.05
"""How often an idle member checks for newly announced weights while it polls."""


class Inference(Service[InferenceSettings]):
    name = "inference"

    def __init__(
        self, settings: InferenceSettings, bus: Bus | None = None, engine: Engine | None = None
    ) -> None:
        super().__init__(settings, bus)
        self.engine = engine
        self._latest: WeightVersion | None = None
        self._latest_delivery: Delivery[WeightVersion] | None = None
        self._new_weights = asyncio.Event()
        self._refused = -1  # newest version whose files failed verification
        self._refused_error: str | None = None
        self._served_changed = asyncio.Event()  # a load or a refusal: report it now
        self._unsettled: deque[asyncio.Task[None]] = deque()  # oldest first
        self._load_lock = asyncio.Lock()  # the batch loop and the watcher both load

    async def setup(self) -> None:
        if self.engine is None:
            # Loaded on the loop thread: transformers' meta-device init is not thread-safe,
            # and nothing else runs before setup ends anyway.
            self.engine = make_engine(self.settings)
        if self.settings.weights_dir is None and self.engine.reads_weight_files:
            log.warning("RLBUS_WEIGHTS_DIR is not set: weights are loaded from any local path "
                        "a WeightVersion names; set it to the learner's weight store")
        self.producer: Producer = await self.bus.producer()
        self.weights: Consumer[WeightVersion] = await self.bus.consumer(
            [self.topics.weights], WeightVersion, assign=[(self.topics.weights, 0)]
        )
        await self._catch_up_weights()
        self.steps: Consumer[StepRequest] = await self.bus.consumer(
            [self.topics.steps], StepRequest, group_id=self.group
        )
        self.spawn("weights", self._watch_weights())
        self.spawn("commits", self._commit_periodically())
        self.spawn("served", self._report_served())

    async def _catch_up_weights(self) -> None:
        """A (re)started replica serves the newest published weights from its first batch."""
        await self._note_weights(await self.weights.read_to_end((self.topics.weights, 0)))
        await self._maybe_reload()

    async def _watch_weights(self) -> None:
        while not self.stopping:
            await self._note_weights(await self.weights.poll(1.0))
            if self.engine is not None and self.engine.inflight_updates:
                await self._maybe_reload()  # now, between two decode steps of any batch

    async def _note_weights(self, batch: list[Delivery[WeightVersion]]) -> None:
        for d in batch:
            w = d.message
            if w.model != self.settings.model_name:
                continue
            refusal = self._outside_store(w)
            if refusal is not None:
                await self.weights.reject(d, refusal)
                self.bump("weights_outside_store")
            elif self._latest is None or w.version > self._latest.version:
                self._latest, self._latest_delivery = w, d
                self._new_weights.set()

    def _outside_store(self, w: WeightVersion) -> Refusal | None:
        """Why ``w`` must not be loaded: its uri lies outside the weight store."""
        store = self.settings.weights_dir
        assert self.engine is not None
        if store is None or not self.engine.reads_weight_files:
            return None
        try:
            inside_store(w.uri, store)
        except WeightsOutsideStoreError as exc:
            return exc.refusal
        return None

    async def _maybe_reload(self) -> None:
        async with self._load_lock:
            await self._reload()

    async def _reload(self) -> None:
        assert self.engine is not None
        w = self._latest
        if w is None or not self._reload_due():
            return
        t0 = time.perf_counter()
        try:
            async with self.engine.step_boundary():  # a no-op unless in-flight updates
                if w.adapter is not None:
                    await self.engine.load_adapter(w.uri, w.checksum, w.version, w.adapter)
                else:
                    await self.engine.load(w.uri, w.checksum, w.version)
        except (ChecksumMismatchError, WeightsMismatchError, OSError) as exc:
            # keep serving the weights we have; a newer announcement will be tried again
            log.error("refusing weights v%d: %s", w.version, exc)
            self._refused, self._refused_error = w.version, str(exc)
            self._served_changed.set()
            self.bump("refused_weights")
            delivery = self._latest_delivery
            if (w.adapter is not None and isinstance(exc, WeightsMismatchError)
                    and delivery is not None and delivery.message is w):
                # an adapter that does not fit the base model never will: a dead letter
                await self.weights.reject(delivery, exc.refusal)
            return
        self._served_changed.set()
        self.bump("reloads")
        log.info("loaded weights v%d in %.2fs", w.version, time.perf_counter() - t0)

    async def _report_served(self) -> None:
        while not self.stopping:
            self._served_changed.clear()
            await self._report()
            waiter = asyncio.create_task(self._served_changed.wait())
            await asyncio.wait({waiter}, timeout=self.settings.served_report_s)
            waiter.cancel()

    async def _report(self, leaving: bool = False) -> None:
        report = WeightsServed(
            model=self.settings.model_name, member=self.member, version=self.engine_version,
            refused_version=self._refused if self._refused >= 0 else None,
            refused_error=self._refused_error, every_s=self.settings.served_report_s,
            leaving=leaving)
        await self.producer.send(self.topics.served, report, key=self.member)

    async def _await_version(self, needed: int) -> None:
        """A request admitted at version v must not be served by older weights: that is
        what keeps staleness within the learner's bound, whatever the topics' relative lag."""
        deadline = time.monotonic() + self.settings.version_wait_s
        while (self._latest.version if self._latest else 0) < needed:
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping:
                log.warning("weights v%d not announced in time; serving older ones", needed)
                self.bump("version_wait_timeouts")
                return
            self._new_weights.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_weights.wait(), left)
        await self._maybe_reload()

    async def main(self) -> None:
        while not self.stopping:
            await self._maybe_reload()
            batch = await self._next_batch()
            if batch:
                await self._serve(batch)

    async def _next_batch(self) -> list[Delivery[StepRequest]]:
        batch = await self._poll_steps()
        wait = self._wait_for_company(batch)
        if wait > 0:
            await asyncio.sleep(wait)
            batch += await self.steps.poll(0.0, self.settings.max_batch_size - len(batch))
        return batch

    async def _poll_steps(self) -> list[Delivery[StepRequest]]:
        """Requests, polled for up to ``IDLE_POLL_S`` in slices of ``RELOAD_CHECK_S``: an
        idle member notices a newly announced version within a slice, not a whole poll
        (a trainer's ``wait_served`` waits on it)."""
        deadline = time.monotonic() + IDLE_POLL_S
        while True:
            batch = await self.steps.poll(RELOAD_CHECK_S, self.settings.max_batch_size)
            if batch or self._reload_due() or time.monotonic() >= deadline or self.stopping:
                return batch

    def _reload_due(self) -> bool:
        w = self._latest
        return (w is not None and self.engine is not None
                and w.version > max(self.engine.version, self._refused))

    def _wait_for_company(self, batch: list[Delivery[StepRequest]]) -> float:
        """Seconds to wait for more requests to join ``batch``: what is left of
        ``batch_wait_ms`` since its oldest request was sent. On an idle replica a burst
        (a group's episodes starting together) fills one batch; on a busy one, requests that
        queued while the engine ran have waited long enough and are served at once."""
        if not batch or len(batch) >= self.settings.max_batch_size:
            return 0.0
        oldest_s = min(d.timestamp_ms for d in batch) / 1000
        limit = self.settings.batch_wait_ms / 1000
        # The timestamp is the sender's clock (or the broker's): one ahead of ours must not
        # make the wait longer than batch_wait_ms, one behind only makes it shorter.
        return min(limit, max(0.0, limit - (time.time() - oldest_s)))

    async def _serve(self, batch: list[Delivery[StepRequest]]) -> None:
        batch = await self._within_limits(batch)
        if not batch:  # all dead-lettered and acked: the next periodic commit covers them
            return
        await self._await_version(max(d.message.min_version for d in batch))
        valid = [d for d in batch if self._routable(d)]
        spans = [d.start_span() for d in valid]  # one per request, each in its own trace
        with telemetry.span(
            "generate", self.member, links=spans, attributes={"rlbus.batch": len(valid)}
        ):
            generated, version = await self._generate(valid)
        replies = []
        for d, gen, span in zip(valid, generated, spans, strict=True):
            # a completion that makes no valid result (the engine's bug, or a request it
            # chokes on): that request is a dead letter, the rest of the batch is answered
            async with self.steps.handling(d):
                result = self._result(d.message, gen, version)
                replies.append(asyncio.create_task(self._reply(d, result, span)))
        await self._settle_later(batch, replies)
        self.count_input(len(batch))
        tokens = sum(len(g.completion_ids) for g in generated if not isinstance(g, Exception))
        self.bump("tokens", tokens)
        telemetry.TOKENS.add(tokens, {"rlbus.service": self.member})

    async def _settle_later(self, batch: list[Delivery[StepRequest]],
                            replies: list[asyncio.Task[None]]) -> None:
        """Ack ``batch`` once the broker has every reply, in the background; a reply the
        broker refused stops the service with the batch unacked (another replica answers)."""
        settle = asyncio.create_task(self._settle(batch, replies))
        settle.add_done_callback(self._settled)
        self._unsettled.append(settle)
        while len(self._unsettled) > MAX_UNSETTLED:
            await asyncio.wait({self._unsettled[0]})

    async def _settle(self, batch: list[Delivery[StepRequest]],
                      replies: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*replies)
        for d in batch:
            self.steps.ack(d)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._unsettled.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch's replies were not delivered", exc_info=task.exception())
            self.request_stop(f"replies not delivered: {task.exception()!r}")

    async def _commit_periodically(self) -> None:
        while not await self.wait_stopped(COMMIT_EVERY_S):
            await self.steps.commit()

    async def _within_limits(self, batch: list[Delivery[StepRequest]]
                             ) -> list[Delivery[StepRequest]]:
        """Requests over an operator limit are dead-lettered before the engine sees them,
        and answered with an error so the episode fails now instead of after its retries."""
        keep = []
        for d in batch:
            why = check_step(d.message, self.settings.limits)
            if why is None:
                keep.append(d)
                continue
            self.bump("rejected")
            await self.steps.reject(d, why)
            if self._routable(d):
                error = self._result(d.message, ValueError(why), self.engine_version)
                await self._reply(d, error, d.start_span())
        self.count_input(len(batch) - len(keep))
        return keep

    @property
    def engine_version(self) -> int:
        return self.engine.version if self.engine is not None else 0

    def _routable(self, d: Delivery[StepRequest]) -> bool:
        if d.message.reply_partition < self.settings.topics.result_partitions:
            return True
        log.warning(
            "request %s asks for reply partition %d of %d; dropped",
            d.message.request_id,
            d.message.reply_partition,
            self.settings.topics.result_partitions,
        )
        self.bump("unroutable")
        return False

    async def _generate(self, batch: list[Delivery[StepRequest]]
                        ) -> tuple[list[Completion | Exception], int]:
        """One engine call per distinct sampling setting: each request's completion (or
        the engine's error), in batch order, and the weight version that made them."""
        assert self.engine is not None
        by_sampling: dict[Sampling, list[int]] = defaultdict(list)
        for i, d in enumerate(batch):
            by_sampling[d.message.sampling].append(i)
        out: list[Completion | Exception] = [ValueError("not generated")] * len(batch)
        version = self.engine.version
        for sampling, idx in by_sampling.items():
            gens = await self._safe_generate([batch[i].message.input_ids for i in idx], sampling)
            for i, g in zip(idx, gens, strict=True):
                out[i] = g
        return out, version

    async def _safe_generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Any]:
        assert self.engine is not None
        try:
            return await self.engine.generate(prompts, sampling)
        except Exception as exc:
            log.exception("engine failed on a batch of %d", len(prompts))
            self.bump("engine_errors")
            return [exc] * len(prompts)

    def _result(self, req: StepRequest, gen: Completion | Exception, version: int) -> StepResult:
        common: dict[str, Any] = {
            "request_id": req.request_id,
            "episode_id": req.episode_id,
            "policy_version": version,
            "replica": self.member,
        }
        if isinstance(gen, Exception):
            return StepResult(**common, finish_reason="error", error=repr(gen)[:500])
        spans = gen.version_spans
        if spans:  # the engine says which version made its tokens: trust it over ours
            common["policy_version"] = min(v for v, _ in spans)
        return StepResult(
            **common,
            completion_ids=gen.completion_ids,
            logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
            version_spans=spans if spans and len(spans) > 1 else None,
        )

    async def _reply(self, d: Delivery[StepRequest], result: StepResult, span: Any) -> None:
        with telemetry.use(span):
            await self.producer.send(
                self.topics.results,
                result,
                key=result.episode_id,
                partition=d.message.reply_partition,
            )

    async def drain(self) -> None:
        if self._unsettled:  # replies handed to the producer: acked once the broker has them
            _, late = await asyncio.wait(list(self._unsettled),
                                         timeout=self.settings.drain_timeout_s / 2)
            for task in late:  # unacked: their requests are redelivered and answered again
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.steps.commit()
        await self._report(leaving=True)  # a trainer waiting for a version stops counting it

    async def close(self) -> None:
        if self.engine is not None:  # None: setup failed before it built one
            await self.engine.close()

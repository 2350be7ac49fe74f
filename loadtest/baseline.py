"""The synchronous colocated baseline: generate a full batch, score it, train, repeat.

This is what synchronous verl does, in one process and without Kafka: every optimizer step
waits for the slowest episode of its batch, and no episode runs while the learner trains.
It shares the decoupled arm's latency models by reusing the same code — the same agent
(:class:`rlbus.agent.MultiTurnAgent`, the rollout tier's default), the synthetic environment
(:class:`rlbus.synthetic.SyntheticTask`), the synthetic engine and tokenizer —
and its resources: the same number of episodes in flight at once, the same engine batching
(one batch loop per inference instance, the same batch size and wait) and the same step time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.metrics import ArmResult
from loadtest.scenario import Scenario
from rlbus.agent import MultiTurnAgent
from rlbus.api import Episode, Generation, TaskSpec
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.engines import SyntheticEngine
from rlbus.inference.settings import InferenceSettings, SyntheticEngineSettings
from rlbus.messages import Sampling
from rlbus.rollout.service import SyntheticTokenizer
from rlbus.rollout.settings import RolloutSettings
from rlbus.synthetic import SyntheticTask


@dataclass
class _Call:
    input_ids: list[int]
    answer: asyncio.Future[Completion] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    sent: float = field(default_factory=time.monotonic)


class Batcher:
    """In-process stand-in for an inference replica: the same batching, no transport."""

    def __init__(self, engine: Engine, sampling: Sampling, max_batch: int, wait_ms: float):
        self.engine, self.sampling = engine, sampling
        self.max_batch, self.wait_s = max_batch, wait_ms / 1000
        self.queue: asyncio.Queue[_Call] = asyncio.Queue()

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        """The :class:`rlbus.api.Policy` the agent plays against (one sampling per run)."""
        call = _Call(input_ids)
        self.queue.put_nowait(call)
        gen = await call.answer
        return Generation(gen.completion_ids, gen.logprobs, self.engine.version,
                          gen.finish_reason)

    async def serve(self) -> None:
        """One replica's loop, as inference batches: the first request, what is left of
        the batch wait since it was sent, one engine batch, answer all."""
        while True:
            batch = [await self.queue.get()]
            wait = self.wait_s - (time.monotonic() - batch[0].sent)
            if wait > 0:
                await asyncio.sleep(wait)
            while len(batch) < self.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            gens = await self.engine.generate([c.input_ids for c in batch], self.sampling)
            for call, gen in zip(batch, gens, strict=True):
                call.answer.set_result(gen)


class SyncTrainer:
    """The synchronous loop; rows like the learner's metrics file."""

    def __init__(self, s: Scenario) -> None:
        self.s = s
        self.task = SyntheticTask()
        self.tokenizer = SyntheticTokenizer()
        settings = InferenceSettings.model_construct(
            engine="synthetic", seed=0, synthetic=SyntheticEngineSettings(**s.engine.model_dump())
        )
        self.sampling = Sampling(max_new_tokens=s.max_new_tokens)
        self.batcher = Batcher(SyntheticEngine(settings), self.sampling,
                               s.inference.max_batch_size, s.inference.batch_wait_ms)
        self.agent = MultiTurnAgent()
        self.limits = RolloutSettings.model_construct()  # the rollout tier's defaults
        self.slots = asyncio.Semaphore(s.concurrency)
        self.specs = s.specs()  # the groups the learner's feeder would admit, in order
        self.rows: list[dict[str, Any]] = []
        self.trained = 0

    async def episode(self, spec: TaskSpec) -> float:
        """One episode, played by the rollout tier's agent; returns the verified reward."""
        async with self.slots:
            episode = Episode(task=self.task, spec=spec, env=self.task.make_env(),
                              policy=self.batcher, tokenizer=self.tokenizer,
                              sampling=self.sampling,
                              max_context_tokens=self.s.rollout.max_context_tokens,
                              timeout_s=self.limits.env_timeout_s)
            await self.agent.run(episode)
        return self.task.score(spec, [t.action for t in episode.turns])

    async def run(self) -> ArmResult:
        servers = [asyncio.create_task(self.batcher.serve())
                   for _ in range(self.s.inference.instances)]
        t0 = time.monotonic()
        try:
            for step in range(self.s.steps):
                await self.one_step(step, t0)
        finally:
            for server in servers:
                server.cancel()
            await asyncio.gather(*servers, return_exceptions=True)
        return ArmResult("synchronous", self.s.name, self.rows, time.monotonic() - t0,
                         self.s.warmup_steps, self.s.cooldown)

    async def one_step(self, step: int, t0: float) -> None:
        groups = self.specs[step * self.s.groups_per_step:(step + 1) * self.s.groups_per_step]
        episodes = [spec for spec in groups for _ in range(self.s.group_size)]
        rewards = await asyncio.gather(*(self.episode(spec) for spec in episodes))
        started = time.monotonic()
        await asyncio.sleep(self.s.learner_step_s)  # the optimizer step; rollout sits idle
        self.trained += len(rewards)
        self.rows.append({
            "step": step + 1,
            "time": round(time.monotonic() - t0, 3),
            "step_seconds": round(time.monotonic() - started, 4),
            "episodes_trained": self.trained,
            "reward_mean": sum(rewards) / len(rewards),
            "staleness_max": 0,
        })


def run_synchronous(s: Scenario) -> ArmResult:
    return asyncio.run(SyncTrainer(s).run())

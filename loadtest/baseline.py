"""The synchronous colocated baseline: generate a full batch, score it, train, repeat.

This is what synchronous verl does, in one process and without Kafka: every optimizer step
waits for the slowest episode of its batch, and no episode runs while the learner trains.
It shares the decoupled arm's latency models by reusing the same code — the synthetic
environment (:class:`rlbus.synthetic.SyntheticTask`), the synthetic engine and tokenizer —
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
from rlbus.messages import Sampling
from rlbus.services.inference.engines import Engine, Generation, SyntheticEngine
from rlbus.services.inference.settings import InferenceSettings, SyntheticEngineSettings
from rlbus.services.rollout.service import SyntheticTokenizer
from rlbus.synthetic import SyntheticTask
from rlbus.tasks import TaskSpec


@dataclass
class _Call:
    input_ids: list[int]
    answer: asyncio.Future[Generation] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Batcher:
    """In-process stand-in for an inference replica: the same batching, no transport."""

    def __init__(self, engine: Engine, sampling: Sampling, max_batch: int, wait_ms: float):
        self.engine, self.sampling = engine, sampling
        self.max_batch, self.wait_s = max_batch, wait_ms / 1000
        self.queue: asyncio.Queue[_Call] = asyncio.Queue()

    async def generate(self, input_ids: list[int]) -> Generation:
        call = _Call(input_ids)
        self.queue.put_nowait(call)
        return await call.answer

    async def serve(self) -> None:
        """One replica's loop: first request, wait for more, one engine batch, answer all."""
        while True:
            batch = [await self.queue.get()]
            if self.wait_s:
                await asyncio.sleep(self.wait_s)
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
        sampling = Sampling(max_new_tokens=s.max_new_tokens)
        self.batcher = Batcher(SyntheticEngine(settings), sampling, s.inference.max_batch_size,
                               s.inference.batch_wait_ms)
        self.slots = asyncio.Semaphore(s.concurrency)
        self.specs = s.specs()  # the groups the learner's feeder would admit, in order
        self.rows: list[dict[str, Any]] = []
        self.trained = 0

    async def episode(self, spec: TaskSpec) -> float:
        """One episode, as the rollout service plays it; returns the verified reward."""
        async with self.slots:
            env = self.task.make_env()
            new_ids = self.tokenizer.encode(await env.reset(spec))
            context: list[int] = []
            actions: list[str] = []
            for _ in range(self.task.max_turns):
                context += new_ids
                gen = await self.batcher.generate(context)
                actions.append(self.tokenizer.decode(gen.completion_ids))
                outcome = await env.step(actions[-1])
                context += gen.completion_ids
                if outcome.done:
                    break
                new_ids = self.tokenizer.encode(outcome.observation)
        return self.task.score(spec, actions)

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

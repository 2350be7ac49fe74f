"""The demo's guess-the-number task behind a long-tailed environment: the real learning task
of :mod:`loadtest.partial_bench`, with the long_tail scenario's latency shape.

Each environment step first sleeps a lognormal time, drawn as the synthetic task draws its
steps (:func:`rlbus.synthetic.draw_step_s`: ``median_ms``, ``sigma``, capped at ``max_ms``),
then answers as :class:`rlbus.tasks.GuessNumberEnv` does. The latency keys travel in the
spec (the learner's ``RLBUS_TASK_SPEC`` merges them over every sampled spec), so one
benchmark sets the shape for every tier and the score never depends on them.

Named by import string (``loadtest.long_tail_task:LongTailGuessNumber``), the way a plugin
under development is: the tiers that run it need the repository root on their path.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from rlbus.api import Env, StepOutcome, TaskSpec
from rlbus.synthetic import draw_step_s
from rlbus.tasks import GuessNumber, GuessNumberEnv

REF = "loadtest.long_tail_task:LongTailGuessNumber"


class LongTailGuessEnv(Env):
    """Guess the number, each step delayed by a long-tailed draw."""

    def __init__(self, task: GuessNumber) -> None:
        self._inner = GuessNumberEnv(task)
        self._spec: TaskSpec = {}
        self._rng = random.Random()

    async def reset(self, task: TaskSpec) -> str:
        self._spec = task
        return await self._inner.reset(task)

    async def step(self, action: str) -> StepOutcome:
        if "median_ms" in self._spec:
            await asyncio.sleep(draw_step_s(self._rng, self._spec))
        return await self._inner.step(action)


@dataclass
class LongTailGuessNumber(GuessNumber):
    """:class:`rlbus.tasks.GuessNumber` with a long-tailed environment latency."""

    name: str = REF

    def make_env(self) -> Env:
        return LongTailGuessEnv(self)

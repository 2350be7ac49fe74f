"""The prompt feeder: training prompts within the credit window, and the evaluation rounds.

Staleness is bounded by the client's credit window (SkyRL/AReaL pacing,
:func:`rlbus.client.credit`): a new group is admitted only while
submitted < (max_staleness + step + 1) * groups_per_step. Every ``eval_every`` steps the
same evaluation set (specs drawn from fixed seeds) is published greedily; its episodes carry
their round in ``Prompt.eval_round`` and come back with it in ``Trajectory.eval_round``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from rlbus.api import Task
from rlbus.client import RolloutClient
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import EvalStats
from rlbus.messages import Sampling, ScoredTrajectory

log = logging.getLogger(__name__)


class Feeder:
    """Submits one run's prompts through the client, whose count of training groups
    submitted (checkpointed) is :attr:`next_index`."""

    def __init__(self, settings: LearnerSettings, task: Task, client: RolloutClient) -> None:
        self.settings = settings
        self.task = task
        self.client = client
        self.total = settings.max_steps * settings.groups_per_step
        self._eval_published: set[int] = set()
        self._evaluated_upto = -1
        self._evals: dict[int, list[tuple[bool, float]]] = {}  # round -> (success, reward)

    @property
    def next_index(self) -> int:
        return self.client.submitted

    def _spec(self, seed: str) -> dict[str, Any]:
        return {**self.task.sample(random.Random(seed)), **self.settings.task_spec}

    async def top_up(self, step: int) -> None:
        """Publish the evaluation set if one is due, then as many training groups as the
        credit window allows; each asks for the client's weights version or newer."""
        await self.publish_eval(step)
        s = self.settings
        sampling = Sampling(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        for _ in range(min(self.client.credit(), self.total - self.next_index)):
            i = self.next_index  # the client names the group <run_name>/<i>
            await self.client.submit(s.task, self._spec(f"{s.seed}/{i}"),
                                     group_size=s.group_size, sampling=sampling)

    async def publish_eval(self, step: int, force: bool = False) -> bool:
        """The evaluation set for round ``step`` if one is due (or ``force``); True if sent."""
        every = self.settings.eval_every
        # steps can outrun the feeder's wake-ups: due once per multiple of eval_every passed
        due = every and (force or step // every > self._evaluated_upto // every)
        if not due or step in self._eval_published:
            return False
        # the round is fixed before the first await: training goes on while the set is sent
        self._eval_published.add(step)
        self._evaluated_upto = step
        greedy = Sampling(temperature=0.0, max_new_tokens=self.settings.max_new_tokens)
        for k in range(self.settings.eval_episodes):
            await self.client.submit(self.settings.task, self._spec(f"eval/{k}"), group_size=1,
                                     sampling=greedy, purpose="eval", eval_round=step,
                                     group_id=f"{self.settings.run_name}/eval{step}/{k}")
        return True

    def take_eval(self, scored: ScoredTrajectory) -> EvalStats | None:
        """Collect one evaluation episode; the round's figures once all of it is back."""
        round_ = scored.trajectory.eval_round
        if round_ is None:
            log.warning("eval episode %s has no eval_round; ignored",
                        scored.trajectory.episode_id)
            return None
        t = scored.trajectory
        # scored now, on intake: a spec that breaks the task's code fails this episode only
        won = t.status == "ok" and self.task.success(
            t.spec, [turn.action for turn in t.turns if turn.tool_call is None])
        results = self._evals.setdefault(round_, [])
        results.append((won, scored.reward))
        if len(results) < self.settings.eval_episodes:
            return None
        del self._evals[round_]
        figures = EvalStats(at_step=round_,
                            success=sum(won for won, _ in results) / len(results),
                            reward=sum(reward for _, reward in results) / len(results))
        log.info("eval at step %d: success %.3f", round_, figures.success)
        return figures

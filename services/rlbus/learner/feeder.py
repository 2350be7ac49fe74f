"""The prompt feeder: training prompts within the credit window, and the evaluation rounds.

Staleness is bounded by the credit window (SkyRL/AReaL pacing): a new group is admitted only
while published < (max_staleness + step + 1) * groups_per_step. Every ``eval_every`` steps the
same evaluation set (specs drawn from fixed seeds) is published greedily; its episodes carry
their round in ``Prompt.eval_round`` and come back with it in ``Trajectory.eval_round``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from rlbus.api import Task
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import EvalStats
from rlbus.messages import Prompt, Sampling, ScoredTrajectory
from rlbus.transport import Producer

log = logging.getLogger(__name__)


def credit(published: int, step: int, max_staleness: int, groups_per_step: int) -> int:
    """How many more groups the feeder may publish now (never negative)."""
    return max(0, (max_staleness + step + 1) * groups_per_step - published)


class Feeder:
    """Publishes one run's prompts; ``next_index`` (checkpointed) is how many it has sent."""

    def __init__(self, settings: LearnerSettings, task: Task, producer: Producer,
                 topic: str, next_index: int = 0) -> None:
        self.settings = settings
        self.task = task
        self.producer = producer
        self.topic = topic
        self.next_index = next_index
        self.total = settings.max_steps * settings.groups_per_step
        self._eval_published: set[int] = set()
        self._evaluated_upto = -1
        self._evals: dict[int, list[tuple[bool, float]]] = {}  # round -> (success, reward)

    def _spec(self, seed: str) -> dict[str, Any]:
        return {**self.task.sample(random.Random(seed)), **self.settings.task_spec}

    async def top_up(self, step: int, version: int) -> None:
        """Publish the evaluation set if one is due, then as many training groups as the
        credit window allows at ``step``; each asks for weights ``version`` or newer."""
        await self.publish_eval(step, version)
        s = self.settings
        sampling = Sampling(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        room = credit(self.next_index, step, s.max_staleness, s.groups_per_step)
        for _ in range(min(room, self.total - self.next_index)):
            i = self.next_index
            prompt = Prompt(group_id=f"{s.run_name}/{i}", task=s.task,
                            spec=self._spec(f"{s.seed}/{i}"), group_size=s.group_size,
                            sampling=sampling, min_version=version)
            await self.producer.send(self.topic, prompt, key=prompt.group_id)
            self.next_index += 1

    async def publish_eval(self, step: int, version: int, force: bool = False) -> bool:
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
            prompt = Prompt(group_id=f"{self.settings.run_name}/eval{step}/{k}",
                            task=self.settings.task, spec=self._spec(f"eval/{k}"), group_size=1,
                            sampling=greedy, min_version=version, purpose="eval",
                            eval_round=step)
            await self.producer.send(self.topic, prompt, key=prompt.group_id)
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

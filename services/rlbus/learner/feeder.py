"""The prompt feeder: training prompts within the credit window, and the evaluation rounds.

Staleness is bounded by the client's credit window (SkyRL/AReaL pacing,
:func:`rlbus.client.credit`): a new group is admitted only while
submitted < (max_staleness + step + 1) * groups_per_step.

Training specs come from the task's ``sample`` (seed ``<seed>/<n>``) or, with
``dataset``, from a :class:`~rlbus.prompt_data.PromptSource`: rows in their epoch's
permutation, a bad row dead-lettered and skipped. :attr:`Feeder.position` is the dataset
position as of the last row sent or dead-lettered, updated in the same step of the event
loop as the client's count of groups sent, so that a checkpoint holds the two together and
a resumed feeder sends every row of an epoch once.

Every ``eval_every`` steps the same evaluation set (the eval dataset's rows, or specs drawn
from fixed seeds) is published: each problem once greedily, and with ``eval_pass_k``, also
``eval_pass_n`` samples at the training temperature for pass@k. Its episodes carry their
round in ``Prompt.eval_round`` and come back with it in ``Trajectory.eval_round``; they are
never trained on.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlbus.api import Task, TaskSpec
from rlbus.client import RolloutClient
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.stats import EvalStats, pass_at_k
from rlbus.messages import Sampling, ScoredTrajectory
from rlbus.prompt_data import BadRow, DatasetPosition, PromptSource

log = logging.getLogger(__name__)

_PASS = "pass"
"""Prefix of the last part of a pass@k group's id (greedy ones end in the problem's number)."""


@dataclass
class _Round:
    """One evaluation round's results so far."""

    greedy: list[tuple[bool, float]] = field(default_factory=list)  # (success, reward)
    samples: dict[str, list[bool]] = field(default_factory=dict)  # pass@k group -> successes


class Feeder:
    """Submits one run's prompts through the client, whose count of training groups
    submitted (checkpointed) is :attr:`next_index`."""

    def __init__(self, settings: LearnerSettings, task: Task, client: RolloutClient, *,
                 source: PromptSource | None = None, eval_specs: list[TaskSpec] | None = None,
                 dead_letter: Callable[[BadRow], Awaitable[None]] | None = None) -> None:
        self.settings = settings
        self.task = task
        self.client = client
        self.source = source
        self.position = source.position if source is not None else DatasetPosition()
        """The dataset position as of the last row sent or dead-lettered (checkpointed)."""
        self._dead_letter = dead_letter
        self.total = settings.max_steps * settings.groups_per_step
        self.eval_specs = eval_specs if eval_specs is not None else [
            self._spec(f"eval/{k}") for k in range(settings.eval_episodes)]
        self._eval_published: set[int] = set()
        self._evaluated_upto = -1
        self._evals: dict[int, _Round] = {}

    @property
    def next_index(self) -> int:
        return self.client.submitted

    @property
    def exhausted(self) -> bool:
        """True once every row of every epoch is sent (or dead-lettered)."""
        return (self.source is not None and self.source.exhausted
                and self.position == self.source.position)

    @property
    def pass_n(self) -> int:
        """Samples per problem for pass@k (0: no pass@k)."""
        k = self.settings.eval_pass_k
        return max(self.settings.eval_pass_n or k, k) if k else 0

    def _spec(self, seed: str) -> dict[str, Any]:
        return {**self.task.sample(random.Random(seed)), **self.settings.task_spec}

    async def _next_spec(self) -> TaskSpec | None:
        """The next training spec; None when the dataset is done."""
        if self.source is None:
            return self._spec(f"{self.settings.seed}/{self.next_index}")
        while (item := self.source.next()) is not None:
            if not isinstance(item, BadRow):
                return {**item, **self.settings.task_spec}
            log.warning("dataset %s", item.error)
            if self._dead_letter is not None:
                await self._dead_letter(item)
            self.position = self.source.position
        return None

    async def top_up(self, step: int) -> None:
        """Publish the evaluation set if one is due, then as many training groups as the
        credit window allows; each asks for the client's weights version or newer."""
        await self.publish_eval(step)
        s = self.settings
        sampling = Sampling(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        for _ in range(min(self.client.credit(), self.total - self.next_index)):
            spec = await self._next_spec()  # the client names the group <run_name>/<n>
            if spec is None:
                return
            await self.client.submit(s.task, spec, group_size=s.group_size, sampling=sampling)
            if self.source is not None:  # no await since the count moved: checkpointed together
                self.position = self.source.position

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
        await self._publish_round(step)
        return True

    async def _publish_round(self, step: int) -> None:
        s = self.settings
        greedy = Sampling(temperature=0.0, max_new_tokens=s.max_new_tokens)
        sampled = Sampling(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        for k, spec in enumerate(self.eval_specs):
            await self.client.submit(s.task, spec, group_size=1, sampling=greedy,
                                     purpose="eval", eval_round=step,
                                     group_id=f"{s.run_name}/eval{step}/{k}")
            if self.pass_n:
                await self.client.submit(s.task, spec, group_size=self.pass_n, sampling=sampled,
                                         purpose="eval", eval_round=step,
                                         group_id=f"{s.run_name}/eval{step}/{_PASS}{k}")

    def take_eval(self, scored: ScoredTrajectory) -> EvalStats | None:
        """Collect one evaluation episode; the round's figures once all of it is back."""
        t = scored.trajectory
        if t.eval_round is None:
            log.warning("eval episode %s has no eval_round; ignored", t.episode_id)
            return None
        # scored now, on intake: a spec that breaks the task's code fails this episode only
        won = t.status == "ok" and self.task.success(
            t.spec, [turn.action for turn in t.turns if turn.tool_call is None])
        results = self._evals.setdefault(t.eval_round, _Round())
        if t.group_id.rsplit("/", 1)[-1].startswith(_PASS):
            results.samples.setdefault(t.group_id, []).append(won)
        else:
            results.greedy.append((won, scored.reward))
        n = len(self.eval_specs)
        if len(results.greedy) < n or sum(map(len, results.samples.values())) < n * self.pass_n:
            return None
        del self._evals[t.eval_round]
        return self._figures(t.eval_round, results)

    def _figures(self, round_: int, results: _Round) -> EvalStats:
        greedy = results.greedy
        k = self.settings.eval_pass_k
        passed = None
        if k:
            estimates = [pass_at_k(len(w), sum(w), k) for w in results.samples.values()]
            passed = sum(estimates) / len(estimates)
        figures = EvalStats(at_step=round_, success=sum(w for w, _ in greedy) / len(greedy),
                            reward=sum(r for _, r in greedy) / len(greedy),
                            pass_at_k=passed, pass_k=k or None)
        log.info("eval at step %d: success %.3f", round_, figures.success)
        return figures

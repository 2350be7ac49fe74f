"""Scenario files (``loadtest/scenarios/*.yaml``) and the ideal bound they imply.

A scenario fixes everything both arms of the comparison share: the batch shape, the
environment's latency model (a :mod:`rlbus.synthetic` task spec), the engine's latency
model, the learner's step time, the episode concurrency and the processes per tier. The
ideal bound is what the slowest tier could sustain if every other cost were zero:

* rollout: ``concurrency / E[episode seconds]``, where an episode is ``E[turns]`` turns of
  one environment step plus one engine batch;
* inference: ``instances * max_batch_size / (batch_wait + engine batch)`` model calls per
  second, divided by ``E[turns]``;
* learner: ``groups_per_step * group_size / step_s``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from rlbus.api import TaskSpec
from rlbus.synthetic import (
    SyntheticTask,
    episode_plan,
    full_spec,
    mean_step_s,
    mean_turns,
    step_quantile_ms,
)

SCENARIOS = Path(__file__).parent / "scenarios"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Engine(_Section):
    """The synthetic engine's latency model (services/rlbus/inference/settings.py)."""

    base_ms: float = Field(default=2.0, ge=0)
    per_token_ms: float = Field(default=0.25, ge=0)
    completion_tokens: int = Field(default=8, ge=1)


class Rollout(_Section):
    instances: int = Field(default=1, ge=1)
    max_concurrent_episodes: int = Field(default=32, ge=1)
    """Per instance; the synchronous baseline gets instances * this."""
    max_groups_in_flight: int | None = Field(default=None, ge=1)
    """Per instance; default four times the groups its episode slots hold at once."""
    max_context_tokens: int = Field(default=4096, ge=16)
    """Longest context an episode may reach (RLBUS_MAX_CONTEXT_TOKENS); long-trajectory
    scenarios raise it, or their episodes end early."""


class Inference(_Section):
    instances: int = Field(default=1, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    batch_wait_ms: float = Field(default=1.0, ge=0)


class Scenario(_Section):
    name: str
    description: str = ""
    group_size: int = Field(default=8, ge=2)
    groups_per_step: int = Field(default=4, ge=1)
    steps: int = Field(default=20, ge=2)
    warmup_steps: int = Field(default=2, ge=0)
    """Steps left out of the steady-state throughput (the pipeline filling up)."""
    cooldown_steps: int | None = Field(default=None, ge=0)
    """Steps left out at the end (the rollout tier running dry); default max_staleness + 1."""
    max_staleness: int = Field(default=2, ge=0)
    straggler_wait_s: float = Field(default=60.0, ge=0)
    """How long the learner holds a step for a group about to go stale (0: mask it)."""
    staleness_from: Literal["oldest", "newest"] = "oldest"
    """Which token an episode's staleness counts from (the learner's
    ``RLBUS_STALENESS_FROM``): newest trains partial rollouts whose latest turn is recent."""
    inflight_updates: bool = False
    """Inference loads a new version while a batch generates, and each token reports the
    version that produced it (``RLBUS_INFLIGHT_UPDATES``; the synthetic engine models it)."""
    learner_step_s: float = Field(default=0.5, ge=0)
    max_new_tokens: int = Field(default=8, ge=1)
    env: dict[str, Any] = {}
    """Task spec keys of the synthetic environment (shared/rlbus/synthetic.py DEFAULTS)."""
    engine: Engine = Engine()
    rollout: Rollout = Rollout()
    inference: Inference = Inference()
    reward_instances: int = Field(default=1, ge=1)
    scaling: list[int] = []
    """Rollout instance counts of the scaling sweep (empty: this scenario has none)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Longest one arm may run before the harness gives up on it."""

    @property
    def batch(self) -> int:
        """Samples per optimizer step."""
        return self.groups_per_step * self.group_size

    @property
    def cooldown(self) -> int:
        return self.max_staleness + 1 if self.cooldown_steps is None else self.cooldown_steps

    @property
    def samples(self) -> int:
        return self.steps * self.batch

    @property
    def concurrency(self) -> int:
        return self.rollout.instances * self.rollout.max_concurrent_episodes

    def with_rollouts(self, instances: int) -> Scenario:
        rollout = self.rollout.model_copy(update={"instances": instances})
        return self.model_copy(update={"rollout": rollout})

    def engine_s(self) -> float:
        """One engine batch: what the synthetic engine sleeps."""
        tokens = min(self.engine.completion_tokens, self.max_new_tokens)
        return (self.engine.base_ms + self.engine.per_token_ms * tokens) / 1000

    def specs(self) -> list[TaskSpec]:
        """Every group's spec, sampled as the learner's feeder samples them (its seed 0)."""
        task = SyntheticTask()
        return [{**task.sample(random.Random(f"0/{i}")), **self.env}
                for i in range(self.steps * self.groups_per_step)]

    def episode_s(self) -> float:
        """Expected episode duration with no queueing and no transport cost."""
        spec = full_spec(self.env)
        per_turn = mean_step_s(spec) + self.engine_s()
        return float(spec["reset_ms"]) / 1000 + mean_turns(spec) * per_turn

    def realized_episode_s(self) -> float:
        """The same, averaged over the episodes this run actually plays (their plans)."""
        reset = float(full_spec(self.env)["reset_ms"]) / 1000
        episodes = [episode_plan(spec, k) for spec in self.specs() for k in range(self.group_size)]
        work = [reset + sum(plan) + len(plan) * self.engine_s() for plan in episodes]
        return sum(work) / len(work)

    def capacities(self, episode_s: float | None = None) -> dict[str, float]:
        """Samples per second each tier could sustain alone (expected episodes by default)."""
        turns = mean_turns(full_spec(self.env))
        batch_s = self.inference.batch_wait_ms / 1000 + self.engine_s()
        calls = _rate(self.inference.instances * self.inference.max_batch_size, batch_s)
        return {
            "rollout": _rate(self.concurrency, episode_s or self.episode_s()),
            "inference": calls / turns,
            "learner": _rate(self.batch, self.learner_step_s),
        }

    def describe(self) -> dict[str, Any]:
        """The bounds a report prints next to the measurements.

        ``ideal_samples_per_s`` uses the episodes this run plays (deterministic plans, see
        :func:`rlbus.synthetic.episode_plan`); ``expected_ideal_samples_per_s`` the latency
        distribution's means. They differ by the luck of a finite sample of a long tail.
        """
        spec = full_spec(self.env)
        realized = self.capacities(self.realized_episode_s())
        tier = min(realized, key=lambda k: realized[k])
        expected = self.capacities()
        return {
            "env_median_ms": step_quantile_ms(spec, 0.5),
            "env_p99_ms": step_quantile_ms(spec, 0.99),
            "env_mean_ms": mean_step_s(spec) * 1000,
            "turns_mean": mean_turns(spec),
            "episode_s": self.episode_s(),
            "realized_episode_s": self.realized_episode_s(),
            "capacities": realized,
            "expected_capacities": expected,
            "bottleneck": tier,
            "ideal_samples_per_s": realized[tier],
            "expected_ideal_samples_per_s": min(expected.values()),
        }


def _rate(count: float, seconds: float) -> float:
    """``count`` per ``seconds``; a tier that takes no time has no limit."""
    return count / seconds if seconds > 0 else math.inf


def load(name_or_path: str | Path) -> Scenario:
    """A scenario by name (``long_tail``) or by path to its YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIOS / f"{name_or_path}.yaml"
    data = yaml.safe_load(path.read_text())
    return Scenario.model_validate({"name": path.stem, **data})

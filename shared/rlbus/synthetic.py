"""A synthetic task for load tests: multi-turn episodes against a long-tailed environment.

Nothing is learned and nothing real runs: each environment step sleeps a lognormal time
(``median_ms``, ``sigma``; capped at ``max_ms`` so a freak draw cannot outlive the rollout's
``env_timeout_s``) and each episode lasts a number of turns drawn uniformly from
``[min_turns, max_turns]``, so the episodes of one group (which share one spec) differ in
length. The draws are a plan per episode (:func:`episode_plan`): the ``k``-th episode a
process plays with one spec follows plan ``k``, so equal specs mean equal work in any
process. The reward is Bernoulli(``success_p``), decided by a hash of the spec's seed and
the actions: the verifier recomputes it from the actions alone.

Every spec key has a default (:data:`DEFAULTS`); a scenario overrides them through the
learner's ``RLBUS_TASK_SPEC``, which is merged over every sampled spec. The closed-form
moments (:func:`mean_turns`, :func:`mean_step_s`) let a load test compute its ideal bound
from the same spec the environments read.

Stdlib only, like :mod:`rlbus.tasks`; registered as ``synthetic`` by entry point.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

from rlbus.api import Env, StepOutcome, Task, TaskSpec

MAX_TURNS = 32
"""Upper bound on any episode's turns: the rollout loop runs at most ``Task.max_turns``."""

DEFAULTS: TaskSpec = {
    "min_turns": 1,  # turns per episode, uniform in [min_turns, max_turns]
    "max_turns": 8,
    "median_ms": 20.0,  # environment step latency: lognormal with this median …
    "sigma": 1.0,  # … and this log-space standard deviation (p99/median = e^(2.33 sigma))
    "max_ms": 10_000.0,  # cap on one step's latency
    "reset_ms": 0.0,  # fixed latency of reset()
    "obs_words": 4,  # words per observation (how fast the context grows)
    "success_p": 0.5,  # probability that an episode's actions earn reward 1
}

_resets: defaultdict[Any, int] = defaultdict(int)  # episodes begun so far, per spec seed


def full_spec(spec: TaskSpec) -> TaskSpec:
    """``spec`` with every missing key filled from :data:`DEFAULTS`."""
    return {**DEFAULTS, **spec}


def turn_range(spec: TaskSpec) -> tuple[int, int]:
    s = full_spec(spec)
    high = min(int(s["max_turns"]), MAX_TURNS)
    return min(max(int(s["min_turns"]), 1), high), high


def mean_turns(spec: TaskSpec) -> float:
    low, high = turn_range(spec)
    return (low + high) / 2


def step_quantile_ms(spec: TaskSpec, q: float) -> float:
    """The ``q`` quantile of one step's latency (before the cap)."""
    s = full_spec(spec)
    return float(s["median_ms"]) * math.exp(float(s["sigma"]) * NormalDist().inv_cdf(q))


def mean_step_s(spec: TaskSpec) -> float:
    """E[min(X, max_ms)] for lognormal X, in seconds (the cap is part of the model)."""
    s = full_spec(spec)
    median, sigma, cap = float(s["median_ms"]), float(s["sigma"]), float(s["max_ms"])
    if sigma == 0 or median <= 0:
        return min(median, cap) / 1000
    mu, z = math.log(median), NormalDist()
    below = math.exp(mu + sigma**2 / 2) * z.cdf((math.log(cap) - mu - sigma**2) / sigma)
    above = cap * (1 - z.cdf((math.log(cap) - mu) / sigma))
    return (below + above) / 1000


def draw_step_s(rng: random.Random, spec: TaskSpec) -> float:
    s = full_spec(spec)
    ms = float(s["median_ms"]) * math.exp(float(s["sigma"]) * rng.gauss(0.0, 1.0))
    return min(ms, float(s["max_ms"])) / 1000


def reward(spec: TaskSpec, actions: Sequence[str]) -> float:
    """1.0 with probability ``success_p``, decided by a hash of the seed and the actions."""
    text = "\n".join([str(spec.get("seed", 0)), *actions])
    digest = hashlib.sha256(text.encode()).digest()
    uniform = int.from_bytes(digest[:8], "big") / 2**64
    return 1.0 if uniform < float(full_spec(spec)["success_p"]) else 0.0


def episode_plan(spec: TaskSpec, k: int) -> list[float]:
    """Seconds of each environment step of the ``k``-th episode played with ``spec``.

    Deterministic: two runs that play the same specs (the learner's feeder and the
    synchronous baseline sample them alike) face exactly the same episodes, so their
    throughputs differ by how they schedule the work, not by the luck of the draw.
    """
    s = full_spec(spec)
    rng = random.Random(f"{s.get('seed', 0)}/{k}")
    return [draw_step_s(rng, s) for _ in range(rng.randint(*turn_range(s)))]


class SyntheticEnv(Env):
    """Sleeps through each step as its plan says; ends when the plan is played out."""

    def __init__(self) -> None:
        self._spec: TaskSpec = {}
        self._plan: list[float] = []
        self._actions: list[str] = []

    async def reset(self, task: TaskSpec) -> str:
        self._spec, self._actions = full_spec(task), []
        seed = self._spec.get("seed", 0)
        self._plan = episode_plan(self._spec, _resets[seed])
        _resets[seed] += 1  # a group's episodes share one spec: the k-th gets plan k
        await asyncio.sleep(float(self._spec["reset_ms"]) / 1000)
        return "synthetic task :"

    async def step(self, action: str) -> StepOutcome:
        if len(self._actions) >= len(self._plan):
            raise RuntimeError("step() outside an episode: reset() first")
        await asyncio.sleep(self._plan[len(self._actions)])
        self._actions.append(action)
        done = len(self._actions) >= len(self._plan)
        # Sparse, like the real tasks: the reward arrives with the last step.
        score = reward(self._spec, self._actions) if done else 0.0
        observation = "done" if done else " ".join(["ok"] * int(self._spec["obs_words"]))
        return StepOutcome(observation, score, done, {"turn": len(self._actions)})


class SyntheticTask(Task):
    """Load-test episodes: latency and length from the spec, reward from a hash."""

    name = "synthetic"
    max_turns = MAX_TURNS

    def sample(self, rng: random.Random) -> TaskSpec:
        return {**DEFAULTS, "seed": rng.getrandbits(32)}

    def make_env(self) -> Env:
        return SyntheticEnv()

    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        return reward(task, actions)

    def success(self, task: TaskSpec, actions: Sequence[str]) -> bool:
        return reward(task, actions) == 1.0

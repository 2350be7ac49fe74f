"""Tasks: gym-like async environments and the verifiers that score them.

The rollout service drives an `Env` (`reset(task)` → first observation, then `step(action)`
per model turn); the reward service calls `Task.score(task, actions)`, which recomputes the
outcome from the model's actions alone (the decoded completion texts, one per turn) and
never trusts a reward the environment reported. Both read the same task spec, a
JSON-serialisable dict produced by `Task.sample`, so a trajectory can be re-scored later.

Texts are lowercase words, numbers and symbols separated by single spaces, so a word-level
tokenizer round-trips them exactly (`Task.vocabulary` lists every word a task emits).

Stdlib only: rollout and reward import this module and must not pull in torch.
"""

from __future__ import annotations

import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

TaskSpec = dict[str, Any]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class StepOutcome:
    """What an environment answers to one action."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    """An async, gym-like environment; one instance per episode."""

    tools: dict[str, Callable[..., Any]]

    async def reset(self, task: TaskSpec) -> str:
        """Start an episode; returns the first observation (the prompt text)."""
        ...

    async def step(self, action: str) -> StepOutcome:
        """Apply one model turn (its decoded completion text)."""
        ...


class Task(ABC):
    """A family of episodes: how to sample them, play them and verify them."""

    name: str
    max_turns: int

    @abstractmethod
    def sample(self, rng: random.Random) -> TaskSpec:
        """A fresh task spec (JSON-serialisable)."""

    @abstractmethod
    def make_env(self) -> Env:
        """A new environment for one episode."""

    @abstractmethod
    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        """The reward, recomputed from the actions alone."""

    @abstractmethod
    def success(self, task: TaskSpec, actions: Sequence[str]) -> bool:
        """Whether the episode solved the task (a metric, free of reward shaping)."""

    @abstractmethod
    def vocabulary(self) -> set[str]:
        """Every word (whitespace-separated token) this task's texts may contain."""


# --------------------------------------------------------------------------- verifiers


def last_number(text: str) -> float | None:
    """The last number in `text`: the "final answer" convention of chatty models."""
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


def exact_match(expected: str, text: str) -> float:
    """1.0 when `text` equals `expected` up to surrounding whitespace."""
    return 1.0 if text.strip() == expected.strip() else 0.0


def numeric_answer(expected: float | str, text: str) -> float:
    """1.0 when the last number in `text` equals `expected` (within float rounding)."""
    answer = last_number(text)
    if answer is None:
        return 0.0
    return 1.0 if abs(answer - float(expected)) < 1e-9 else 0.0


# ------------------------------------------------------------------------ guess_number

HIGHER, LOWER, CORRECT, INVALID = "higher", "lower", "correct", "invalid"


@dataclass(frozen=True)
class GuessReplay:
    """The game replayed from a list of actions."""

    found: bool
    guesses: int  # turns played (at most max_turns; play stops at the correct guess)
    low: int  # the interval the feedback still allows after the last turn played
    high: int

    def remaining(self) -> int:
        """How many candidates are left (1 once found)."""
        return 1 if self.found else max(self.high - self.low + 1, 1)


def parse_guess(action: str) -> int | None:
    """The guessed integer: the action's last number, if it is an integer."""
    value = last_number(action)
    return int(value) if value is not None and value.is_integer() else None


def guess_feedback(task: TaskSpec, guess: int | None) -> str:
    """The environment's answer to one guess; out-of-range guesses are invalid."""
    if guess is None or not task["low"] <= guess <= task["high"]:
        return INVALID
    if guess == task["target"]:
        return CORRECT
    return HIGHER if task["target"] > guess else LOWER


def replay_guesses(task: TaskSpec, actions: Sequence[str]) -> GuessReplay:
    """Play `actions` against `task`; the single source of truth for env and verifier."""
    low, high, played = task["low"], task["high"], 0
    for action in actions[: task["max_turns"]]:
        played += 1
        guess = parse_guess(action)
        if guess is None or not low <= guess <= high:
            continue  # invalid, or ruled out already: the answer adds nothing
        feedback = guess_feedback(task, guess)
        if feedback == CORRECT:
            return GuessReplay(True, played, guess, guess)
        low, high = (guess + 1, high) if feedback == HIGHER else (low, guess - 1)
    return GuessReplay(False, played, low, high)


class GuessNumberEnv:
    """Guess a hidden integer; each wrong guess is answered "higher" or "lower"."""

    def __init__(self, task: GuessNumber) -> None:
        self.tools: dict[str, Callable[..., Any]] = {}
        self._task = task
        self._spec: TaskSpec | None = None
        self._actions: list[str] = []

    async def reset(self, task: TaskSpec) -> str:
        self._spec, self._actions = task, []
        return f"guess a number from {task['low']} to {task['high']} :"

    async def step(self, action: str) -> StepOutcome:
        if self._spec is None or self._done(self._spec):
            raise RuntimeError("step() outside an episode: reset() first")
        self._actions.append(action)
        feedback = guess_feedback(self._spec, parse_guess(action))
        done = self._done(self._spec)
        # Sparse: the whole episode's reward arrives on its last step.
        reward = self._task.score(self._spec, self._actions) if done else 0.0
        return StepOutcome(feedback, reward, done, {"turn": len(self._actions)})

    def _done(self, spec: TaskSpec) -> bool:
        last = self._actions[-1] if self._actions else None
        found = last is not None and guess_feedback(spec, parse_guess(last)) == CORRECT
        return found or len(self._actions) >= spec["max_turns"]


@dataclass
class GuessNumber(Task):
    """Find a hidden integer in [low, high] within `max_turns` guesses.

    Text format: the prompt is "guess a number from 0 to 15 :", each completion is one
    number, each observation is one word: "higher", "lower", "invalid" (unparsable or out of
    range; the turn is spent) or "correct" (the episode ends). Episodes end after a correct
    guess or `max_turns` guesses; the final observation is never shown to the model.

    Reward: 1.0 when the target is found within `max_turns`, else 0.0, plus
    `progress_bonus` * (share of the log search space the guesses eliminated; 1 once found).
    The bonus is recomputable from the actions like the rest, gives a signal long before the
    first success, and credits each guess that halves the interval, so binary search is the
    best policy under both terms. `success` ignores it.
    """

    name: str = "guess_number"
    low: int = 0
    high: int = 15
    max_turns: int = 5
    progress_bonus: float = 0.0

    def sample(self, rng: random.Random) -> TaskSpec:
        target = rng.randint(self.low, self.high)
        return {"target": target, "low": self.low, "high": self.high,
                "max_turns": self.max_turns}

    def make_env(self) -> Env:
        return GuessNumberEnv(self)

    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        game = replay_guesses(task, actions)
        space = task["high"] - task["low"] + 1
        progress = 1.0 - math.log(game.remaining()) / math.log(max(space, 2))
        return float(game.found) + self.progress_bonus * progress

    def success(self, task: TaskSpec, actions: Sequence[str]) -> bool:
        return replay_guesses(task, actions).found

    def vocabulary(self) -> set[str]:
        return {"guess", "a", "number", "from", "to", ":", HIGHER, LOWER, CORRECT, INVALID}


# ---------------------------------------------------------------------------- addition


class AdditionEnv:
    """One question, one answer."""

    def __init__(self, task: Addition) -> None:
        self.tools: dict[str, Callable[..., Any]] = {}
        self._task = task
        self._spec: TaskSpec | None = None

    async def reset(self, task: TaskSpec) -> str:
        self._spec = task
        return f"{task['a']} + {task['b']} ="

    async def step(self, action: str) -> StepOutcome:
        if self._spec is None:
            raise RuntimeError("step() before reset()")
        spec, self._spec = self._spec, None  # single turn: a second step is an error
        reward = self._task.score(spec, [action])
        return StepOutcome(CORRECT if reward else "wrong", reward, True, {"turn": 1})


@dataclass
class Addition(Task):
    """`a + b =` with operands in [0, max_operand]; exact-match scoring of the sum."""

    name: str = "addition"
    max_operand: int = 9
    max_turns: int = 1

    def sample(self, rng: random.Random) -> TaskSpec:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return {"a": a, "b": b, "max_turns": 1}

    def make_env(self) -> Env:
        return AdditionEnv(self)

    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        return exact_match(str(task["a"] + task["b"]), actions[0]) if actions else 0.0

    def success(self, task: TaskSpec, actions: Sequence[str]) -> bool:
        return self.score(task, actions) == 1.0

    def vocabulary(self) -> set[str]:
        return {"+", "=", CORRECT, "wrong"}


# progress_bonus 1.0: a partial reward for narrowing the interval gives a signal long before
# the first success; it made guess_number learnable in minutes (see GuessNumber).
TASKS: dict[str, Task] = {
    task.name: task for task in (GuessNumber(progress_bonus=1.0), Addition())
}
"""The built-in tasks by name (a `Prompt` names its task; the reward service looks it up)."""

import rlbus.synthetic  # noqa: E402, F401  (registers "synthetic"; it subclasses Task above)

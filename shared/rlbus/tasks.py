"""The built-in tasks: guess_number, addition and python_tests, written against
:mod:`rlbus.api` like any user's task and registered by entry point in rlbus's pyproject.

The rollout tier drives an :class:`~rlbus.api.Env` (``reset(spec)`` → first observation,
then ``step(action)`` per model turn); the reward tier recomputes the outcome from the
model's actions alone (the decoded completion texts, one per turn) and never trusts a
reward the environment reported. Both read the same spec, which holds every parameter the
score depends on, so a stored trajectory re-scores to the same reward.

Texts are lowercase words, numbers and symbols separated by single spaces, so the demo's
word-level tokenizer round-trips them exactly.

Stdlib only: rollout and reward import this module and must not pull in torch.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rlbus.api import Env, StepOutcome, Task, TaskSpec

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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


class GuessNumberEnv(Env):
    """Guess a hidden integer; each wrong guess is answered "higher" or "lower"."""

    def __init__(self, task: GuessNumber) -> None:
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

    Reward: 1.0 when the target is found within `max_turns`, else 0.0, plus the spec's
    `progress_bonus` * (share of the log search space the guesses eliminated; 1 once found);
    the bonus travels in the spec (absent: 0), so re-scoring never depends on this class.
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
                "max_turns": self.max_turns, "progress_bonus": self.progress_bonus}

    def make_env(self) -> Env:
        return GuessNumberEnv(self)

    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        game = replay_guesses(task, actions)
        space = task["high"] - task["low"] + 1
        progress = 1.0 - math.log(game.remaining()) / math.log(max(space, 2))
        return float(game.found) + float(task.get("progress_bonus", 0.0)) * progress

    def success(self, task: TaskSpec, actions: Sequence[str]) -> bool:
        return replay_guesses(task, actions).found


# ---------------------------------------------------------------------------- addition


class AdditionEnv(Env):
    """One question, one answer."""

    def __init__(self, task: Addition) -> None:
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


# ------------------------------------------------------------------------ python_tests

_PROGRAMS = [
    ("print the sum of two integers read from one line", [("1 2", "3"), ("-4 9", "5")]),
    ("print the larger of two integers read from one line", [("3 8", "8"), ("7 -1", "7")]),
    ("print the line read reversed", [("abc", "cba"), ("rl bus", "sub lr")]),
]


class PythonTestsEnv(Env):
    """One turn: the model answers with a program; nothing runs here (the reward tier runs
    it in the sandbox)."""

    async def reset(self, spec: TaskSpec) -> str:
        return f"write a python program : {spec['problem']}"

    async def step(self, action: str) -> StepOutcome:
        return StepOutcome("submitted", 0.0, True)


@dataclass
class PythonTests(Task):
    """Write a program that passes stdin/stdout tests; scored by the ``python_tests``
    verifier, which runs the program in the reward tier's sandbox. A spec from elsewhere
    (e.g. ``rlbus feed``) may carry any problem and tests of the same shape."""

    name: str = "python_tests"
    max_turns: int = 1
    verifier: str | None = "python_tests"

    def sample(self, rng: random.Random) -> TaskSpec:
        problem, tests = rng.choice(_PROGRAMS)
        return {"problem": problem, "max_turns": 1,
                "tests": [{"stdin": i, "expected": o} for i, o in tests]}

    def make_env(self) -> Env:
        return PythonTestsEnv()

    def score(self, task: TaskSpec, actions: Sequence[str]) -> float:
        from rlbus.code_verifier import python_tests  # the sandbox: reward only

        return python_tests(task, actions)


# progress_bonus 1.0: a partial reward for narrowing the interval gives a signal long before
# the first success; it made guess_number learnable in minutes (see GuessNumber).
guess_number = GuessNumber(progress_bonus=1.0)
addition = Addition()
python_tests = PythonTests()
"""The instances rlbus's pyproject registers under the entry-point group ``rlbus.tasks``."""

"""The built-in ``gsm8k`` task: grade-school math word problems, one answer, exact match.

A spec is ``{"question": ..., "answer": ...}`` as GSM8K's rows are: the reference answer
may be a whole worked solution ending in ``#### 72``; only its final number counts. The
model's answer is read the same way (:func:`extract_answer`): the number after the last
``####`` if there is one, else the last number of the text, with thousands separators,
a leading ``$`` and trailing zeros of a decimal dropped; reward 1.0 when it equals the
reference's (exact match of the normalised numbers), else 0.0. ``success`` is the same.

The reward tier scores it with :meth:`MathProblem.score` (no separate verifier): the score
needs the spec and the actions alone, and a task's own score already runs in the reward
tier's worker process. The ``math_answer`` verifier (:mod:`rlbus.reward.verifiers`) applies
the same extraction to any task whose spec names it.

The prompt is ``spec["prompt"]`` if a dataset template rendered one, else the question,
after ``spec["system_prompt"]`` if there is one. Stdlib only (rollout and reward import it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from rlbus.api import Env, StepOutcome, Task, TaskSpec

_FINAL = "####"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")

_PROBLEMS = [
    ("tom has 3 boxes of 4 apples . how many apples does he have ?", "3 * 4 = 12 #### 12"),
    ("a pen costs 2 dollars . how much do 5 pens cost ?", "5 * 2 = 10 #### 10"),
    ("sara read 7 pages on monday and 9 on tuesday . how many pages in all ?", "#### 16"),
]
"""What :meth:`MathProblem.sample` draws from without a dataset (a smoke test's worth)."""


def normalise_number(text: str) -> str | None:
    """``text`` as a canonical number string ("1,000.50" -> "1000.5", "$7" -> "7"), None if
    it is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution or a model's completion, normalised: the first number
    after the last ``####``, else the last number in the text; None if there is none."""
    if _FINAL in text:
        found = _NUMBER.findall(text.rsplit(_FINAL, 1)[1])
        return normalise_number(found[0]) if found else None
    found = _NUMBER.findall(text)
    return normalise_number(found[-1]) if found else None


def math_answer(reference: str, text: str) -> float:
    """1.0 when ``text``'s final answer equals ``reference``'s (exact match), else 0.0."""
    expected = extract_answer(str(reference))
    return 1.0 if expected is not None and extract_answer(text) == expected else 0.0


class MathEnv(Env):
    """One question, one answer."""

    def __init__(self, task: MathProblem) -> None:
        self._task = task
        self._spec: TaskSpec | None = None

    async def reset(self, spec: TaskSpec) -> str:
        self._spec = spec
        text = str(spec.get("prompt") or spec["question"])
        system = spec.get("system_prompt")
        return f"{system}\n\n{text}" if system else text

    async def step(self, action: str) -> StepOutcome:
        if self._spec is None:
            raise RuntimeError("step() before reset()")
        spec, self._spec = self._spec, None  # single turn: a second step is an error
        reward = self._task.score(spec, [action])
        return StepOutcome("correct" if reward else "wrong", reward, True, {"turn": 1})


@dataclass
class MathProblem(Task):
    """A word problem answered with one number (GSM8K's format); see the module."""

    name: str = "gsm8k"
    max_turns: int = 1

    def sample(self, rng: random.Random) -> TaskSpec:
        question, answer = rng.choice(_PROBLEMS)
        return {"question": question, "answer": answer}

    def make_env(self) -> Env:
        return MathEnv(self)

    def score(self, spec: TaskSpec, actions: Sequence[str]) -> float:
        return math_answer(spec["answer"], actions[-1]) if actions else 0.0

    def validate(self, spec: TaskSpec) -> None:
        question = spec.get("prompt") or spec.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError("needs a non-empty 'question' (or a rendered 'prompt')")
        if "answer" not in spec:
            raise ValueError("needs an 'answer'")
        if extract_answer(str(spec["answer"])) is None:
            raise ValueError(f"'answer' has no number: {str(spec['answer'])[:80]!r}")


gsm8k = MathProblem()
"""The instance rlbus's pyproject registers as the ``gsm8k`` entry point of ``rlbus.tasks``."""

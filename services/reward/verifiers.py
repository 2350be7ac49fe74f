"""The verifier registry: which function scores a trajectory.

A task's own scorer (``rlbus.tasks.TASKS``) recomputes the outcome from the model's actions;
a spec may instead name a generic verifier (``{"verifier": "exact_match", "answer": "42"}``)
to score the final action against a reference, or run it as a program against tests in the
sandbox (``{"verifier": "python_tests", "tests": [{"stdin": "1 2", "expected": "3"}]}``).
Verifiers are plain functions ``(spec, actions) -> float``; the reward service runs them in a
worker thread under a timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlbus.services.reward.code_verifier import python_tests
from rlbus.tasks import TASKS, exact_match, numeric_answer

Verifier = Callable[[dict[str, Any], Sequence[str]], float]


def _final_answer(check: Callable[[Any, str], float]) -> Verifier:
    def verify(spec: dict[str, Any], actions: Sequence[str]) -> float:
        return check(spec["answer"], actions[-1]) if actions else 0.0

    return verify


GENERIC: dict[str, Verifier] = {
    "exact_match": _final_answer(lambda answer, text: exact_match(str(answer), text)),
    "numeric": _final_answer(numeric_answer),
    "python_tests": python_tests,  # model-written code, run only in the sandbox
}


class UnknownVerifierError(LookupError):
    """Neither the spec's verifier nor the task is registered."""


def resolve(task: str, spec: dict[str, Any]) -> tuple[str, Verifier]:
    """The (name, function) that scores an episode of ``task`` with ``spec``."""
    named = spec.get("verifier")
    if named is not None:
        if named not in GENERIC:
            raise UnknownVerifierError(f"unknown verifier {named!r}; known: {sorted(GENERIC)}")
        return named, GENERIC[named]
    if task not in TASKS:
        raise UnknownVerifierError(f"no verifier for task {task!r}; known: {sorted(TASKS)}")
    return task, TASKS[task].score

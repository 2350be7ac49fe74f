"""Which verifier scores a trajectory, and the built-in ones.

The spec may name a verifier (``{"verifier": "exact_match", "answer": "42"}``; an entry point
of ``rlbus.verifiers`` or an import string); otherwise the task's own ``verifier``, if it
names one; otherwise the task's ``score`` recomputes the outcome from the actions
(:class:`TaskScore`). The reward tier runs whichever it is in a worker process
(:mod:`.pool`), never on its event loop.

Built-ins: ``exact_match`` and ``numeric`` compare the final action with ``spec["answer"]``;
``math_answer`` compares the final answers as :func:`rlbus.math_task.extract_answer`
reads them (GSM8K's ``#### 72``, else the last number); ``python_tests`` runs it as a
program against ``spec["tests"]`` in the sandbox (:mod:`.code_verifier`).
"""

from __future__ import annotations

from rlbus import plugins
from rlbus.api import Task, Verdict, Verifier
from rlbus.code_verifier import python_tests
from rlbus.math_task import math_answer
from rlbus.messages import Trajectory
from rlbus.tasks import exact_match, numeric_answer


def _actions(t: Trajectory) -> list[str]:
    return [turn.action for turn in t.turns if turn.tool_call is None]


class TaskScore(Verifier):
    """A task's own ``score(spec, actions)``; tool-call turns are not actions."""

    def __init__(self, task: Task) -> None:
        self.task = task

    async def verify(self, trajectory: Trajectory) -> Verdict:
        return Verdict(float(self.task.score(trajectory.spec, _actions(trajectory))))


class _FinalAnswer(Verifier):
    def check(self, answer: str, text: str) -> float:
        raise NotImplementedError

    async def verify(self, trajectory: Trajectory) -> Verdict:
        if "answer" not in trajectory.spec:
            raise ValueError(f"{type(self).__name__} needs spec['answer']")
        actions = _actions(trajectory)
        answer = str(trajectory.spec["answer"])
        return Verdict(self.check(answer, actions[-1]) if actions else 0.0)


class ExactMatch(_FinalAnswer):
    """1.0 when the final action equals ``spec["answer"]`` up to surrounding whitespace."""

    def check(self, answer: str, text: str) -> float:
        return exact_match(answer, text)


class NumericAnswer(_FinalAnswer):
    """1.0 when the final action's last number equals ``spec["answer"]``."""

    def check(self, answer: str, text: str) -> float:
        return numeric_answer(answer, text)


class MathAnswer(_FinalAnswer):
    """1.0 when the final action's answer equals ``spec["answer"]``'s, both read as
    :func:`rlbus.math_task.extract_answer` reads them (exact match of the numbers)."""

    def check(self, answer: str, text: str) -> float:
        return math_answer(answer, text)


class PythonTestsVerifier(Verifier):
    """Share of ``spec["tests"]`` the final action passes as a program, in the sandbox."""

    async def verify(self, trajectory: Trajectory) -> Verdict:
        actions = _actions(trajectory)
        return Verdict(python_tests(trajectory.spec, actions))


def resolve(t: Trajectory) -> tuple[str, Verifier]:
    """The (name, verifier) that scores ``t``; raises :class:`rlbus.plugins.PluginError`."""
    named = t.spec.get("verifier")
    if named is not None:
        return str(named), plugins.verifier(str(named))
    task = plugins.task(t.task)
    if task.verifier is not None:
        return task.verifier, plugins.verifier(task.verifier)
    return t.task, TaskScore(task)

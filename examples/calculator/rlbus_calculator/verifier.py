"""The calculator verifier: sees the whole trajectory, tool calls included."""

from __future__ import annotations

from rlbus.api import Verdict, Verifier
from rlbus.messages import Trajectory
from rlbus_calculator.task import final_answer


class CalculatorVerifier(Verifier):
    """1.0 for the right final answer; info counts the tool calls and the failed ones."""

    async def verify(self, trajectory: Trajectory) -> Verdict:
        calls = [t.tool_call for t in trajectory.turns if t.tool_call is not None]
        answers = [t.action for t in trajectory.turns if t.tool_call is None]
        right = bool(answers) and final_answer(answers[-1]) == trajectory.spec["answer"]
        return Verdict(float(right), info={
            "tool_calls": len(calls),
            "tool_errors": sum(c.error is not None for c in calls),
            "answered": bool(answers) and final_answer(answers[-1]) is not None,
        })

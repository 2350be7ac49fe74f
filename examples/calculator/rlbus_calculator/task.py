"""The calculator task: "compute a op b op c", with a calculator tool to help."""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Sequence

from rlbus.api import Env, StepOutcome, Task, TaskSpec, Tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
WORDS = ["compute", "answer", "right", "wrong", "say", "then", "*", "-", "+"]
"""The words of this task's texts, for a word-level tokenizer (``rlbus model init --words``)."""


def evaluate(expression: str) -> int:
    """Integer + - * only; anything else is an error (never ``eval``)."""
    if len(expression) > 200:
        raise ValueError("expression too long")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    return walk(ast.parse(expression, mode="eval"))


def final_answer(action: str) -> int | None:
    """The number after the last "answer" in ``action``, if any."""
    words = action.split()
    for i in range(len(words) - 2, -1, -1):
        if words[i] == "answer":
            try:
                return int(words[i + 1])
            except ValueError:
                return None
    return None


async def _calculator(expression: str) -> str:
    return str(evaluate(expression))


class CalculatorEnv(Env):
    tools = (Tool(
        name="calculator",
        description="evaluates an integer expression with + - *",
        fn=_calculator,
        parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]},
    ),)

    def __init__(self) -> None:
        self.spec: TaskSpec = {}

    async def reset(self, spec: TaskSpec) -> str:
        self.spec = spec
        return f"compute {spec['expression']} then say answer"

    async def step(self, action: str) -> StepOutcome:
        answer = final_answer(action)
        if answer is None:
            return StepOutcome("say answer then a number", 0.0, False)
        right = answer == self.spec["answer"]
        return StepOutcome("right" if right else "wrong", float(right), True)


class CalculatorTask(Task):
    """Chained arithmetic; scored by the ``calculator`` verifier of this package."""

    name = "calculator"
    max_turns = 4
    verifier = "calculator"

    def __init__(self, terms: int = 3, high: int = 9) -> None:
        self.terms, self.high = terms, high

    def sample(self, rng: random.Random) -> TaskSpec:
        while True:  # answers 0..99: one token each for the demo's word-level tokenizer
            parts = [str(rng.randint(0, self.high))]
            for _ in range(self.terms - 1):
                parts += [rng.choice(["+", "-", "*"]), str(rng.randint(0, self.high))]
            expression = " ".join(parts)
            if 0 <= evaluate(expression) <= 99:
                break
        # everything the score depends on travels in the spec
        return {"expression": expression, "answer": evaluate(expression), "max_turns": 4}

    def make_env(self) -> Env:
        return CalculatorEnv()

    def score(self, spec: TaskSpec, actions: Sequence[str]) -> float:
        return float(bool(actions) and final_answer(actions[-1]) == spec["answer"])

"""The example plugin's task, tool and verifier (imported from the folder, not installed)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from rlbus.agent import MultiTurnAgent
from rlbus.api import Episode, Generation
from rlbus.messages import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "calculator"))
from rlbus_calculator import CalculatorTask, CalculatorVerifier, evaluate

from tests import factories


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("2 + 3 * 4") == 14 and evaluate("-2 * 3") == -6
    for hostile in ("__import__('os').system('id')", "2 ** 99999", "1 / 0", "x", "2" * 300):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate(hostile)


def test_specs_carry_their_answer_and_stay_in_the_tokenizer_range():
    task = CalculatorTask()
    rng = random.Random(0)
    for _ in range(200):
        spec = task.sample(rng)
        assert spec["answer"] == evaluate(spec["expression"]) and 0 <= spec["answer"] <= 99


class Script:
    def __init__(self, actions: list[str]) -> None:
        self.actions, self.n = actions, 0

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        self.n += 1
        return Generation([self.n - 1], [0.0], 0)

    def encode(self, text: str) -> list[int]:
        return [7]

    def decode(self, ids: list[int]) -> str:
        return self.actions[ids[0]]


async def test_an_episode_with_the_tool_scores_through_the_plugin_verifier():
    task = CalculatorTask()
    spec = {"expression": "3 * 4 + 5", "answer": 17, "max_turns": 4}
    script = Script(['<tool_call>{"name": "calculator", "arguments": '
                     '{"expression": "3 * 4 + 5"}}</tool_call>',
                     "i think", "answer 17"])
    ep = Episode(task=task, spec=spec, env=task.make_env(), policy=script, tokenizer=script,
                 sampling=Sampling(max_new_tokens=4), max_context_tokens=100, timeout_s=1)
    await MultiTurnAgent().run(ep)
    assert [t.observation for t in ep.turns] == ["17", "say answer then a number", "right"]
    t = factories.trajectory("g").model_copy(update={"turns": ep.turns, "spec": spec,
                                                     "task": "calculator"})
    verdict = await CalculatorVerifier().verify(t)
    assert verdict.reward == 1.0
    assert verdict.info == {"tool_calls": 1, "tool_errors": 0, "answered": True}

"""The gsm8k task reads final answers as GSM8K writes them and scores by exact match."""

import asyncio

import pytest

from rlbus import plugins
from rlbus.math_task import extract_answer, gsm8k, math_answer


@pytest.mark.parametrize(("text", "answer"), [
    ("3 * 4 = 12\n#### 12", "12"),
    ("#### 1,737", "1737"),            # thousands separators dropped
    ("so she pays $18.", "18"),        # a dollar sign and a full stop around it
    ("it is 2.50 dollars", "2.5"),     # trailing zeros of a decimal
    ("4 * 0.5 = 2.0\n#### 2.0", "2"),  # an integral decimal is the integer
    ("I think 3, no: 7", "7"),         # without ####, the last number
    ("#### 5 (not 9)", "5"),           # after ####, the first number
    ("first #### 1 then #### 8", "8"),  # the last ####
    ("the answer is -3", "-3"),
    ("no number here", None),
    ("#### none", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_exact_match_of_the_numbers_not_the_text():
    assert math_answer("#### 1,200", "The total is 1200 dollars.") == 1.0
    assert math_answer("#### 12", "12.0") == 1.0
    assert math_answer("#### 12", "121") == 0.0
    assert math_answer("#### 12", "") == 0.0


def test_validate_names_what_a_spec_lacks():
    gsm8k.validate({"question": "q?", "answer": "#### 3"})
    with pytest.raises(ValueError, match="question"):
        gsm8k.validate({"answer": "#### 3"})
    with pytest.raises(ValueError, match="no number"):
        gsm8k.validate({"question": "q?", "answer": "three"})


def test_the_env_shows_system_prompt_then_question_and_scores_one_turn():
    env = gsm8k.make_env()
    spec = {"question": "1 + 1?", "answer": "#### 2", "system_prompt": "be brief"}
    assert asyncio.run(env.reset(spec)) == "be brief\n\n1 + 1?"
    outcome = asyncio.run(env.step("it is 2"))
    assert outcome.done and outcome.reward == 1.0
    assert gsm8k.success(spec, ["2"]) and not gsm8k.success(spec, ["3"])


def test_found_by_import_string():
    # the gsm8k entry point is declared in pyproject; the import string needs no install
    assert plugins.task("rlbus.math_task:gsm8k") is gsm8k

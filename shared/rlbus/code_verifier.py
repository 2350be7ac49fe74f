"""The ``python_tests`` verifier: the model's final action is a program, run against tests.

Spec::

    {"verifier": "python_tests",
     "tests": [{"stdin": "1 2\\n", "expected": "3\\n"}, ...],
     "timeout_s": 2.0,          # wall clock per test (CPU seconds: the same, rounded up)
     "memory_mb": 256,          # address space per test
     "total_timeout_s": 8.0}    # tests not started by then fail

Reward: the fraction of tests whose run exits 0 within its limits and prints the expected
output (compared line by line, trailing whitespace ignored). A program that crashes, hangs,
floods its output or hits any limit fails that test; only a broken spec or a sandbox that
cannot start raises, and the reward service masks such a sample instead of scoring it.

``total_timeout_s`` keeps the whole verification under the reward service's
``verifier_timeout_s`` (10 s by default): past that, a slow program would be masked rather
than given the 0 it earned.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from typing import Any

from rlbus.sandbox import run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(action: str) -> str:
    """The last fenced code block of ``action`` (chat models wrap code in one), else all of it."""
    blocks = _FENCE.findall(action)
    return str(blocks[-1]) if blocks else action


def python_tests(spec: dict[str, Any], actions: Sequence[str]) -> float:
    """Fraction of ``spec["tests"]`` the final action passes (see the module docstring)."""
    tests = spec["tests"]
    if not tests:
        raise ValueError("python_tests spec has no tests")
    if not actions:
        return 0.0
    program = extract_program(actions[-1])
    timeout_s = float(spec.get("timeout_s", 2.0))
    memory_mb = int(spec.get("memory_mb", 256))
    deadline = time.monotonic() + float(spec.get("total_timeout_s", 8.0))
    passed = 0
    for test in tests:
        left = min(timeout_s, deadline - time.monotonic())
        if left <= 0:
            break
        passed += _passes(program, test, left, memory_mb)
    return passed / len(tests)


def _passes(program: str, test: dict[str, Any], timeout_s: float, memory_mb: int) -> bool:
    result = run_python(program, stdin=str(test.get("stdin", "")), timeout_s=timeout_s,
                        cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb)
    return result.ok and _lines(result.stdout) == _lines(str(test["expected"]))


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]

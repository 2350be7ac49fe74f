"""Example rlbus plugin: chained arithmetic with a calculator tool (see README.md)."""

from rlbus_calculator.task import WORDS, CalculatorEnv, CalculatorTask, evaluate
from rlbus_calculator.verifier import CalculatorVerifier

__all__ = ["WORDS", "CalculatorEnv", "CalculatorTask", "CalculatorVerifier", "evaluate"]

"""Waiting in tests: for records on a real broker, where delivery takes a few fetches, and for
a condition, polled against a deadline instead of a fixed sleep.

The deadlines are safety nets, sized for a loaded 2-core CI machine: a test waits only as
long as the condition takes to hold, so a generous deadline costs nothing when all is well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

DEADLINE_S = 30.0
"""Default safety net of ``wait_until``/``wait_until_sync``."""


async def poll_until(consumer: Any, n: int, rounds: int = 40) -> list[Any]:
    """Deliveries until at least ``n`` arrived; fails after ``rounds`` half-second polls."""
    got: list[Any] = []
    for _ in range(rounds):
        got += await consumer.poll(0.5)
        if len(got) >= n:
            return got
    raise AssertionError(f"only {len(got)} of {n} records arrived")


async def wait_until(condition: Callable[[], object], what: str = "the condition",
                     timeout_s: float = DEADLINE_S, every_s: float = 0.02) -> None:
    """Return as soon as ``condition()`` is true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g}s")
        await asyncio.sleep(every_s)


def wait_until_sync(condition: Callable[[], object], what: str = "the condition",
                    timeout_s: float = DEADLINE_S, every_s: float = 0.05) -> None:
    """``wait_until`` for synchronous tests (subprocesses, files)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g}s")
        time.sleep(every_s)

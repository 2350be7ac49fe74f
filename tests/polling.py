"""Waiting for records on a real broker, where delivery takes a few fetches."""

from __future__ import annotations

from typing import Any


async def poll_until(consumer: Any, n: int, rounds: int = 40) -> list[Any]:
    """Deliveries until at least ``n`` arrived; fails after ``rounds`` half-second polls."""
    got: list[Any] = []
    for _ in range(rounds):
        got += await consumer.poll(0.5)
        if len(got) >= n:
            return got
    raise AssertionError(f"only {len(got)} of {n} records arrived")

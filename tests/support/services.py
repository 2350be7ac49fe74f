"""Running services in-process on the in-memory bus until a condition holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from rlbus.codec import decode
from rlbus.service import Service
from rlbus.transport import MemoryBroker


def read_log(broker: MemoryBroker, topic: str, cls: type) -> list[Any]:
    """Every record of ``topic`` (all partitions), decoded as ``cls``."""
    return [decode(r.value, cls) for part in broker.logs.get(topic, []) for r in part]


async def run_until(services: Sequence[Service[Any]], until: Callable[[], bool],
                    limit_s: float = 20.0) -> None:
    """Run ``services`` until ``until()``; a crashed service fails the caller right there;
    all are stopped (and drained) on the way out."""
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        async with asyncio.timeout(limit_s):
            while not until():
                for t in tasks:
                    if t.done():
                        t.result()
                await asyncio.sleep(0.05)
    finally:
        for s in services:
            s.request_stop("test over")
        await asyncio.gather(*tasks)

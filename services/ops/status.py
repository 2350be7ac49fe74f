"""``rlbus status``: lag and throughput per topic and consumer group, live.

Lag is the topic's end offset minus the group's committed offset, summed over partitions;
throughput is how fast end offsets (produced) and committed offsets (consumed) move between
two samples. Read-only: it joins no group and commits nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.structs import TopicPartition
from pydantic import BaseModel

from rlbus.settings import KafkaSettings
from rlbus.topics import Topics
from rlbus.transport import KafkaBus, admin_client, with_timeout


@dataclass(frozen=True)
class Sample:
    at: float
    ends: dict[str, int]  # topic -> sum of end offsets
    committed: dict[tuple[str, str], int]  # (group, topic) -> sum of committed offsets
    lag: dict[tuple[str, str], int]  # (group, topic) -> records not yet committed


async def sample(kafka: KafkaSettings, topics: Topics, bus: KafkaBus) -> Sample:
    names = [s.name for s in topics.catalogue()]
    tps = [(n, p) for n in names for p in await bus.partitions(n)]
    reader = await bus.consumer(names, BaseModel, assign=tps)
    try:
        ends = await reader.end_offsets(tps)
    finally:
        await reader.close()
    committed: dict[tuple[str, str], int] = {}
    lag: dict[tuple[str, str], int] = {}
    async with admin_client(kafka) as admin:
        groups = [g[0] for g in await with_timeout(admin.list_consumer_groups(), 30, "groups")]
        for group in sorted(groups):
            offsets = await with_timeout(
                admin.list_consumer_group_offsets(group), 30, "group offsets"
            )
            _fold(group, offsets, ends, committed, lag)
    per_topic = {n: sum(v for (t, _), v in ends.items() if t == n) for n in names}
    return Sample(time.monotonic(), per_topic, committed, lag)


def _fold(
    group: str,
    offsets: dict[TopicPartition, Any],
    ends: dict[tuple[str, int], int],
    committed: dict[tuple[str, str], int],
    lag: dict[tuple[str, str], int],
) -> None:
    for tp, meta in offsets.items():
        end = ends.get((tp.topic, tp.partition))
        if end is None or meta.offset < 0:
            continue  # another prefix's topic, or nothing committed yet
        key = (group, tp.topic)
        committed[key] = committed.get(key, 0) + meta.offset
        lag[key] = lag.get(key, 0) + max(0, end - meta.offset)


def table(prev: Sample | None, cur: Sample) -> Any:
    from rich.table import Table

    dt = (cur.at - prev.at) if prev else 0.0
    t = Table(title="rlbus status: lag and throughput per topic and group")
    for col, justify in (
        ("topic", "left"),
        ("group", "left"),
        ("end offset", "right"),
        ("produced/s", "right"),
        ("lag", "right"),
        ("consumed/s", "right"),
    ):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for topic, end in cur.ends.items():
        produced = _rate(prev.ends.get(topic) if prev else None, end, dt)
        readers = sorted(g for g, tp in cur.lag if tp == topic)
        if not readers:
            t.add_row(topic, "-", str(end), produced, "-", "-")
        for i, group in enumerate(readers):
            done = cur.committed[(group, topic)]
            consumed = _rate(prev.committed.get((group, topic)) if prev else None, done, dt)
            t.add_row(
                topic if i == 0 else "",
                group,
                str(end) if i == 0 else "",
                produced if i == 0 else "",
                str(cur.lag[(group, topic)]),
                consumed,
            )
    return t


def _rate(before: int | None, now: int, dt: float) -> str:
    return "-" if before is None or dt <= 0 else f"{(now - before) / dt:.1f}"


async def status_command(kafka: KafkaSettings, topics: Topics, once: bool, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    bus = KafkaBus(kafka, dlq_topic=None, service="status")
    try:
        prev = None
        cur = await sample(kafka, topics, bus)
        if once:
            Console().print(table(prev, cur))
            return 0
        with Live(table(prev, cur), refresh_per_second=1) as live:
            while True:
                await asyncio.sleep(interval)
                prev, cur = cur, await sample(kafka, topics, bus)
                live.update(table(prev, cur))
    except KeyboardInterrupt:
        return 0
    finally:
        await bus.close()

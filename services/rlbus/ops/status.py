"""``rlbus status``: lag and throughput per topic and consumer group, and what trained, live.

Lag is the topic's end offset minus the group's committed offset, summed over partitions;
throughput is how fast end offsets (produced) and committed offsets (consumed) move between
two samples. Records consumed are not samples trained: the learner's newest ``WeightVersion``
carries its running counts of episodes that entered the loss and of those masked, by cause,
and the second table shows them with the trained rate. Read-only: it joins no group and
commits nothing.

The topic prefix is printed once, above the table, and left out of topic and group names, so
that ``demo-20261203-101112.trajectories`` and ``demo-20261203-101112.trajectories.scored``
stay distinguishable at 80 columns. Off a terminal (a pipe, a file, CI) it prints one table
and exits, as with ``--once``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition
from pydantic import BaseModel

from rlbus.messages import MASK_CAUSES, WeightVersion
from rlbus.settings import KafkaSettings
from rlbus.topics import Topics
from rlbus.transport import KafkaBus, admin_client, with_timeout

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class Sample:
    at: float
    ends: dict[str, int]  # topic -> sum of end offsets
    committed: dict[tuple[str, str], int]  # (group, topic) -> sum of committed offsets
    lag: dict[tuple[str, str], int]  # (group, topic) -> records not yet committed
    learner: dict[str, WeightVersion] = field(default_factory=dict)  # model -> newest version


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
    learner = await newest_weights(bus, topics.weights, ends.get((topics.weights, 0), 0))
    return Sample(time.monotonic(), per_topic, committed, lag, learner)


async def newest_weights(bus: KafkaBus, topic: str, end: int,
                         last: int = 32) -> dict[str, WeightVersion]:
    """The newest WeightVersion of each model among the ``last`` records before ``end``."""
    if end <= 0:
        return {}
    reader = await bus.consumer([topic], WeightVersion, assign=[(topic, 0)])
    try:
        await reader.seek((topic, 0), max(0, end - last))
        newest: dict[str, WeightVersion] = {}
        for d in await reader.read_to_end((topic, 0)):
            newest[d.message.model] = d.message
        return newest
    finally:
        await reader.close()


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


def table(prev: Sample | None, cur: Sample, prefix: str = "") -> Any:
    """The table of one sample; rates need the previous one. ``prefix``: the topic prefix,
    left out of the names (shown once, in the title)."""
    from rich.table import Table
    from rich.text import Text

    dt = (cur.at - prev.at) if prev else 0.0
    title = "rlbus status: lag and throughput per topic and group"
    t = Table(title=f"{title}\ntopics of prefix {prefix}" if prefix else title)
    t.add_column("topic", no_wrap=True)
    t.add_column("group", overflow="fold")  # a long group name wraps, never loses its end
    for col in ("end offset", "produced/s", "lag", "consumed/s"):
        t.add_column(col, justify="right", no_wrap=True)
    for topic, end in cur.ends.items():
        produced = _rate(prev.ends.get(topic) if prev else None, end, dt)
        name = _short(topic, prefix)
        readers = sorted(g for g, tp in cur.lag if tp == topic)
        if not readers:
            t.add_row(name, "-", str(end), produced, "-", "-")
        for i, group in enumerate(readers):
            done = cur.committed[(group, topic)]
            consumed = _rate(prev.committed.get((group, topic)) if prev else None, done, dt)
            t.add_row(
                name if i == 0 else "",
                Text(_short(group, prefix)),  # Text: a group name is not rich markup
                str(end) if i == 0 else "",
                produced if i == 0 else "",
                str(cur.lag[(group, topic)]),
                consumed,
            )
    return t


def training(prev: Sample | None, cur: Sample) -> Any:
    """Samples that entered the loss (and the trained rate), and those masked by cause, per
    model, from the learner's newest WeightVersion; None before its first step."""
    from rich.table import Table

    if not cur.learner:
        return None
    dt = (cur.at - prev.at) if prev else 0.0
    t = Table(title="training: samples that entered the loss, and those masked")
    for col in ("model", "step", "trained", "trained/s", *(f"masked {c}" for c in MASK_CAUSES)):
        t.add_column(col, justify="right", no_wrap=True)
    for model, w in sorted(cur.learner.items()):
        before = prev.learner.get(model) if prev else None
        rate = _rate(before.samples_trained if before else None, w.samples_trained, dt)
        masked = (str(w.samples_masked.get(c, 0)) for c in MASK_CAUSES)
        t.add_row(model, str(w.step), str(w.samples_trained), rate, *masked)
    return t


def render(prev: Sample | None, cur: Sample, prefix: str = "") -> Any:
    """Both tables, as one renderable."""
    from rich.console import Group

    parts = [table(prev, cur, prefix), training(prev, cur)]
    return Group(*(p for p in parts if p is not None))


def _short(name: str, prefix: str) -> str:
    return name.removeprefix(prefix + ".") if prefix else name


def _rate(before: int | None, now: int, dt: float) -> str:
    """Per second between two samples; "-" with nothing to compare, or when the count went
    back (a learner resumed from an older checkpoint, a topic recreated)."""
    if before is None or dt <= 0 or now < before:
        return "-"
    return f"{(now - before) / dt:.1f}"


async def status_command(
    kafka: KafkaSettings,
    topics: Topics,
    once: bool,
    interval: float,
    console: Console | None = None,
) -> int:
    """Print the table every ``interval`` seconds until Ctrl-C; once if ``once`` or when
    the output is not a terminal (a live display would write nothing readable there)."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    prefix = topics.settings.prefix
    bus = KafkaBus(kafka, dlq_topic=None, service="status")
    try:
        prev = None
        cur = await sample(kafka, topics, bus)
        if once or not console.is_terminal:
            console.print(render(prev, cur, prefix))
            return 0
        with Live(render(prev, cur, prefix), console=console, refresh_per_second=1) as live:
            while True:
                await asyncio.sleep(interval)
                prev, cur = cur, await sample(kafka, topics, bus)
                live.update(render(prev, cur, prefix))
    finally:
        await bus.close()

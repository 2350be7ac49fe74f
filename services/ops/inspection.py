"""Debugging tools over the topics: ``rlbus replay`` and ``rlbus trace``.

Both read with a group-less consumer (they never move any tier's committed offsets), so they
are safe to run against a live run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from pydantic import BaseModel

from rlbus.codec import DecodeError, decode, to_jsonable
from rlbus.messages import (
    Prompt,
    ScoredTrajectory,
    StepRequest,
    StepResult,
    Trajectory,
)
from rlbus.topics import Topics
from rlbus.transport import TP, Bus, RawRecord


@dataclass(frozen=True)
class Start:
    """Where a replay begins: an offset (per partition), a timestamp, or the beginning."""

    offset: int | None = None
    timestamp_ms: int | None = None


def parse_time(text: str) -> int:
    """Epoch seconds or milliseconds, or an ISO 8601 date-time; returns epoch milliseconds."""
    try:
        value = float(text)
        return int(value if value > 1e11 else value * 1000)
    except ValueError:
        pass
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1000)
    except ValueError:
        raise SystemExit(f"--from-time {text!r}: not epoch seconds/ms or ISO 8601") from None


def resolve_topic(topics: Topics, name: str) -> tuple[str, type[BaseModel] | None]:
    """Full topic name and message type; ``trajectories`` → ``<prefix>.trajectories``."""
    for spec in topics.catalogue():
        if name in (spec.name, spec.name.removeprefix(topics.settings.prefix + ".")):
            return spec.name, spec.message
    return name, None  # a topic outside the catalogue (e.g. a replay target): bytes only


# -- matching ---------------------------------------------------------------------------


def episode_of(message: BaseModel) -> str | None:
    if isinstance(message, StepRequest | StepResult | Trajectory):
        return message.episode_id
    if isinstance(message, ScoredTrajectory):
        return message.trajectory.episode_id
    return None


def group_of(message: BaseModel) -> str | None:
    if isinstance(message, Prompt | Trajectory):
        return message.group_id
    if isinstance(message, ScoredTrajectory):
        return message.trajectory.group_id
    episode = episode_of(message)
    return episode.rsplit("/", 1)[0] if episode else None


@dataclass(frozen=True)
class Filter:
    key: str | None = None
    episode: str | None = None
    group: str | None = None

    def __call__(self, raw: RawRecord, message: BaseModel | None) -> bool:
        if self.key is not None and (raw.key or b"").decode(errors="replace") != self.key:
            return False
        if self.episode is not None and (message is None or episode_of(message) != self.episode):
            return False
        return self.group is None or (message is not None and group_of(message) == self.group)


# -- reading ----------------------------------------------------------------------------


async def read_topic(
    bus: Bus, topic: str, start: Start = Start(), limit: int | None = None
) -> list[RawRecord]:
    """Every record of ``topic`` from ``start`` up to its end as of now, in offset order
    per partition and timestamp order across partitions."""
    tps: list[TP] = [(topic, p) for p in await bus.partitions(topic)]
    consumer = await bus.consumer([topic], BaseModel, assign=tps)
    try:
        ends = await consumer.end_offsets(tps)
        begin = await _start_offsets(consumer, tps, start, ends)
        for tp, off in begin.items():
            await consumer.seek(tp, off)
        records = await _drain(consumer, begin, ends, limit)
    finally:
        await consumer.close()
    return sorted(records, key=lambda r: (r.timestamp_ms, r.partition, r.offset))


async def _start_offsets(consumer: Any, tps: list[TP], start: Start, ends: dict[TP, int]) -> Any:
    if start.timestamp_ms is not None:
        return await consumer.offsets_for_time(tps, start.timestamp_ms)
    return {tp: min(start.offset or 0, ends[tp]) for tp in tps}


async def _drain(
    consumer: Any, position: dict[TP, int], ends: dict[TP, int], limit: int | None
) -> list[RawRecord]:
    out: list[RawRecord] = []
    idle = 0
    while any(position[tp] < ends[tp] for tp in ends) and idle < 20:
        batch = [r for r in await consumer.poll_raw(0.5) if r.offset < ends[(r.topic, r.partition)]]
        idle = 0 if batch else idle + 1
        for r in batch:
            position[(r.topic, r.partition)] = r.offset + 1
        out += batch
        if limit is not None and len(out) >= limit:
            break
    return out


def decoded(
    records: list[RawRecord], message_type: type[BaseModel] | None
) -> Iterator[tuple[RawRecord, BaseModel | None, str | None]]:
    for r in records:
        if message_type is None:
            yield r, None, None
            continue
        try:
            yield r, decode(r.value, message_type), None
        except DecodeError as exc:
            yield r, None, str(exc)


def as_json(raw: RawRecord, message: BaseModel | None, error: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "topic": raw.topic,
        "partition": raw.partition,
        "offset": raw.offset,
        "timestamp_ms": raw.timestamp_ms,
        "key": raw.key.decode(errors="replace") if raw.key is not None else None,
    }
    if message is not None:
        row["message"] = to_jsonable(message)
    else:
        row["error" if error else "bytes"] = error or len(raw.value)
    return row


async def replay(
    bus: Bus,
    topics: Topics,
    name: str,
    start: Start,
    match: Filter,
    *,
    to: str | None = None,
    limit: int | None = None,
    out: IO[str] = sys.stdout,
) -> int:
    """Print matching messages as JSON lines, or re-publish their bytes to ``to``."""
    topic, message_type = resolve_topic(topics, name)
    records = await read_topic(bus, topic, start)
    chosen = [(r, m, e) for r, m, e in decoded(records, message_type) if match(r, m)]
    chosen = chosen[:limit] if limit is not None else chosen
    if to is None:
        for r, m, e in chosen:
            out.write(json.dumps(as_json(r, m, e)) + "\n")
        return len(chosen)
    producer = await bus.producer()
    target, _ = resolve_topic(topics, to)
    for r, _m, _e in chosen:
        await producer.send_raw(target, r.value, key=r.key, headers=r.headers)
    return len(chosen)


# -- trace ------------------------------------------------------------------------------


async def gather_episode(bus: Bus, topics: Topics, episode_id: str) -> list[dict[str, Any]]:
    """Every message of one episode across topics, in time order."""
    group = episode_id.rsplit("/", 1)[0]
    rows: list[dict[str, Any]] = []
    for name, match in (
        (topics.prompts, Filter(group=group)),
        (topics.steps, Filter(episode=episode_id)),
        (topics.results, Filter(episode=episode_id)),
        (topics.trajectories, Filter(episode=episode_id)),
        (topics.scored, Filter(episode=episode_id)),
    ):
        _, message_type = resolve_topic(topics, name)
        for r, m, _e in decoded(await read_topic(bus, name), message_type):
            if m is not None and match(r, m):
                rows.append({"raw": r, "message": m})
    return sorted(rows, key=lambda x: x["raw"].timestamp_ms)


def render_episode(
    episode_id: str, rows: list[dict[str, Any]], write: Callable[[str], Any]
) -> None:
    """The conversation turn by turn, then the message timeline."""
    if not rows:
        write(f"no messages found for episode {episode_id}\n")
        return
    msgs = [r["message"] for r in rows]
    prompt = next((m for m in msgs if isinstance(m, Prompt)), None)
    traj = next((m for m in msgs if isinstance(m, Trajectory)), None)
    scored = [m for m in msgs if isinstance(m, ScoredTrajectory)]
    write(f"episode {episode_id}\n")
    if prompt is not None:
        write(f"  prompt  task={prompt.task} spec={json.dumps(prompt.spec)}\n")
    if traj is not None:
        write(f"  status  {traj.status}{' (' + traj.error + ')' if traj.error else ''}\n")
        for i, t in enumerate(traj.turns):
            write(
                f"  turn {i}  [policy v{t.policy_version}, {len(t.completion_ids)} tokens, "
                f"{t.finish_reason}] action: {t.action!r} -> observation: {t.observation!r}\n"
            )
    for s in scored:
        validity = "" if s.valid else f" (masked: {s.error})"
        write(f"  reward  {s.reward} by {s.verifier or '-'}{validity}\n")
    write("  timeline:\n")
    for r in rows:
        raw, m = r["raw"], r["message"]
        write(
            f"    {raw.timestamp_ms}  {raw.topic}[{raw.partition}]@{raw.offset}  "
            f"{type(m).__name__}\n"
        )

"""Debugging tools over the topics: ``rlbus replay`` and ``rlbus trace``.

Both read with a group-less consumer (they never move any tier's committed offsets), so they
are safe to run against a live run. Neither trusts what it reads: a record that does not
decode (garbage bytes, msgpack that fails the schema) is shown as base64 of its bytes next to
the decode error, never as a traceback. A dead letter's key and payload are shown as what they
hold: a UTF-8 key as text, a payload as the message its source topic carries, else as plain
msgpack, and as base64 only when it is neither (``raw_bytes``: always base64, as stored).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any, NamedTuple

from pydantic import BaseModel

from rlbus.codec import DecodeError, decode, unpack
from rlbus.messages import (
    DeadLetter,
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


def carried_type(topics: Topics, topic: str) -> type[BaseModel] | None:
    """The message type ``topic`` carries: its catalogue name under any prefix, so a dead
    letter from another prefix's run (a re-scoring run's ``rescore.trajectories``) decodes
    too. The longest name wins: ``x.trajectories.scored`` is not ``x.trajectories``."""
    prefix = topics.settings.prefix + "."
    names = sorted(
        ((s.name.removeprefix(prefix), s.message) for s in topics.catalogue()),
        key=lambda named: len(named[0]),
        reverse=True,
    )
    return next((t for name, t in names if topic == name or topic.endswith("." + name)), None)


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


class Decoded(NamedTuple):
    """A record and what became of decoding it: the message, or the error (or neither, for
    a topic outside the catalogue, whose type is unknown)."""

    raw: RawRecord
    message: BaseModel | None
    error: str | None


def decoded(records: list[RawRecord], message_type: type[BaseModel] | None) -> Iterator[Decoded]:
    for r in records:
        if message_type is None:
            yield Decoded(r, None, None)
            continue
        try:
            yield Decoded(r, decode(r.value, message_type), None)
        except DecodeError as exc:
            yield Decoded(r, None, str(exc))


def iso_time(timestamp_ms: int) -> str:
    """``2026-12-03T10:11:12.345Z``; a timestamp out of datetime's range stays a number."""
    try:
        at = datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return str(timestamp_ms)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def jsonable(value: Any) -> Any:
    """JSON-ready form of anything a decoded message can hold. Bytes (a dead letter's
    payload, binary values in a spec) become ``{"base64": ...}``: they are often not UTF-8."""
    if isinstance(value, BaseModel):
        return jsonable(value.model_dump(mode="python"))
    if isinstance(value, bytes | bytearray | memoryview):
        return {"base64": b64(bytes(value))}
    if isinstance(value, dict):
        return {_json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float):
        return value
    return repr(value)  # e.g. a msgpack Timestamp or ExtType inside a free-form spec


def _json_key(key: Any) -> str:
    if isinstance(key, bytes):
        return key.decode(errors="backslashreplace")
    return key if isinstance(key, str) else repr(key)


def key_text(key: bytes | None) -> str | dict[str, str] | None:
    """A record key as text, or ``{"base64": ...}`` when it is not UTF-8."""
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return {"base64": b64(key)}


def payload_json(payload: bytes, message_type: type[BaseModel] | None) -> tuple[str, Any]:
    """What a dead letter's payload holds and its JSON form: the type's name and the message,
    ``"msgpack"`` and the plain object (a map or array that fails the type, within the
    decode limits), or ``"base64"`` and the bytes. A lone msgpack scalar counts as bytes:
    ``b"7"`` parses as the integer 55, which says less than the bytes do."""
    if message_type is not None:
        try:
            return message_type.__name__, jsonable(decode(payload, message_type))
        except DecodeError:
            pass
    try:  # within the decode limits: a payload nested 1000 deep would break jsonable
        value = unpack(payload)
    except DecodeError:
        value = None
    if isinstance(value, dict | list):
        return "msgpack", jsonable(value)
    return "base64", {"base64": b64(payload)}


def dead_letter_json(letter: DeadLetter, topics: Topics) -> dict[str, Any]:
    """A dead letter (its ``reason`` code next to its ``error`` text) with its key as text
    where it is UTF-8 and its payload decoded, next to ``payload_type`` (see
    :func:`payload_json`)."""
    row: dict[str, Any] = jsonable(letter)
    row["key"] = key_text(letter.key)
    del row["payload"]  # put back last, the largest field, after what it was decoded as
    kind, payload = payload_json(letter.payload, carried_type(topics, letter.source_topic))
    return row | {"payload_type": kind, "payload": payload}


def as_json(
    raw: RawRecord,
    message: BaseModel | None,
    error: str | None,
    *,
    topics: Topics | None = None,
    raw_bytes: bool = False,
) -> dict[str, Any]:
    """One record as a JSON-ready row. A dead letter's key and payload are decoded
    (:func:`dead_letter_json`) unless ``raw_bytes`` or no ``topics`` is given."""
    row: dict[str, Any] = {
        "topic": raw.topic,
        "partition": raw.partition,
        "offset": raw.offset,
        "timestamp_ms": raw.timestamp_ms,
        "time": iso_time(raw.timestamp_ms),
        "key": key_text(raw.key),
    }
    if isinstance(message, DeadLetter) and topics is not None and not raw_bytes:
        row["message"] = dead_letter_json(message, topics)
        return row
    if message is not None:
        row["message"] = jsonable(message)
        return row
    if error is not None:
        row["error"] = error
    row["value_base64"] = b64(raw.value)
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
    raw_bytes: bool = False,
    out: IO[str] = sys.stdout,
) -> int:
    """Print matching messages as JSON lines, or re-publish their bytes to ``to``.
    ``raw_bytes``: a dead letter's key and payload as base64, as stored."""
    topic, message_type = resolve_topic(topics, name)
    records = await read_topic(bus, topic, start)
    chosen = [d for d in decoded(records, message_type) if match(d.raw, d.message)]
    chosen = chosen[:limit] if limit is not None else chosen
    if to is None:
        for d in chosen:
            out.write(json.dumps(as_json(*d, topics=topics, raw_bytes=raw_bytes)) + "\n")
        return len(chosen)
    producer = await bus.producer()
    target, _ = resolve_topic(topics, to)
    for d in chosen:
        await producer.send_raw(target, d.raw.value, key=d.raw.key, headers=d.raw.headers)
    return len(chosen)


# -- trace ------------------------------------------------------------------------------


@dataclass
class EpisodeRecords:
    """One episode's records across topics, in time order. An undecodable record is kept
    when its key names the episode or its group (the key each topic is written with);
    ``unreadable`` counts the others, which cannot be attributed to any episode."""

    episode_id: str
    rows: list[Decoded] = field(default_factory=list)
    unreadable: dict[str, int] = field(default_factory=dict)


def _belongs(d: Decoded, episode_id: str, group: str, match: Filter) -> bool:
    if isinstance(d.message, DeadLetter):
        return d.message.key in (episode_id.encode(), group.encode())
    if d.message is not None:
        return match(d.raw, d.message)
    return d.raw.key in (episode_id.encode(), group.encode())


async def gather_episode(bus: Bus, topics: Topics, episode_id: str) -> EpisodeRecords:
    """Every record of one episode across topics (dead letters included), in time order."""
    group = episode_id.rsplit("/", 1)[0]
    found = EpisodeRecords(episode_id)
    for name, match in (
        (topics.prompts, Filter(group=group)),
        (topics.steps, Filter(episode=episode_id)),
        (topics.results, Filter(episode=episode_id)),
        (topics.trajectories, Filter(episode=episode_id)),
        (topics.scored, Filter(episode=episode_id)),
        (topics.dlq, Filter()),
    ):
        _, message_type = resolve_topic(topics, name)
        for d in decoded(await read_topic(bus, name), message_type):
            if _belongs(d, episode_id, group, match):
                found.rows.append(d)
            elif d.message is None:
                found.unreadable[name] = found.unreadable.get(name, 0) + 1
    found.rows.sort(key=lambda d: d.raw.timestamp_ms)
    return found


def render_episode(found: EpisodeRecords, write: Callable[[str], Any]) -> None:
    """The conversation turn by turn, then the message timeline."""
    episode_id, rows = found.episode_id, found.rows
    if not rows:
        write(f"no messages found for episode {episode_id}\n")
    else:
        _render_conversation(episode_id, [d.message for d in rows if d.message is not None], write)
        _render_timeline(rows, write)
    for topic, n in sorted(found.unreadable.items()):
        write(
            f"  note: {n} undecodable record(s) in {topic} with no key of this episode "
            f"(rlbus replay {topic} shows them)\n"
        )


def _render_conversation(
    episode_id: str, msgs: list[BaseModel], write: Callable[[str], Any]
) -> None:
    prompt = next((m for m in msgs if isinstance(m, Prompt)), None)
    traj = next((m for m in msgs if isinstance(m, Trajectory)), None)
    scored = [m for m in msgs if isinstance(m, ScoredTrajectory)]
    write(f"episode {episode_id}\n")
    if prompt is not None:
        write(f"  prompt  task={prompt.task} spec={json.dumps(jsonable(prompt.spec))}\n")
    if traj is not None:
        write(f"  status  {traj.status}{' (' + traj.error + ')' if traj.error else ''}\n")
        segments = len(traj.segments())
        if segments > 1:
            write(f"  segments {segments} (its agent's history was not linear: each is "
                  "trained as a sequence of its own)\n")
        for i, t in enumerate(traj.turns):
            if t.fresh_context:
                write(f"  -- segment starts: turn {i}'s context is its {len(t.input_ids)} "
                      "input tokens, not the turns above\n")
            write(
                f"  turn {i}  [policy v{t.policy_version}, {len(t.completion_ids)} tokens, "
                f"{t.finish_reason}] action: {t.action!r} -> observation: {t.observation!r}\n"
            )
    for s in scored:
        validity = "" if s.valid else f" (masked: {s.error})"
        write(f"  reward  {s.reward} by {s.verifier or '-'}{validity}\n")


def _render_timeline(rows: list[Decoded], write: Callable[[str], Any]) -> None:
    """One line per record: UTC time, time since the first record, where, what."""
    start = rows[0].raw.timestamp_ms
    write(f"  timeline (from {iso_time(start)}):\n")
    for raw, message, error in rows:
        since = f"+{(raw.timestamp_ms - start) / 1000:.3f}s"
        where = f"{raw.topic}[{raw.partition}]@{raw.offset}"
        what = _what(raw, message, error)
        write(f"    {iso_time(raw.timestamp_ms)}  {since:>10}  {where}  {what}\n")


def _what(raw: RawRecord, message: BaseModel | None, error: str | None) -> str:
    if isinstance(message, DeadLetter):
        reason = f" [{message.reason}]" if message.reason else ""
        return (
            f"DeadLetter from {message.source_topic}[{message.partition}]@{message.offset} "
            f"by {message.service}{reason}: {message.error}; "
            f"payload base64 {_preview(message.payload)}"
        )
    if message is not None:
        return type(message).__name__
    return f"undecodable ({error}); base64 {_preview(raw.value)}"


PREVIEW_BYTES = 96
"""A transcript line shows this much of undecodable bytes; ``--json`` shows them all."""


def _preview(data: bytes) -> str:
    if len(data) <= PREVIEW_BYTES:
        return b64(data)
    return f"{b64(data[:PREVIEW_BYTES])}... ({len(data)} bytes; --json has them all)"

"""``rlbus replay``, ``trace`` and ``status`` on topics a hostile client wrote to.

The records are produced with plain aiokafka (a client that is not ours): bytes that are not
msgpack, msgpack that fails the schema, a dead letter whose payload is not UTF-8, garbage on
the dead-letter topic itself, and a consumer group whose name looks like rich markup. Every
command must exit 0 with each bad record shown as base64 plus its decode error.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

import msgpack
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from rlbus.codec import encode
from rlbus.messages import DeadLetter
from rlbus.processes import child_env
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import Topics, ensure_topics
from tests import factories

pytestmark = pytest.mark.kafka

GROUP, EPISODE = "run/9", "run/9/1"
GARBAGE = b"\xc1\xff\xfe\x00 not msgpack"
NOT_A_STEP = msgpack.packb({"episode_id": 7, "completion_ids": "x"})
NOT_A_MAP = msgpack.packb([1, 2, 3])
PAYLOAD = b"\xff\xfe\x80 raw bytes that are not UTF-8"
MARKUP_GROUP = "[b]x[/b]"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
async def hostile(kafka_bootstrap, unique_name):
    """A fresh prefix whose topics hold the bad records; returns (topics, environment)."""
    settings = TopicSettings(prefix=unique_name("bad"), partitions=1, result_partitions=1)
    await ensure_topics(KafkaSettings(bootstrap=kafka_bootstrap), settings)
    topics = Topics(settings)
    letter = DeadLetter(source_topic=topics.steps, partition=0, offset=1, error="not msgpack",
                        service="inference-0", key=EPISODE.encode(), payload=PAYLOAD)  # fmt: skip
    records = [
        (topics.steps, encode(factories.step_request(EPISODE, 0)), EPISODE.encode()),
        (topics.steps, GARBAGE, EPISODE.encode()),
        (topics.steps, GARBAGE, None),  # no key: not attributable to any episode
        (topics.results, NOT_A_STEP, EPISODE.encode()),
        (topics.prompts, NOT_A_MAP, GROUP.encode()),
        (topics.dlq, encode(letter), topics.steps.encode()),
        (topics.dlq, GARBAGE, b"\xff"),
    ]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for topic, value, key in records:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()
    await _commit_as(kafka_bootstrap, MARKUP_GROUP, TopicPartition(topics.steps, 0), 1)
    env = child_env({
        **settings_env(kafka=KafkaSettings(bootstrap=kafka_bootstrap), topics=settings),
        "COLUMNS": "80",
    })  # fmt: skip
    return topics, env


async def _commit_as(bootstrap: str, group: str, tp: TopicPartition, offset: int) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: offset})
    finally:
        await consumer.stop()


async def rlbus(env: dict[str, str], *args: str) -> str:
    """Run ``rlbus ARGS`` as a subprocess (stdout a pipe, not a terminal); its stdout."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlbus.ops.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode() + err.decode()
    assert "Traceback" not in text, text
    assert proc.returncode == 0, text
    return out.decode()


def rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


async def test_replay_shows_every_bad_record_as_base64_and_its_error(hostile):
    topics, env = hostile
    steps = rows(await rlbus(env, "replay", "steps"))
    assert [("message" in r, r.get("value_base64")) for r in steps] == [
        (True, None),
        (False, b64(GARBAGE)),
        (False, b64(GARBAGE)),
    ]
    assert all(r["error"].startswith("not msgpack") for r in steps[1:])
    (result,) = rows(await rlbus(env, "replay", "steps.results"))
    assert result["error"].startswith("invalid StepResult") and result["value_base64"] == b64(
        NOT_A_STEP
    )
    (prompt,) = rows(await rlbus(env, "replay", topics.prompts))
    assert prompt["error"] == "expected a map for Prompt, got list"


async def test_replay_dlq_shows_a_non_utf8_payload_as_base64(hostile):
    _, env = hostile
    letter, garbage = rows(await rlbus(env, "replay", "dlq"))
    assert letter["message"]["payload"] == {"base64": b64(PAYLOAD)}
    assert letter["message"]["error"] == "not msgpack"
    assert garbage["key"] == {"base64": b64(b"\xff")}
    assert garbage["error"].startswith("not msgpack") and garbage["value_base64"] == b64(GARBAGE)


async def test_trace_shows_the_episodes_bad_records_and_counts_the_rest(hostile):
    topics, env = hostile
    out = await rlbus(env, "trace", EPISODE)
    assert "StepRequest" in out
    assert "undecodable (not msgpack: " in out and f"base64 {b64(GARBAGE)}" in out
    assert f"base64 {b64(NOT_A_STEP)}" in out  # the result that fails the schema
    assert f"base64 {b64(NOT_A_MAP)}" in out  # the group's prompt
    assert f"DeadLetter from {topics.steps}[0]@1 by inference-0" in out
    assert f"payload base64 {b64(PAYLOAD)}" in out
    assert f"1 undecodable record(s) in {topics.steps} with no key of this episode" in out
    assert f"1 undecodable record(s) in {topics.dlq}" in out
    lines = rows(await rlbus(env, "trace", EPISODE, "--json"))
    assert len(lines) == 5
    assert sum("error" in r for r in lines) == 3
    assert all("time" in r for r in lines)


async def test_status_off_a_terminal_prints_one_readable_table(hostile):
    topics, env = hostile
    out = await rlbus(env, "status")  # no --once: stdout is a pipe, so it prints once and exits
    assert max(len(line) for line in out.splitlines()) <= 80
    assert out.count(topics.settings.prefix) == 1
    assert "steps.results" in out and "trajectories.scored" in out
    assert MARKUP_GROUP in out

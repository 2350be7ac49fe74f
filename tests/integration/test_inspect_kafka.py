"""rlbus replay and rlbus trace against the real broker."""

import asyncio
import base64
import io
import json
import sys
import time

import pytest

from rlbus.codec import encode
from rlbus.errors import Refusal, RefusalReason
from rlbus.messages import Prompt, StepRequest, Trajectory
from rlbus.ops import inspection
from rlbus.processes import child_env
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus, RawRecord
from rlbus.transport.deadletter import DeadLetterSink
from tests import factories

pytestmark = pytest.mark.kafka


@pytest.fixture
async def env(kafka_bootstrap, unique_name):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    settings = TopicSettings(prefix=unique_name("r"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, settings)
    bus = KafkaBus(kafka, dlq_topic=None, service="test")
    yield bus, Topics(settings)
    await bus.close()


async def _publish_episode(bus, topics, group="run/7", index=1):
    p = await bus.producer()
    episode = f"{group}/{index}"
    if index == 1:  # one prompt per group
        await p.send(topics.prompts, factories.prompt(group), key=group)
    await p.send(topics.steps, factories.step_request(episode, 0), key=episode)
    await p.send(topics.results, factories.step_result(episode), key=episode, partition=0)
    await p.send(topics.trajectories, factories.trajectory(group, index), key=group)
    await p.send(topics.scored, factories.scored(group, index, reward=1.0), key=group)
    return episode


def _lines(buf):
    return [json.loads(x) for x in buf.getvalue().splitlines()]


async def test_replay_from_beginning_offset_and_filters(env):
    bus, topics = env
    p = await bus.producer()
    for i in range(6):
        await p.send(topics.prompts, factories.prompt(f"g{i}"), key=f"g{i}", partition=i % 2)
    out = io.StringIO()
    n = await inspection.replay(
        bus, topics, "prompts", inspection.Start(), inspection.Filter(), out=out
    )
    assert n == 6
    assert sorted(r["message"]["group_id"] for r in _lines(out)) == [f"g{i}" for i in range(6)]

    out = io.StringIO()
    await inspection.replay(
        bus, topics, "prompts", inspection.Start(offset=2), inspection.Filter(), out=out
    )
    assert sorted(r["message"]["group_id"] for r in _lines(out)) == ["g4", "g5"]

    out = io.StringIO()
    await inspection.replay(
        bus, topics, topics.prompts, inspection.Start(), inspection.Filter(key="g3"), out=out
    )
    (row,) = _lines(out)
    assert row["key"] == "g3" and row["partition"] == 1 and row["offset"] == 1

    out = io.StringIO()
    await inspection.replay(
        bus, topics, "prompts", inspection.Start(), inspection.Filter(group="g0"), out=out
    )
    assert [r["message"]["group_id"] for r in _lines(out)] == ["g0"]


async def test_replay_from_timestamp(env):
    bus, topics = env
    p = await bus.producer()
    await p.send(topics.prompts, factories.prompt("old"), partition=0)
    await asyncio.sleep(0.05)
    cut = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    await p.send(topics.prompts, factories.prompt("new"), partition=1)
    out = io.StringIO()
    await inspection.replay(
        bus, topics, "prompts", inspection.Start(timestamp_ms=cut), inspection.Filter(), out=out
    )
    assert [r["message"]["group_id"] for r in _lines(out)] == ["new"]


async def test_replay_by_episode_and_republish(env, unique_name):
    bus, topics = env
    episode = await _publish_episode(bus, topics)
    await _publish_episode(bus, topics, index=2)
    out = io.StringIO()
    await inspection.replay(
        bus, topics, "steps", inspection.Start(), inspection.Filter(episode=episode), out=out
    )
    assert [r["message"]["episode_id"] for r in _lines(out)] == [episode]

    # re-publish trajectories to a second prefix's topic, as a re-scoring run would read them
    other = Topics(TopicSettings(prefix=unique_name("rescore")))
    await ensure_topics(bus.kafka, other.settings)
    n = await inspection.replay(
        bus, topics, "trajectories", inspection.Start(), inspection.Filter(), to=other.trajectories
    )
    assert n == 2
    copied = await inspection.read_topic(bus, other.trajectories)
    decoded = [m for _, m, _ in inspection.decoded(copied, Trajectory)]
    assert sorted(t.episode_id for t in decoded) == ["run/7/1", "run/7/2"]


def _settings_env(kafka_bootstrap: str, topics: Topics) -> dict[str, str]:
    """The broker and topics of this test for a CLI process."""
    return settings_env(kafka=KafkaSettings(bootstrap=kafka_bootstrap), topics=topics.settings)


async def _replay_cli(kafka_bootstrap, topics, *args):
    env_vars = child_env(_settings_env(kafka_bootstrap, topics))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlbus.ops.cli", "replay", *args, env=env_vars,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


async def test_replay_dlq_shows_a_dead_letters_key_as_text_and_its_payload_decoded(
    env, kafka_bootstrap
):
    bus, topics = env
    sink = DeadLetterSink(await bus.producer(), topics.dlq, "rollout-0")
    prompt = factories.prompt("long/1")
    for key, value in ((b"long/1", encode(prompt)), (b"\xfe", b"\xc1garbage")):
        await sink.put(RawRecord(topics.prompts, 0, 7, key, value, {}, 0),
                       Refusal(RefusalReason.OVER_LIMIT, "too long"))
    rows = await _replay_cli(kafka_bootstrap, topics, "dlq")
    readable, garbage = [row["message"] for row in rows]
    assert readable["key"] == "long/1" and readable["payload_type"] == "Prompt"
    assert readable["payload"]["group_id"] == "long/1"
    assert readable["source_topic"] == topics.prompts and readable["error"] == "too long"
    assert readable["reason"] == "over_limit"
    assert garbage["key"] == {"base64": "/g=="} and garbage["payload_type"] == "base64"
    assert base64.b64decode(garbage["payload"]["base64"]) == b"\xc1garbage"

    raw, _ = [row["message"] for row in await _replay_cli(kafka_bootstrap, topics, "dlq", "--raw")]
    assert raw["key"] == {"base64": base64.b64encode(b"long/1").decode()}
    assert base64.b64decode(raw["payload"]["base64"]) == encode(prompt)
    assert "payload_type" not in raw


async def test_trace_gathers_one_episode_across_topics(env):
    bus, topics = env
    episode = await _publish_episode(bus, topics)
    await _publish_episode(bus, topics, index=2)  # a sibling that must not appear
    found = await inspection.gather_episode(bus, topics, episode)
    kinds = [type(d.message).__name__ for d in found.rows]
    assert kinds == ["Prompt", "StepRequest", "StepResult", "Trajectory", "ScoredTrajectory"]
    assert isinstance(found.rows[0].message, Prompt)
    assert isinstance(found.rows[1].message, StepRequest)
    assert found.unreadable == {}
    text = []
    inspection.render_episode(found, text.append)
    transcript = "".join(text)
    assert "task=guess_number" in transcript
    assert "turn 0  [policy v0, 2 tokens, stop] action: '3' -> observation: 'correct'" in transcript
    assert "reward  1.0 by x" in transcript
    first = found.rows[0].raw.timestamp_ms
    assert f"timeline (from {inspection.iso_time(first)}):" in transcript
    assert str(first) not in transcript  # human times, not epoch milliseconds


async def test_status_reports_lag_per_group_and_topic(env, unique_name):
    from rlbus.ops.status import sample, table

    bus, topics = env
    p = await bus.producer()
    for i in range(5):
        await p.send(topics.prompts, factories.prompt(f"g{i}"), partition=0)
    group = unique_name("g")
    consumer = await bus.consumer([topics.prompts], Prompt, group_id=group)
    got = []
    for _ in range(20):
        got += await consumer.poll(0.5)
        if len(got) >= 5:
            break
    for d in got[:2]:
        consumer.ack(d)
    await consumer.commit()
    first = await sample(bus.kafka, topics, bus)
    assert first.ends[topics.prompts] == 5
    assert first.lag[(group, topics.prompts)] == 3
    consumer.ack(got[2])
    await consumer.commit()
    second = await sample(bus.kafka, topics, bus)
    assert second.lag[(group, topics.prompts)] == 2
    rendered = table(first, second)
    assert rendered.row_count >= len(topics.catalogue())
    assert first.learner == {}  # nothing trained yet: no training table


async def test_status_reads_what_trained_from_the_newest_weight_version(env):
    from rlbus.ops.status import sample

    bus, topics = env
    p = await bus.producer()
    for step, model in [(1, "a"), (2, "a"), (1, "b"), (3, "a")]:
        w = factories.weight_version(step).model_copy(
            update={"model": model, "samples_trained": 10 * step,
                    "samples_masked": {"stale": step}})
        await p.send(topics.weights, w, key=model)
    got = (await sample(bus.kafka, topics, bus)).learner
    assert {m: (w.step, w.samples_trained, w.samples_masked) for m, w in got.items()} == {
        "a": (3, 30, {"stale": 3}), "b": (1, 10, {"stale": 1})}


async def test_rlbus_feed_publishes_a_prompt_file(env, tmp_path, kafka_bootstrap):
    bus, topics = env
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"task": "guess_number", "spec": {"target": 3, "low": 0, "high": 15, "max_turns": 5}}\n'
        '{"task": "addition", "spec": {"a": 1, "b": 2}, "group_id": "mine/1"}\n'
    )
    env_vars = child_env(_settings_env(kafka_bootstrap, topics))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rlbus.ops.cli",
        "feed",
        str(path),
        "--group-size",
        "4",
        env=env_vars,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert b"published 2 prompt(s)" in out
    records = await inspection.read_topic(bus, topics.prompts)
    prompts = sorted(
        (m.group_id, m.task, m.group_size) for _, m, _ in inspection.decoded(records, Prompt)
    )
    assert prompts == [("feed/1", "guess_number", 4), ("mine/1", "addition", 4)]


async def test_rlbus_feed_publishes_a_dataset_and_dead_letters_its_bad_rows(env, tmp_path,
                                                                        kafka_bootstrap):
    """A parquet dataset through the task's column mapping and template; the row whose
    answer is missing goes to the dead-letter topic with its number, the others are sent."""
    from datasets import Dataset

    from rlbus.messages import DeadLetter

    bus, topics = env
    rows = [{"q": "What is 2 + 3?", "a": "#### 5"}, {"q": "What is 7 - 4?", "a": None},
            {"q": "What is 6 * 7?", "a": "6 * 7 = 42\n#### 42"}]
    path = tmp_path / "math.parquet"
    Dataset.from_list(rows).to_parquet(str(path))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlbus.ops.cli", "feed", str(path),
        "--task", "rlbus.math_task:gsm8k", "--columns", '{"q": "question", "a": "answer"}',
        "--template", "Solve: {q}", "--epochs", "2", "--group-size", "2",
        env=child_env(_settings_env(kafka_bootstrap, topics)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert b"published 4 prompt(s)" in out and b"2 bad row(s)" in out, out
    prompts = [m for _, m, _ in inspection.decoded(
        await inspection.read_topic(bus, topics.prompts), Prompt)]
    assert sorted(p.spec["prompt"] for p in prompts) == [
        "Solve: What is 2 + 3?", "Solve: What is 2 + 3?",
        "Solve: What is 6 * 7?", "Solve: What is 6 * 7?"]
    assert {p.group_size for p in prompts} == {2}
    letters = [m for _, m, _ in inspection.decoded(
        await inspection.read_topic(bus, topics.dlq), DeadLetter)]
    assert [(d.source_topic, d.offset, d.reason) for d in letters] == [
        (f"dataset:{path}", 1, "invalid")] * 2  # once per epoch
    assert letters[0].error == "row 1: missing column(s) a"

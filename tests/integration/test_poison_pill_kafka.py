"""A poison pill on the real broker: a valid Prompt asking for 10^9 episodes, between valid
prompts. It is dead-lettered exactly once, the prompts around it are trained, and a rollout
instance that joins afterwards does not read it again."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiokafka import AIOKafkaConsumer

from rlbus.codec import decode
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.messages import DeadLetter, Prompt
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.tasks import GuessNumber
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def _dead_letters(bootstrap: str, topic: str) -> list[DeadLetter]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=3000)
        return [decode(r.value, DeadLetter) for rs in batches.values() for r in rs]
    finally:
        await consumer.stop()


async def test_a_poison_prompt_is_dead_lettered_once_and_never_read_again(
    kafka_bootstrap, unique_name, tmp_path
):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("poison"), partitions=1, result_partitions=2)
    await ensure_topics(kafka, topics)
    t = Topics(topics)
    common = {"kafka": kafka, "topics": topics}

    def bus(service: str) -> KafkaBus:
        return KafkaBus(kafka, dlq_topic=t.dlq, service=service)

    sender = bus("test")
    producer = await sender.producer()
    rng = random.Random(0)
    for i, size in enumerate([2, 10**9, 2, 2, 2]):  # the pill is the second prompt
        group = "poison" if size > 2 else f"run/{i - (i > 1)}"
        prompt = Prompt(group_id=group, task="guess_number", spec=GuessNumber().sample(rng),
                        group_size=size)
        await producer.send(t.prompts, prompt, key=group)
    await sender.close()

    others = [
        Inference(InferenceSettings(**common, engine="synthetic"), bus("inference")),
        Reward(RewardSettings(**common), bus("reward")),
        Rollout(RolloutSettings(**common, tokenizer="synthetic"), bus("rollout")),
    ]
    learner = Learner(LearnerSettings(
        **common, feed=False, trainer="synthetic", synthetic_step_s=0.05, max_steps=2,
        groups_per_step=2, group_size=2, checkpoint_dir=tmp_path / "checkpoint",
        weights_dir=tmp_path / "weights"), bus("learner"))
    runs = [asyncio.create_task(o.run()) for o in others]
    try:
        await asyncio.wait_for(learner.run(), 120)
    finally:
        for o in others:
            o.request_stop("test over")
        for r in await asyncio.gather(*runs, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r
    assert sorted(learner.assembler.trained_ids()) == ["run/0", "run/1", "run/2", "run/3"]

    # a new rollout member of the same group starts where the first one committed
    again = Rollout(RolloutSettings(**common, tokenizer="synthetic", instance="1",
                                    until_idle_s=4.0), bus("rollout"))
    summary = await asyncio.wait_for(again.run(), 60)
    assert summary["handled"] == 0

    letters = await _dead_letters(kafka_bootstrap, t.dlq)
    assert len(letters) == 1, [x.error for x in letters]
    (letter,) = letters
    assert letter.source_topic == t.prompts and letter.offset == 1
    assert "group_size 1000000000 is over the limit 256" in letter.error
    assert decode(letter.payload, Prompt).group_id == "poison"


async def test_a_rollout_process_fed_the_pill_still_stops_on_sigterm(
    kafka_bootstrap, unique_name, tmp_path
):
    """The pill used to make the process allocate without bound and ignore SIGTERM."""
    import signal
    import time

    from rlbus.ops.launcher import ServiceProcesses
    from rlbus.processes import child_env

    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("pill"), partitions=1, result_partitions=1)
    await ensure_topics(kafka, topics)
    t = Topics(topics)
    procs = ServiceProcesses(tmp_path)
    rollout = procs.spawn("rollout", 0, child_env({
        **settings_env(kafka=kafka, topics=topics, tokenizer="synthetic"),
        "PYTHONUNBUFFERED": "1"}))
    try:
        sender = KafkaBus(kafka, dlq_topic=None, service="test")
        producer = await sender.producer()
        await producer.send(t.prompts, Prompt(group_id="pill", task="guess_number", spec={},
                                              group_size=10**9), key="pill")
        await sender.close()
        deadline = time.monotonic() + 60
        while "prompt pill dead-lettered" not in rollout.log.read_text():
            assert rollout.alive and time.monotonic() < deadline, rollout.tail(30)
            await asyncio.sleep(0.2)
        rollout.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(rollout.popen.wait, 120) == 0, rollout.tail(30)
        text = rollout.log.read_text()  # stopped by draining, not cut off at drain_timeout_s
        assert "did not return in time" not in text and "drain timed out" not in text, text
    finally:
        procs.stop(timeout=10)

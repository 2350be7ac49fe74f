"""Rollout takes answers only to requests it sent: an answer to any other request id (a
forged one, or another member's) is dropped and counted, apart from late duplicates."""

from __future__ import annotations

import asyncio

from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import Prompt, StepResult, Trajectory
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories
from tests.support.services import read_log, run_until

TOPICS = TopicSettings(prefix="rp", partitions=1, result_partitions=1)
T = Topics(TOPICS)


async def test_answers_to_requests_never_sent_are_dropped_and_counted() -> None:
    broker = memory_broker(TOPICS)
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"), MemoryBus(broker))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    forged = factories.step_result("run/0/0")  # an episode this instance never ran

    async def attack() -> None:
        await rollout.ready.wait()  # it reads replies from the end: send once it is up
        attacker = await MemoryBus(broker).producer()
        await attacker.send(T.results, forged, key=forged.episode_id, partition=0)
        prompt = Prompt(group_id="rp/0", task="synthetic", group_size=2,
                        spec={"max_turns": 2, "median_ms": 1})
        await attacker.send(T.prompts, prompt, key=prompt.group_id)

    sent = asyncio.create_task(attack())
    await run_until([rollout, inference], lambda: sent.done() and len(
        read_log(broker, T.trajectories, Trajectory)) == 2)
    await sent

    assert rollout.counters["unsolicited_replies"] == 1
    trajectories = read_log(broker, T.trajectories, Trajectory)
    assert all(t.status == "ok" for t in trajectories)
    answered = {r.request_id for r in read_log(broker, T.results, StepResult)}
    assert forged.request_id in answered  # it was there, and no episode took it
    assert not any(forged.completion_ids == turn.completion_ids
                   for t in trajectories for turn in t.turns)

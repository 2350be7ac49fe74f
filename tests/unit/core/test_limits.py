"""Operator limits and liveness: hostile sizes are dead letters before any allocation, and a
group that crashes is retried a bounded number of times, then dead-lettered, never stuck."""

from __future__ import annotations

import random
import resource

import pytest

from rlbus.codec import decode
from rlbus.errors import Refusal, RefusalReason
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.limits import Limits, check_prompt, check_step, check_trajectory
from rlbus.messages import (
    DeadLetter,
    Prompt,
    Sampling,
    ScoredTrajectory,
    StepRequest,
    StepResult,
    Trajectory,
)
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.tasks import GuessNumber
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories
from tests.support.services import read_log, run_until

TOPICS = TopicSettings(prefix="lim", partitions=1, result_partitions=1)
T = Topics(TOPICS)


def _prompt(group: str, **update) -> Prompt:
    spec = GuessNumber().sample(random.Random(group))
    return Prompt(group_id=group, task="guess_number", spec=spec, group_size=2).model_copy(
        update=update)


def _over(refusal: Refusal | None) -> str:
    """The text of an over-the-limit refusal."""
    assert refusal is not None and refusal.reason is RefusalReason.OVER_LIMIT, refusal
    return refusal.detail


def test_each_limit_names_its_setting():
    limits = Limits()
    assert "RLBUS_LIMITS__MAX_GROUP_SIZE" in _over(check_prompt(_prompt("a", group_size=10**9),
                                                                limits))
    big = _prompt("a", sampling=Sampling(max_new_tokens=10**7))
    assert "RLBUS_LIMITS__MAX_NEW_TOKENS" in _over(check_prompt(big, limits))
    huge_spec = _prompt("a", spec={"blob": "x" * 300_000})
    assert "RLBUS_LIMITS__MAX_SPEC_BYTES" in _over(check_prompt(huge_spec, limits))
    assert check_prompt(_prompt("a"), limits) is None
    step = StepRequest(request_id="e/t0", episode_id="e", turn=0, input_ids=[1] * 200_000,
                       reply_partition=0)
    assert "RLBUS_LIMITS__MAX_INPUT_TOKENS" in _over(check_step(step, limits))
    t = factories.trajectory("g").model_copy(update={"index": 5, "group_size": 2})
    invalid = check_trajectory(t, limits)
    assert invalid is not None and invalid.reason is RefusalReason.INVALID
    assert "not below its group_size" in invalid.detail


@pytest.mark.slow
async def test_a_poison_prompt_is_dead_lettered_before_any_allocation(caplog):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    await producer.send(T.prompts, _prompt("ok-1"))
    await producer.send(T.prompts, _prompt("poison", group_size=10**9))
    await producer.send(T.prompts, _prompt("ok-2"))
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"),
                      MemoryBus(broker, dlq_topic=T.dlq))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    await run_until([rollout, inference],  # its deadline is the safety net
                    lambda: len(read_log(broker, T.trajectories, Trajectory)) == 4)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 200  # 10^9 episodes were never started
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "group_size 1000000000 is over the limit 256" in letter.error
    assert letter.reason == RefusalReason.OVER_LIMIT
    assert letter.offset == 1 and decode(letter.payload, Prompt).group_id == "poison"
    assert {t.group_id for t in read_log(broker, T.trajectories, Trajectory)} == {"ok-1", "ok-2"}
    assert broker.groups["lim.rollout"].committed[(T.prompts, 0)] == 3  # never read again


@pytest.mark.slow
async def test_a_step_request_over_a_limit_is_refused_and_answered_with_an_error():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    big = StepRequest(request_id="e/t0", episode_id="e", turn=0, input_ids=[3] * 10,
                      reply_partition=0, sampling=Sampling(max_new_tokens=10**6))
    fine = big.model_copy(update={"request_id": "f/t0", "episode_id": "f",
                                  "sampling": Sampling(max_new_tokens=4)})
    await producer.send(T.steps, big)
    await producer.send(T.steps, fine)
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([inference], lambda: len(read_log(broker, T.results, StepResult)) == 2)
    results = {r.request_id: r for r in read_log(broker, T.results, StepResult)}
    assert results["e/t0"].finish_reason == "error"
    assert "max_new_tokens 1000000 is over the limit" in results["e/t0"].error
    assert results["f/t0"].finish_reason != "error"
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.source_topic == T.steps and letter.offset == 0
    assert broker.groups["lim.inference"].committed[(T.steps, 0)] == 2


@pytest.mark.slow
async def test_reward_dead_letters_a_trajectory_whose_group_could_never_complete():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    await producer.send(T.trajectories, factories.trajectory("huge").model_copy(
        update={"group_size": 10**9}))
    await producer.send(T.trajectories, factories.trajectory("fine"))
    reward = Reward(RewardSettings(topics=TOPICS), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([reward], lambda: len(read_log(broker, T.scored, ScoredTrajectory)) == 1)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "group_size 1000000000" in letter.error
    assert broker.groups["lim.reward"].committed[(T.trajectories, 0)] == 2


@pytest.mark.slow
async def test_a_crashing_group_is_retried_then_dead_lettered_and_commits_advance(caplog):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    await producer.send(T.prompts, _prompt("cursed"))
    await producer.send(T.prompts, _prompt("fine"))
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic", group_attempts=2),
                      MemoryBus(broker, dlq_topic=T.dlq))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    real = rollout._traced_episode
    attempts = []

    async def flaky(task, prompt, index, parent):
        if prompt.group_id == "cursed":
            attempts.append(index)
            raise ConnectionError("broker went away mid-publish")
        await real(task, prompt, index, parent)

    rollout._traced_episode = flaky  # type: ignore[method-assign]
    await run_until([rollout, inference],
               lambda: broker.groups.get("lim.rollout") is not None
               and broker.groups["lim.rollout"].committed.get((T.prompts, 0)) == 2)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "group failed on attempt 2: ConnectionError: broker went away" in letter.error
    assert letter.reason == RefusalReason.GROUP_GIVEN_UP
    assert len(attempts) == 2 * 2  # two attempts of a group of two
    cursed = [t for t in read_log(broker, T.trajectories, Trajectory) if t.group_id == "cursed"]
    # given up, the group is published as failed: it completes, masked, at the learner
    assert sorted(t.index for t in cursed) == [0, 1]
    assert all(t.status == "failed" and not t.turns and t.error == letter.error for t in cursed)
    assert rollout.counters["group_crashes"] == 2

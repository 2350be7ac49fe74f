"""A message whose handling raises, in each tier, on the in-memory bus: it ends as a dead
letter carrying the exception's type and message, the messages after it are handled and
committed past it, and the service keeps running."""

from __future__ import annotations

import random

import msgpack
import pytest

from rlbus.codec import encode
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.limits import Limits
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

pytestmark = pytest.mark.slow

TOPICS = TopicSettings(prefix="hb", partitions=1, result_partitions=1)
T = Topics(TOPICS)


def _committed(broker, group: str, topic: str) -> int | None:
    g = broker.groups.get(group)
    return None if g is None else g.committed.get((topic, 0))


def _prompt(group: str) -> Prompt:
    return Prompt(group_id=group, task="guess_number", group_size=2,
                  spec=GuessNumber().sample(random.Random(group)))


async def test_rollout_dead_letters_a_prompt_whose_group_raises_and_commits_past_it():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for group in ("before", "cursed", "after"):
        await producer.send(T.prompts, _prompt(group))
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"),
                      MemoryBus(broker, dlq_topic=T.dlq))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    real = rollout._roll_out

    async def roll_out(d, task, span):
        if d.message.group_id == "cursed":  # outside the group's own retries
            raise KeyError("a bug in the group's bookkeeping")
        await real(d, task, span)

    rollout._roll_out = roll_out  # type: ignore[method-assign]
    await run_until([rollout, inference],
                    lambda: _committed(broker, "hb.rollout", T.prompts) == 3)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.error == "KeyError: \"a bug in the group's bookkeeping\""
    assert letter.reason == "handling_failed"
    assert letter.offset == 1 and letter.source_topic == T.prompts
    assert {t.group_id for t in read_log(broker, T.trajectories, Trajectory)} == {
        "before", "after"}
    assert rollout.summary()["stop_reason"] == "test over"  # alive until the test ended


async def test_rollout_dead_letters_a_prompt_nested_too_deep_for_json():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    raw = msgpack.unpackb(encode(_prompt("deep")))
    raw["spec"] = {"target": "HOLE"}
    # 1000 levels: msgpack's stack takes it; json.dumps (the spec size check) raised
    # RecursionError, and pydantic cannot serialize it into a trajectory
    deep = msgpack.packb(raw).replace(msgpack.packb("HOLE"), b"\x91" * 1000 + b"\x01")
    await producer.send_raw(T.prompts, deep)
    await producer.send(T.prompts, _prompt("after"))
    rollout = Rollout(RolloutSettings(topics=TOPICS, tokenizer="synthetic"),
                      MemoryBus(broker, dlq_topic=T.dlq))
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"),
                          MemoryBus(broker))
    await run_until([rollout, inference],
                    lambda: _committed(broker, "hb.rollout", T.prompts) == 2)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "RLBUS_LIMITS__MAX_DEPTH" in letter.error and letter.reason == "over_limit"
    assert {t.group_id for t in read_log(broker, T.trajectories, Trajectory)} == {"after"}


class _ChokingEngine(Engine):
    """Answers every prompt, but the one starting with token 666 with a logprob above 0:
    no valid StepResult can carry it."""

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        return [Completion([7], [0.5 if p[0] == 666 else -0.5], "stop") for p in prompts]

    async def load(self, uri: str, checksum: str, version: int) -> None:
        self.version = version


async def test_inference_dead_letters_a_request_it_cannot_answer_and_serves_the_rest():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for i, first in enumerate([1, 666, 2]):
        await producer.send(T.steps, StepRequest(
            request_id=f"e{i}/t0", episode_id=f"e{i}", turn=0, input_ids=[first, 5],
            reply_partition=0))
    inference = Inference(InferenceSettings(topics=TOPICS), MemoryBus(broker, dlq_topic=T.dlq),
                          engine=_ChokingEngine())
    await run_until([inference], lambda: _committed(broker, "hb.inference", T.steps) == 3)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.error.startswith("ValidationError: ") and "logprobs" in letter.error
    assert letter.offset == 1
    assert {r.request_id for r in read_log(broker, T.results, StepResult)} == {"e0/t0", "e2/t0"}
    assert inference.summary()["stop_reason"] == "test over"


async def test_reward_dead_letters_a_trajectory_whose_scoring_raises():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for group in ("before", "cursed", "after"):
        await producer.send(T.trajectories, factories.trajectory(group))
    reward = Reward(RewardSettings(topics=TOPICS), MemoryBus(broker, dlq_topic=T.dlq))
    real = reward.score

    async def score(t):
        if t.group_id == "cursed":
            raise AttributeError("'NoneType' object has no attribute 'verify'")
        return await real(t)

    reward.score = score  # type: ignore[method-assign]
    await run_until([reward], lambda: _committed(broker, "hb.reward", T.trajectories) == 3)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.error == "AttributeError: 'NoneType' object has no attribute 'verify'"
    assert letter.offset == 1
    assert reward.summary()["stop_reason"] == "test over"
    scored = {s.trajectory.group_id: s for s in read_log(broker, T.scored, ScoredTrajectory)}
    assert set(scored) == {"before", "cursed", "after"}
    # in its place a failed stand-in: its group completes at the learner, this member masked
    stand_in = scored["cursed"]
    assert not stand_in.valid and stand_in.trajectory.status == "failed"
    assert stand_in.trajectory.turns == [] and stand_in.trajectory.spec == {}
    assert stand_in.error == letter.error and stand_in.trajectory.episode_id == "cursed/0"


async def test_reward_dead_letters_token_ids_that_int32_cannot_hold():
    # accepted by the schema before, they crashed the reward transaction when re-encoded
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    bad = msgpack.unpackb(encode(factories.trajectory("huge-ids"), packed=False))
    bad["turns"][0]["completion_ids"] = [2**40, 1]
    await producer.send_raw(T.trajectories, msgpack.packb(bad))
    await producer.send(T.trajectories, factories.trajectory("after"))
    reward = Reward(RewardSettings(topics=TOPICS), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([reward], lambda: _committed(broker, "hb.reward", T.trajectories) == 2)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "completion_ids" in letter.error and "range of int32" in letter.error
    assert [s.trajectory.group_id for s in read_log(broker, T.scored, ScoredTrajectory)] == [
        "after"]


def _learner(tmp_path, **kw) -> LearnerSettings:
    return LearnerSettings(**{
        "topics": TOPICS, "trainer": "synthetic", "synthetic_step_s": 0.0, "feed": False,
        "group_size": 2, "groups_per_step": 1, "max_steps": 2, "max_staleness": 100,
        "checkpoint_every": 1, "checkpoint_dir": tmp_path / "ckpt", **kw})


async def test_learner_dead_letters_an_eval_episode_whose_success_check_raises(tmp_path):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for i in range(2):
        await producer.send(T.scored, factories.scored("run/0", i))
    evil = factories.scored("eval/0", 0)
    evil = evil.model_copy(update={"trajectory": evil.trajectory.model_copy(update={
        "spec": {}, "purpose": "eval", "eval_round": 0, "group_size": 1})})
    await producer.send(T.scored, evil)  # guess_number's success() needs spec["target"]
    for i in range(2):
        await producer.send(T.scored, factories.scored("run/1", i))
    learner = Learner(_learner(tmp_path, feed=True, eval_episodes=1, eval_every=0,
                               max_steps=2), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([learner], lambda: learner.step >= 2
                    and _committed(broker, "hb.learner", T.scored) == 5)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.error.startswith("KeyError: ") and letter.offset == 2


async def test_learner_completes_the_group_of_a_dead_lettered_member_with_a_stand_in(tmp_path):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    long_one = factories.scored("bad", 1)
    long_one = long_one.model_copy(update={"trajectory": long_one.trajectory.model_copy(
        update={"turns": long_one.trajectory.turns * 3})})
    for s in [factories.scored("run/0", 0), factories.scored("run/0", 1),
              factories.scored("bad", 0), long_one,  # over max_turns: a dead letter
              factories.scored("run/1", 0), factories.scored("run/1", 1)]:
        await producer.send(T.scored, s)
    learner = Learner(_learner(tmp_path, limits=Limits(max_turns=2), max_steps=3),
                      MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([learner], lambda: learner.step >= 3
                    and _committed(broker, "hb.learner", T.scored) == 6)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "RLBUS_LIMITS__MAX_TURNS" in letter.error and letter.offset == 3
    # "bad"/0 no longer holds offset 2: its group trained, the stand-in for "bad"/1 masked
    assert sorted(learner.ledger[-3:]) == [["bad/0", "bad/1"], ["run/0/0", "run/0/1"],
                                           ["run/1/0", "run/1/1"]]
    assert learner.counters.get("abandoned_groups", 0) == 0


async def test_learner_ends_the_group_of_a_member_that_can_be_no_groups_member(tmp_path):
    """A group of 10^9 would wait for its members for ever: given up, not stood in for."""
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    huge = factories.scored("huge", 1)
    huge = huge.model_copy(update={"trajectory": huge.trajectory.model_copy(
        update={"group_size": 10**9})})
    for s in [factories.scored("run/0", 0), factories.scored("huge", 0), huge,
              factories.scored("run/0", 1), factories.scored("run/1", 0),
              factories.scored("run/1", 1)]:
        await producer.send(T.scored, s)
    learner = Learner(_learner(tmp_path), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([learner], lambda: learner.step >= 2
                    and _committed(broker, "hb.learner", T.scored) == 6)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "RLBUS_LIMITS__MAX_GROUP_SIZE" in letter.error and letter.offset == 2
    assert learner.counters["abandoned_groups"] == 1  # "huge"/0 no longer holds offset 1
    assert learner.ledger[-2:] == [["run/0/0", "run/0/1"], ["run/1/0", "run/1/1"]]


def _alien_token() -> ScoredTrajectory:
    s = _played("bad", 1)
    (turn,) = s.trajectory.turns
    return s.model_copy(update={"trajectory": s.trajectory.model_copy(update={
        "turns": [turn.model_copy(update={"completion_ids": [5, 10**6]})]})})


@pytest.mark.parametrize(("bad", "error", "reason"), [
    # valid on the wire, it failed the training step it landed in (an embedding lookup out
    # of range), again at every restart: a poison pill for the learner
    (_alien_token, "InvalidMessageError: turn 0 completion_ids holds token id 1000000, "
                   "outside the model's vocabulary of 121", "invalid"),
    # the step computes each episode's success: a spec that makes the task's code raise
    (lambda: factories.scored("bad", 1), "KeyError: 'low'",  # guess_number needs "low"
     "handling_failed"),
], ids=["token-past-the-vocabulary", "spec-that-breaks-success"])
async def test_learner_admits_each_episode_before_it_can_fail_a_step(bad, error, reason,
                                                                     tmp_path):
    from rlbus.learner.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for s in [_played("run/0", 0), _played("run/0", 1), _played("bad", 0), bad(),
              _played("run/1", 0), _played("run/1", 1)]:
        await producer.send(T.scored, s)
    learner = Learner(_learner(tmp_path, trainer="grpo", model_path=model, max_steps=3,
                               weights_dir=tmp_path / "weights"),
                      MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([learner], lambda: learner.step >= 3
                    and _committed(broker, "hb.learner", T.scored) == 6)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert letter.offset == 3 and letter.error == error and letter.reason == reason
    # "bad" trained too, its dead-lettered member as a masked stand-in
    assert sorted(learner.ledger[-3:]) == [["bad/0", "bad/1"], ["run/0/0", "run/0/1"],
                                           ["run/1/0", "run/1/1"]]


def _played(group: str, index: int) -> ScoredTrajectory:
    """A scored guess_number episode with a spec the task can replay."""
    s = factories.scored(group, index)
    spec = GuessNumber().sample(random.Random(group))
    return s.model_copy(update={"trajectory": s.trajectory.model_copy(update={"spec": spec})})

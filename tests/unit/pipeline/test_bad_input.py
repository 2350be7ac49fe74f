"""Bad input of every kind: a clear log line, a dead letter or a masked sample, no crash,
and nothing else lost."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence

import msgpack
import pytest

from rlbus.api import StepOutcome
from rlbus.codec import encode
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import DeadLetter, Prompt, ScoredTrajectory, Trajectory
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

TOPICS = TopicSettings(prefix="bad", partitions=1, result_partitions=1)
T = Topics(TOPICS)


class _Env:
    tools: dict = {}

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def reset(self, task: dict) -> str:
        if self.mode == "reset-raises":
            raise RuntimeError("sandbox image missing")
        return "guess a number from 0 to 15 :"

    async def step(self, action: str) -> StepOutcome:
        if self.mode == "step-hangs":
            await asyncio.sleep(3600)
        raise ValueError("tool crashed")


class BrokenTask(GuessNumber):
    """guess_number with a broken environment or verifier, chosen by ``mode``."""

    def __init__(self, name: str, mode: str) -> None:
        super().__init__(name=name)
        self.mode = mode

    def make_env(self):  # type: ignore[override]
        return _Env(self.mode) if self.mode.startswith(("reset", "step")) else super().make_env()

    def score(self, task: dict, actions: Sequence[str]) -> float:
        if self.mode == "score-raises":
            raise ZeroDivisionError("verifier bug")
        if self.mode == "score-hangs":
            import time

            time.sleep(3)
        if self.mode == "score-nan":
            return math.nan
        return super().score(task, actions)


MODES = ("reset-raises", "step-hangs", "step-raises", "score-raises", "score-hangs", "score-nan")
for _mode in MODES:  # module attributes, so the import string finds them in any process
    globals()[_mode.replace("-", "_").upper()] = BrokenTask(_mode, _mode)


def ref(task: str) -> str:
    """The task reference prompts and trajectories carry: an import string for the broken
    tasks (the reward tier's verifier processes import them), the entry point otherwise."""
    return f"{__name__}:{task.replace('-', '_').upper()}" if task in MODES else task


@pytest.fixture
def broken_tasks():
    return MODES


def _prompt(task: str, group: str, spec: dict | None = None) -> Prompt:
    spec = spec or GuessNumber().sample(random.Random(group))
    return Prompt(group_id=group, task=task, spec=spec, group_size=2)


@pytest.mark.slow
async def test_environments_that_raise_or_hang_fail_their_episode_only(broken_tasks, caplog):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for task in ("reset-raises", "step-raises", "step-hangs", "guess_number"):
        await producer.send(T.prompts, _prompt(ref(task), f"g-{task}"))
    rollout = Rollout(
        RolloutSettings(topics=TOPICS, tokenizer="synthetic", env_timeout_s=0.5),
        MemoryBus(broker),
    )
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"), MemoryBus(broker))
    await run_until([rollout, inference],
                    lambda: len(read_log(broker, T.trajectories, Trajectory)) == 8)

    by_group = {}
    for t in read_log(broker, T.trajectories, Trajectory):
        by_group.setdefault(t.group_id, []).append(t)
    assert {t.status for t in by_group["g-guess_number"]} == {"ok"}
    for group, needle in (
        ("g-reset-raises", "sandbox image missing"),
        ("g-step-raises", "tool crashed"),
        ("g-step-hangs", "TimeoutError"),
    ):
        assert [t.status for t in by_group[group]] == ["failed", "failed"], group
        assert all(needle in (t.error or "") for t in by_group[group]), by_group[group][0].error
    assert "episode g-reset-raises/0 failed: RuntimeError: sandbox image missing" in caplog.text
    # every prompt was completed and committed: nothing is redelivered, nothing lost
    assert broker.groups["bad.rollout"].committed[(T.prompts, 0)] == 4


@pytest.mark.slow
async def test_verifiers_that_raise_hang_or_return_nan_mask_their_sample(broken_tasks, caplog):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    tasks = ["score-raises", "score-hangs", "score-nan", "guess_number"]
    for i, task in enumerate(tasks):
        t = factories.trajectory(f"g{i}", 0).model_copy(
            update={"task": ref(task), "spec": GuessNumber().sample(random.Random(i))}
        )
        await producer.send(T.trajectories, t)
    reward = Reward(RewardSettings(topics=TOPICS, verifier_timeout_s=0.5), MemoryBus(broker))
    await run_until([reward], lambda: len(read_log(broker, T.scored, ScoredTrajectory)) == 4)

    by_ref = {ref(task): task for task in tasks}
    scored = {by_ref[s.trajectory.task]: s for s in read_log(broker, T.scored, ScoredTrajectory)}
    assert scored["guess_number"].valid
    for task, needle in (
        ("score-raises", "ZeroDivisionError: verifier bug"),
        ("score-hangs", "TimeoutError"),
        ("score-nan", "returned nan"),
    ):
        assert not scored[task].valid and needle in scored[task].error, scored[task].error
        assert scored[task].reward == 0.0
    assert "masked: ZeroDivisionError: verifier bug" in caplog.text
    assert broker.groups["bad.reward"].committed[(T.trajectories, 0)] == 4


@pytest.mark.slow
async def test_invalid_trajectory_and_nan_reward_become_dead_letters(caplog):
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    bad = msgpack.unpackb(encode(factories.trajectory("bad"), packed=False))
    bad["turns"][0]["logprobs"] = [-1.0]  # 2 completion tokens, 1 logprob
    await producer.send_raw(T.trajectories, msgpack.packb(bad))
    await producer.send(T.trajectories, factories.trajectory("good"))
    reward = Reward(RewardSettings(topics=TOPICS), MemoryBus(broker, dlq_topic=T.dlq))
    await run_until([reward], lambda: len(read_log(broker, T.scored, ScoredTrajectory)) == 1)
    (letter,) = read_log(broker, T.dlq, DeadLetter)
    assert "1 logprobs for 2 completion tokens" in letter.error
    assert letter.reason == "invalid"  # msgpack, but not a valid Trajectory
    assert letter.source_topic == T.trajectories and letter.offset == 0
    assert "dead letter" in caplog.text

    nan = msgpack.unpackb(encode(factories.scored("nan")))
    nan["reward"] = math.nan
    await producer.send_raw(T.scored, msgpack.packb(nan))
    consumer = await MemoryBus(broker, dlq_topic=T.dlq).consumer(
        [T.scored], ScoredTrajectory, group_id="bad.learner"
    )
    got = await consumer.poll(0.1)
    assert [d.message.trajectory.group_id for d in got] == ["good"]
    letters = read_log(broker, T.dlq, DeadLetter)
    assert "reward must be finite" in letters[-1].error


@pytest.mark.slow
async def test_oversized_trajectory_is_published_as_a_failed_stub():
    topics = TopicSettings(prefix="big", partitions=1, result_partitions=1, max_message_bytes=1100)
    t = Topics(topics)
    broker = memory_broker(topics)
    prompt = _prompt("guess_number", "g")
    sampling = prompt.sampling.model_copy(update={"max_new_tokens": 64})
    await (await MemoryBus(broker).producer()).send(
        t.prompts, prompt.model_copy(update={"sampling": sampling})
    )
    rollout = Rollout(RolloutSettings(topics=topics, tokenizer="synthetic"), MemoryBus(broker))
    # 64-token completions make the full trajectory larger than 1100 bytes
    inference = Inference(
        InferenceSettings(topics=topics, engine="synthetic", synthetic={"completion_tokens": 64}),
        MemoryBus(broker),
    )
    await run_until([rollout, inference],
                    lambda: len(read_log(broker, t.trajectories, Trajectory)) == 2)
    for traj in read_log(broker, t.trajectories, Trajectory):
        assert traj.status == "failed" and traj.turns == []
        assert "topics accept 1100" in traj.error
    assert broker.groups["big.rollout"].committed[(t.prompts, 0)] == 1

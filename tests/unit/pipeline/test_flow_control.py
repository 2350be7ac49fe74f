"""Staleness stays within its bound, and a stalled tier stops the others from piling up work.

In-memory bus, synthetic engine and trainer: these are properties of the flow control, not
of the model or the broker.
"""

import asyncio
import json
import threading
from collections.abc import Callable

import pytest

from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.feeder import Feeder
from rlbus.learner.service import Learner
from rlbus.learner.settings import LearnerSettings
from rlbus.learner.trainer import SyntheticTrainer
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="fc", partitions=2, result_partitions=2)


def _learner(tmp_path, **kw) -> LearnerSettings:
    base = {
        "topics": TOPICS,
        "trainer": "synthetic",
        "synthetic_step_s": 0.0,
        "group_size": 2,
        "groups_per_step": 2,
        "max_steps": 6,
        "max_staleness": 1,
        "checkpoint_dir": tmp_path / "ckpt",
        "metrics_file": tmp_path / "metrics.jsonl",
        "checkpoint_every": 100,
    }
    return LearnerSettings(**{**base, **kw})


def _rollout(**kw) -> RolloutSettings:
    return RolloutSettings(topics=TOPICS, tokenizer="synthetic", **kw)


def _inference(**kw) -> InferenceSettings:
    return InferenceSettings(topics=TOPICS, engine="synthetic", **kw)


async def _run_until(learner: Learner, others: list,
                     until: Callable[[], bool] | None = None) -> None:
    """Run until the learner ends by itself (``max_steps``) or, given ``until``, until that
    holds; then stop everything."""
    tasks = [asyncio.create_task(o.run()) for o in others]
    try:
        if until is None:
            await asyncio.wait_for(learner.run(), 120)
        else:
            run = asyncio.create_task(learner.run())
            await wait_until(lambda: until() or run.done() or any(t.done() for t in tasks),
                             "the expected state")
            for t in (run, *tasks):
                if t.done():
                    raise AssertionError(f"a service stopped early: {t.result()}")
            learner.request_stop("test over")
            await run
    finally:
        for o in others:
            o.request_stop("test over")
        await asyncio.gather(*tasks)


def _count(broker, topic: str) -> int:
    return sum(len(p) for p in broker.logs.get(topic, []))


@pytest.mark.slow
async def test_slow_learner_never_sees_staleness_beyond_the_bound(tmp_path):
    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    # the learner is the bottleneck: rollouts are instant, each step takes 0.4 s
    learner = Learner(_learner(tmp_path, synthetic_step_s=0.4), bus())
    others = [
        Inference(_inference(), bus()),
        Reward(RewardSettings(topics=TOPICS), bus()),
        Rollout(_rollout(), bus()),
    ]
    await _run_until(learner, others)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert max(r["staleness_max"] for r in rows) == 1  # the bound is reached ...
    assert all(r["staleness_max"] <= 1 for r in rows)  # ... and never exceeded
    assert sum(r["masked"] for r in rows) == 0  # nothing had to be dropped for staleness


@pytest.mark.slow
async def test_with_inference_stopped_rollout_stops_taking_prompts(tmp_path):
    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    settings = _learner(tmp_path, max_staleness=4, groups_per_step=2)
    learner = Learner(settings, bus())
    rollout = Rollout(_rollout(max_groups_in_flight=3, step_timeout_s=30, drain_timeout_s=1), bus())
    t = Topics(TOPICS)

    def saturated() -> bool:
        # every admitted prompt published, and rollout found itself at its bound of groups
        # in flight: from there it takes no prompt until a group ends, and none can
        return (_count(broker, t.prompts) == 10 and _count(broker, t.steps) == 6
                and rollout.counters.get("group_bound_waits", 0) >= 1)

    await _run_until(learner, [rollout, Reward(RewardSettings(topics=TOPICS), bus())], saturated)

    # the feeder admitted (max_staleness + step + 1) * groups_per_step = 10 groups, no more
    assert learner.step == 0  # the window never moved
    assert _count(broker, t.prompts) == (4 + 0 + 1) * 2
    # rollout took only as many as its bound; the rest wait in Kafka, not in memory
    assert rollout.handled == 0
    assert _count(broker, t.steps) == 3 * 2  # 3 groups in flight x 2 episodes, on turn 0
    assert broker.groups["fc.rollout"].committed.get((t.prompts, 0), 0) == 0


@pytest.mark.slow
async def test_with_the_learner_stalled_the_feeder_stops_publishing(tmp_path, monkeypatch):
    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    # the first step does not finish while the test looks: the learner is stalled
    in_step, release = threading.Event(), threading.Event()

    def stalled_step(self, groups, version):
        in_step.set()
        release.wait(60)
        return step(self, groups, version)

    step = SyntheticTrainer.step
    monkeypatch.setattr(SyntheticTrainer, "step", stalled_step)
    top_ups_while_stalled = 0
    top_up = Feeder.top_up

    async def counted_top_up(self, *args):
        nonlocal top_ups_while_stalled
        top_ups_while_stalled += in_step.is_set()
        await top_up(self, *args)

    monkeypatch.setattr(Feeder, "top_up", counted_top_up)
    settings = _learner(tmp_path, max_staleness=1, drain_timeout_s=1)
    learner = Learner(settings, bus())
    others = [
        Inference(_inference(), bus()),
        Reward(RewardSettings(topics=TOPICS), bus()),
        Rollout(_rollout(), bus()),
    ]
    prompts = Topics(TOPICS).prompts
    try:
        # the feeder looked again while the step was stalled, and published nothing more (two
        # looks: the first of them has surely finished, publishing included)
        await _run_until(learner, others,
                         lambda: top_ups_while_stalled >= 2 and _count(broker, prompts) == 4)
    finally:
        release.set()
    assert learner.step == 0
    assert _count(broker, prompts) == (1 + 0 + 1) * 2  # the credit window, then nothing


@pytest.mark.slow
async def test_a_stopping_rollout_finishes_its_episodes_instead_of_timing_out(tmp_path):
    """SIGTERM: rollout stops taking prompts but keeps reading replies, so the episodes in
    flight finish and are published within a few engine calls, not after the drain timeout
    (it used to stop reading replies first, and every group waited out 80% of it)."""
    from rlbus.inference.settings import SyntheticEngineSettings

    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    learner = Learner(_learner(tmp_path, max_steps=1000, max_staleness=4), bus())
    engine = SyntheticEngineSettings(base_ms=100, per_token_ms=0)  # 0.1 s per model call
    # a drain timeout no run reaches: stopping within the safety net below shows that the
    # episodes finished, not that the drain timed out
    rollout = Rollout(_rollout(drain_timeout_s=600), bus())
    others = [Inference(_inference(synthetic=engine), bus()),
              Reward(RewardSettings(topics=TOPICS), bus())]
    tasks = [asyncio.create_task(s.run()) for s in (learner, *others)]
    run = asyncio.create_task(rollout.run())
    try:
        await wait_until(lambda: _count(broker, Topics(TOPICS).steps) > 0 or run.done(),
                         "an episode in flight")
        assert not run.done(), run.result()
        rollout.request_stop("test: SIGTERM")
        await asyncio.wait_for(run, 60)  # 600 s drain timeout x 0.8 before
    finally:
        for s in (learner, *others):
            s.request_stop("test over")
        await asyncio.gather(*tasks)
    assert rollout.counters.get("episodes", 0) > 0
    assert rollout.counters.get("group_crashes", 0) == 0  # nothing was cancelled mid-group
    published = sum(len(p) for p in broker.logs[Topics(TOPICS).trajectories])
    committed = sum(broker.groups["fc.rollout"].committed.values())
    assert published == committed * 2  # every group it took was finished and committed

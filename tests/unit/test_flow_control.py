"""Staleness stays within its bound, and a stalled tier stops the others from piling up work.

In-memory bus, synthetic engine and trainer: these are properties of the flow control, not
of the model or the broker.
"""

import asyncio
import json

import pytest

from rlbus.services.inference.service import Inference
from rlbus.services.inference.settings import InferenceSettings
from rlbus.services.learner.service import Learner
from rlbus.services.learner.settings import LearnerSettings
from rlbus.services.reward.service import Reward
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.rollout.service import Rollout
from rlbus.services.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus

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


async def _run_until(learner: Learner, others: list, seconds: float | None = None) -> None:
    tasks = [asyncio.create_task(o.run()) for o in others]
    try:
        if seconds is None:
            await asyncio.wait_for(learner.run(), 60)
        else:
            run = asyncio.create_task(learner.run())
            await asyncio.sleep(seconds)
            learner.request_stop("test over")
            await run
    finally:
        for o in others:
            o.request_stop("test over")
        await asyncio.gather(*tasks)


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
    await _run_until(learner, [rollout, Reward(RewardSettings(topics=TOPICS), bus())], 2.0)

    # the feeder admitted (max_staleness + step + 1) * groups_per_step = 10 groups, no more
    prompts = sum(len(p) for p in broker.logs[Topics(TOPICS).prompts])
    assert prompts == (4 + 0 + 1) * 2
    # rollout took only as many as its bound; the rest wait in Kafka, not in memory
    assert rollout.handled == 0
    requests = sum(len(p) for p in broker.logs[Topics(TOPICS).steps])
    assert requests == 3 * 2  # 3 groups in flight x 2 episodes, each waiting on turn 0
    assert broker.groups["fc.rollout"].committed.get((Topics(TOPICS).prompts, 0), 0) == 0


@pytest.mark.slow
async def test_with_the_learner_stalled_the_feeder_stops_publishing(tmp_path):
    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    # a learner step that does not finish within the test: no step completes
    settings = _learner(tmp_path, synthetic_step_s=4, max_staleness=1, drain_timeout_s=1)
    learner = Learner(settings, bus())
    others = [
        Inference(_inference(), bus()),
        Reward(RewardSettings(topics=TOPICS), bus()),
        Rollout(_rollout(), bus()),
    ]
    task = asyncio.create_task(_run_until(learner, others, 2.0))
    await task
    prompts = sum(len(p) for p in broker.logs[Topics(TOPICS).prompts])
    assert prompts == (1 + 0 + 1) * 2  # the credit window, then nothing


@pytest.mark.slow
async def test_a_stopping_rollout_finishes_its_episodes_instead_of_timing_out(tmp_path):
    """SIGTERM: rollout stops taking prompts but keeps reading replies, so the episodes in
    flight finish and are published within a few engine calls, not after the drain timeout
    (it used to stop reading replies first, and every group waited out 80% of it)."""
    from rlbus.services.inference.settings import SyntheticEngineSettings

    broker = memory_broker(TOPICS)
    bus = lambda: MemoryBus(broker)  # noqa: E731
    learner = Learner(_learner(tmp_path, max_steps=1000, max_staleness=4), bus())
    engine = SyntheticEngineSettings(base_ms=100, per_token_ms=0)  # 0.1 s per model call
    rollout = Rollout(_rollout(drain_timeout_s=20), bus())
    others = [Inference(_inference(synthetic=engine), bus()),
              Reward(RewardSettings(topics=TOPICS), bus())]
    tasks = [asyncio.create_task(s.run()) for s in (learner, *others)]
    run = asyncio.create_task(rollout.run())
    try:
        await asyncio.sleep(1.0)
        assert broker.logs[Topics(TOPICS).steps], "no episode in flight yet"
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        rollout.request_stop("test: SIGTERM")
        await asyncio.wait_for(run, 30)
        took = loop.time() - stopped
    finally:
        for s in (learner, *others):
            s.request_stop("test over")
        await asyncio.gather(*tasks)
    assert took < 5, f"rollout took {took:.1f} s to stop"  # 20 s drain timeout x 0.8 before
    assert rollout.counters.get("episodes", 0) > 0
    assert rollout.counters.get("group_crashes", 0) == 0  # nothing was cancelled mid-group
    published = sum(len(p) for p in broker.logs[Topics(TOPICS).trajectories])
    committed = sum(broker.groups["fc.rollout"].committed.values())
    assert published == committed * 2  # every group it took was finished and committed

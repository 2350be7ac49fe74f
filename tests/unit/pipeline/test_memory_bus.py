"""The four services learn together on the in-memory bus (fast; the Kafka twin is in
tests/integration/test_pipeline_kafka.py)."""

import json

import pytest

from rlbus.learner.tiny_model import build_tiny_model
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from tests.pipeline import bus_factory, run_pipeline, settings


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.slow
async def test_every_group_trained_exactly_once_and_weights_reach_inference(tiny_model, tmp_path):
    topics = TopicSettings(prefix="mem", partitions=2, result_partitions=2)
    broker = memory_broker(topics)
    # max_staleness 0: the second step's groups must be sampled by the first step's weights
    s = settings(tiny_model, tmp_path, {"topics": topics}, max_staleness=0)
    out = await run_pipeline(s, bus_factory(MemoryBus, broker=broker, dlq_topic="mem.dlq"))
    learner, (inference, reward, rollout) = out["learner"], out["others"]

    assert learner.step == 2
    assert sorted(learner.assembler.trained_ids()) == ["run/0", "run/1", "run/2", "run/3"]
    assert learner.assembler.duplicates == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes"] for r in rows] == [8, 8]
    assert [r["staleness_max"] for r in rows] == [0, 0]
    assert [r["masked"] for r in rows] == [0, 0]
    # the first weights were published and loaded before the run ended
    assert inference.engine.version >= 1
    assert (tmp_path / "weights" / "v000002" / "model.safetensors").exists()
    assert rollout.counters["episodes"] >= 16
    assert reward.handled == 16  # no duplicate trajectories in a fault-free run
    assert not broker.logs.get("mem.dlq", [[]])[0]  # nothing dead-lettered


@pytest.mark.slow
async def test_evaluation_episodes_are_measured_not_trained(tiny_model, tmp_path):
    topics = TopicSettings(prefix="ev", partitions=2, result_partitions=2)
    s = settings(tiny_model, tmp_path, {"topics": topics}, eval_every=1, eval_episodes=4)
    out = await run_pipeline(s, bus_factory(MemoryBus, broker=memory_broker(topics)))
    learner = out["learner"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["eval_at_step"] for r in rows if "eval_at_step" in r}
    assert evals == {0, 1, 2}  # before training, after step 1, and the final weights
    assert all(0.0 <= r["eval_success"] <= 1.0 for r in rows if "eval_success" in r)
    trained = [e for step in learner.ledger for e in step]
    assert len(trained) == 16 and not any("eval" in e for e in trained)


@pytest.mark.slow
async def test_the_checkpoint_ledger_is_bounded(tiny_model, tmp_path):
    import torch

    topics = TopicSettings(prefix="led", partitions=2, result_partitions=2)
    s = settings(tiny_model, tmp_path, {"topics": topics}, max_steps=3, groups_per_step=1,
                 group_size=2, ledger_steps=2)
    learner = (await run_pipeline(s, bus_factory(MemoryBus, broker=memory_broker(topics))))[
        "learner"]
    assert learner.step == 3
    assert len(learner.ledger) == 2 and all(len(step) == 2 for step in learner.ledger)
    groups = {e.rsplit("/", 1)[0] for step in learner.ledger for e in step}
    assert len(groups) == 2 and groups < {"run/0", "run/1", "run/2"}  # steps 2 and 3 only
    state = torch.load(tmp_path / "checkpoint" / "checkpoint.pt", weights_only=False)
    assert state["ledger_first_step"] == 2 and state["episodes_trained"] == 6

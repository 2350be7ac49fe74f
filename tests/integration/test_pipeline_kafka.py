"""A short training run of the four services on the real broker."""

import json

import pytest

from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import WeightVersion
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import bus_factory, run_pipeline, settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


async def test_short_run_trains_every_group_once_and_inference_loads_weights(
    kafka_bootstrap, unique_name, tiny_model, tmp_path
):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("run"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    common = {"kafka": kafka, "topics": topics}
    # max_staleness 0: step 2's groups are admitted at version 1 and must be sampled by it
    s = settings(tiny_model, tmp_path, common, max_staleness=0, max_steps=2)
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq))
    learner, (inference, reward, rollout) = out["learner"], out["others"]

    assert learner.step == 2
    assert sorted(learner.assembler.trained_ids()) == ["run/0", "run/1", "run/2", "run/3"]
    assert learner.assembler.duplicates == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes"] for r in rows] == [8, 8]
    assert [r["masked"] for r in rows] == [0, 0]
    assert [r["staleness_max"] for r in rows] == [0, 0]
    assert inference.engine.version >= 1  # loaded the learner's first weights
    assert reward.handled == 16
    assert rollout.counters.get("failed_episodes", 0) == 0

    bus = KafkaBus(kafka, dlq_topic=None, service="check")
    try:
        weights = await bus.consumer([Topics(topics).weights], WeightVersion,
                                     assign=[(Topics(topics).weights, 0)])
        published = []
        for _ in range(20):
            published += [d.message.version for d in await weights.poll(0.5)]
            if len(published) >= 2:
                break
        assert published == [1, 2]
    finally:
        await bus.close()


async def test_a_lora_run_publishes_adapters_that_inference_serves(
    kafka_bootstrap, unique_name, tiny_model, tmp_path
):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("lora"), partitions=1, result_partitions=1)
    await ensure_topics(kafka, topics)
    common = {"kafka": kafka, "topics": topics}
    s = settings(tiny_model, tmp_path, common, max_staleness=0, max_steps=2,
                 lora={"rank": 4})
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq))
    learner, (inference, _, _) = out["learner"], out["others"]

    assert learner.step == 2
    # max_staleness 0: step 2 trained on episodes sampled by v1, base + the first adapter
    assert inference.engine.version >= 1 and inference.engine.adapter == learner.trainer.adapter
    assert inference.counters.get("refused_weights", 0) == 0
    newest = tmp_path / "weights" / "v000002"
    assert sorted(p.name for p in newest.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["publish_bytes"] == (newest / "adapter_model.safetensors").stat().st_size

"""rlbus.client as the trainer of the real rollout, inference and reward services over the
real broker: submit, receive, publish two versions and wait until they are served, restart
from a saved position with nothing lost and nothing delivered twice."""

import asyncio
import random

import pytest
import torch

from rlbus import plugins
from rlbus.client import ClientSettings, Position, RolloutClient
from rlbus.inference.service import Inference
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import Sampling, WeightVersion
from rlbus.reward.service import Reward
from rlbus.rollout.service import Rollout
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SAMPLING = Sampling(temperature=1.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


async def _submit(client: RolloutClient, n: int) -> list[str]:
    task = plugins.task("guess_number")
    return [(await client.submit("guess_number", task.sample(random.Random(i)), group_size=2,
                                 sampling=SAMPLING)).group_id for i in range(n)]


async def test_a_trainer_of_its_own_drives_the_services_through_the_client(
        kafka_bootstrap, unique_name, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("cl"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(tiny_model, tmp_path, {"kafka": kafka, "topics": topics})
    s["inference"] = s["inference"].model_copy(update={"served_report_s": 0.5})
    dlq = Topics(topics).dlq
    services = [Inference(s["inference"], KafkaBus(kafka, dlq_topic=dlq, service="inference")),
                Reward(s["reward"], KafkaBus(kafka, dlq_topic=dlq, service="reward")),
                Rollout(s["rollout"], KafkaBus(kafka, dlq_topic=dlq, service="rollout"))]
    tasks = [asyncio.create_task(x.run()) for x in services]
    trainer = ClientSettings(kafka=kafka, topics=topics, model_path=tiny_model,
                             weights_dir=tmp_path / "weights", groups_per_step=2,
                             max_staleness=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    clients: list[RolloutClient] = []
    try:
        first = await RolloutClient.connect(trainer)
        clients.append(first)
        submitted = await _submit(first, first.credit())  # (1 + 0 + 1) x 2
        trained = await first.receive(2, timeout_s=180)
        assert len(trained) == 2
        for e in (e for g in trained for e in g.episodes):
            assert len(e.token_ids) == len(e.loss_mask) == len(e.logprobs) and any(e.loss_mask)
            assert e.episode_id.startswith(f"{e.scored.trajectory.group_id}/")
        saved = first.position().to_json()  # checkpointed with the model trained on them
        await first.commit(Position.from_json(saved))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        v1 = await first.publish_weights(model, wait_served=True, timeout_s=120)
        submitted += await _submit(first, first.credit())  # the next step's credit
        assert len(await first.receive(1, timeout_s=180)) == 1  # taken, then a crash
        await first.close()

        second = await RolloutClient.connect(trainer, position=Position.from_json(saved))
        clients.append(second)
        assert second.version == 1  # versions only grow
        rest = await second.receive(len(submitted) - 2, timeout_s=180)
        assert sorted(g.group_id for g in trained + rest) == sorted(submitted)
        assert await second.receive(1, timeout_s=3) == []  # nothing twice
        v2 = await second.publish_weights(model.state_dict(), wait_served=True, timeout_s=120)
        assert (v1.version, v2.version) == (1, 2)
        assert services[0].engine is not None and services[0].engine.version == 2
    finally:
        for c in clients:
            await c.close()
        for x in services:
            x.request_stop("test over")
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert services[2].counters.get("failed_episodes", 0) == 0

    bus = KafkaBus(kafka, dlq_topic=None, service="check")
    try:
        weights = await bus.consumer([Topics(topics).weights], WeightVersion,
                                     assign=[(Topics(topics).weights, 0)])
        announced = await weights.read_to_end((Topics(topics).weights, 0))
        assert [d.message.version for d in announced] == [1, 2]
    finally:
        await bus.close()

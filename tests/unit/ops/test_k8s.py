"""`rlbus k8s names`: the group and input topic of each tier, as the services themselves
subscribe; the chart is held to these names in tests/k8s/test_chart.py."""

import asyncio
import json

import pytest

from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.ops.cli import main
from rlbus.ops.k8s import SCALABLE, TIER_INPUTS, names
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.rollout.service import Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import TopicSettings, tiers
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus

TOPICS = TopicSettings(prefix="k8", partitions=3, result_partitions=2)


def test_every_installed_tier_has_an_input_topic_and_only_the_learner_is_not_scaled():
    assert set(TIER_INPUTS) == set(tiers())
    assert set(TIER_INPUTS) - set(SCALABLE) == {"learner"}


@pytest.mark.parametrize(
    ("service", "settings"),
    [
        (Rollout, RolloutSettings(topics=TOPICS, tokenizer="synthetic")),
        (Inference, InferenceSettings(topics=TOPICS, engine="synthetic")),
        (Reward, RewardSettings(topics=TOPICS)),
    ],
)
async def test_the_names_are_what_each_service_subscribes_to(service, settings):
    broker = memory_broker(TOPICS)
    member = service(settings, MemoryBus(broker))
    run = asyncio.create_task(member.run())
    try:
        await asyncio.wait_for(member.ready.wait(), 60)
        expected = names(TOPICS)["tiers"][member.name]
        group = broker.groups[expected["group"]]
        assert [sorted(m.topics) for m in group.members] == [[expected["topic"]]]
        assert expected["partitions"] == TOPICS.partitions
    finally:
        member.request_stop("test over")
        await asyncio.wait_for(run, 60)


def test_the_command_prints_the_names_for_a_prefix(capsys, monkeypatch):
    monkeypatch.setenv("RLBUS_TOPICS__PARTITIONS", "5")
    assert main(["k8s", "names", "--prefix", "exp1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiers"]["rollout"] == {
        "group": "exp1.rollout", "topic": "exp1.prompts", "partitions": 5, "autoscaled": True
    }
    assert out["tiers"]["learner"]["autoscaled"] is False
    assert out["topics"]["exp1.steps.results"] == TopicSettings().result_partitions

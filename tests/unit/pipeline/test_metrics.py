"""The services report their OpenTelemetry metrics."""

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rlbus.learner.tiny_model import build_tiny_model
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from tests.pipeline import bus_factory, run_pipeline, settings


@pytest.fixture(scope="module")
def reader():
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return reader


def _points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


@pytest.mark.slow
async def test_pipeline_reports_its_metrics(reader, tmp_path):
    model = build_tiny_model(tmp_path / "model")
    topics = TopicSettings(prefix="m", partitions=1, result_partitions=1)
    s = settings(model, tmp_path, {"topics": topics}, max_steps=1, groups_per_step=1, group_size=2)
    await run_pipeline(s, bus_factory(MemoryBus, broker=memory_broker(topics)))
    points = _points(reader)
    assert sum(p.value for p in points["rlbus.episodes"]) == 2
    assert sum(p.value for p in points["rlbus.tokens"]) > 0
    assert sum(p.count for p in points["rlbus.step.latency"]) >= 2  # one per turn at least
    assert sum(p.count for p in points["rlbus.staleness"]) == 2
    assert sum(p.count for p in points["rlbus.reward"]) == 2
    assert sum(p.count for p in points["rlbus.loss"]) == 1
    loop_lag = {p.attributes["rlbus.service"] for p in points["rlbus.event_loop.lag"]}
    # the learner may finish its one step before its first 0.1 s probe; the others outlive it
    assert {"rollout-0", "inference-0", "reward-0"} <= loop_lag


async def test_consumer_lag_counts_records_not_yet_fetched(reader):
    from rlbus.messages import Prompt
    from rlbus.transport import MemoryBroker
    from tests import factories

    bus = MemoryBus(MemoryBroker({"lagged": 1}), service="svc")
    producer = await bus.producer()
    for i in range(5):
        await producer.send("lagged", factories.prompt(f"g{i}"))
    consumer = await bus.consumer(["lagged"], Prompt, group_id="lag-test")
    assert len(await consumer.poll(0.1, max_records=2)) == 2
    lag = [
        p
        for p in _points(reader)["rlbus.consumer.lag"]
        if p.attributes["messaging.consumer.group.name"] == "lag-test"
    ]
    assert [(p.value, p.attributes["messaging.destination.name"]) for p in lag] == [(3, "lagged")]
    await bus.close()

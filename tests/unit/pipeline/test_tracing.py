"""One episode yields one connected trace across all four services."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rlbus.learner.tiny_model import build_tiny_model
from rlbus.settings import TopicSettings
from rlbus.topics import memory_broker
from rlbus.transport import MemoryBus
from tests.pipeline import bus_factory, run_pipeline, settings


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first test in this process to trace
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.mark.slow
async def test_episode_trace_spans_all_four_services(spans, tmp_path):
    model = build_tiny_model(tmp_path / "model")
    topics = TopicSettings(prefix="tr", partitions=1, result_partitions=1)
    s = settings(model, tmp_path, {"topics": topics}, max_steps=1, groups_per_step=1, group_size=2)
    await run_pipeline(s, bus_factory(MemoryBus, broker=memory_broker(topics)))

    finished = spans.get_finished_spans()
    root = next(x for x in finished if x.name == "episode" and x.parent is None)
    tree = [x for x in finished if x.context.trace_id == root.context.trace_id]
    names = {x.name for x in tree}
    assert {
        "episode",
        "env.reset",
        "env.step",
        "send tr.steps",
        "process tr.steps",
        "send tr.steps.results",
        "send tr.trajectories",
        "process tr.trajectories",
        "score",
        "send tr.trajectories.scored",
        "process tr.trajectories.scored",
    } <= names
    services = {x.attributes["rlbus.service"] for x in tree}
    assert services == {"rollout-0", "inference-0", "reward-0", "learner-0"}
    by_id = {x.context.span_id: x for x in tree}
    for x in tree:  # connected: every span but the root has its parent in the same trace
        assert x is root or x.parent.span_id in by_id
    send = next(x for x in tree if x.name == "send tr.steps")
    assert send.kind == trace.SpanKind.PRODUCER
    assert send.attributes["messaging.system"] == "kafka"
    assert send.attributes["messaging.destination.name"] == "tr.steps"
    process = next(x for x in tree if x.name == "process tr.steps")
    assert (
        process.kind == trace.SpanKind.CONSUMER and process.parent.span_id == send.context.span_id
    )
    # batch spans are linked to the episodes they served
    generate = [x for x in finished if x.name == "generate"]
    assert any(link.context.trace_id == root.context.trace_id for g in generate for link in g.links)
    train = next(x for x in finished if x.name == "train_step")
    assert any(link.context.trace_id == root.context.trace_id for link in train.links)

"""Inference loads a published version only from the weight store; any other uri is a dead
letter with the reason, and the weights it serves do not change."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlbus.errors import WeightsMismatchError
from rlbus.inference.engine import Completion, Engine
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import (
    DeadLetter,
    Sampling,
    StepResult,
    WeightsServed,
    WeightVersion,
    spans_of,
)
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories
from tests.polling import wait_until
from tests.support.services import read_log, run_until

TOPICS = TopicSettings(prefix="wv", partitions=1, result_partitions=1)
T = Topics(TOPICS)


class RecordingEngine(Engine):
    """Loads nothing; remembers what it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        return [Completion([1], [0.0], "stop") for _ in prompts]

    async def load(self, uri: str, checksum: str, version: int) -> None:
        self.loaded.append(uri)
        self.version = version


async def test_a_version_outside_the_weight_store_is_dead_lettered(tmp_path: Path) -> None:
    store = tmp_path / "weights"
    broker = memory_broker(TOPICS)
    bus = MemoryBus(broker, dlq_topic=T.dlq)
    producer = await bus.producer()
    outside = WeightVersion(model="policy", version=5, uri=str(tmp_path / "evil"), checksum="x",
                            step=5)
    inside = WeightVersion(model="policy", version=1, uri=str(store / "v000001"), checksum="y",
                           step=1)
    for w in (outside, inside):
        await producer.send(T.weights, w, key="policy")
    engine = RecordingEngine()
    inference = Inference(InferenceSettings(topics=TOPICS, weights_dir=store), bus, engine)

    await run_until([inference], lambda: engine.version == 1 and bool(broker.logs.get(T.dlq)))

    assert engine.loaded == [inside.uri]  # the newer, outside version was never tried
    [letter] = read_log(broker, T.dlq, DeadLetter)
    assert letter.source_topic == T.weights
    assert letter.reason == "invalid" and "outside the weight store" in letter.error
    assert inference.counters["weights_outside_store"] == 1


class MisfitEngine(RecordingEngine):
    """Every version's file is intact but does not fit the served model."""

    async def load(self, uri: str, checksum: str, version: int) -> None:
        raise WeightsMismatchError(f"{uri}: model.norm.weight: missing")


async def test_weights_that_do_not_fit_are_refused_and_the_member_keeps_serving(
        tmp_path: Path) -> None:
    store = tmp_path / "weights"
    broker = memory_broker(TOPICS)
    bus = MemoryBus(broker, dlq_topic=T.dlq)
    producer = await bus.producer()
    await producer.send(T.weights, WeightVersion(model="policy", version=1,
                                                 uri=str(store / "v000001"), checksum="y",
                                                 step=1), key="policy")
    engine = MisfitEngine()
    inference = Inference(InferenceSettings(topics=TOPICS, weights_dir=store), bus, engine)

    await run_until([inference], lambda: inference.counters.get("refused_weights") == 1)

    assert engine.version == 0


class SteppingEngine(Engine):
    """Decodes one token per step until it has seen a load land mid-batch (or 200 steps),
    recording each token's version the way the hf engine's in-flight loop does."""

    inflight_updates = True

    def __init__(self) -> None:
        self.loads_during_batch = 0
        self.generating = False

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        self.generating = True
        versions: list[int] = []
        for _ in range(200):
            async with self.step_boundary():
                versions.append(self.version)
            if versions[-1] != versions[0]:
                break
            await asyncio.sleep(0.01)
        self.generating = False
        return [Completion([1] * len(versions), [-0.5] * len(versions), "length",
                           spans_of(versions)) for _ in prompts]

    async def load(self, uri: str, checksum: str, version: int) -> None:
        self.loads_during_batch += self.generating
        self.version = version


async def test_with_in_flight_updates_a_version_lands_inside_a_running_batch() -> None:
    broker = memory_broker(TOPICS)
    bus = MemoryBus(broker, dlq_topic=T.dlq)
    producer = await bus.producer()
    engine = SteppingEngine()
    inference = Inference(InferenceSettings(topics=TOPICS, engine="synthetic"), bus, engine)

    async def announce_while_generating() -> None:
        await wait_until(lambda: engine.generating, "a batch generating")
        await producer.send(T.weights, WeightVersion(model="policy", version=1, uri="/w/1",
                                                     checksum="x", step=1), key="policy")
    await producer.send(T.steps, factories.step_request(), key="run/0/0")
    announcing = asyncio.create_task(announce_while_generating())
    await run_until([inference], lambda: bool(read_log(broker, T.results, StepResult)))
    await announcing

    [result] = read_log(broker, T.results, StepResult)
    assert engine.loads_during_batch == 1
    assert result.policy_version == 0  # the oldest token's
    assert result.version_spans is not None
    assert [v for v, _ in result.version_spans] == [0, 1]


async def test_an_adapter_that_does_not_fit_is_dead_lettered_and_the_old_one_serves(
        tmp_path: Path) -> None:
    from rlbus.inference.engines import HFEngine
    from tests.support.lora import publish, random_adapter, tiny_qwen2

    base, store = tiny_qwen2(tmp_path / "base"), tmp_path / "weights"
    _, weights = random_adapter(base)
    broker = memory_broker(TOPICS)
    bus = MemoryBus(broker, dlq_topic=T.dlq)
    producer = await bus.producer()
    for v, rank in ((1, 4), (2, 2)):  # v2 says rank 2 of an adapter of rank 4
        uri, checksum = publish(weights, store, v)
        adapter = weights.adapter.model_copy(update={"rank": rank})
        await producer.send(T.weights, WeightVersion(model="policy", version=v, uri=uri,
                                                     checksum=checksum, step=v, adapter=adapter),
                            key="policy")
    settings = InferenceSettings(topics=TOPICS, weights_dir=store, model_path=base,
                                 torch_threads=None)
    engine = HFEngine(settings)
    await engine.load_adapter(uri, checksum, 1, weights.adapter)  # v1 served (same tensors)
    inference = Inference(settings, bus, engine)

    def refused() -> bool:
        served = read_log(broker, T.served, WeightsServed)
        return bool(broker.logs.get(T.dlq)) and any(s.refused_version == 2 for s in served)

    await run_until([inference], refused)

    [letter] = read_log(broker, T.dlq, DeadLetter)
    assert letter.reason == "invalid" and "r 4, announced rank 2" in letter.error
    assert engine.version == 1 and inference.counters["refused_weights"] == 1
    served = read_log(broker, T.served, WeightsServed)
    assert served[-1].version == 1 and served[-1].refused_version == 2
    assert "announced rank 2" in (served[-1].refused_error or "")


async def test_an_adapter_version_to_an_engine_without_lora_is_refused(tmp_path: Path) -> None:
    """A LoRA version reaches the engine's ``load_adapter``, not ``load``; an engine that
    serves no adapters refuses it, and the member keeps serving what it served."""
    from rlbus.messages import LoraAdapter

    store = tmp_path / "weights"
    broker = memory_broker(TOPICS)
    bus = MemoryBus(broker, dlq_topic=T.dlq)
    producer = await bus.producer()
    adapter = LoraAdapter(rank=4, alpha=8, target_modules=["q_proj"])
    await producer.send(T.weights, WeightVersion(model="policy", version=1,
                                                 uri=str(store / "v000001"), checksum="y",
                                                 step=1, adapter=adapter), key="policy")
    engine = RecordingEngine()
    inference = Inference(InferenceSettings(topics=TOPICS, weights_dir=store), bus, engine)

    await run_until([inference], lambda: inference.counters.get("refused_weights") == 1)

    assert (engine.loaded, engine.version) == ([], 0)
    assert inference._refused == 1 and "serves none" in (inference._refused_error or "")

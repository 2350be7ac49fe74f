"""rlbus.client on the in-memory bus: the credit window, exactly-once groups, resuming from
a position, publishing weights (and refusing the wrong ones), waiting until they are served.

The test plays the other tiers where it needs them: it publishes scored episodes itself,
and runs a real inference member (synthetic engine) for ``wait_served``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlbus.client import (
    ClientSettings,
    NoCreditError,
    NotServedError,
    PluginError,
    Position,
    PositionError,
    RolloutClient,
    SyncRolloutClient,
    WeightsMismatchError,
    WeightsRefusedError,
)
from rlbus.client.tensors import read_header
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.tiny_model import build_tiny_model
from rlbus.messages import Prompt, ScoredTrajectory, WeightsServed, WeightVersion
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBroker, MemoryBus
from rlbus.weights import verified_weights, weights_file
from tests.factories import trajectory
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="cl", partitions=2, result_partitions=1)
T = Topics(TOPICS)

Connect = Callable[..., Awaitable[RolloutClient]]


@pytest.fixture
def broker() -> MemoryBroker:
    return memory_broker(TOPICS)


@pytest.fixture
async def connect(broker: MemoryBroker, tmp_path: Path) -> AsyncIterator[Connect]:
    """Factory of clients on ``broker``, each on a bus of its own (closed at the end)."""
    buses: list[MemoryBus] = []

    async def make(position: Position | None = None, **settings: Any) -> RolloutClient:
        bus = MemoryBus(broker, dlq_topic=T.dlq, service="trainer")
        buses.append(bus)
        base = {"topics": TOPICS, "groups_per_step": 2, "max_staleness": 1,
                "weights_dir": tmp_path / "weights"}
        return await RolloutClient.connect(ClientSettings(**{**base, **settings}), bus,
                                           position=position)

    yield make
    for bus in buses:
        await bus.close()


async def send_scored(broker: MemoryBroker, group: str, *indexes: int, version: int = 0,
                      size: int = 2) -> None:
    producer = await MemoryBus(broker).producer()
    for i in indexes:
        t = trajectory(group, i, version=version).model_copy(update={"group_size": size})
        await producer.send(T.scored, ScoredTrajectory(trajectory=t, reward=float(i)), key=group)


def logged(broker: MemoryBroker, topic: str) -> int:
    return sum(len(p) for p in broker.logs.get(topic, []))


# -- submitting


async def test_the_credit_window_admits_max_staleness_plus_one_steps_of_groups(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    assert client.credit() == (1 + 0 + 1) * 2
    sent = [await client.submit("guess_number", {"target": 3}, group_size=2) for _ in range(4)]
    assert [p.group_id for p in sent] == ["run/0", "run/1", "run/2", "run/3"]
    assert client.credit() == 0
    with pytest.raises(NoCreditError, match="publish the next weights"):
        await client.submit("guess_number", {"target": 3}, group_size=2)
    assert logged(broker, T.prompts) == 4  # the refused one was not sent
    # an evaluation group takes no credit
    await client.submit("guess_number", {"target": 3}, group_size=1, purpose="eval")
    assert logged(broker, T.prompts) == 5


async def test_a_submit_waiting_for_credit_goes_out_when_weights_are_published(
        connect: Connect) -> None:
    client = await connect(groups_per_step=1, max_staleness=0)
    await client.submit("guess_number", {"target": 3}, group_size=2)
    waiting = asyncio.create_task(
        client.submit("guess_number", {"target": 4}, group_size=2, wait_s=math.inf))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # no credit until the next version
    await client.publish_weights(None)
    prompt = await asyncio.wait_for(waiting, 5)
    assert (prompt.group_id, prompt.min_version) == ("run/1", 1)


async def test_an_unknown_task_is_refused_at_submit_and_nothing_is_sent(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    with pytest.raises(PluginError, match="no task named 'no_such_task'"):
        await client.submit("no_such_task", {}, group_size=2)
    assert logged(broker, T.prompts) == 0 and client.submitted == 0
    assert client.credit() == 4


async def test_a_trainer_that_stops_receiving_leaves_the_records_in_kafka(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    await send_scored(broker, "run/0", 0, 1)
    assert client.assembler.held == 0 and "records" not in client.counters  # nothing read
    assert len(await client.receive(1, timeout_s=5)) == 1
    read = client.counters["records"]
    for g in range(1, 20):
        await send_scored(broker, f"run/{g}", 0, 1)
    await asyncio.sleep(0.2)
    assert client.counters["records"] == read and client.assembler.held == 0
    assert len(await client.receive(3, timeout_s=5)) == 3  # there when it asks again


# -- receiving


async def test_groups_come_complete_and_once_whatever_the_copies(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    await send_scored(broker, "run/0", 1, 1)  # a redelivered episode
    assert await client.receive(1, timeout_s=0.3) == []  # incomplete: not handed out
    await send_scored(broker, "run/0", 0, 0, 1)  # the rest, and more copies
    (group,) = await client.receive(1, timeout_s=5)
    assert group.group_id == "run/0" and group.purpose == "train"
    assert [e.episode_id for e in group.episodes] == ["run/0/0", "run/0/1"]
    e = group.episodes[1]
    assert e.token_ids == [1, 2, 5, 2] and e.loss_mask == [False, False, True, True]
    assert e.logprobs == [0.0, 0.0, -1.5, -0.125]
    assert (e.reward, e.policy_version, e.finish_reason, e.valid) == (1.0, 0, "stop", True)
    await send_scored(broker, "run/0", 0, 1)  # a whole second copy, after it was taken
    assert await client.receive(1, timeout_s=0.5) == []
    assert client.assembler.duplicates == 5  # 1, then 0 and 1, then both after it was taken


async def test_evaluation_groups_are_handed_out_apart(connect: Connect,
                                                      broker: MemoryBroker) -> None:
    client = await connect()
    producer = await MemoryBus(broker).producer()
    t = trajectory("run/eval0/0").model_copy(update={"group_size": 1, "purpose": "eval",
                                                     "eval_round": 0})
    await producer.send(T.scored, ScoredTrajectory(trajectory=t, reward=1.0), key="x")
    assert await client.receive(1, timeout_s=0.3) == []
    (group,) = await client.evaluations(timeout_s=5)
    assert (group.purpose, group.eval_round, len(group.episodes)) == ("eval", 0, 1)


async def test_a_restarted_client_resumes_from_its_position_with_nothing_lost_or_repeated(
        connect: Connect, broker: MemoryBroker) -> None:
    for g in range(3):
        await send_scored(broker, f"run/{g}", 0, 1)
    await send_scored(broker, "run/3", 0)  # half a group
    first = await connect()
    taken = await first.receive(2, timeout_s=5)
    saved = first.position().to_json()  # the trainer checkpoints after training on these
    taken += await first.receive(1, timeout_s=5)  # then takes one more and crashes
    assert sorted(g.group_id for g in taken) == ["run/0", "run/1", "run/2"]
    before = {g.group_id for g in taken[:2]}
    await first.bus.close()

    await send_scored(broker, "run/3", 1)  # the other half arrives while it is down
    second = await connect(Position.from_json(saved))
    again = await second.receive(2, timeout_s=5)
    assert {g.group_id for g in again} == {"run/0", "run/1", "run/2", "run/3"} - before
    assert await second.receive(1, timeout_s=0.5) == []  # nothing more, nothing twice
    assert second.position().taken[:2] == Position.from_json(saved).taken


def test_a_position_round_trips_through_json_and_names_its_format() -> None:
    p = Position(topic="x.trajectories.scored", offsets={0: 12, 3: 7}, taken=["run/0"],
                 submitted=4, steps=2, version=5)
    assert Position.from_json(p.to_json()) == p
    with pytest.raises(PositionError, match="format 1"):
        Position.from_json('{"format_version": 2}')


async def test_a_position_of_another_topic_is_refused(connect: Connect) -> None:
    with pytest.raises(PositionError, match=r"other\.trajectories\.scored"):
        await connect(Position(topic="other.trajectories.scored", offsets={0: 3}))


# -- weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def announced(broker: MemoryBroker) -> list[WeightVersion]:
    from rlbus.codec import decode

    return [decode(r.value, WeightVersion) for p in broker.logs.get(T.weights, []) for r in p]


async def test_weights_are_published_from_a_state_dict_a_model_or_a_folder(
        connect: Connect, broker: MemoryBroker, tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    client = await connect(model_path=tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    v1 = await client.publish_weights(model)  # tied embeddings: one tensor, two names
    v2 = await client.publish_weights(state)  # clones: the tied pair is two equal tensors
    v3 = await client.publish_weights(tiny)  # a saved folder, as it is
    assert [e.version for e in announced(broker)] == [1, 2, 3]
    assert (client.version, client.steps) == (3, 3)
    for event in (v1, v2, v3):
        assert verified_weights(event.uri, event.checksum).exists()
    written = load_file(verified_weights(v2.uri, v2.checksum))
    torch.testing.assert_close(written["model.norm.weight"], state["model.norm.weight"])
    # the served folder's names: the tied embedding is kept under the name it has there
    assert set(read_header(verified_weights(v1.uri, v1.checksum))) == set(
        read_header(tiny / "model.safetensors"))


@pytest.mark.parametrize(("change", "says"), [
    (lambda s: s.update({"model.norm.weight": torch.zeros(3)}), r"shape \[3\]"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].long()}), "dtype I64"),
    (lambda s: s.pop("model.norm.weight"), "model.norm.weight: missing"),
    (lambda s: s.update({"extra.bias": torch.zeros(2)}), "extra.bias: no such tensor"),
])
async def test_weights_of_another_shape_or_dtype_are_refused_and_nothing_is_published(
        connect: Connect, broker: MemoryBroker, tiny: Path, tmp_path: Path,
        change: Callable[[dict[str, Any]], object], says: str) -> None:
    client = await connect(model_path=tiny)
    state = dict(load_file(tiny / "model.safetensors"))
    change(state)
    with pytest.raises(WeightsMismatchError, match=says):
        await client.publish_weights(state)
    assert announced(broker) == [] and client.version == 0 and client.steps == 0
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())


async def test_after_a_version_its_dtype_is_the_reference(connect: Connect,
                                                         broker: MemoryBroker,
                                                         tiny: Path) -> None:
    client = await connect(model_path=tiny)
    state = load_file(tiny / "model.safetensors")
    await client.publish_weights({k: v.bfloat16() for k, v in state.items()})  # engines cast
    with pytest.raises(WeightsMismatchError, match="dtype F32, v1"):
        await client.publish_weights(state)  # but not a change of dtype mid-run
    assert [e.version for e in announced(broker)] == [1]


async def test_wait_served_returns_once_every_live_member_serves_the_version(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    settings = InferenceSettings(topics=TOPICS, engine="synthetic", served_report_s=0.2)
    inference = Inference(settings, MemoryBus(broker))
    run = asyncio.create_task(inference.run())
    try:
        await wait_until(lambda: inference.ready.is_set(), "inference ready")
        await client.publish_weights(None, wait_served=True, timeout_s=10)
        served = await client.wait_served(timeout_s=10)
        assert served.members == {"inference-0": 1}
    finally:
        inference.request_stop("test over")
        await run
    await client.publish_weights(None)
    with pytest.raises(NotServedError, match="no live inference member"):
        await client.wait_served(timeout_s=0.5)  # it said it was leaving


async def test_wait_served_names_a_lagging_member_and_stops_at_a_refusal(
        connect: Connect, broker: MemoryBroker) -> None:
    client = await connect()
    await client.publish_weights(None)
    producer = await MemoryBus(broker).producer()

    async def report(**fields: Any) -> None:
        r = WeightsServed(model="policy", member="inference-7", every_s=5, **fields)
        await producer.send(T.served, r, key=r.member)

    await report(version=0)
    gone = WeightsServed(model="policy", member="inference-8", every_s=5, version=0, at=0.0)
    await producer.send(T.served, gone, key=gone.member)  # reported long ago: not live
    with pytest.raises(NotServedError, match=r"inference-7 serves v0$"):
        await client.wait_served(1, timeout_s=0.5)
    await report(version=0, refused_version=1, refused_error="sha256 mismatch")
    with pytest.raises(WeightsRefusedError, match="inference-7 refused weights v1: sha256"):
        await client.wait_served(1, timeout_s=30)
    await report(version=1)
    assert (await client.wait_served(1, timeout_s=5)).members == {"inference-7": 1}


def test_the_sync_client_makes_the_same_calls(broker: MemoryBroker, tmp_path: Path) -> None:
    settings = ClientSettings(topics=TOPICS, groups_per_step=1, max_staleness=0,
                              weights_dir=tmp_path / "weights")
    with SyncRolloutClient(settings, MemoryBus(broker)) as client:
        prompt = client.submit("guess_number", {"target": 3}, group_size=2)
        assert isinstance(prompt, Prompt) and client.credit() == 0
        client.run(send_scored(broker, "run/0", 0, 1))
        (group,) = client.receive(1, timeout_s=5)
        assert group.group_id == "run/0" and client.position().taken == ["run/0"]
        assert client.publish_weights(None).version == 1 and client.credit() == 1


async def test_the_next_versions_file_is_reserved_then_filled(
        connect: Connect, tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    client = await connect(model_path=tiny, weights_checksum="xxh3_128")
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    v1 = await client.publish_weights(model)
    assert v1.checksum.startswith("xxh3_128:")
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    v2 = await client.publish_weights(model)  # written into the file reserved after v1
    await client.close()  # waits for the reservation of v3
    reserved = tmp_path / "weights" / ".v000003.tmp" / "model.safetensors"
    assert reserved.stat().st_size == weights_file(v2.uri).stat().st_size
    written = load_file(verified_weights(v2.uri, v2.checksum))
    torch.testing.assert_close(written["model.norm.weight"], model.model.norm.weight)

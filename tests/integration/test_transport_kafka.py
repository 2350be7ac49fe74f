"""The transport against a real broker: round trips, dead letters, topics, transactions."""

from __future__ import annotations

import msgpack
import pytest

from rlbus.codec import encode
from rlbus.messages import DeadLetter, Prompt
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import TopicMismatchError, Topics, ensure_topics
from rlbus.transport import KafkaBus, admin_client
from tests import factories
from tests.polling import poll_until

pytestmark = pytest.mark.kafka


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)


@pytest.fixture
async def topics(kafka: KafkaSettings, unique_name) -> Topics:
    settings = TopicSettings(prefix=unique_name("t"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, settings)
    return Topics(settings)


@pytest.mark.parametrize("make", factories.ALL, ids=lambda f: f.__name__)
async def test_every_message_type_round_trips_through_kafka(kafka, topics, unique_name, make):
    msg = make()
    topic = next(s.name for s in topics.catalogue() if s.message is type(msg))
    bus = KafkaBus(kafka, dlq_topic=topics.dlq, service="test")
    try:
        prod = await bus.producer()
        await prod.send(topic, msg, key="k", headers={"h": b"v"})
        cons = await bus.consumer([topic], type(msg), group_id=unique_name("g"))
        got = await poll_until(cons, 1)
        assert got[0].message == msg
        assert got[0].key == b"k" and got[0].headers["h"] == b"v"
    finally:
        await bus.close()


async def test_garbage_and_unknown_version_go_to_dlq_and_consumer_carries_on(
    kafka, topics, unique_name
):
    bus = KafkaBus(kafka, dlq_topic=topics.dlq, service="test-svc")
    group = unique_name("g")
    try:
        prod = await bus.producer()
        future = msgpack.unpackb(encode(factories.prompt("future")))
        future["schema_version"] = 2
        await prod.send_raw(topics.prompts, b"\xc1garbage", partition=0)
        await prod.send_raw(topics.prompts, msgpack.packb(future), partition=0)
        await prod.send(topics.prompts, factories.prompt("good"), partition=0)
        cons = await bus.consumer([topics.prompts], Prompt, group_id=group)
        got = await poll_until(cons, 1)
        assert [d.message.group_id for d in got] == ["good"]
        cons.ack(got[0])
        assert await cons.commit() == {(topics.prompts, 0): 3}

        letters = await bus.consumer([topics.dlq], DeadLetter, group_id=unique_name("dlq"))
        dead = await poll_until(letters, 2)
        assert [d.message.offset for d in dead] == [0, 1]
        assert "not msgpack" in dead[0].message.error
        assert "schema_version" in dead[1].message.error
        assert dead[1].headers["rlbus.source.topic"] == topics.prompts.encode()
        assert dead[0].message.service == "test-svc"
    finally:
        await bus.close()

    # the dead letters' offsets were committed: a restarted member sees nothing left
    bus2 = KafkaBus(kafka, dlq_topic=topics.dlq, service="test-svc")
    try:
        again = await bus2.consumer([topics.prompts], Prompt, group_id=group)
        assert await again.poll(2.0) == []
    finally:
        await bus2.close()


async def test_topic_creation_twice_is_a_no_op(kafka, unique_name):
    settings = TopicSettings(prefix=unique_name("t"), partitions=3)
    first = await ensure_topics(kafka, settings)
    assert len(first) == len(Topics(settings).catalogue())
    assert await ensure_topics(kafka, settings) == []
    async with admin_client(kafka) as admin:
        (desc,) = await admin.describe_topics([Topics(settings).prompts])
        assert len(desc["partitions"]) == 3


async def test_topic_with_wrong_partition_count_fails_clearly(kafka, unique_name):
    prefix = unique_name("t")
    await ensure_topics(kafka, TopicSettings(prefix=prefix, partitions=2))
    with pytest.raises(TopicMismatchError, match="has 2 partitions but the settings ask for 4"):
        await ensure_topics(kafka, TopicSettings(prefix=prefix, partitions=4))


async def test_transaction_commits_output_and_offsets_atomically(kafka, topics, unique_name):
    bus = KafkaBus(kafka, dlq_topic=topics.dlq, service="test")
    group = unique_name("g")
    try:
        prod = await bus.producer()
        await prod.send(topics.prompts, factories.prompt("in"), partition=0)
        cons = await bus.consumer([topics.prompts], Prompt, group_id=group)
        (d,) = await poll_until(cons, 1)
        txp = await bus.producer(transactional_id=unique_name("tx"))
        with pytest.raises(RuntimeError):
            async with txp.transaction():
                await txp.send(topics.dlq, factories.dead_letter())
                raise RuntimeError("abort this one")
        async with txp.transaction():
            await txp.send(topics.dlq, factories.dead_letter())
            await txp.send_offsets({d.tp: d.offset + 1}, group)
        reader = await bus.consumer(
            [topics.dlq], DeadLetter, group_id=unique_name("r"), read_committed=True
        )
        got = await poll_until(reader, 1)
        assert len(got) + len(await reader.poll(1.0)) == 1  # the aborted one is invisible
    finally:
        await bus.close()
    bus2 = KafkaBus(kafka, dlq_topic=topics.dlq, service="test")
    try:
        again = await bus2.consumer([topics.prompts], Prompt, group_id=group)
        assert await again.poll(2.0) == []  # offsets committed with the transaction
    finally:
        await bus2.close()


async def test_topic_creation_refused_by_the_broker_fails_clearly(kafka, unique_name):
    from rlbus.topics import TopicCreationError

    # one broker cannot hold three replicas
    settings = TopicSettings(prefix=unique_name("t"), replication=3)
    with pytest.raises(TopicCreationError, match=r"creating .* failed: error"):
        await ensure_topics(kafka, settings)

"""The Kafka consumer's commit after a rebalance, against a stand-in for aiokafka's consumer."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import TopicPartition

from rlbus.messages import Prompt
from rlbus.transport.kafka import KafkaConsumer


class _AiokafkaConsumer:
    """What aiokafka's consumer does on commit: refuse any partition it is not assigned."""

    def __init__(self, *owned: TopicPartition) -> None:
        self.owned = set(owned)
        self.committed: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return set(self.owned)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        for tp in offsets:
            if tp not in self.owned:
                raise IllegalStateError(f"Partition {tp} is not assigned")
        self.committed.update(offsets)


async def test_work_of_a_partition_a_rebalance_took_away_is_left_to_its_new_owner():
    """Found by the compose end-to-end test: an inference member finished a batch from two
    partitions after a member that joined meanwhile was given one of them; committing the
    batch raised IllegalStateError and the member crashed."""
    client = _AiokafkaConsumer(TopicPartition("steps", 0))
    consumer = KafkaConsumer(client, Prompt, None, timeout_s=5)
    for partition in (0, 1):  # fetched while both were ours
        consumer.tracker.delivered("steps", partition, 10)
        consumer.tracker.ack("steps", partition, 10)
    assert await consumer.commit() == {("steps", 0): 11}  # only what the broker took
    assert client.committed == {TopicPartition("steps", 0): 11}
    assert consumer.tracker.committable() == {}  # the lost partition is forgotten, not retried
    # if the partition comes back, its commits start from what it delivers then, not
    # from a mark of an offset that was never committed
    client.owned.add(TopicPartition("steps", 1))
    consumer.tracker.delivered("steps", 1, 4)
    consumer.tracker.ack("steps", 1, 4)
    assert await consumer.commit() == {("steps", 1): 5}


async def test_a_commit_the_group_refused_is_not_recorded_as_made():
    class _Refusing(_AiokafkaConsumer):
        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            raise CommitFailedError("the group rebalanced")

    consumer = KafkaConsumer(_Refusing(TopicPartition("steps", 0)), Prompt, None, timeout_s=5)
    consumer.tracker.delivered("steps", 0, 3)
    consumer.tracker.ack("steps", 0, 3)
    assert await consumer.commit() == {}
    assert consumer.tracker.committable() == {("steps", 0): 4}  # still to commit


class _StopCancelled(_AiokafkaConsumer):
    """aiokafka's consumer ``stop()`` with the broker gone: the CancelledError of its own
    fetch task comes out of it."""

    async def stop(self) -> None:
        raise asyncio.CancelledError


class _StopHangs(_AiokafkaConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.stopping = asyncio.Event()

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.Event().wait()


async def test_a_client_whose_stop_raises_its_own_cancellation_is_abandoned_not_fatal():
    """The bus closes every client whatever one of them does; only a cancellation of the
    caller's own task propagates."""
    consumer = KafkaConsumer(_StopCancelled(), Prompt, None, timeout_s=5)
    await consumer.close()  # returns: the caller was not cancelled
    assert consumer.closed

    client = _StopHangs()
    task = asyncio.create_task(KafkaConsumer(client, Prompt, None, timeout_s=60).close())
    await asyncio.wait_for(client.stopping.wait(), 30)
    task.cancel()  # inside stop(): our own cancellation still ends the task
    with pytest.raises(asyncio.CancelledError):
        await task

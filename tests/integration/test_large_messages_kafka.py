"""Messages above the clients' defaults: ``max_message_bytes`` sizes topics and clients alike.

A ~10 MiB trajectory is larger than aiokafka's 1 MiB producer request and partition fetch
defaults and than the old hard-coded 8 MiB, so it round-trips only if the topic config, the
producer's ``max_request_size`` and the consumer's fetch sizes all follow the setting.
"""

from __future__ import annotations

import pytest

from rlbus.codec import encode
from rlbus.messages import Trajectory, Turn
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus, MessageTooLargeError
from tests.polling import poll_until

pytestmark = pytest.mark.kafka

MiB = 1024 * 1024
LIMIT = 12 * MiB


def _trajectory(encoded_bytes: int) -> Trajectory:
    """A one-turn trajectory whose prompt tokens (int32 on the wire) take ``encoded_bytes``."""
    n = encoded_bytes // 4
    return Trajectory(
        episode_id="big/0",
        group_id="big",
        index=0,
        group_size=1,
        task="guess_number",
        spec={"target": 3},
        turns=[
            Turn(
                input_ids=[i % 50_000 for i in range(n)],
                completion_ids=[5, 2],
                logprobs=[-1.5, -0.125],
                policy_version=0,
            )
        ],
    )


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=30)


@pytest.fixture
async def topics(kafka: KafkaSettings, unique_name) -> Topics:
    settings = TopicSettings(
        prefix=unique_name("t"), partitions=1, result_partitions=1, max_message_bytes=LIMIT
    )
    await ensure_topics(kafka, settings)
    return Topics(settings)


async def test_ten_mib_message_round_trips_and_over_the_limit_is_refused_locally(
    kafka, topics, unique_name
):
    big = _trajectory(10 * MiB)
    size = len(encode(big))
    assert 8 * MiB < size < LIMIT, size

    bus = KafkaBus(
        kafka, dlq_topic=topics.dlq, service="test", max_message_bytes=LIMIT
    )
    try:
        prod = await bus.producer()

        # refused by the producer itself, before any bytes go to the broker
        too_big = _trajectory(LIMIT + MiB)
        sent_raw = []
        real_send_raw = prod.send_raw

        async def spy(*args, **kwargs):
            sent_raw.append(args)
            return await real_send_raw(*args, **kwargs)

        prod.send_raw = spy  # type: ignore[method-assign]
        with pytest.raises(MessageTooLargeError, match=r"encodes to \d+ bytes; topics accept"):
            await prod.send(topics.trajectories, too_big, key=too_big.group_id, partition=0)
        assert sent_raw == []

        await prod.send(topics.trajectories, big, key=big.group_id, partition=0)
        assert len(sent_raw) == 1

        cons = await bus.consumer(
            [topics.trajectories], Trajectory, group_id=unique_name("g")
        )
        (got,) = await poll_until(cons, 1)
        assert got.offset == 0  # the refused one never reached the topic
        assert got.message == big
        assert await cons.end_offsets([(topics.trajectories, 0)]) == {
            (topics.trajectories, 0): 1
        }
    finally:
        await bus.close()

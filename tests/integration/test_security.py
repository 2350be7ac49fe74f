"""Services against a broker that only speaks SASL_SSL with SCRAM-SHA-512
(tests/support/secure_broker.py).

The broker is always started here (never ``$RLBUS_KAFKA_BOOTSTRAP``): an external broker is not
known to be secured, and the tests need to know its users. Every failure case runs under a hard
``asyncio.timeout`` so that a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from rlbus.messages import Prompt, ScoredTrajectory
from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests import factories
from tests.polling import poll_until
from tests.support.secure_broker import SecureCluster

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# A client that waits instead of failing shows up as a call that lasts this long. A refusal
# takes well under a second; the margin is for a loaded machine (5 s was short there).
REQUEST_TIMEOUT_S = 20.0
# Hard bound on any failing call: above the request timeout, far below pytest's.
HANG_BOUND_S = 3 * REQUEST_TIMEOUT_S


@pytest.fixture(scope="module")
def secure() -> Iterator[SecureCluster]:
    cluster = SecureCluster().start(timeout=90)
    try:
        yield cluster
    finally:
        cluster.stop(timeout=10)


def kafka_settings(secure: SecureCluster, **changes: Any) -> KafkaSettings:
    return KafkaSettings(**{**secure.settings(), "request_timeout_s": REQUEST_TIMEOUT_S, **changes})


@pytest.fixture
async def topics(secure: SecureCluster, unique_name: Callable[..., str]) -> TopicSettings:
    settings = TopicSettings(prefix=unique_name("sec"), partitions=1, result_partitions=1)
    assert await ensure_topics(kafka_settings(secure), settings)  # created over SASL_SSL
    return settings


# ------------------------------------------------------------------------------ works when right


async def test_produce_and_consume_through_tls_and_scram(
    secure: SecureCluster, topics: TopicSettings
) -> None:
    names = Topics(topics)
    bus = KafkaBus(kafka_settings(secure), dlq_topic=names.dlq, service="sec-test")
    try:
        producer = await bus.producer()
        sent = factories.prompt()
        await producer.send(names.prompts, sent, key="k")
        consumer = await bus.consumer([names.prompts], Prompt, group_id=f"{names.prompts}.g")
        [delivery] = await poll_until(consumer, 1)
        assert delivery.message == sent
    finally:
        await bus.close()


async def test_reward_service_scores_exactly_once_over_sasl_ssl(
    secure: SecureCluster, topics: TopicSettings
) -> None:
    # Transactions, group join and offset commits all go through the secured listener too.
    names = Topics(topics)
    kafka = kafka_settings(secure)
    bus = KafkaBus(kafka, dlq_topic=None, service="sec-test")
    try:
        producer = await bus.producer()
        sent = factories.trajectory()
        await producer.send(names.trajectories, sent, key=sent.group_id)
        settings = RewardSettings(kafka=kafka, topics=topics, max_messages=1, until_idle_s=30)
        summary = await asyncio.wait_for(Reward(settings).run(), 60)
        assert summary["handled"] == 1
        scored = await bus.consumer([names.scored], ScoredTrajectory, read_committed=True)
        [delivery] = await poll_until(scored, 1)
        assert delivery.message.trajectory == sent
    finally:
        await bus.close()


# ------------------------------------------------------------------------ refused when wrong


async def _ensure(kafka: KafkaSettings, topics: TopicSettings) -> None:
    await ensure_topics(kafka, topics)


async def _produce(kafka: KafkaSettings, topics: TopicSettings) -> None:
    bus = KafkaBus(kafka, dlq_topic=None, service="sec-test")
    try:
        await bus.producer()
    finally:
        await bus.close()


async def _consume(kafka: KafkaSettings, topics: TopicSettings) -> None:
    bus = KafkaBus(kafka, dlq_topic=None, service="sec-test")
    try:
        await bus.consumer([Topics(topics).prompts], Prompt, group_id="sec-test")
    finally:
        await bus.close()


async def _reward(kafka: KafkaSettings, topics: TopicSettings) -> None:
    await Reward(RewardSettings(kafka=kafka, topics=topics)).run()


Attempt = Callable[[KafkaSettings, TopicSettings], Awaitable[None]]


async def refused(attempt: Attempt, kafka: KafkaSettings, topics: TopicSettings) -> Exception:
    """The error ``attempt`` fails with; asserts it came from the broker, not a timeout."""
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        async with asyncio.timeout(HANG_BOUND_S):
            await attempt(kafka, topics)
    elapsed = time.monotonic() - started
    assert not isinstance(caught.value, TimeoutError), f"hung instead: {caught.value!r}"
    assert elapsed < REQUEST_TIMEOUT_S, f"refused only after {elapsed:.1f}s"
    return caught.value


@pytest.mark.parametrize(
    "attempt",
    [_ensure, _produce, _consume, _reward],
    ids=["topics", "producer", "consumer", "reward"],
)
async def test_wrong_password_is_refused_promptly(
    secure: SecureCluster,
    topics: TopicSettings,
    attempt: Attempt,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await refused(attempt, kafka_settings(secure, sasl_password="not-the-password"), topics)
    # aiokafka raises only "Unable to bootstrap from [...]"; the real cause is in its log.
    assert "SaslAuthenticationFailed" in caplog.text
    assert "invalid credentials" in caplog.text


async def test_wrong_password_error_says_authentication_failed(
    secure: SecureCluster, topics: TopicSettings
) -> None:
    error = await refused(_reward, kafka_settings(secure, sasl_password="nope"), topics)
    assert "authentication failed" in str(error).lower()


@pytest.mark.parametrize(
    "changes",
    [
        {"security_protocol": "PLAINTEXT"},
        {"security_protocol": "SSL"},  # TLS but no SASL login
        {"security_protocol": "SASL_PLAINTEXT"},  # SASL login but no TLS
        {"ssl_cafile": None},  # the system CAs do not trust our broker
        {"sasl_mechanism": "SCRAM-SHA-256"},  # a mechanism the broker does not enable
    ],
    ids=["plaintext", "tls-only", "sasl-only", "untrusted-ca", "sha-256"],
)
async def test_other_client_security_is_refused_promptly(
    secure: SecureCluster, topics: TopicSettings, changes: dict[str, Any]
) -> None:
    await refused(_ensure, kafka_settings(secure, **changes), topics)

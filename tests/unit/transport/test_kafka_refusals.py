"""The broker's authorization refusals, as aiokafka raises them, become one AccessDeniedError
line naming the user, the operation and the resource; none is dead-lettered as if the message
were at fault. (tests/integration/test_security.py gets them from a real broker.)"""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from rlbus.errors import AccessDeniedError
from rlbus.settings import KafkaSettings
from rlbus.transport import MemoryBroker, MemoryBus
from rlbus.transport.kafka import KafkaProducer, access_denied
from tests import factories

KAFKA = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                      sasl_username="rollout", sasl_password="pw")


@pytest.mark.parametrize(("error", "operation", "line"), [
    (TopicAuthorizationFailedError("p.weights"), "WRITE",
     "does not allow user 'rollout' WRITE on topic 'p.weights'"),
    (TopicAuthorizationFailedError("p.scored"), "READ",
     "does not allow user 'rollout' READ on topic 'p.scored'"),
    (GroupAuthorizationFailedError("p.learner"), "READ",
     "does not allow user 'rollout' READ on group 'p.learner'"),
    (TransactionalIdAuthorizationFailed("p.reward-0"), "WRITE",
     "does not allow user 'rollout' WRITE on transactional id 'p.reward-0'"),
    (TopicAuthorizationFailedError({"p.weights"}), "READ",  # as aiokafka's fetcher gives it
     "does not allow user 'rollout' READ on topic 'p.weights'"),
])
def test_each_refusal_names_user_operation_and_resource(error: Exception, operation: str,
                                                        line: str) -> None:
    message = str(access_denied(error, KAFKA, operation))
    assert line in message and "\n" not in message and "pw" not in message.split("'")


class _Refusing:
    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        raise TopicAuthorizationFailedError(topic)


async def test_a_refused_send_raises_access_denied() -> None:
    producer = KafkaProducer(_Refusing(), 5.0, KAFKA)
    with pytest.raises(AccessDeniedError, match=r"WRITE on topic 'p\.scored'"):
        await producer.send("p.scored", factories.scored())


async def test_a_refusal_while_handling_stops_instead_of_dead_lettering() -> None:
    broker = MemoryBroker({"in": 1, "dlq": 1})
    bus = MemoryBus(broker, dlq_topic="dlq")
    await (await bus.producer()).send("in", factories.prompt())
    consumer = await bus.consumer(["in"], type(factories.prompt()), group_id="g")
    [delivery] = await consumer.poll(1.0)
    with pytest.raises(AccessDeniedError):
        async with consumer.handling(delivery):
            raise AccessDeniedError("the broker does not allow user 'x' WRITE on topic 'out'")
    assert not any(broker.logs.get("dlq", []))

"""The dead-letter sink: undecodable or unprocessable records, kept for operators.

A dead letter always fits its topic: the reason is cut to ``rlbus.errors.MAX_ERROR_CHARS``
and a payload that would make the letter larger than ``max_message_bytes`` is left out (the
letter says so, and still names topic, partition and offset). Otherwise the record at the
largest size the topic accepts, or a reason quoting a huge string, could not be
dead-lettered, and the record would hold back its partition's commits for good.

Every letter carries its refusal's reason code (:class:`rlbus.errors.RefusalReason`) in the
``reason`` field and the ``rlbus.reason`` header, next to the text in ``error``.
"""

from __future__ import annotations

from rlbus.errors import Refusal, bounded
from rlbus.messages import DeadLetter
from rlbus.transport.interfaces import Bus, DeadLetters, Producer, RawRecord

LETTER_OVERHEAD_BYTES = 1024
"""Room kept for a letter's own fields (names, offsets, msgpack framing)."""


class DeadLetterSink:
    """Publishes undecodable or unprocessable records to the dead-letter topic."""

    def __init__(self, producer: Producer, topic: str, service: str) -> None:
        self.producer = producer
        self.topic = topic
        self.service = service

    @property
    def closed(self) -> bool:
        return self.producer.closed

    async def put(self, raw: RawRecord, refusal: Refusal) -> None:
        error = bounded(refusal.detail)
        payload = raw.value
        room = (self.producer.max_message_bytes - LETTER_OVERHEAD_BYTES
                - len(error.encode()) - len(raw.key or b"") - len(raw.topic))
        if len(payload) > room:
            error += (f" [payload of {len(payload)} bytes left out: the letter must fit "
                      "RLBUS_TOPICS__MAX_MESSAGE_BYTES]")
            payload = b""
        letter = DeadLetter(
            source_topic=raw.topic,
            partition=raw.partition,
            offset=raw.offset,
            error=error,
            service=self.service,
            key=raw.key,
            payload=payload,
            reason=refusal.reason,
        )
        headers = {
            "rlbus.source.topic": raw.topic.encode(),
            "rlbus.source.partition": str(raw.partition).encode(),
            "rlbus.source.offset": str(raw.offset).encode(),
            "rlbus.error": error.encode()[:1000],
            "rlbus.reason": refusal.reason.encode(),
            "rlbus.service": self.service.encode(),
        }
        await self.producer.send(self.topic, letter, key=raw.topic, headers=headers)


async def sink_of(bus: Bus) -> DeadLetters | None:
    """The sink of ``bus``'s dead-letter topic, None if it has none: made on the first call,
    on a producer of its own, and shared by every later one (a consumer each, a dataset's
    bad rows one by one), so that dead letters never open a producer apiece."""
    if bus.dlq_topic is None:
        return None
    async with bus.dead_letters_made:
        if bus.dead_letters is None or bus.dead_letters.closed:  # a bus used after close
            bus.dead_letters = DeadLetterSink(await bus.producer(), bus.dlq_topic, bus.service)
    return bus.dead_letters

"""The dead-letter sink: undecodable or unprocessable records, kept for operators."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbus.messages import DeadLetter

if TYPE_CHECKING:  # only types: interfaces imports this module
    from rlbus.transport.interfaces import Producer, RawRecord


class DeadLetterSink:
    """Publishes undecodable or unprocessable records to the dead-letter topic."""

    def __init__(self, producer: Producer, topic: str, service: str) -> None:
        self.producer = producer
        self.topic = topic
        self.service = service

    async def put(self, raw: RawRecord, error: str) -> None:
        letter = DeadLetter(
            source_topic=raw.topic,
            partition=raw.partition,
            offset=raw.offset,
            error=error,
            service=self.service,
            key=raw.key,
            payload=raw.value,
        )
        headers = {
            "rlbus.source.topic": raw.topic.encode(),
            "rlbus.source.partition": str(raw.partition).encode(),
            "rlbus.source.offset": str(raw.offset).encode(),
            "rlbus.error": error.encode()[:1000],
            "rlbus.service": self.service.encode(),
        }
        await self.producer.send(self.topic, letter, key=raw.topic, headers=headers)

"""The dead-letter sink: undecodable or unprocessable records, kept for operators.

A dead letter always fits its topic: the reason is cut to ``MAX_ERROR_CHARS`` and a payload
that would make the letter larger than ``max_message_bytes`` is left out (the letter says
so, and still names topic, partition and offset). Otherwise the record at the largest size
the topic accepts, or a reason quoting a huge string, could not be dead-lettered, and the
record would hold back its partition's commits for good.

Every letter carries its refusal's reason code (:class:`rlbus.errors.RefusalReason`) in the
``reason`` field and the ``rlbus.reason`` header, next to the text in ``error``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbus.errors import Refusal, reason_of
from rlbus.messages import DeadLetter

if TYPE_CHECKING:  # only types: interfaces imports this module
    from rlbus.transport.interfaces import Producer, RawRecord

MAX_ERROR_CHARS = 2000
"""Longest reason a dead letter carries (a reason may quote hostile input)."""
LETTER_OVERHEAD_BYTES = 1024
"""Room kept for a letter's own fields (names, offsets, msgpack framing)."""


def failure_reason(exc: BaseException) -> str:
    """The reason a dead letter gives for an exception: its type and message."""
    return bounded(f"{type(exc).__name__}: {exc}")


def refusal_for(exc: BaseException) -> Refusal:
    """The refusal of a delivery whose handling raised ``exc``: the reason a
    :class:`rlbus.errors.RefusedError` carries (else ``handling_failed``), and
    :func:`failure_reason`'s text."""
    return Refusal(reason_of(exc), failure_reason(exc))


def bounded(error: str) -> str:
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return f"{error[:MAX_ERROR_CHARS]}... ({len(error) - MAX_ERROR_CHARS} more characters)"


class DeadLetterSink:
    """Publishes undecodable or unprocessable records to the dead-letter topic."""

    def __init__(self, producer: Producer, topic: str, service: str) -> None:
        self.producer = producer
        self.topic = topic
        self.service = service

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

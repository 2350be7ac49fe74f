"""The transport's interfaces: what service code sees (Bus, Producer, Consumer, Delivery).

Delivery contract of this layer:

* Producers are idempotent with ``acks=all``; every send awaits the broker's ack under a
  timeout, because aiokafka's ``send_and_wait``/``stop`` can hang forever while the broker
  is down (aiokafka #1101). A timed-out send raises :class:`BrokerTimeout`.
* Consumers never auto-commit. A service ``ack``s each delivery once its work is durable;
  ``commit`` then commits, per partition, the offset below which everything is acked
  (:mod:`rlbus.transport.offsets`), so a crash redelivers exactly the unfinished messages.
* A record that does not decode or validate, or is over a decode limit (depth, elements,
  string bytes: :class:`rlbus.limits.Limits`), is published to the dead-letter topic
  (:mod:`rlbus.transport.deadletter`), acked, and never reaches the handler.
* A delivery whose handling raises, inside :meth:`Consumer.handling`, is dead-lettered with
  the exception's type and message and acked: the offset moves on and the service goes on.
* Every dead letter carries a :class:`rlbus.errors.Refusal`: its reason code and its text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry.trace import Span
from pydantic import BaseModel

from rlbus import telemetry
from rlbus.codec import decode, encode
from rlbus.errors import (
    BrokerTimeout,
    DecodeError,
    FatalError,
    MessageTooLargeError,
    Refusal,
    failure_reason,
    refusal_for,
)
from rlbus.limits import Limits
from rlbus.settings import TopicSettings
from rlbus.transport.offsets import TP, OffsetTracker

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Headers = dict[str, bytes]
AssignCallback = Callable[["Consumer[Any]", list[TP]], Awaitable[None]]
"""Called with the consumer and its new partitions once a rebalance assigns them (before
any record of theirs is fetched): the place to seek, e.g. to checkpointed offsets."""

DEFAULT_MAX_MESSAGE_BYTES = TopicSettings().max_message_bytes

FRAMING_BYTES = 64 * 1024
"""Room above ``max_message_bytes`` for what Kafka counts with the value against a topic's
``max.message.bytes``: key, headers, record and batch framing. Topics, producer requests and
consumer fetches are all sized ``max_message_bytes + FRAMING_BYTES``."""


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """One decoded record handed to a service."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    message: M
    headers: Headers
    timestamp_ms: int
    service: str = ""
    group: str | None = None

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)

    def start_span(self) -> Span:
        """A ``process <topic>`` span, child of the sender's span (not made current)."""
        return telemetry.start_consumer_span(
            self.service,
            self.topic,
            self.partition,
            self.offset,
            self.key,
            self.headers,
            self.group,
        )

    @contextlib.contextmanager
    def processing(self) -> Iterator[Span]:
        """The ``process <topic>`` span around a handler; sends inside it join its trace."""
        with telemetry.use(self.start_span()) as span:
            yield span


@dataclass
class Outcome:
    """How the handling of one delivery ended (:meth:`Consumer.handling`)."""

    refusal: Refusal | None = None
    """Why it was dead-lettered; None while it was not."""

    @property
    def error(self) -> str | None:
        """The refusal's text; None while it was not dead-lettered."""
        return None if self.refusal is None else self.refusal.detail


@dataclass(frozen=True)
class RawRecord:
    """A record as the broker holds it (before decoding)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Headers
    timestamp_ms: int


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


async def with_timeout(aw: Awaitable[Any], seconds: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError as exc:
        raise BrokerTimeout(f"{what} got no answer from the broker within {seconds:.0f}s") from exc


class DeadLetters(Protocol):
    """Where a consumer sends what it refuses (:class:`rlbus.transport.deadletter.DeadLetterSink`
    on the dead-letter topic; the concrete buses make one)."""

    async def put(self, raw: RawRecord, refusal: Refusal) -> None: ...

    @property
    def closed(self) -> bool:
        """True once its producer is closed (with its bus): a new sink is needed."""
        ...


class Producer(ABC):
    """Publishes typed messages; ``send`` returns once the broker has the record.

    ``send`` opens a ``send <topic>`` span and injects its trace context into the headers.
    """

    service: str = ""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    closed: bool = False
    """Set by ``close``."""

    @abstractmethod
    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> tuple[int, int]:
        """Publish bytes; return (partition, offset)."""

    async def send(
        self,
        topic: str,
        message: BaseModel,
        *,
        key: str | bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> tuple[int, int]:
        key_b = _key_bytes(key)
        hdrs = dict(headers or {})
        value = encode(message)
        extra = len(key_b or b"") + sum(len(k) + len(v) for k, v in hdrs.items())
        # refused here, identically for Kafka and the in-memory twin, with a clear reason
        if len(value) > self.max_message_bytes:
            raise MessageTooLargeError(
                f"{type(message).__name__} for {topic} encodes to {len(value)} bytes; topics "
                f"accept {self.max_message_bytes} (RLBUS_TOPICS__MAX_MESSAGE_BYTES)"
            )
        if extra > FRAMING_BYTES // 2:
            raise MessageTooLargeError(
                f"{type(message).__name__} for {topic}: key and headers take {extra} bytes; "
                f"at most {FRAMING_BYTES // 2} are allowed"
            )
        with telemetry.producer_span(self.service, topic, key_b, partition, hdrs) as span:
            placed = await self.send_raw(topic, value, key=key_b, partition=partition, headers=hdrs)
            span.set_attribute("messaging.destination.partition.id", str(placed[0]))
            return placed

    @abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Sends and ``send_offsets`` inside commit together or not at all."""

    @abstractmethod
    async def send_offsets(self, offsets: dict[TP, int], group_id: str) -> None:
        """Commit consumer offsets as part of the open transaction."""

    @abstractmethod
    async def close(self) -> None: ...


class Consumer(ABC, Generic[M]):
    """Reads one message type from one or more topics, with ack-based commits."""

    def __init__(self, message_type: type[M], dlq: DeadLetters | None) -> None:
        self.message_type = message_type
        self.dlq = dlq
        self.closed = False
        """Set by ``close``."""
        self.group: str | None = None
        self.service = ""
        self.tracker = OffsetTracker()
        self.limits = Limits()
        """What a record may hold to be decoded (set by the bus from the service's settings)."""

    @abstractmethod
    async def _fetch(self, timeout_s: float, max_records: int) -> list[RawRecord]: ...

    @abstractmethod
    async def _commit(self, offsets: dict[TP, int]) -> dict[TP, int]:
        """Commit ``offsets``; returns those the broker took (a partition a rebalance took
        away, or a commit the group refused, is left out)."""

    @abstractmethod
    def assignment(self) -> list[TP]: ...

    @abstractmethod
    async def seek(self, tp: TP, offset: int) -> None: ...

    @abstractmethod
    async def end_offsets(self, tps: list[TP]) -> dict[TP, int]: ...

    @abstractmethod
    async def position(self, tp: TP) -> int:
        """The offset of the next record this consumer will fetch from ``tp``."""

    @abstractmethod
    async def offsets_for_time(self, tps: list[TP], timestamp_ms: int) -> dict[TP, int]:
        """Per partition, the first offset at or after ``timestamp_ms`` (end if none)."""

    @abstractmethod
    async def close(self) -> None: ...

    async def poll_raw(self, timeout_s: float = 1.0, max_records: int = 500) -> list[RawRecord]:
        """Undecoded records (replay re-publishes bytes as they are); not tracked for commit."""
        return await self._fetch(timeout_s, max_records)

    async def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Delivery[M]]:
        """Next decoded records; bad ones go to the dead-letter topic and are acked."""
        out: list[Delivery[M]] = []
        for raw in await self._fetch(timeout_s, max_records):
            self.tracker.delivered(raw.topic, raw.partition, raw.offset)
            delivery = await self._decode(raw)
            if delivery is not None:
                out.append(delivery)
        return out

    async def read_to_end(self, tp: TP, poll_s: float = 0.5) -> list[Delivery[M]]:
        """Every record of ``tp`` from the current position to the end offset as of the call:
        how a compacted topic (weights) is caught up on. Ends on the position, not on the
        last record seen, so compaction gaps, transaction markers and dead-lettered records
        at the tail cannot keep it waiting."""
        (end,) = (await self.end_offsets([tp])).values()
        out: list[Delivery[M]] = []
        while await self.position(tp) < end:
            out.extend(d for d in await self.poll(poll_s) if d.tp == tp)
        return out

    async def _decode(self, raw: RawRecord) -> Delivery[M] | None:
        try:
            message = decode(raw.value, self.message_type, self.limits)
        except DecodeError as exc:
            log.warning("dead letter %s[%d]@%d: %s", raw.topic, raw.partition, raw.offset, exc)
            if self.dlq is not None:
                await self.dlq.put(raw, exc.refusal)
            self.tracker.ack(raw.topic, raw.partition, raw.offset)
            return None
        return Delivery(
            raw.topic,
            raw.partition,
            raw.offset,
            raw.key,
            message,
            raw.headers,
            raw.timestamp_ms,
            self.service,
            self.group,
        )

    def highwater(self, tp: TP) -> int | None:
        """The partition's end offset as of the last fetch (None if not known yet)."""
        return None

    def lag(self) -> dict[TP, int]:
        """Records on the broker that this consumer has not fetched yet, per partition."""
        out = {}
        for tp in self.assignment():
            end = self.highwater(tp)
            if end is not None:
                out[tp] = max(0, end - self.tracker.position(tp, end))
        return out

    async def reject(self, delivery: Delivery[M], refusal: Refusal, *, ack: bool = True
                     ) -> None:
        """A decoded message this service refuses (over a limit, unknown task): to the
        dead-letter topic with ``refusal``, then acked, so the offset moves on and no member
        reads it again. ``ack=False``: the caller acks it once what it does instead is
        durable (the learner, once the group of a stand-in for it is trained)."""
        log.warning("dead letter %s[%d]@%d: %s: %s", delivery.topic, delivery.partition,
                    delivery.offset, refusal.reason, refusal.detail)
        if self.dlq is not None:
            raw = RawRecord(delivery.topic, delivery.partition, delivery.offset, delivery.key,
                            _payload(delivery.message), delivery.headers, delivery.timestamp_ms)
            await self.dlq.put(raw, refusal)
        if ack:
            self.ack(delivery)

    @contextlib.asynccontextmanager
    async def handling(self, delivery: Delivery[M], *,
                       hand_back: Callable[[], bool] = lambda: False,
                       ack: bool = True) -> AsyncIterator[Outcome]:
        """The one boundary around the work on one delivery, in whichever task does it: an
        exception raised inside dead-letters the delivery with the exception's type and
        message and the reason a :class:`rlbus.errors.RefusedError` carries (else
        ``handling_failed``), also left in the yielded :class:`Outcome`, and acks it, so the
        offset moves on and the service goes on. Work that finishes normally acks as it always does.
        While ``hand_back()`` is true (a service draining) the exception propagates instead
        and the delivery stays unacked: the next owner of the partition handles it again.
        Cancellation and a :class:`~rlbus.errors.FatalError` (the broker refuses this
        principal a right it needs) always propagate. If the dead letter cannot be written
        (the broker is gone), that error propagates: the caller stops rather than drop the
        delivery.
        ``ack=False``: dead-lettered, it is left for the caller to ack (:meth:`reject`)."""
        outcome = Outcome()
        try:
            yield outcome
        except Exception as exc:
            if hand_back() or isinstance(exc, FatalError):  # not the message's fault
                raise
            log.error("handling %s[%d]@%d failed", delivery.topic, delivery.partition,
                      delivery.offset, exc_info=exc)
            outcome.refusal = refusal_for(exc)
            await self.reject(delivery, outcome.refusal, ack=ack)

    def ack(self, delivery: Delivery[Any]) -> None:
        self.tracker.ack(delivery.topic, delivery.partition, delivery.offset)

    async def commit(self, offsets: dict[TP, int] | None = None) -> dict[TP, int]:
        """Commit what is acked, or exactly ``offsets`` (a checkpoint's, which Kafka's
        offsets must follow, never lead); returns the offsets committed (empty if nothing
        moved)."""
        offsets = self.tracker.committable() if offsets is None else offsets
        if not offsets:
            return {}
        done = await self._commit(offsets)
        self.tracker.committed(done)
        return done

    async def iterate(self, timeout_s: float = 1.0) -> AsyncIterator[Delivery[M]]:
        while True:
            for d in await self.poll(timeout_s):
                yield d


def _payload(message: BaseModel) -> bytes:
    """A decoded message as a dead letter's payload; one that no longer encodes (a value
    its wire type cannot hold) leaves the payload empty rather than the delivery unacked."""
    try:
        return encode(message)
    except Exception as exc:
        log.warning("dead letter without payload: %s", failure_reason(exc))
        return b""


class Bus(ABC):
    """Factory for producers and consumers on one cluster (or in memory)."""

    def __init__(
        self,
        dlq_topic: str | None,
        service: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.dlq_topic = dlq_topic
        self.service = service
        self.max_message_bytes = max_message_bytes
        self.limits = Limits()
        """Decode limits of every consumer this bus makes (a service sets its own)."""
        self.dead_letters: DeadLetters | None = None
        """The sink of ``dlq_topic``, made once it is first needed: one producer for the
        dead letters of every consumer and caller of this bus
        (:func:`rlbus.transport.deadletter.sink_of`)."""
        self.dead_letters_made = asyncio.Lock()
        """Held while the sink is made, so that concurrent first uses make one."""

    @abstractmethod
    async def producer(self, *, transactional_id: str | None = None) -> Producer: ...

    @abstractmethod
    async def consumer(
        self,
        topics: list[str],
        message_type: type[M],
        *,
        group_id: str | None = None,
        assign: list[TP] | None = None,
        from_end: bool = False,
        read_committed: bool = False,
        on_assign: AssignCallback | None = None,
    ) -> Consumer[M]:
        """A group member (``group_id``) or a static reader of ``assign`` partitions."""

    @abstractmethod
    async def partitions(self, topic: str) -> list[int]:
        """The partition ids of ``topic``; raises LookupError if it does not exist."""

    async def close(self) -> None:
        return None

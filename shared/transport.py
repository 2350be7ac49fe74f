"""Typed publish/consume over Kafka, and an in-memory twin with the same interface.

Delivery contract of this layer:

* Producers are idempotent with ``acks=all``; every send awaits the broker's ack under a
  timeout, because aiokafka's ``send_and_wait``/``stop`` can hang forever while the broker
  is down (aiokafka #1101). A timed-out send raises :class:`BrokerTimeout`.
* Consumers never auto-commit. A service ``ack``s each delivery once its work is durable;
  ``commit`` then commits, per partition, the offset below which everything is acked, so a
  crash redelivers exactly the unfinished messages (at-least-once; ids make dedup possible).
* A record that does not decode or validate is published to the dead-letter topic (source
  topic, partition, offset and error in headers and in the :class:`DeadLetter` body), acked,
  and never reaches the handler: one bad message cannot stop a service.

:class:`KafkaBus` is the real thing; :class:`MemoryBus` keeps partitions, consumer groups,
committed offsets and transactions in memory for fast unit tests. Service code sees only
:class:`Bus`, :class:`Producer` and :class:`Consumer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import weakref
import zlib
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError, KafkaConnectionError
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import TopicPartition
from opentelemetry.trace import Span
from pydantic import BaseModel

from shared import telemetry
from shared.codec import DecodeError, decode, encode
from shared.messages import DeadLetter
from shared.settings import KafkaSettings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
TP = tuple[str, int]
Headers = dict[str, bytes]
AssignCallback = Callable[[list[TP]], Awaitable[None]]


class BrokerTimeout(TimeoutError):
    """A broker call did not finish within ``KafkaSettings.request_timeout_s``."""


class MessageTooLargeError(ValueError):
    """An encoded message is larger than the topics accept (``max_message_bytes``)."""


class BrokerConnectError(ConnectionError):
    """The first connection to the cluster failed; the message says why, if it can tell."""


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


# --------------------------------------------------------------------------- interfaces


class Producer(ABC):
    """Publishes typed messages; ``send`` returns once the broker has the record.

    ``send`` opens a ``send <topic>`` span and injects its trace context into the headers.
    """

    service: str = ""
    max_message_bytes: int = 8 * 1024 * 1024

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
        if len(value) > self.max_message_bytes:
            # refused here, identically for Kafka and the in-memory twin, with a clear reason
            raise MessageTooLargeError(
                f"{type(message).__name__} for {topic} is {len(value)} bytes; topics accept "
                f"{self.max_message_bytes} (RLBUS_TOPICS__MAX_MESSAGE_BYTES)"
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

    def __init__(self, message_type: type[M], dlq: DeadLetterSink | None) -> None:
        self.message_type = message_type
        self.dlq = dlq
        self.group: str | None = None
        self.service = ""
        self.tracker = OffsetTracker()

    @abstractmethod
    async def _fetch(self, timeout_s: float, max_records: int) -> list[RawRecord]: ...

    @abstractmethod
    async def _commit(self, offsets: dict[TP, int]) -> None: ...

    @abstractmethod
    def assignment(self) -> list[TP]: ...

    @abstractmethod
    async def seek(self, tp: TP, offset: int) -> None: ...

    @abstractmethod
    async def end_offsets(self, tps: list[TP]) -> dict[TP, int]: ...

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

    async def _decode(self, raw: RawRecord) -> Delivery[M] | None:
        try:
            message = decode(raw.value, self.message_type)
        except DecodeError as exc:
            log.warning("dead letter %s[%d]@%d: %s", raw.topic, raw.partition, raw.offset, exc)
            if self.dlq is not None:
                await self.dlq.put(raw, str(exc))
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

    def ack(self, delivery: Delivery[Any]) -> None:
        self.tracker.ack(delivery.topic, delivery.partition, delivery.offset)

    async def commit(self) -> dict[TP, int]:
        """Commit what is acked; returns the offsets committed (empty if nothing moved)."""
        offsets = self.tracker.committable()
        if offsets:
            await self._commit(offsets)
            self.tracker.committed(offsets)
        return offsets

    async def iterate(self, timeout_s: float = 1.0) -> AsyncIterator[Delivery[M]]:
        while True:
            for d in await self.poll(timeout_s):
                yield d


_live_consumers: weakref.WeakSet[Consumer[Any]] = weakref.WeakSet()


def _lag_observations() -> Iterator[tuple[int, dict[str, Any]]]:
    for c in list(_live_consumers):
        if c.group is None:
            continue  # static readers (replies, weights) have no backlog to speak of
        for (topic, partition), lag in c.lag().items():
            attrs = {
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "messaging.consumer.group.name": c.group,
                "rlbus.service": c.service,
            }
            yield lag, attrs


telemetry.register_lag_source(_lag_observations)


class Bus(ABC):
    """Factory for producers and consumers on one cluster (or in memory)."""

    def __init__(self, dlq_topic: str | None, service: str) -> None:
        self.dlq_topic = dlq_topic
        self.service = service
        self.max_message_bytes = 8 * 1024 * 1024

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

    async def dead_letter_sink(self) -> DeadLetterSink | None:
        if self.dlq_topic is None:
            return None
        return DeadLetterSink(await self.producer(), self.dlq_topic, self.service)

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------- shared pieces


class OffsetTracker:
    """Per partition, the offset below which every delivered record is acked.

    Records finish out of order (episodes of one prompt batch end at different times); Kafka
    stores one offset per partition, so only a contiguous acked prefix may be committed.
    """

    def __init__(self) -> None:
        self._pending: dict[TP, dict[int, bool]] = defaultdict(dict)
        self._next: dict[TP, int] = {}
        self._committed: dict[TP, int] = {}

    def delivered(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        self._pending[tp][offset] = False
        self._next[tp] = offset + 1
        self._committed.setdefault(tp, offset)  # where the group stood when we began

    def ack(self, topic: str, partition: int, offset: int) -> None:
        pending = self._pending.get((topic, partition))
        if pending is not None and offset in pending:
            pending[offset] = True

    def committable(self) -> dict[TP, int]:
        out: dict[TP, int] = {}
        for tp, pending in self._pending.items():
            while pending:
                first = min(pending)
                if not pending[first]:
                    break
                del pending[first]
            mark = min(pending) if pending else self._next[tp]
            if mark > self._committed[tp]:
                out[tp] = mark
        return out

    def committed(self, offsets: dict[TP, int]) -> None:
        self._committed.update(offsets)

    def forget(self, tps: Iterable[TP]) -> None:
        """Partitions revoked in a rebalance: their unfinished work is someone else's now."""
        for tp in tps:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    def position(self, tp: TP, default: int) -> int:
        """The next offset to be delivered on ``tp``."""
        return self._next.get(tp, default)

    def in_flight(self) -> int:
        return sum(1 for p in self._pending.values() for done in p.values() if not done)


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


# --------------------------------------------------------------------------- Kafka


def client_options(kafka: KafkaSettings) -> dict[str, Any]:
    """aiokafka keyword arguments for connection and security."""
    opts: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": int(kafka.request_timeout_s * 1000),
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        opts["ssl_context"] = create_ssl_context(
            cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
            certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
            keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
        )
    if kafka.security_protocol.startswith("SASL_"):
        assert kafka.sasl_password is not None  # settings validation guarantees it
        opts["sasl_mechanism"] = kafka.sasl_mechanism
        opts["sasl_plain_username"] = kafka.sasl_username
        opts["sasl_plain_password"] = kafka.sasl_password.get_secret_value()
    return opts


async def explain_connect_failure(kafka: KafkaSettings) -> str:
    """Why the first bootstrap broker refuses us.

    aiokafka logs the cause of a failed bootstrap and raises only "Unable to bootstrap"; one
    direct connection surfaces the real error (wrong password, untrusted certificate, wrong
    protocol), which is what a user needs to fix their settings.
    """
    from aiokafka.conn import create_conn
    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    host, _, port = kafka.bootstrap.split(",")[0].strip().rpartition(":")
    opts = {k: v for k, v in client_options(kafka).items() if k != "bootstrap_servers"}
    where = f"Kafka at {kafka.bootstrap}"
    try:
        conn = await asyncio.wait_for(create_conn(host, int(port), **opts), kafka.request_timeout_s)
    except SaslAuthenticationFailed as exc:
        return (
            f"{where}: authentication failed for user {kafka.sasl_username!r} with "
            f"{kafka.sasl_mechanism}; check RLBUS_KAFKA__SASL_USERNAME/SASL_PASSWORD ({exc})"
        )
    except UnsupportedSaslMechanismError as exc:
        return f"{where} does not accept SASL mechanism {kafka.sasl_mechanism} ({exc})"
    except ssl.SSLError as exc:
        return f"TLS to {where} failed: {exc}; check RLBUS_KAFKA__SSL_CAFILE"
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port}; is the broker running?"
    except (OSError, TimeoutError, Exception) as exc:
        return (
            f"{where} closed the connection ({type(exc).__name__}: {exc}); does its listener "
            f"expect security_protocol={kafka.security_protocol}?"
        )
    conn.close()
    return f"{where} accepted a direct connection but not the client's bootstrap"


async def start_client(client: Any, kafka: KafkaSettings, what: str) -> None:
    """Start an aiokafka client; on failure close it and raise a clear BrokerConnectError."""
    try:
        await with_timeout(client.start(), kafka.request_timeout_s, what)
    except (KafkaConnectionError, BrokerTimeout) as exc:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_close(client), 5)
        raise BrokerConnectError(await explain_connect_failure(kafka)) from exc


async def _close(client: Any) -> None:
    stop = getattr(client, "stop", None) or client.close
    await stop()


@contextlib.asynccontextmanager
async def admin_client(kafka: KafkaSettings) -> AsyncIterator[Any]:
    admin = AIOKafkaAdminClient(**client_options(kafka))
    await start_client(admin, kafka, "admin connect")
    try:
        yield admin
    finally:
        await with_timeout(admin.close(), kafka.request_timeout_s, "admin close")


def _headers_in(headers: Headers | None) -> list[tuple[str, bytes]] | None:
    return list(headers.items()) if headers else None


class KafkaProducer(Producer):
    def __init__(self, producer: Any, timeout_s: float) -> None:
        self._p = producer
        self._timeout = timeout_s

    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> tuple[int, int]:
        fut = await with_timeout(
            self._p.send(topic, value, key=key, partition=partition, headers=_headers_in(headers)),
            self._timeout,
            f"send to {topic}",
        )
        meta = await with_timeout(fut, self._timeout, f"ack from {topic}")
        return meta.partition, meta.offset

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        await with_timeout(self._p.begin_transaction(), self._timeout, "begin transaction")
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                await with_timeout(self._p.abort_transaction(), self._timeout, "abort")
            raise
        await with_timeout(self._p.commit_transaction(), self._timeout, "commit transaction")

    async def send_offsets(self, offsets: dict[TP, int], group_id: str) -> None:
        tps = {TopicPartition(t, p): o for (t, p), o in offsets.items()}
        await with_timeout(
            self._p.send_offsets_to_transaction(tps, group_id), self._timeout, "send offsets"
        )

    async def close(self) -> None:
        try:
            await with_timeout(self._p.stop(), self._timeout, "producer stop")
        except BrokerTimeout:
            log.warning("producer did not stop in %.0fs; abandoning it", self._timeout)


class KafkaConsumer(Consumer[M]):
    def __init__(
        self, consumer: Any, message_type: type[M], dlq: DeadLetterSink | None, timeout_s: float
    ) -> None:
        super().__init__(message_type, dlq)
        self._c = consumer
        self._timeout = timeout_s

    async def _fetch(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        batches = await with_timeout(
            self._c.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records),
            timeout_s + self._timeout,
            "fetch",
        )
        return [
            RawRecord(
                r.topic, r.partition, r.offset, r.key, r.value, dict(r.headers or ()), r.timestamp
            )
            for records in batches.values()
            for r in records
        ]

    async def _commit(self, offsets: dict[TP, int]) -> None:
        tps = {TopicPartition(t, p): o for (t, p), o in offsets.items()}
        try:
            await with_timeout(self._c.commit(tps), self._timeout, "commit")
        except CommitFailedError as exc:
            # The group rebalanced under us; the new owner re-reads from the last commit,
            # and ids let it drop what we already finished.
            log.warning("commit lost to a rebalance (%s); work will be redelivered", exc)

    def assignment(self) -> list[TP]:
        return sorted((tp.topic, tp.partition) for tp in self._c.assignment())

    def highwater(self, tp: TP) -> int | None:
        hw: int | None = self._c.highwater(TopicPartition(*tp))
        return hw

    async def seek(self, tp: TP, offset: int) -> None:
        self._c.seek(TopicPartition(*tp), offset)

    async def end_offsets(self, tps: list[TP]) -> dict[TP, int]:
        got = await with_timeout(
            self._c.end_offsets([TopicPartition(*tp) for tp in tps]), self._timeout, "offsets"
        )
        return {(tp.topic, tp.partition): off for tp, off in got.items()}

    async def offsets_for_time(self, tps: list[TP], timestamp_ms: int) -> dict[TP, int]:
        query = {TopicPartition(*tp): timestamp_ms for tp in tps}
        found = await with_timeout(self._c.offsets_for_times(query), self._timeout, "offsets")
        ends = await self.end_offsets(tps)
        return {
            (tp.topic, tp.partition): (
                hit.offset if hit is not None else ends[(tp.topic, tp.partition)]
            )
            for tp, hit in found.items()
        }

    async def close(self) -> None:
        try:
            await with_timeout(self._c.stop(), self._timeout, "consumer stop")
        except BrokerTimeout:
            log.warning("consumer did not stop in %.0fs; abandoning it", self._timeout)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits acked work before a rebalance takes partitions away (aiokafka's advice)."""

    def __init__(self, on_assign: AssignCallback | None) -> None:
        self.consumer: KafkaConsumer[Any] | None = None
        self.on_assign = on_assign

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if self.consumer is None:
            return
        with contextlib.suppress(Exception):
            await self.consumer.commit()
        self.consumer.tracker.forget((tp.topic, tp.partition) for tp in revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if self.on_assign is not None:
            await self.on_assign(sorted((tp.topic, tp.partition) for tp in assigned))


class KafkaBus(Bus):
    def __init__(self, kafka: KafkaSettings, *, dlq_topic: str | None, service: str) -> None:
        super().__init__(dlq_topic, service)
        self.kafka = kafka
        self._clients: list[Producer | Consumer[Any]] = []

    async def producer(self, *, transactional_id: str | None = None) -> Producer:
        p = AIOKafkaProducer(
            **client_options(self.kafka),
            enable_idempotence=True,  # implies acks=all
            transactional_id=transactional_id,
            max_request_size=8 * 1024 * 1024,
            # 0: aiokafka still batches what queues while a request is in flight; 1 ms of
            # linger added ~1.7 ms to every step round trip (loadtest overhead scenario)
            linger_ms=0,
        )
        await start_client(p, self.kafka, "producer connect")
        prod = KafkaProducer(p, self.kafka.request_timeout_s)
        prod.service, prod.max_message_bytes = self.service, self.max_message_bytes
        self._clients.append(prod)
        return prod

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
        c = AIOKafkaConsumer(
            **client_options(self.kafka),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="latest" if from_end else "earliest",
            isolation_level="read_committed" if read_committed else "read_uncommitted",
            max_partition_fetch_bytes=8 * 1024 * 1024,
        )
        listener = _Listener(on_assign)
        if assign is not None:
            c.assign([TopicPartition(t, p) for t, p in assign])
        else:
            c.subscribe(topics, listener=listener)
        await start_client(c, self.kafka, "consumer connect")
        consumer = KafkaConsumer(
            c, message_type, await self.dead_letter_sink(), self.kafka.request_timeout_s
        )
        listener.consumer = consumer
        consumer.service, consumer.group = self.service, group_id
        _live_consumers.add(consumer)
        self._clients.append(consumer)
        if assign is not None and on_assign is not None:
            await on_assign(sorted(assign))
        return consumer

    async def partitions(self, topic: str) -> list[int]:
        async with admin_client(self.kafka) as admin:
            described = await with_timeout(
                admin.describe_topics([topic]), self.kafka.request_timeout_s, "describe"
            )
        if not described or described[0].get("error_code", 0) != 0:
            raise LookupError(f"no topic {topic!r} on {self.kafka.bootstrap}")
        return sorted(p["partition"] for p in described[0]["partitions"])

    async def close(self) -> None:
        for client in reversed(self._clients):
            await client.close()
        self._clients.clear()


# --------------------------------------------------------------------------- in memory


@dataclass
class _Group:
    members: list[MemoryConsumer[Any]] = field(default_factory=list)
    committed: dict[TP, int] = field(default_factory=dict)


class MemoryBroker:
    """Partitions, groups and committed offsets in one process. Shared by MemoryBus objects."""

    def __init__(self, partitions: dict[str, int] | None = None, default_partitions: int = 4):
        self.logs: dict[str, list[list[RawRecord]]] = {}
        self.groups: dict[str, _Group] = defaultdict(_Group)
        self.default_partitions = default_partitions
        self.changed = asyncio.Condition()
        for topic, n in (partitions or {}).items():
            self.create_topic(topic, n)

    def create_topic(self, topic: str, partitions: int) -> None:
        self.logs.setdefault(topic, [[] for _ in range(partitions)])

    def partitions(self, topic: str) -> list[list[RawRecord]]:
        if topic not in self.logs:
            self.create_topic(topic, self.default_partitions)
        return self.logs[topic]

    async def append(
        self, records: list[tuple[str, bytes, bytes | None, int | None, Headers]]
    ) -> list[tuple[int, int]]:
        placed: list[tuple[int, int]] = []
        for topic, value, key, partition, headers in records:
            parts = self.partitions(topic)
            p = partition if partition is not None else _partition_for(key, len(parts))
            log_ = parts[p]
            now_ms = int(time.time() * 1000)
            log_.append(RawRecord(topic, p, len(log_), key, value, headers, now_ms))
            placed.append((p, len(log_) - 1))
        async with self.changed:
            self.changed.notify_all()
        return placed

    def rebalance(self, group_id: str) -> None:
        group = self.groups[group_id]
        for member in group.members:
            member.reassign([])
        if not group.members:
            return
        topics = sorted({t for m in group.members for t in m.topics})
        tps = [(t, p) for t in topics for p in range(len(self.partitions(t)))]
        shares: dict[int, list[TP]] = defaultdict(list)
        for i, tp in enumerate(tps):
            shares[i % len(group.members)].append(tp)
        for i, member in enumerate(group.members):
            member.reassign(shares[i])


_rr = 0


def _partition_for(key: bytes | None, n: int) -> int:
    global _rr
    if key is None:
        _rr += 1
        return _rr % n
    return zlib.crc32(key) % n


class MemoryProducer(Producer):
    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self._txn: list[tuple[str, bytes, bytes | None, int | None, Headers]] | None = None
        self._txn_offsets: list[tuple[dict[TP, int], str]] = []

    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> tuple[int, int]:
        rec = (topic, value, key, partition, dict(headers or {}))
        if self._txn is not None:
            self._txn.append(rec)
            return (-1, -1)  # position is only known at commit, as with Kafka
        (placed,) = await self.broker.append([rec])
        return placed

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._txn, self._txn_offsets = [], []
        try:
            yield
            pending, offsets = self._txn, self._txn_offsets
        finally:
            self._txn = None
        await self.broker.append(pending)
        for offs, group_id in offsets:
            self.broker.groups[group_id].committed.update(offs)

    async def send_offsets(self, offsets: dict[TP, int], group_id: str) -> None:
        if self._txn is None:
            raise RuntimeError("send_offsets outside a transaction")
        self._txn_offsets.append((dict(offsets), group_id))

    async def close(self) -> None:
        return None


class MemoryConsumer(Consumer[M]):
    def __init__(
        self,
        broker: MemoryBroker,
        topics: list[str],
        message_type: type[M],
        dlq: DeadLetterSink | None,
        group_id: str | None,
        from_end: bool,
        on_assign: AssignCallback | None,
    ) -> None:
        super().__init__(message_type, dlq)
        self.broker = broker
        self.topics = topics
        self.group_id = group_id
        self.from_end = from_end
        self.on_assign = on_assign
        self._assigned: list[TP] = []
        self._positions: dict[TP, int] = {}
        self._announce = False

    def reassign(self, tps: list[TP]) -> None:
        revoked = [tp for tp in self._assigned if tp not in tps]
        self.tracker.forget(revoked)
        self._assigned = list(tps)
        committed = self.broker.groups[self.group_id].committed if self.group_id else {}
        self._positions = {tp: self._start(tp, committed) for tp in tps}
        self._announce = True

    def _start(self, tp: TP, committed: dict[TP, int]) -> int:
        if tp in committed:
            return committed[tp]
        return len(self.broker.partitions(tp[0])[tp[1]]) if self.from_end else 0

    async def _fetch(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        if self._announce and self.on_assign is not None:
            self._announce = False
            await self.on_assign(list(self._assigned))
        deadline = time.monotonic() + timeout_s
        async with self.broker.changed:
            while True:
                out = self._take(max_records)
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.broker.changed.wait(), left)

    def _take(self, max_records: int) -> list[RawRecord]:
        out: list[RawRecord] = []
        for tp in self._assigned:
            log_ = self.broker.partitions(tp[0])[tp[1]]
            pos = self._positions[tp]
            chunk = log_[pos : pos + max_records - len(out)]
            self._positions[tp] = pos + len(chunk)
            out.extend(chunk)
        return out

    async def _commit(self, offsets: dict[TP, int]) -> None:
        if self.group_id is None:
            raise RuntimeError("commit needs a group_id")
        self.broker.groups[self.group_id].committed.update(offsets)

    def assignment(self) -> list[TP]:
        return list(self._assigned)

    def highwater(self, tp: TP) -> int | None:
        return len(self.broker.partitions(tp[0])[tp[1]])

    async def seek(self, tp: TP, offset: int) -> None:
        self._positions[tp] = offset

    async def end_offsets(self, tps: list[TP]) -> dict[TP, int]:
        return {tp: len(self.broker.partitions(tp[0])[tp[1]]) for tp in tps}

    async def offsets_for_time(self, tps: list[TP], timestamp_ms: int) -> dict[TP, int]:
        out = {}
        for tp in tps:
            log_ = self.broker.partitions(tp[0])[tp[1]]
            out[tp] = next((r.offset for r in log_ if r.timestamp_ms >= timestamp_ms), len(log_))
        return out

    async def close(self) -> None:
        if self.group_id is not None:
            group = self.broker.groups[self.group_id]
            if self in group.members:
                group.members.remove(self)
                self.broker.rebalance(self.group_id)


class MemoryBus(Bus):
    """The in-memory twin of :class:`KafkaBus`; several services may share one broker."""

    def __init__(
        self, broker: MemoryBroker | None = None, *, dlq_topic: str | None = None, service: str = ""
    ) -> None:
        super().__init__(dlq_topic, service)
        self.broker = broker or MemoryBroker()
        self._consumers: list[MemoryConsumer[Any]] = []

    async def producer(self, *, transactional_id: str | None = None) -> Producer:
        prod = MemoryProducer(self.broker)
        prod.service, prod.max_message_bytes = self.service, self.max_message_bytes
        return prod

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
        c = MemoryConsumer(
            self.broker,
            topics,
            message_type,
            await self.dead_letter_sink(),
            group_id,
            from_end,
            on_assign,
        )
        c.service, c.group = self.service, group_id
        _live_consumers.add(c)
        if assign is not None:
            c.reassign(assign)
        elif group_id is not None:
            self.broker.groups[group_id].members.append(c)
            self.broker.rebalance(group_id)
        else:
            c.reassign([(t, p) for t in topics for p in range(len(self.broker.partitions(t)))])
        self._consumers.append(c)
        return c

    async def partitions(self, topic: str) -> list[int]:
        if topic not in self.broker.logs:
            raise LookupError(f"no topic {topic!r}")
        return list(range(len(self.broker.logs[topic])))

    async def close(self) -> None:
        for c in self._consumers:
            await c.close()
        self._consumers.clear()

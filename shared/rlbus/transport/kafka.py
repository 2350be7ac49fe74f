"""The real transport: aiokafka producers, consumers and admin clients.

Size limits come from ``TopicSettings.max_message_bytes``: the producer's request size and
the consumer's fetch sizes follow it (plus ``FRAMING_BYTES``, as the topics do), so a topic
that accepts larger messages can also be written and read by our clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    CommitFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import TopicPartition

from rlbus.errors import AccessDeniedError, BrokerConnectError, BrokerTimeout
from rlbus.settings import KafkaSettings
from rlbus.transport.deadletter import sink_of
from rlbus.transport.diagnostics import explain_connect_failure
from rlbus.transport.interfaces import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FRAMING_BYTES,
    AssignCallback,
    Bus,
    Consumer,
    DeadLetters,
    Headers,
    M,
    Producer,
    RawRecord,
    with_timeout,
)
from rlbus.transport.lag import track
from rlbus.transport.offsets import TP

log = logging.getLogger(__name__)

_DEFAULT_FETCH_MAX_BYTES = 50 * 1024 * 1024  # aiokafka's default


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
        opts["sasl_mechanism"] = kafka.sasl_mechanism
        opts["sasl_plain_username"] = kafka.sasl_username
        opts["sasl_plain_password"] = kafka.password()
    return opts


_REFUSALS: dict[type[Exception], tuple[str | None, str]] = {
    # aiokafka's error → (operation, or None: the caller's on topics; resource kind)
    TopicAuthorizationFailedError: (None, "topic"),
    GroupAuthorizationFailedError: ("READ", "group"),
    TransactionalIdAuthorizationFailed: ("WRITE", "transactional id"),
    ClusterAuthorizationFailedError: (None, "the cluster"),
}
_AUTHORIZATION_ERRORS = tuple(_REFUSALS)


def access_denied(exc: Exception, kafka: KafkaSettings | None,
                  operation: str) -> AccessDeniedError:
    """The broker's refusal ``exc`` (an aiokafka authorization error) in one line that
    names the principal, the operation (``operation`` on a topic) and the resource."""
    op, kind = _REFUSALS.get(type(exc), (None, "resource"))
    named = exc.args[0] if exc.args else None  # aiokafka gives a name, or a set of them
    names = [named] if isinstance(named, str) else sorted(map(str, named or ()))
    name = "".join(f" {n!r}" for n in names[:3])
    user = f"user {kafka.sasl_username!r}" if kafka and kafka.sasl_username else "this client"
    return AccessDeniedError(
        f"the broker does not allow {user} {op or operation} on {kind}{name}; "
        "is the role right, and its ACLs applied (`rlbus acl apply`, docs/security.md)?")


@contextlib.contextmanager
def refusals(kafka: KafkaSettings | None, operation: str) -> Iterator[None]:
    """Turn the broker's authorization refusals inside into :class:`AccessDeniedError`
    (``operation``: what a topic refusal refused, e.g. WRITE for a send)."""
    try:
        yield
    except _AUTHORIZATION_ERRORS as exc:
        raise access_denied(exc, kafka, operation) from exc


async def start_client(client: Any, kafka: KafkaSettings, what: str,
                       operation: str = "DESCRIBE") -> None:
    """Start an aiokafka client; on failure close it and raise a clear BrokerConnectError,
    or an :class:`AccessDeniedError` if the broker refuses what starting it does (join a
    group, take a transactional id: ``operation`` on a topic)."""
    try:
        with refusals(kafka, operation):
            await with_timeout(client.start(), kafka.request_timeout_s, what)
    except (KafkaConnectionError, BrokerTimeout) as exc:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_close(client), 5)
        reason = await explain_connect_failure(kafka, client_options(kafka))
        raise BrokerConnectError(reason) from exc
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_close(client), 5)
        raise


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
    def __init__(self, producer: Any, timeout_s: float,
                 kafka: KafkaSettings | None = None) -> None:
        self._p = producer
        self._timeout = timeout_s
        self._kafka = kafka  # whose refusals are reported (None: "this client")

    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> tuple[int, int]:
        with refusals(self._kafka, "WRITE"):
            fut = await with_timeout(
                self._p.send(topic, value, key=key, partition=partition,
                             headers=_headers_in(headers)),
                self._timeout,
                f"send to {topic}",
            )
            meta = await with_timeout(fut, self._timeout, f"ack from {topic}")
        return meta.partition, meta.offset

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        with refusals(self._kafka, "WRITE"):
            await with_timeout(self._p.begin_transaction(), self._timeout, "begin transaction")
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                await with_timeout(self._p.abort_transaction(), self._timeout, "abort")
            raise
        with refusals(self._kafka, "WRITE"):
            await with_timeout(self._p.commit_transaction(), self._timeout,
                               "commit transaction")

    async def send_offsets(self, offsets: dict[TP, int], group_id: str) -> None:
        tps = {TopicPartition(t, p): o for (t, p), o in offsets.items()}
        with refusals(self._kafka, "READ"):
            await with_timeout(self._p.send_offsets_to_transaction(tps, group_id),
                               self._timeout, "send offsets")

    async def close(self) -> None:
        self.closed = True
        await _stop_client(self._p.stop(), self._timeout, "producer")


async def _stop_client(stop: Awaitable[None], timeout_s: float, what: str) -> None:
    """Stop an aiokafka client without letting its failure stop the caller's shutdown.

    With the broker gone, aiokafka's consumer ``stop()`` can raise the ``CancelledError`` of
    its own fetch task: our task was not cancelled, so that would end the service's close
    half-way (other clients left open, no summary line). Only a cancellation of our own
    task propagates.
    """
    try:
        await with_timeout(stop, timeout_s, f"{what} stop")
    except BrokerTimeout:
        log.warning("%s did not stop in %.0fs; abandoning it", what, timeout_s)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("%s stop was cancelled inside the Kafka client; abandoning it", what)
    except Exception as exc:  # a client that fails to stop is abandoned, the rest still close
        log.warning("%s stop failed: %r; abandoning it", what, exc)


class KafkaConsumer(Consumer[M]):
    def __init__(
        self, consumer: Any, message_type: type[M], dlq: DeadLetters | None, timeout_s: float,
        kafka: KafkaSettings | None = None,
    ) -> None:
        super().__init__(message_type, dlq)
        self._c = consumer
        self._timeout = timeout_s
        self._kafka = kafka  # whose refusals are reported (None: "this client")

    async def _fetch(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        with refusals(self._kafka, "READ"):
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

    async def _commit(self, offsets: dict[TP, int]) -> dict[TP, int]:
        tps = {TopicPartition(t, p): o for (t, p), o in offsets.items()}
        # Work of a partition a rebalance has taken away since it was fetched is the new
        # owner's: it re-reads from the last commit, and ids let it drop what we finished.
        # aiokafka refuses to commit it (IllegalStateError), which crashed a scaled compose
        # member when another joined mid-batch; so it is left out, and forgotten like a
        # revoked partition.
        owned = self._c.assignment()
        lost = [tp for tp in tps if tp not in owned]
        if lost:
            log.info("not committing %s: a rebalance gave it to another member",
                     ", ".join(f"{tp.topic}[{tp.partition}]" for tp in lost))
            self.tracker.forget((tp.topic, tp.partition) for tp in lost)
            tps = {tp: o for tp, o in tps.items() if tp in owned}
        if not tps:
            return {}
        try:
            with refusals(self._kafka, "READ"):
                await with_timeout(self._c.commit(tps), self._timeout, "commit")
        except CommitFailedError as exc:
            # The group rebalanced under us; the new owner re-reads from the last commit,
            # and ids let it drop what we already finished.
            log.warning("commit lost to a rebalance (%s); work will be redelivered", exc)
            return {}
        return {(tp.topic, tp.partition): o for tp, o in tps.items()}

    def assignment(self) -> list[TP]:
        return sorted((tp.topic, tp.partition) for tp in self._c.assignment())

    def highwater(self, tp: TP) -> int | None:
        hw: int | None = self._c.highwater(TopicPartition(*tp))
        return hw

    async def seek(self, tp: TP, offset: int) -> None:
        self._c.seek(TopicPartition(*tp), offset)

    async def position(self, tp: TP) -> int:
        pos: int = await with_timeout(self._c.position(TopicPartition(*tp)), self._timeout,
                                      "position")
        return pos

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
        self.closed = True
        await _stop_client(self._c.stop(), self._timeout, "consumer")


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
        if self.on_assign is not None and self.consumer is not None:
            await self.on_assign(self.consumer, sorted((tp.topic, tp.partition)
                                                       for tp in assigned))


class KafkaBus(Bus):
    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        dlq_topic: str | None,
        service: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(dlq_topic, service, max_message_bytes)
        self.kafka = kafka
        self._clients: list[Producer | Consumer[Any]] = []

    async def producer(self, *, transactional_id: str | None = None) -> Producer:
        p = AIOKafkaProducer(
            **client_options(self.kafka),
            enable_idempotence=True,  # implies acks=all
            transactional_id=transactional_id,
            max_request_size=self.max_message_bytes + FRAMING_BYTES,
            # 0: aiokafka still batches what queues while a request is in flight; 1 ms of
            # linger added ~1.7 ms to every step round trip (loadtest overhead scenario)
            linger_ms=0,
        )
        await start_client(p, self.kafka, "producer connect", "WRITE")
        prod = KafkaProducer(p, self.kafka.request_timeout_s, self.kafka)
        prod.service, prod.max_message_bytes = self.service, self.max_message_bytes
        self._keep(prod)
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
            max_partition_fetch_bytes=self.max_message_bytes + FRAMING_BYTES,
            fetch_max_bytes=max(_DEFAULT_FETCH_MAX_BYTES, self.max_message_bytes + FRAMING_BYTES),
        )
        # made before the client starts: the group may assign partitions while it starts
        consumer = KafkaConsumer(c, message_type, await sink_of(self),
                                 self.kafka.request_timeout_s, self.kafka)
        consumer.service, consumer.group = self.service, group_id
        consumer.limits = self.limits
        listener = _Listener(on_assign)
        listener.consumer = consumer
        if assign is not None:
            c.assign([TopicPartition(t, p) for t, p in assign])
        else:
            c.subscribe(topics, listener=listener)
        await start_client(c, self.kafka, "consumer connect", "READ")
        track(consumer)
        self._keep(consumer)
        if assign is not None and on_assign is not None:
            await on_assign(consumer, sorted(assign))
        return consumer

    async def partitions(self, topic: str) -> list[int]:
        async with admin_client(self.kafka) as admin:
            described = await with_timeout(
                admin.describe_topics([topic]), self.kafka.request_timeout_s, "describe"
            )
        if not described or described[0].get("error_code", 0) != 0:
            raise LookupError(f"no topic {topic!r} on {self.kafka.bootstrap}")
        return sorted(p["partition"] for p in described[0]["partitions"])

    def _keep(self, client: Producer | Consumer[Any]) -> None:
        """Remembered to close with the bus; those closed already are let go (a long-lived
        ``rlbus status`` opens and closes readers every sample)."""
        self._clients = [c for c in self._clients if not c.closed]
        self._clients.append(client)

    async def close(self) -> None:
        for client in reversed(self._clients):
            if not client.closed:
                await client.close()
        self._clients.clear()

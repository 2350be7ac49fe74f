"""The in-memory twin of the Kafka transport, for fast unit tests.

Partitions, consumer groups, committed offsets and transactions live in one process; only
the client is replaced, so services, codec and dead-letter paths run their production code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rlbus.transport.deadletter import sink_of
from rlbus.transport.interfaces import (
    DEFAULT_MAX_MESSAGE_BYTES,
    AssignCallback,
    Bus,
    Consumer,
    DeadLetters,
    Headers,
    M,
    Producer,
    RawRecord,
)
from rlbus.transport.lag import track
from rlbus.transport.offsets import TP


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
        self.closed = True


class MemoryConsumer(Consumer[M]):
    def __init__(
        self,
        broker: MemoryBroker,
        topics: list[str],
        message_type: type[M],
        dlq: DeadLetters | None,
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
            await self.on_assign(self, list(self._assigned))
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

    async def _commit(self, offsets: dict[TP, int]) -> dict[TP, int]:
        if self.group_id is None:
            raise RuntimeError("commit needs a group_id")
        self.broker.groups[self.group_id].committed.update(offsets)
        return offsets

    def assignment(self) -> list[TP]:
        return list(self._assigned)

    def highwater(self, tp: TP) -> int | None:
        return len(self.broker.partitions(tp[0])[tp[1]])

    async def seek(self, tp: TP, offset: int) -> None:
        self._positions[tp] = offset

    async def position(self, tp: TP) -> int:
        return self._positions[tp]

    async def end_offsets(self, tps: list[TP]) -> dict[TP, int]:
        return {tp: len(self.broker.partitions(tp[0])[tp[1]]) for tp in tps}

    async def offsets_for_time(self, tps: list[TP], timestamp_ms: int) -> dict[TP, int]:
        out = {}
        for tp in tps:
            log_ = self.broker.partitions(tp[0])[tp[1]]
            out[tp] = next((r.offset for r in log_ if r.timestamp_ms >= timestamp_ms), len(log_))
        return out

    async def close(self) -> None:
        self.closed = True
        if self.group_id is not None:
            group = self.broker.groups[self.group_id]
            if self in group.members:
                group.members.remove(self)
                self.broker.rebalance(self.group_id)


class MemoryBus(Bus):
    """The in-memory twin of :class:`KafkaBus`; several services may share one broker."""

    def __init__(
        self,
        broker: MemoryBroker | None = None,
        *,
        dlq_topic: str | None = None,
        service: str = "",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(dlq_topic, service, max_message_bytes)
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
            await sink_of(self),
            group_id,
            from_end,
            on_assign,
        )
        c.service, c.group, c.limits = self.service, group_id, self.limits
        track(c)
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

"""Ack-based offset tracking: which offset of each partition may be committed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

TP = tuple[str, int]


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

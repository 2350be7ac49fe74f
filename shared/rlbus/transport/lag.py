"""Consumer lag as a metric: every live consumer reports its backlog per partition."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from rlbus import telemetry
from rlbus.transport.interfaces import Consumer

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


def track(consumer: Consumer[Any]) -> None:
    """Report ``consumer``'s lag for as long as it lives."""
    _live_consumers.add(consumer)

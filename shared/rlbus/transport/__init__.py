"""Typed publish/consume over Kafka, and an in-memory twin with the same interface.

One concern a file: :mod:`.interfaces` (what services see), :mod:`.offsets` (ack-based
commits), :mod:`.deadletter`, :mod:`.kafka` (aiokafka clients), :mod:`.diagnostics` (why a
connection failed), :mod:`.memory` (the twin for unit tests), :mod:`.lag` (the lag metric).
Service code imports from here and sees only :class:`Bus`, :class:`Producer` and
:class:`Consumer`.
"""

from rlbus.errors import (
    BrokerConnectError,
    BrokerTimeout,
    MessageTooLargeError,
    failure_reason,
    refusal_for,
)
from rlbus.transport.deadletter import DeadLetterSink
from rlbus.transport.interfaces import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FRAMING_BYTES,
    AssignCallback,
    Bus,
    Consumer,
    Delivery,
    Headers,
    Outcome,
    Producer,
    RawRecord,
    with_timeout,
)
from rlbus.transport.kafka import KafkaBus, admin_client, client_options
from rlbus.transport.memory import MemoryBroker, MemoryBus
from rlbus.transport.offsets import TP, OffsetTracker

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FRAMING_BYTES",
    "TP",
    "AssignCallback",
    "BrokerConnectError",
    "BrokerTimeout",
    "Bus",
    "Consumer",
    "DeadLetterSink",
    "Delivery",
    "Headers",
    "KafkaBus",
    "MemoryBroker",
    "MemoryBus",
    "MessageTooLargeError",
    "OffsetTracker",
    "Outcome",
    "Producer",
    "RawRecord",
    "admin_client",
    "client_options",
    "failure_reason",
    "refusal_for",
    "with_timeout",
]

"""A local Apache Kafka broker for tests, the demo and ``rlbus broker`` (no Docker needed)."""

from rlbus.ops.broker.cluster import (
    LocalCluster,
    bootstrap_or_start,
    describe_broker_ids,
    free_port_pairs,
)
from rlbus.ops.broker.command import main
from rlbus.ops.broker.jars import (
    BOOTSTRAP_ENV,
    KAFKA_VERSION,
    LOOPBACK,
    BrokerError,
    jar_cache_dir,
    resolve_jars,
)

__all__ = [
    "BOOTSTRAP_ENV",
    "KAFKA_VERSION",
    "LOOPBACK",
    "BrokerError",
    "LocalCluster",
    "bootstrap_or_start",
    "describe_broker_ids",
    "free_port_pairs",
    "jar_cache_dir",
    "main",
    "resolve_jars",
]

"""Shared pytest fixtures.

Kafka is started lazily: only a test that asks for ``kafka_bootstrap`` or ``kafka_cluster3``
starts a JVM, so the unit tier (tests/unit) never needs Java. Set ``RLBUS_KAFKA_BOOTSTRAP`` to
run the Kafka tests against an existing broker (e.g. ``docker compose up``) instead.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator

import pytest

from rlbus.ops.broker import LocalCluster, bootstrap_or_start


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap address of one Kafka broker shared by the whole session."""
    bootstrap, cluster = bootstrap_or_start()
    try:
        yield bootstrap
    finally:
        if cluster is not None:
            cluster.stop()


@pytest.fixture(scope="module")
def _kafka_cluster3_module() -> Iterator[LocalCluster]:
    # Module scope: fault tests mutate the cluster, so each module gets a fresh one.
    cluster = LocalCluster(nodes=3).start(timeout=90)
    try:
        yield cluster
    finally:
        cluster.stop(timeout=10)


@pytest.fixture
def kafka_cluster3(_kafka_cluster3_module: LocalCluster) -> LocalCluster:
    """A 3-node cluster (replication 3, min ISR 2) for fault tests; all nodes up at test start."""
    _kafka_cluster3_module.ensure_running()
    return _kafka_cluster3_module


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[..., str]:
    """Factory of topic/group names unique per call, e.g. ``t-test_produce-1a2b3c4d``."""
    # Kafka names allow only [a-zA-Z0-9._-] (max 249); parametrised ids contain [ ] and more.
    test = re.sub(r"[^a-zA-Z0-9._-]+", "_", request.node.name)[:80]

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{test}-{uuid.uuid4().hex[:8]}"

    return make

"""The native Kafka broker (services/rlbus/ops/broker/) against real JVMs, through aiokafka."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlbus.ops.broker import LocalCluster, describe_broker_ids, free_port_pairs, main
from rlbus.ops.broker.cluster import _new_cluster_id

pytestmark = pytest.mark.kafka


async def create_topic(
    bootstrap: str, name: str, partitions: int = 1, replication: int = 1
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(name, partitions, replication)])
    finally:
        await admin.close()
    # aiokafka returns per-topic error codes instead of raising.
    errors = [(topic, code) for topic, code, *_ in response.topic_errors if code != 0]
    assert not errors, f"create_topics failed: {errors}"


async def partition_state(bootstrap: str, topic: str) -> dict[int, tuple[int, list[int]]]:
    """partition -> (leader id, ISR ids)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return {p["partition"]: (p["leader"], sorted(p["isr"])) for p in described["partitions"]}


async def consume_all(
    bootstrap: str, topic: str, expected: int, wait_s: float = 30.0
) -> list[bytes]:
    # No group: reading from the beginning needs no __consumer_offsets, which keeps the test
    # independent of where the group coordinator lives.
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    values: list[bytes] = []
    try:
        async with asyncio.timeout(wait_s):
            while len(values) < expected:
                batches = await consumer.getmany(timeout_ms=1000)
                values += [m.value for msgs in batches.values() for m in msgs if m.value]
    finally:
        await consumer.stop()
    return values


async def test_broker_serves_produce_and_consume(
    kafka_bootstrap: str, unique_name: Callable[..., str]
) -> None:
    topic = unique_name()
    await create_topic(kafka_bootstrap, topic)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"hello", key=b"k")
    finally:
        await producer.stop()
    assert await consume_all(kafka_bootstrap, topic, expected=1) == [b"hello"]


def test_status_when_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLBUS_HOME", str(tmp_path))
    assert main(["status"]) == 1
    assert "not running" in capsys.readouterr().out
    assert main(["stop"]) == 0  # stopping nothing is fine


def test_cli_start_status_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLBUS_HOME", str(tmp_path))
    port = free_port_pairs(1)[0][0]
    address = f"127.0.0.1:{port}"
    try:
        assert main(["start", "--port", str(port)]) == 0
        assert capsys.readouterr().out.strip() == address
        assert (tmp_path / "broker" / "state.json").is_file()
        assert describe_broker_ids(address) == {1}

        assert main(["start", "--port", str(port)]) == 0  # idempotent: reports the running one
        assert capsys.readouterr().out.strip() == address

        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0] == address
        assert "alive" in out and "reachable" in out
    finally:
        assert main(["stop"]) == 0
    assert "stopped 1 node" in capsys.readouterr().out
    assert main(["status"]) == 1


def test_cluster_ids_never_look_like_a_flag() -> None:
    # A base64url id may start with "-", which the storage tool parses as an option.
    assert not any(_new_cluster_id().startswith("-") for _ in range(5000))


def test_cli_rejects_bad_arguments() -> None:
    assert main(["start", "--nodes", "2"]) == 2
    assert main([]) == 2


@pytest.mark.slow
async def test_three_nodes_survive_a_killed_leader(
    kafka_cluster3: LocalCluster, unique_name: Callable[..., str]
) -> None:
    cluster = kafka_cluster3
    topic = unique_name()
    await create_topic(cluster.bootstrap, topic, partitions=3, replication=3)
    producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all")
    await producer.start()
    try:
        sent = [f"before-{i}".encode() for i in range(30)]
        for value in sent:
            await producer.send_and_wait(topic, value)
        leader = (await partition_state(cluster.bootstrap, topic))[0][0]
        cluster.kill_node(leader - 1)
        after = [f"after-{i}".encode() for i in range(30)]
        for value in after:  # acks=all still succeeds with min.insync.replicas=2 of 3
            await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()
    assert sorted(await consume_all(cluster.bootstrap, topic, 60)) == sorted(sent + after)

    await asyncio.to_thread(cluster.restart_node, leader - 1)
    assert describe_broker_ids(cluster.bootstrap) == {1, 2, 3}
    await wait_for_full_isr(cluster.bootstrap, topic)


async def wait_for_full_isr(bootstrap: str, topic: str, wait_s: float = 60.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        state = await partition_state(bootstrap, topic)
        if all(isr == [1, 2, 3] for _, isr in state.values()):
            return
        assert time.monotonic() < deadline, f"restarted node did not rejoin the ISR: {state}"
        await asyncio.sleep(0.5)

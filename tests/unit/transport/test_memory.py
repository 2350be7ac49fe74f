"""The in-memory twin behaves like the Kafka transport where services rely on it."""


from rlbus.messages import DeadLetter, Prompt
from rlbus.transport import MemoryBroker, MemoryBus, OffsetTracker
from tests import factories


async def test_publish_consume_ack_commit():
    bus = MemoryBus(dlq_topic="dlq", service="t")
    prod = await bus.producer()
    for i in range(3):
        await prod.send("p", factories.prompt(f"g{i}"), key=f"g{i}")
    cons = await bus.consumer(["p"], Prompt, group_id="g")
    got = await cons.poll(0.1)
    assert sorted(d.message.group_id for d in got) == ["g0", "g1", "g2"]
    for d in got:
        cons.ack(d)
    assert await cons.commit()
    # a new member of the same group starts after the committed offsets
    await cons.close()
    again = await bus.consumer(["p"], Prompt, group_id="g")
    assert await again.poll(0.05) == []


async def test_unacked_work_is_redelivered_to_the_next_member():
    broker = MemoryBroker({"p": 1})
    bus = MemoryBus(broker)
    prod = await bus.producer()
    for i in range(3):
        await prod.send("p", factories.prompt(f"g{i}"))
    first = await bus.consumer(["p"], Prompt, group_id="g")
    got = await first.poll(0.1)
    first.ack(got[0])
    first.ack(got[2])  # offset 1 unfinished: only offset 0 may be committed
    assert await first.commit() == {("p", 0): 1}
    await first.close()
    second = await bus.consumer(["p"], Prompt, group_id="g")
    assert [d.message.group_id for d in await second.poll(0.1)] == ["g1", "g2"]


async def test_bad_records_go_to_the_dead_letter_topic_and_are_acked():
    broker = MemoryBroker({"p": 1})
    bus = MemoryBus(broker, dlq_topic="dlq", service="svc")
    prod = await bus.producer()
    await prod.send_raw("p", b"\xc1not msgpack")
    await prod.send("p", factories.prompt("good"))
    cons = await bus.consumer(["p"], Prompt, group_id="g")
    got = await cons.poll(0.1)
    assert [d.message.group_id for d in got] == ["good"]
    cons.ack(got[0])
    assert await cons.commit() == {("p", 0): 2}
    letters = await bus.consumer(["dlq"], DeadLetter)
    (letter,) = await letters.poll(0.1)
    assert letter.message.source_topic == "p" and letter.message.offset == 0
    assert letter.headers["rlbus.source.offset"] == b"0"
    assert letter.message.reason == "undecodable" and letter.headers["rlbus.reason"] == (
        b"undecodable")
    assert letter.message.payload == b"\xc1not msgpack"


async def test_transaction_publishes_and_commits_offsets_together():
    broker = MemoryBroker({"in": 1, "out": 1})
    bus = MemoryBus(broker)
    prod = await bus.producer(transactional_id="x")
    async with prod.transaction():
        await prod.send("out", factories.prompt())
        await prod.send_offsets({("in", 0): 5}, "g")
        assert broker.logs["out"][0] == []  # invisible until commit
    assert len(broker.logs["out"][0]) == 1
    assert broker.groups["g"].committed == {("in", 0): 5}


async def test_aborted_transaction_publishes_nothing():
    broker = MemoryBroker({"out": 1})
    prod = await MemoryBus(broker).producer(transactional_id="x")
    try:
        async with prod.transaction():
            await prod.send("out", factories.prompt())
            raise RuntimeError("verifier crashed")
    except RuntimeError:
        pass
    assert broker.logs["out"][0] == []


async def test_group_members_split_partitions():
    broker = MemoryBroker({"p": 4})
    bus = MemoryBus(broker)
    a = await bus.consumer(["p"], Prompt, group_id="g")
    b = await bus.consumer(["p"], Prompt, group_id="g")
    assert sorted(a.assignment() + b.assignment()) == [("p", i) for i in range(4)]
    assert set(a.assignment()).isdisjoint(b.assignment())


def test_offset_tracker_commits_only_contiguous_prefix():
    t = OffsetTracker()
    for off in range(4):
        t.delivered("p", 0, off)
    t.ack("p", 0, 1)
    assert t.committable() == {}
    t.ack("p", 0, 0)
    assert t.committable() == {("p", 0): 2}
    t.committed({("p", 0): 2})
    t.ack("p", 0, 3)
    assert t.committable() == {}
    t.ack("p", 0, 2)
    assert t.committable() == {("p", 0): 4}
    assert t.in_flight() == 0



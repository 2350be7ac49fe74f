"""Per-tier throughput from the tiers' topics: records per second between two samples."""

from rlbus.learner.throughput import TierThroughput
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories

TOPICS = TopicSettings(prefix="tp", partitions=2, result_partitions=2)
T = Topics(TOPICS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _publish(bus, trajectories: int, results: int) -> None:
    producer = await bus.producer()
    for i in range(trajectories):
        await producer.send(T.trajectories, factories.trajectory(f"g/{i}"), key=f"g/{i}")
    for i in range(results):
        await producer.send(T.results, factories.step_result(f"e/{i}"), key=f"e/{i}")


async def test_rates_are_the_records_each_tier_wrote_per_second_between_samples():
    bus = MemoryBus(memory_broker(TOPICS))
    clock = Clock()
    meter = TierThroughput(bus, T, every_s=10.0, clock=clock)
    await _publish(bus, trajectories=3, results=5)
    await meter.sample()
    assert meter.rates() == {}  # one sample: no interval yet

    await _publish(bus, trajectories=20, results=40)
    meter.scored_received += 10
    clock.now += 5.0
    await meter.sample()  # before every_s: not measured again
    assert meter.rates() == {}
    clock.now += 5.0
    await meter.sample()
    assert meter.rates() == {"rollout_episodes_per_s": 2.0, "inference_results_per_s": 4.0,
                             "reward_scored_per_s": 1.0}

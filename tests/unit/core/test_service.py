"""The service lifecycle: bounded runs end by themselves; a crashed task stops the service."""

import asyncio

import pytest

from rlbus.reward.service import Reward
from rlbus.reward.settings import RewardSettings
from rlbus.settings import TopicSettings
from rlbus.topics import Topics, memory_broker
from rlbus.transport import MemoryBus
from tests import factories
from tests.polling import wait_until

TOPICS = TopicSettings(prefix="lc", partitions=1)


async def test_until_idle_stops_a_quiet_service():
    reward = Reward(
        RewardSettings(topics=TOPICS, until_idle_s=0.3), MemoryBus(memory_broker(TOPICS))
    )
    summary = await asyncio.wait_for(reward.run(), 30)
    assert "idle" in summary["stop_reason"]


async def test_idle_counts_from_ready_not_from_a_slow_start_up():
    """A start-up longer than ``until_idle_s`` (importing torch, joining a group) is not idle:
    a rollout with ``until_idle_s=8`` once stopped with nothing handled after a 23 s start."""

    class SlowStart(Reward):
        async def setup(self) -> None:
            await super().setup()
            await asyncio.sleep(0.6)  # the start-up, longer than until_idle_s below
            self.setup_done_at = loop.time()

        def request_stop(self, reason: str = "requested") -> None:
            self.stop_requested_at = loop.time()
            super().request_stop(reason)

    loop = asyncio.get_running_loop()
    reward = SlowStart(RewardSettings(topics=TOPICS, until_idle_s=0.3),
                       MemoryBus(memory_broker(TOPICS)))
    summary = await asyncio.wait_for(reward.run(), 30)
    assert "idle" in summary["stop_reason"]
    assert reward.stop_requested_at - reward.setup_done_at >= 0.3  # a whole idle period


async def test_max_messages_stops_after_that_many():
    broker = memory_broker(TOPICS)
    producer = await MemoryBus(broker).producer()
    for i in range(5):
        await producer.send(Topics(TOPICS).trajectories, factories.trajectory(f"g{i}"))
    reward = Reward(RewardSettings(topics=TOPICS, max_messages=2, batch_size=1), MemoryBus(broker))
    summary = await asyncio.wait_for(reward.run(), 30)
    assert summary["handled"] == 2 and "max_messages" in summary["stop_reason"]
    # what was handled is committed; the rest stays for the next member
    assert broker.groups["lc.reward"].committed[(Topics(TOPICS).trajectories, 0)] == 2


async def test_a_crashed_background_task_stops_the_service_instead_of_vanishing():
    reward = Reward(RewardSettings(topics=TOPICS), MemoryBus(memory_broker(TOPICS)))

    async def boom():
        raise RuntimeError("watcher died")

    run = asyncio.create_task(reward.run())
    await wait_until(lambda: reward.ready.is_set() or run.done(), "the service is up")
    assert not run.done(), run.result()
    reward.spawn("boom", boom())  # crashes while the service runs
    summary = await asyncio.wait_for(run, 30)
    assert "watcher died" in summary["stop_reason"]


async def test_a_failed_setup_is_closed_but_not_drained():
    """Drain may use all that setup builds (a failed setup took no work); close releases
    whatever it had built."""

    class Broken(Reward):
        calls: list[str] = []

        async def setup(self) -> None:
            await super().setup()
            raise RuntimeError("no model")

        async def drain(self) -> None:
            self.calls.append("drain")

        async def close(self) -> None:
            self.calls.append("close")
            await super().close()

    broken = Broken(RewardSettings(topics=TOPICS), MemoryBus(memory_broker(TOPICS)))
    with pytest.raises(RuntimeError, match="no model"):
        await asyncio.wait_for(broken.run(), 30)
    assert broken.calls == ["close"]


def test_services_run_on_uvloop_unless_told_otherwise():
    import uvloop

    from rlbus.runner import loop_factory

    assert RewardSettings().event_loop == "uvloop"
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None  # asyncio's default loop
    assert loop_factory("uvloop", tls=True) is None  # its TLS close can stall for 30 s

"""The Kafka path's own cost, with a zero-latency engine and environment.

* Round trip: one StepRequest at a time from this process to one inference process and its
  StepResult back (two produce-acks and two fetches over loopback), p50 and p99.
* Sustained steps/s of one rollout process driving that inference process: prompts are
  published up front and the rate is read from the growth of the steps topic's end offsets
  over a window after a warm-up, with each process's CPU use in that window (a process near
  one core is the bottleneck; neither near one means the time goes to waiting).

``profile=True`` runs both processes under cProfile (see :meth:`Fleet.profiles`): where the
per-message cost goes.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from loadtest.fleet import Fleet, FleetError, Proc, cpu_seconds, inference_env, rollout_env
from loadtest.scenario import Scenario
from rlbus.messages import Prompt, Sampling, StepRequest, StepResult
from rlbus.runner import loop_factory
from rlbus.settings import KafkaSettings, ServiceSettings, TopicSettings
from rlbus.synthetic import SyntheticTask
from rlbus.topics import Topics
from rlbus.transport import Consumer, KafkaBus, Producer

EVENT_LOOP = ServiceSettings.model_fields["event_loop"].default
"""The services' default event loop, which the harness (standing in for rollout) uses too."""
TRIP_TIMEOUT_S = 60.0
"""The first trips wait for the inference process to join its group; later ones are fast."""


def measure(s: Scenario, bootstrap: str, run_dir: Path, trips: int, window_s: float,
            warmup_s: float, profile: bool = False) -> dict[str, Any]:
    """Round trip, then sustained rate, on one inference process."""
    with Fleet(run_dir, bootstrap, profile=profile) as fleet:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topics = Topics(TopicSettings(prefix=fleet.prefix, partitions=fleet.partitions,
                                      result_partitions=fleet.result_partitions))
        inference = fleet.spawn("inference", 0, inference_env(s))
        rtt = round_trip(kafka, topics, trips, fleet, warmup_s)
        rollout = fleet.spawn("rollout", 0, rollout_env(s))
        fleet.wait_ready()
        asyncio.run(_publish_prompts(kafka, topics, s, max(s.steps * s.groups_per_step, 100)))
        rate = sustained_rate(kafka, topics, fleet, [inference, rollout], window_s, warmup_s)
    return {"round_trip": rtt, "sustained": rate, **fleet.profiles()}


# --------------------------------------------------------------------------- round trip


def round_trip(kafka: KafkaSettings, topics: Topics, n: int, fleet: Fleet,
               warmup_s: float) -> dict[str, Any]:
    """p50/p99 of request → reply over ``n`` trips, after ``warmup_s`` of trips left out (a
    fresh topic's first trips, about 0.1 s of them, take 8-9 ms: they would be the p99).
    The harness runs on the event loop the services use (uvloop by default)."""
    reply_partition = fleet.result_partitions - 1  # not the rollout's (instance 0 → 0)
    with asyncio.Runner(loop_factory=loop_factory(EVENT_LOOP)) as runner:
        times = runner.run(_round_trips(kafka, topics, n, warmup_s, reply_partition))
    fleet.check_alive()
    ms = sorted(t * 1000 for t in times)
    return {"n": n, "warmup_s": warmup_s, "p50_ms": statistics.median(ms),
            "p99_ms": ms[int(0.99 * (len(ms) - 1))], "mean_ms": statistics.fmean(ms)}


async def _round_trips(kafka: KafkaSettings, topics: Topics, n: int, warmup_s: float,
                       partition: int) -> list[float]:
    bus = KafkaBus(kafka, dlq_topic=None, service="loadtest")
    try:
        producer = await bus.producer()
        replies = await bus.consumer([topics.results], StepResult,
                                     assign=[(topics.results, partition)], from_end=True)
        warm_until, i = time.perf_counter() + warmup_s, 0
        while time.perf_counter() < warm_until:
            await _one_trip(producer, replies, topics, i, partition)
            i += 1
        return [await _one_trip(producer, replies, topics, i + k, partition) for k in range(n)]
    finally:
        await bus.close()


async def _one_trip(producer: Producer, replies: Consumer[StepResult], topics: Topics,
                    i: int, partition: int) -> float:
    request = StepRequest(request_id=f"rtt/{i}", episode_id=f"rtt/{i}", turn=0,
                          input_ids=list(range(64)), reply_partition=partition)
    t0 = time.perf_counter()
    await producer.send(topics.steps, request, key=request.episode_id)
    while time.perf_counter() - t0 < TRIP_TIMEOUT_S:
        for d in await replies.poll(1.0):
            if d.message.request_id == request.request_id:
                return time.perf_counter() - t0
    raise FleetError(f"no answer to {request.request_id} within {TRIP_TIMEOUT_S:.0f}s")


# --------------------------------------------------------------------------- sustained rate


async def _publish_prompts(kafka: KafkaSettings, topics: Topics, s: Scenario, n: int) -> None:
    task = SyntheticTask()
    sampling = Sampling(max_new_tokens=s.max_new_tokens)
    prompts = [Prompt(group_id=f"rate/{i}", task=task.name, group_size=s.group_size,
                      spec={**task.sample(random.Random(i)), **s.env}, sampling=sampling)
               for i in range(n)]
    bus = KafkaBus(kafka, dlq_topic=None, service="loadtest")
    try:
        producer = await bus.producer()
        await asyncio.gather(*(producer.send(topics.prompts, p, key=p.group_id)
                               for p in prompts))
    finally:
        await bus.close()


def sustained_rate(kafka: KafkaSettings, topics: Topics, fleet: Fleet, procs: list[Proc],
                   window_s: float, warmup_s: float) -> dict[str, Any]:
    """Steps/s over ``window_s`` after ``warmup_s``, and each process's CPU cores used."""
    time.sleep(warmup_s)
    fleet.check_alive()
    steps0, cpu0, t0 = _sample(kafka, topics, fleet.partitions, procs)
    time.sleep(window_s)
    steps1, cpu1, t1 = _sample(kafka, topics, fleet.partitions, procs)
    fleet.check_alive()
    names = [p.label for p in procs] + ["machine"]  # machine: every process, the broker too
    cpu = {n: (c1 - c0) / (t1 - t0) for n, c0, c1 in zip(names, cpu0, cpu1, strict=True)}
    rate = (steps1 - steps0) / (t1 - t0)
    per_step = {n: 1000 * c / rate for n, c in cpu.items()} if rate else {}
    return {"steps_per_s": rate, "window_s": t1 - t0, "cpu_cores": cpu,
            "cpu_ms_per_step": per_step, "cpus": os.cpu_count()}


def _sample(kafka: KafkaSettings, topics: Topics, partitions: int,
            procs: list[Proc]) -> tuple[int, list[float], float]:
    steps = asyncio.run(_steps_sent(kafka, topics, partitions))
    return steps, [*(cpu_seconds(p.popen.pid) for p in procs), _machine_cpu_s()], time.monotonic()


async def _steps_sent(kafka: KafkaSettings, topics: Topics, partitions: int) -> int:
    bus = KafkaBus(kafka, dlq_topic=None, service="loadtest")
    try:
        tps = [(topics.steps, p) for p in range(partitions)]
        reader = await bus.consumer([topics.steps], StepRequest, assign=tps)
        return sum((await reader.end_offsets(tps)).values())
    finally:
        await bus.close()


def _machine_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (Linux; else 0)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return 0.0
    ticks = [int(x) for x in first[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")

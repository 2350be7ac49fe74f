"""How cost grows with trajectory length and with model size.

    python -m loadtest.cost_bench                        # both parts
    python -m loadtest.cost_bench --only trajectories    # or --only weights
    python -m loadtest.cost_bench --smoke --out DIR      # tiny sizes, seconds; checks no timing

**Trajectories** of about 1k, 8k and 32k tokens (:data:`SHAPES`: a fixed number of turns,
each half observation, half completion with its logprobs):

* codec: encode and decode time per message and wire bytes of the packed encoding the wire
  uses, on :func:`loadtest.codec_bench.make_trajectory`'s trajectory of that shape, and of
  the StepRequest of its last turn;
* broker: produce and consume MB/s and messages/s of that trajectory through the local
  broker, on fresh topics, with our own idempotent ``acks=all`` producer (``send``, so
  encoding included) and consumer (``poll``, so decoding into ``Trajectory`` included);
* end to end: the four services as processes over Kafka (:func:`loadtest.fleet.run_decoupled`)
  with a zero-latency synthetic environment and engine whose episodes reach that length,
  and a synthetic trainer of :data:`LEARNER_STEP_S`. Steady-state samples/s; per finished
  episode the bytes it put on each topic (read back from the run's topics) and the CPU
  time of each process (the broker's too, if this run started it). Every StepRequest
  carries the whole context so far, so step traffic grows with turns x length.

**Weights** of about 10 MB, 100 MB and 1 GB (fp32 parameters of a plain stack of
``nn.Linear`` layers), the median of ``--repeats`` rounds by total time: the learner's
``save_weights`` (the write and its checksum in one pass, with the rename and the pruning of
the previous version), the WeightVersion send and
its arrival at a consumer, and the reader's side as the hf engine does it
(``verified_weights``, then ``safetensors.torch.load_model`` into a same-shaped module of
zeros). Files go to a temporary folder that is deleted; the file is in the page cache when
it is hashed and read back, as on one machine (a replica elsewhere reads it over its
storage instead).

Starts a local Kafka broker unless ``RLBUS_KAFKA_BOOTSTRAP`` names one. Writes ``cost.json``
(every figure, the machine and its load average before and after each part) into ``--out``
(default ``runs/cost-<time>``) and prints one table per part. The machine is shared and
noisy: compare sizes within one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.codec_bench import make_trajectory, measure
from loadtest.fleet import run_decoupled
from loadtest.scenario import Engine, Inference, Rollout, Scenario
from rlbus.codec import decode, encode
from rlbus.messages import ScoredTrajectory, StepRequest, Trajectory, WeightVersion
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import Consumer, KafkaBus, Producer, RawRecord

LEARNER_STEP_S = 0.02
"""The synthetic trainer's step: small, so the learner is not what limits end to end."""
PROMPT_TOKENS = 3
"""The synthetic environment's first observation ("synthetic task :") in tokens."""


@dataclass(frozen=True)
class Shape:
    """A trajectory of about ``tokens`` tokens in ``turns`` turns, each turn half observation
    ids and half completion ids (+ logprobs); ``e2e_steps`` learner steps end to end."""

    tokens: int
    turns: int
    e2e_steps: int

    @property
    def per_turn(self) -> int:
        """Completion tokens per turn, and observation words (= tokens) per turn."""
        return self.tokens // (2 * self.turns)

    @property
    def e2e_tokens(self) -> int:
        """Tokens of an end-to-end episode: the prompt, T completions, T-1 observations."""
        return PROMPT_TOKENS + self.turns * self.per_turn + (self.turns - 1) * self.per_turn


SHAPES = (Shape(1024, 4, 60), Shape(8192, 16, 16), Shape(32768, 32, 10))
SMOKE_SHAPES = (Shape(64, 2, 3), Shape(512, 4, 3))
WEIGHT_MB = (10, 100, 1000)
SMOKE_WEIGHT_MB = (1, 4)
SENDERS = 64
"""Concurrent sends in the broker measurement: the rollout's default episodes in flight.
(5,000 sends of 1k-token trajectories all at once measured 287 messages/s against about
2,400 with 64 senders; thousands of waiting sends is not how a rollout tier sends.)"""
LAYERS = 16
"""Linear layers of every weight-part model; the width sets the size."""


def say(text: str) -> None:
    print(f"[cost] {text}", flush=True)


def loadavg() -> list[float]:
    return list(os.getloadavg())


# --------------------------------------------------------------------------- trajectories


@dataclass(frozen=True)
class Bench:
    """Where and how this run measures."""

    bootstrap: str
    out: Path
    smoke: bool
    profile: bool
    """End-to-end processes under cProfile (``profile-<process>.txt`` in each run folder)."""
    broker_pids: dict[str, int]
    """The broker's JVMs, if this run started them: their CPU is counted end to end."""


def trajectories(shapes: tuple[Shape, ...], bench: Bench) -> dict[str, Any]:
    """Codec, broker and end-to-end figures per shape, each measured alone in turn."""
    kafka = KafkaSettings(bootstrap=bench.bootstrap)
    rows = []
    for shape in shapes:
        say(f"trajectories of ~{shape.tokens} tokens ({shape.turns} turns)")
        traj = make_trajectory(shape.tokens, shape.turns)
        row = {"shape": {**asdict(shape), "per_turn": shape.per_turn},
               "codec": codec(traj, bench.smoke),
               "broker": asyncio.run(broker(kafka, traj, bench.smoke))}
        row["codec_share"] = codec_share(row["codec"], row["broker"])
        row["e2e"] = end_to_end(shape, bench)
        rows.append(row)
    return {"rows": rows, "learner_step_s": LEARNER_STEP_S, "loadavg_after": loadavg()}


def codec(traj: Trajectory, smoke: bool) -> dict[str, Any]:
    """Best-of-5 encode/decode ms per message of the packed wire encoding: the trajectory,
    and the StepRequest of its last turn (a context of every token but the last turn's
    completion; an episode sends one per turn, each with the whole context so far)."""
    number = 1 if smoke else max(5, 200_000 // traj.num_tokens)
    enc_ms, dec_ms, size = measure(True, traj, number)
    context = traj.num_tokens - len(traj.turns[-1].completion_ids)
    step = StepRequest(request_id="e/t0", episode_id="e", turn=len(traj.turns) - 1,
                       input_ids=[i % 50_000 for i in range(context)], reply_partition=0)
    step_enc, step_dec, step_size = measure(True, step, number)
    return {"tokens": traj.num_tokens, "encode_ms": enc_ms, "decode_ms": dec_ms, "bytes": size,
            "last_step": {"tokens": context, "encode_ms": step_enc, "decode_ms": step_dec,
                          "bytes": step_size}}


def codec_share(c: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Share of the broker measurement's wall time that encoding (produce) and decoding
    (consume) take, at the codec's own per-message cost."""
    return {"produce": c["encode_ms"] / 1e3 * b["produce"]["messages_per_s"],
            "consume": c["decode_ms"] / 1e3 * b["consume"]["messages_per_s"]}


def broker_count(size: int, smoke: bool) -> int:
    """Messages per broker measurement: about 48 MB (1 MB smoke), within [100, 5000]."""
    volume, low, high = (1 << 20, 10, 200) if smoke else (48 << 20, 100, 5000)
    return max(low, min(high, volume // size))


async def broker(kafka: KafkaSettings, traj: Trajectory, smoke: bool) -> dict[str, Any]:
    """Produce copies of ``traj`` (about :func:`broker_count`), then consume and decode them
    all; the two timed apart, on a fresh topic."""
    size = len(encode(traj))
    count = broker_count(size, smoke)
    topics = await fresh_topics(kafka, size)
    bus = KafkaBus(kafka, dlq_topic=None, service="cost-bench",
                   max_message_bytes=topics.settings.max_message_bytes)
    try:
        tps = [(topics.trajectories, p) for p in range(topics.settings.partitions)]
        producer, reader = await warm_pair(bus, tps, traj)
        produce_s = await produce(producer, topics.trajectories, traj, count)
        consumed, consume_s = await consume(reader, count, decode(encode(traj), Trajectory))
    finally:
        await bus.close()
    return {"messages": count, "bytes": size, "produce": _rate(count, size, produce_s),
            "consume": _rate(consumed["decoded"], size, consume_s), **consumed}


async def produce(producer: Producer, topic: str, traj: Trajectory, count: int) -> float:
    """Seconds to send ``count`` copies from :data:`SENDERS` concurrent senders, each
    awaiting its acks one at a time as a rollout episode does."""
    async def sender(k: int) -> None:
        for i in range(k, count, SENDERS):
            await producer.send(topic, traj, key=f"g/{i}")

    t0 = time.perf_counter()
    await asyncio.gather(*(sender(k) for k in range(SENDERS)))
    return time.perf_counter() - t0


async def warm_pair(bus: KafkaBus, tps: list[tuple[str, int]],
                    traj: Trajectory) -> tuple[Producer, Consumer[Trajectory]]:
    """A producer that has written to every partition of a new topic (leaders elected,
    connections open) and a consumer placed after those writes: set-up stays untimed."""
    producer = await bus.producer()
    await asyncio.gather(*(producer.send(t, traj, partition=p) for t, p in tps))
    reader = await bus.consumer([tps[0][0]], Trajectory, assign=tps, from_end=True)
    for tp in tps:
        await reader.position(tp)  # resolves "end" now, before the timed writes
    return producer, reader


async def fresh_topics(kafka: KafkaSettings, largest: int) -> Topics:
    """A new topic prefix whose topics accept messages of ``largest`` bytes."""
    default = TopicSettings().max_message_bytes
    settings = TopicSettings(prefix=f"cost-{uuid.uuid4().hex[:8]}",
                             max_message_bytes=max(default, 2 * largest))
    await ensure_topics(kafka, settings)
    return Topics(settings)


async def consume(reader: Consumer[Trajectory], count: int,
                  expected: Trajectory) -> tuple[dict[str, int], float]:
    """Poll (decoding into Trajectory) until ``count`` arrived; counts of what came back.
    ``expected`` is the sent trajectory after one encode/decode (logprobs as float32)."""
    decoded = equal = 0
    t0 = time.perf_counter()
    deadline = t0 + max(60.0, count / 10)
    while decoded < count and time.perf_counter() < deadline:
        for d in await reader.poll(1.0):
            decoded += 1
            equal += d.message.turns == expected.turns
    return {"decoded": decoded, "equal_to_sent": equal}, time.perf_counter() - t0


async def _partitions(bus: KafkaBus, topic: str) -> list[tuple[str, int]]:
    return [(topic, p) for p in await bus.partitions(topic)]


def _rate(count: int, size: int, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "messages_per_s": count / seconds,
            "mb_per_s": count * size / seconds / 1e6}


# --------------------------------------------------------------------------- end to end


def scenario(shape: Shape, smoke: bool) -> Scenario:
    """Zero-latency episodes of exactly ``shape.turns`` turns reaching ~``shape.tokens``."""
    per = shape.per_turn
    return Scenario(
        name=f"cost-{shape.tokens}", group_size=8, groups_per_step=4, steps=shape.e2e_steps,
        warmup_steps=1 if smoke else 2, cooldown_steps=1 if smoke else None,
        learner_step_s=LEARNER_STEP_S, max_new_tokens=per,
        env={"min_turns": shape.turns, "max_turns": shape.turns, "median_ms": 0, "sigma": 0,
             "obs_words": per},
        engine=Engine(base_ms=0, per_token_ms=0, completion_tokens=per),
        rollout=Rollout(max_concurrent_episodes=64, max_context_tokens=shape.tokens + per),
        inference=Inference(max_batch_size=64, batch_wait_ms=0),
        timeout_s=120 if smoke else 300,
    )


def end_to_end(shape: Shape, bench: Bench) -> dict[str, Any]:
    """One decoupled run: steady samples/s, and per finished episode the bytes it put on
    each topic and the CPU time each process spent."""
    s = scenario(shape, bench.smoke)
    run_dir = bench.out / f"e2e-{shape.tokens}"
    run = run_decoupled(s, bench.bootstrap, run_dir, bench.profile, watch=bench.broker_pids)
    kafka = KafkaSettings(bootstrap=bench.bootstrap)
    traffic = asyncio.run(run_traffic(kafka, run.extra["prefix"]))
    episodes = max(traffic["episodes"], 1)
    return {"scenario": s.model_dump(), "expected_tokens": shape.e2e_tokens,
            "samples_per_s": run.throughput(), "run": run.summary(), "traffic": traffic,
            "cpu_ms_per_episode": {k: 1e3 * v / episodes
                                   for k, v in run.extra["cpu_s"].items()}}


async def run_traffic(kafka: KafkaSettings, prefix: str) -> dict[str, Any]:
    """Per finished episode: records and bytes it put on each topic (read back after the run)."""
    topics = Topics(TopicSettings(prefix=prefix))
    bus = KafkaBus(kafka, dlq_topic=None, service="cost-bench")
    try:
        episodes = await _finished(bus, topics.trajectories)
        per_topic = {name: await _per_episode(bus, topic, episodes, key)
                     for name, topic, key in _traffic_topics(topics)}
    finally:
        await bus.close()
    tokens = list(episodes.values())
    return {"episodes": len(tokens), "tokens_mean": statistics.fmean(tokens) if tokens else 0,
            "per_episode": per_topic}


def _traffic_topics(t: Topics) -> list[tuple[str, str, Callable[[RawRecord], str]]]:
    """(name, topic, episode id of a raw record) for every topic an episode writes to."""
    return [
        ("step_requests", t.steps, _key),
        ("step_results", t.results, _key),
        ("trajectories", t.trajectories, lambda r: decode(r.value, Trajectory).episode_id),
        ("scored", t.scored, lambda r: decode(r.value, ScoredTrajectory).trajectory.episode_id),
    ]


def _key(r: RawRecord) -> str:
    """Steps and their results are keyed by episode id; trajectories by group id."""
    return (r.key or b"").decode()


async def _finished(bus: KafkaBus, topic: str) -> dict[str, int]:
    """Tokens of every episode published as ok, by episode id."""
    out = {}
    async for r in records(bus, topic):
        t = decode(r.value, Trajectory)
        if t.status == "ok":
            out[t.episode_id] = t.num_tokens
    return out


async def _per_episode(bus: KafkaBus, topic: str, episodes: dict[str, int],
                       episode_of: Callable[[RawRecord], str]) -> dict[str, float]:
    """Mean records and bytes on ``topic`` per episode of ``episodes``."""
    count: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
    async for r in records(bus, topic):
        episode = episode_of(r)
        if episode in episodes:
            count[episode][0] += 1
            count[episode][1] += len(r.value)
    n = max(len(episodes), 1)
    return {"records": sum(c[0] for c in count.values()) / n,
            "bytes": sum(c[1] for c in count.values()) / n}


async def records(bus: KafkaBus, topic: str) -> AsyncIterator[RawRecord]:
    """Every record of ``topic`` up to its end offsets as of the call, undecoded."""
    tps = await _partitions(bus, topic)
    reader = await bus.consumer([topic], StepRequest, assign=tps)  # poll_raw: type unused
    ends = await reader.end_offsets(tps)
    while any([await reader.position(tp) < end for tp, end in ends.items()]):
        for r in await reader.poll_raw(1.0):
            yield r


# --------------------------------------------------------------------------- weights


def weights(sizes_mb: tuple[int, ...], bootstrap: str, repeats: int) -> dict[str, Any]:
    """Publication cost per model size; the median round of ``repeats`` each."""
    kafka = KafkaSettings(bootstrap=bootstrap)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cost-weights-") as tmp:
        for mb in sizes_mb:
            say(f"weights of ~{mb} MB ({repeats} rounds)")
            rows.append(asyncio.run(publication(kafka, mb, Path(tmp) / f"{mb}mb", repeats)))
    return {"rows": rows, "layers": LAYERS, "loadavg_after": loadavg()}


def linear_stack(mb: float) -> Any:
    """``LAYERS`` bias-free fp32 Linear layers of ~``mb`` MB in all (width a multiple of 64)."""
    import torch
    from torch import nn

    width = max(64, round((mb * 1e6 / 4 / LAYERS) ** 0.5 / 64) * 64)
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))


async def publication(kafka: KafkaSettings, mb: int, folder: Path,
                      repeats: int) -> dict[str, Any]:
    """``repeats`` rounds of save → publish → verify → load into a zeroed twin."""
    model = linear_stack(mb)
    topics = await fresh_topics(kafka, 0)
    bus = KafkaBus(kafka, dlq_topic=None, service="cost-bench")
    try:
        producer = await bus.producer()
        events = await bus.consumer([topics.weights], WeightVersion,
                                    assign=[(topics.weights, 0)])
        warm_up = WeightVersion(model="cost", version=0, uri="", checksum="", step=0)
        await publish(producer, events, topics.weights, warm_up)  # leader, metadata: untimed
        rounds = [await one_round(model, folder, v, producer, events, topics.weights)
                  for v in range(1, repeats + 1)]
    finally:
        await bus.close()
    return {"target_mb": mb, "params": sum(p.numel() for p in model.parameters()),
            "width": model[0].in_features, **median_round(rounds), "rounds": rounds}


async def one_round(model: Any, folder: Path, version: int, producer: Producer,
                    events: Consumer[WeightVersion], topic: str) -> dict[str, Any]:
    """The learner's side, the event, then the replica's side, each timed."""
    from safetensors.torch import load_model

    from rlbus.learner import store
    from rlbus.weights import verified_weights

    saved_s, (path, digest) = _timed(store.save_weights, model, folder, version, 1)
    event = WeightVersion(model="cost", version=version, uri=str(path), checksum=digest, step=0)
    sent_s, arrived_s = await publish(producer, events, topic, event)
    twin = _twin(model)
    verify_s, file = _timed(verified_weights, event.uri, event.checksum)
    load_s, _ = _timed(load_model, twin, str(file))
    return {"bytes": file.stat().st_size, "save_s": saved_s, "send_s": sent_s,
            "arrive_s": arrived_s, "verify_s": verify_s, "load_s": load_s,
            "loaded_equal": _equal(model, twin),
            "total_s": saved_s + arrived_s + verify_s + load_s}


def _twin(model: Any) -> Any:
    """A same-shaped stack of zeros (what a replica holds before the load)."""
    import torch
    from torch import nn

    width = model[0].in_features
    twin = nn.Sequential(*(nn.Linear(width, width, bias=False, device="meta")
                           for _ in range(len(model))))
    twin = twin.to_empty(device="cpu")
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    return twin


def _equal(a: Any, b: Any) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


async def publish(producer: Producer, events: Consumer[WeightVersion], topic: str,
                  event: WeightVersion) -> tuple[float, float]:
    """Seconds until the broker acked the event, and until a consumer had it."""
    t0 = time.perf_counter()
    await producer.send(topic, event, key=event.model)
    sent = time.perf_counter() - t0
    while time.perf_counter() - t0 < 60:
        if any(d.message.version == event.version for d in await events.poll(1.0)):
            return sent, time.perf_counter() - t0
    raise TimeoutError(f"weight version {event.version} did not arrive within 60s")


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose total time is the median (its parts add up, as separate medians'
    would not); ``loaded_equal`` must hold in every round."""
    middle = sorted(rounds, key=lambda r: r["total_s"])[len(rounds) // 2]
    return {**middle, "loaded_equal": all(r["loaded_equal"] for r in rounds)}


# --------------------------------------------------------------------------- tables


def trajectory_table(part: dict[str, Any]) -> str:
    rows = []
    for r in part["rows"]:
        c, b, e = r["codec"], r["broker"], r["e2e"]
        steps = e["traffic"]["per_episode"]["step_requests"]
        rows.append([
            f"{c['tokens']} ({r['shape']['turns']} turns)", f"{c['encode_ms']:.3f}",
            f"{c['decode_ms']:.3f}", f"{c['bytes'] / 1e3:.1f}",
            f"{c['last_step']['encode_ms']:.3f}/{c['last_step']['decode_ms']:.3f}",
            f"{b['produce']['mb_per_s']:.1f} ({b['produce']['messages_per_s']:.0f})",
            f"{b['consume']['mb_per_s']:.1f} ({b['consume']['messages_per_s']:.0f})",
            f"{e['traffic']['tokens_mean']:.0f}", f"{e['samples_per_s']:.2f}",
            f"{steps['bytes'] / 1e6:.2f}", _cpu(e["cpu_ms_per_episode"]),
        ])
    return "\n".join([
        "trajectories: codec per message, broker MB/s (msgs/s), end to end over Kafka",
        report.table(["tokens", "encode ms", "decode ms", "wire KB", "last step enc/dec ms",
                      "produce MB/s",
                      "consume MB/s", "e2e tokens", "e2e samples/s", "step-req MB/sample",
                      "CPU ms/sample"], rows),
        "CPU ms/sample: " + "/".join(CPU_ORDER) + " (the broker only if this run started it)",
    ])


CPU_ORDER = ("rollout", "inference", "reward", "broker")


def _cpu(per_process: dict[str, float]) -> str:
    """CPU ms per sample as rollout/inference/reward/broker (summed over instances)."""
    total = {name: sum(v for k, v in per_process.items() if k.startswith(name + "-"))
             for name in CPU_ORDER}
    return "/".join(f"{total[n]:.1f}" for n in CPU_ORDER)


def weight_table(part: dict[str, Any]) -> str:
    rows = []
    for r in part["rows"]:
        mb = r["bytes"] / 1e6
        rows.append([
            f"{mb:.0f}", f"{r['save_s']:.3f} ({mb / r['save_s']:.0f})",
            f"{1e3 * r['send_s']:.1f}", f"{1e3 * r['arrive_s']:.1f}",
            f"{r['verify_s']:.3f}", f"{r['load_s']:.3f} ({mb / r['load_s']:.0f})",
            f"{r['total_s']:.2f}", str(r["loaded_equal"]),
        ])
    return "\n".join([
        "weight publication: seconds (MB/s); the round of median total time",
        report.table(["MB", "save s (write + checksum)", "send ms", "arrive ms", "verify s",
                      "load s", "total s", "loaded = saved"], rows),
    ])


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.cost_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("trajectories", "weights"), action="append",
                   help="run only this part (repeatable)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes: checks the harness in seconds, not timings")
    p.add_argument("--out", type=Path, help="output folder (default runs/cost-<time>)")
    p.add_argument("--repeats", type=int, default=5, help="rounds per weight size")
    p.add_argument("--profile", action="store_true",
                   help="end-to-end service processes under cProfile (slower; hot spots)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: at least one round per size, not {args.repeats}")
    return args


def run_part(part: str, args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    if part == "trajectories":
        result = trajectories(SMOKE_SHAPES if args.smoke else SHAPES, bench)
        print(trajectory_table(result), flush=True)
        return result
    result = weights(SMOKE_WEIGHT_MB if args.smoke else WEIGHT_MB, bench.bootstrap,
                     1 if args.smoke else args.repeats)
    print(weight_table(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = report.output_folder(args.out, "cost")
    from rlbus.ops.broker import bootstrap_or_start

    results: dict[str, Any] = {"machine": report.machine(), "argv": sys.argv[1:],
                               "smoke": args.smoke}
    say("starting Kafka (or using RLBUS_KAFKA_BOOTSTRAP)")
    bootstrap, cluster = bootstrap_or_start()
    pids = {f"broker-{i}": pid for i, pid in enumerate(cluster.pids if cluster else [])
            if pid is not None}
    bench = Bench(bootstrap, out, args.smoke, args.profile, pids)
    try:
        for part in args.only or ["trajectories", "weights"]:
            results[part] = run_part(part, args, bench)
            report.write_json(out, results, "cost.json")  # a later failure keeps these
    finally:
        if cluster is not None:
            cluster.stop()
    say(f"wrote {report.write_json(out, results, 'cost.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

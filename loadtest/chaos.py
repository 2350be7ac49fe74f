"""``python -m loadtest.chaos``: the chaos soak. About 10 minutes of the four tiers on a
3-node cluster while members are SIGKILLed, a broker restarts, members come and go and bad
messages arrive; then the count of what was lost, trained twice and dead-lettered.

    python -m loadtest.chaos                  # 8 minutes of chaos, then the drain
    python -m loadtest.chaos --minutes 1      # a short one (checks the harness)

The driver feeds the prompts itself (the learner's feeder is off): ``groups`` prompts paced
over the chaos phase, ids ``soak/<n>``, so "lost" and "twice" are counted against a known
set: every episode of every prompt must be in the learner's ledger exactly once when it
stops at ``groups / groups_per_step`` steps. Meanwhile, every 10-30 s one member of a random
tier is SIGKILLed and restarted 1-3 s later; at 50% one broker node is stopped and
restarted; at 30% a second rollout and a second inference member join, at 70% they leave
(SIGTERM). Bad messages are injected at random times: garbage bytes on prompts, a prompt
asking for 10^9 episodes, one naming a task nobody installed, and a trajectory for a
group of 10^9 (the dead-letter topic must hold exactly these). The services use the
synthetic engine and trainer: the contract is about data, not about learning.

Writes ``results.json`` and ``chaos.png`` (episodes trained over time, with the faults
marked) into ``--out`` and prints the counts; exits 1 if anything was lost or trained twice
or a dead letter is not one of the injected ones.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from loadtest import report
from rlbus.codec import decode, encode
from rlbus.messages import DeadLetter, Prompt, Trajectory
from rlbus.ops.broker import LocalCluster
from rlbus.ops.launcher import ServiceProcesses
from rlbus.processes import child_env, tail
from rlbus.settings import KafkaSettings, TopicSettings, settings_env
from rlbus.tasks import GuessNumber
from rlbus.topics import Topics, ensure_topics

GROUPS_PER_STEP, GROUP_SIZE = 2, 4
WINDOW_S = 20.0
"""The plot's throughput is a trailing average over this many seconds."""


def say(text: str) -> None:
    print(f"[chaos +{time.monotonic() - T0:6.1f}s] {text}", flush=True)


T0 = time.monotonic()


def envs(kafka: KafkaSettings, topics: TopicSettings, run: Path,
         steps: int) -> dict[str, dict[str, str]]:
    base = child_env({**settings_env(kafka=kafka, topics=topics, drain_timeout_s=10),
                      "PYTHONUNBUFFERED": "1"})
    return {
        "inference": {**base, **settings_env(engine="synthetic")},
        "reward": base,
        "rollout": {**base, **settings_env(tokenizer="synthetic", step_timeout_s=3,
                                           step_retries=60)},
        "learner": {**base, **settings_env(
            feed=False, trainer="synthetic", synthetic_step_s=0.2, max_steps=steps,
            groups_per_step=GROUPS_PER_STEP, group_size=GROUP_SIZE, checkpoint_every=3,
            ledger_steps=steps, checkpoint_dir=run / "checkpoint", weights_dir=run / "weights",
            metrics_file=run / "metrics.jsonl",
        )},
    }


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: LocalCluster) -> None:
        self.args, self.cluster = args, cluster
        self.out: Path = args.out
        self.rng = random.Random(args.seed)
        self.prefix = f"chaos-{int(time.time())}"
        self.topics = Topics(TopicSettings(prefix=self.prefix, partitions=4,
                                           result_partitions=4, replication=3,
                                           min_insync_replicas=2))
        self.steps = args.groups // GROUPS_PER_STEP
        self.procs = ServiceProcesses(self.out / "logs")
        self.events: list[tuple[float, str]] = []
        self.injected: Counter[str] = Counter()
        self.started = 0.0

    def event(self, what: str) -> None:
        self.events.append((round(time.monotonic() - T0 - self.started, 2), what))
        say(what)

    # -- the run

    async def run(self) -> dict[str, Any]:
        await ensure_topics(KafkaSettings(bootstrap=self.cluster.bootstrap), self.topics.settings)
        # The services' calls outlive a broker's kill and restart (the producer's below too).
        kafka = KafkaSettings(bootstrap=self.cluster.bootstrap, request_timeout_s=60)
        env = envs(kafka, self.topics.settings, self.out, self.steps)
        self.env = env
        for name in ("inference", "reward", "rollout", "learner"):
            self.procs.spawn(name, 0, env[name])
        self.started = time.monotonic() - T0  # ~ the learner's clock zero (it imports first)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.cluster.bootstrap,
                                         acks="all", enable_idempotence=True,
                                         request_timeout_ms=60_000)
        await self.producer.start()
        try:
            chaos_s = self.args.minutes * 60
            sampler = asyncio.create_task(self.sample())
            await asyncio.gather(self.feed(chaos_s), self.chaos(chaos_s))
            self.event("chaos over; waiting for the learner to finish")
            await self.wait_learner(self.args.drain_minutes * 60)
            sampler.cancel()
        finally:
            await self.producer.stop()
            self.procs.stop(timeout=30)
        return await self.count()

    async def sample(self) -> None:
        """(driver time, episodes trained) every 2 s, from the learner's metrics file (its
        own clock restarts with it; this one does not)."""
        self.samples: list[tuple[float, int]] = []
        path = self.out / "metrics.jsonl"
        while True:
            await asyncio.sleep(2)
            if path.exists():
                rows = [x for x in path.read_text().splitlines()[-20:] if '"loss"' in x]
                if rows:
                    trained = json.loads(rows[-1])["episodes_trained"]
                    self.samples.append((round(time.monotonic() - T0 - self.started, 2),
                                         trained))

    async def feed(self, seconds: float) -> None:
        """The prompts, paced over the chaos phase, and the bad messages among them."""
        bad_at = sorted(self.rng.uniform(0.05, 0.95) * self.args.groups for _ in range(8))
        for n in range(self.args.groups):
            while bad_at and bad_at[0] <= n:
                bad_at.pop(0)
                await self.inject()
            spec = GuessNumber().sample(self.rng)
            p = Prompt(group_id=f"soak/{n}", task="guess_number", spec=spec,
                       group_size=GROUP_SIZE)
            await self.producer.send_and_wait(self.topics.prompts, encode(p),
                                              key=p.group_id.encode())
            await asyncio.sleep(seconds / self.args.groups)

    async def inject(self) -> None:
        kind = self.rng.choice(["garbage", "poison", "unknown_task", "huge_group"])
        self.injected[kind] += 1
        topic, value = self.topics.prompts, b""
        if kind == "garbage":
            value = bytes(self.rng.getrandbits(8) for _ in range(64))
        elif kind in ("poison", "unknown_task"):
            value = encode(Prompt(
                group_id=f"bad/{kind}/{self.injected[kind]}", spec={}, group_size=10**9
                if kind == "poison" else 2, task="guess_number" if kind == "poison"
                else "no_such_task"))
        else:
            topic = self.topics.trajectories
            group = f"bad/huge/{self.injected[kind]}"
            value = encode(Trajectory(episode_id=f"{group}/0", group_id=group, index=0,
                                      group_size=10**9, task="guess_number", spec={},
                                      turns=[]))
        await self.producer.send_and_wait(topic, value, key=b"bad")
        self.event(f"injected {kind}")

    async def chaos(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        start = time.monotonic()
        joined = left = restarted_broker = False
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.uniform(10, 30))
            done = (time.monotonic() - start) / seconds
            if done > 0.3 and not joined:
                joined = True
                for name in ("rollout", "inference"):
                    self.procs.spawn(name, 1, {**self.env[name], "RLBUS_INSTANCE": "1"})
                self.event("rollout-1 and inference-1 joined")
            elif done > 0.5 and not restarted_broker:
                restarted_broker = True
                node = self.rng.randrange(3)
                # on this thread, not a worker's: a node dies with the thread that started it
                self.cluster.stop_node(node)
                self.event(f"broker node {node} stopped")
                await asyncio.sleep(self.rng.uniform(5, 15))
                self.cluster.restart_node(node)
                self.event(f"broker node {node} restarted")
            elif done > 0.7 and not left:
                left = True
                for label in ("rollout-1", "inference-1"):
                    p = self.procs.get(label)
                    if p.alive:
                        p.popen.send_signal(signal.SIGTERM)
                self.event("rollout-1 and inference-1 left (SIGTERM)")
            else:
                await self.kill_one()

    async def kill_one(self) -> None:
        live = [p for p in self.procs.procs if p.alive and p.index == 0]
        victim = self.rng.choice(live)
        self.procs.kill(victim.label)
        self.event(f"SIGKILL {victim.label}")
        await asyncio.sleep(self.rng.uniform(1, 3))
        self.procs.restart(victim.label)

    async def wait_learner(self, seconds: float) -> None:
        learner = self.procs.get("learner-0")
        deadline = time.monotonic() + seconds
        while learner.alive and time.monotonic() < deadline:
            for p in self.procs.procs:  # a crash (not our SIGKILL, not a leaver) is a finding
                code = p.popen.poll()
                if code not in (None, 0, -9, -15):
                    say(f"{p.label} exited {code}; restarting it:\n{tail(p.log, 10)}")
                    self.procs.restart(p.label)
            await asyncio.sleep(1)
        if learner.alive:
            say(f"the learner did not finish within {seconds:.0f}s after the chaos")

    # -- the counts

    async def count(self) -> dict[str, Any]:
        state_path = self.out / "checkpoint" / "checkpoint.pt"
        state = torch.load(state_path, weights_only=False) if state_path.exists() else {}
        trained = Counter(e for step in state.get("ledger", []) for e in step)
        expected = {f"soak/{g}/{i}" for g in range(self.args.groups) for i in range(GROUP_SIZE)}
        letters = await self.dead_letters()
        by_kind = Counter(_kind(letter) for letter in letters)
        result = {
            "minutes": self.args.minutes, "groups": self.args.groups,
            "steps_done": state.get("step", 0), "steps_expected": self.steps,
            "episodes_expected": len(expected),
            "episodes_lost": len(expected - set(trained)),
            "episodes_trained_twice": sum(1 for n in trained.values() if n > 1),
            "episodes_unexpected": len(set(trained) - expected),
            "injected": dict(self.injected), "dead_letters": dict(by_kind),
            "events": self.events,
            "throughput": getattr(self, "samples", []),
        }
        result["ok"] = (result["episodes_lost"] == 0 and result["episodes_trained_twice"] == 0
                        and result["episodes_unexpected"] == 0
                        and dict(by_kind) == dict(self.injected))
        return result

    async def dead_letters(self) -> list[DeadLetter]:
        consumer = AIOKafkaConsumer(self.topics.dlq, bootstrap_servers=self.cluster.bootstrap,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            out: list[DeadLetter] = []
            while True:
                batch = await consumer.getmany(timeout_ms=3000)
                if not batch:
                    return out
                out += [decode(r.value, DeadLetter) for rs in batch.values() for r in rs]
        finally:
            await consumer.stop()


def _kind(letter: DeadLetter) -> str:
    """Which injected kind a dead letter is (or "other": a finding)."""
    if "not msgpack" in letter.error or "expected a map" in letter.error:
        return "garbage"
    if "no task named 'no_such_task'" in letter.error:
        return "unknown_task"
    if "group_size 1000000000" in letter.error:
        return "huge_group" if letter.source_topic.endswith(".trajectories") else "poison"
    return "other"


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    pts = result["throughput"]
    if len(pts) > 1:
        times, trained = zip(*pts, strict=True)
        best = list(itertools.accumulate(trained, max))  # a restarted learner resumes at
        rate = []  # its checkpoint: count each episode when it is first trained
        for i, t in enumerate(times):
            j = next(k for k in range(i + 1) if times[k] >= t - WINDOW_S)
            rate.append((best[i] - best[j]) / max(t - times[j], 1e-6) if i > j else 0.0)
        ax.plot(times, rate, lw=1.0, color="tab:blue",
                label=f"episodes trained / s ({WINDOW_S:.0f} s window)")
        offered = result["episodes_expected"] / (result["minutes"] * 60)
        ax.axhline(offered, color="tab:blue", lw=0.8, ls="--",
                   label=f"offered: {offered:.1f} episodes / s (the driver's prompt pace)")
    colors = {"SIGKILL": "tab:red", "broker": "black", "joined": "tab:green",
              "left": "tab:olive", "injected": "tab:purple"}
    for at, what in result["events"]:
        color = next((c for k, c in colors.items() if k in what), "grey")
        ax.axvline(at, color=color, lw=0.6, alpha=0.6)
    ax.set_xlabel("seconds since the services were started")
    ax.set_ylabel("episodes trained per second")
    ax.set_title(f"chaos soak: {result['episodes_expected']} episodes, lost "
                 f"{result['episodes_lost']}, trained twice {result['episodes_trained_twice']}"
                 " (red: SIGKILL, black: broker, green/olive: members join/leave, purple: bad"
                 " input)", fontsize=9)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos",
                                description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=8.0, help="length of the chaos phase")
    p.add_argument("--drain-minutes", type=float, default=4.0,
                   help="longest wait for the learner after the chaos")
    p.add_argument("--groups", type=int, default=None,
                   help="prompts to feed (default: 1 per 2 s of chaos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.groups = args.groups or max(4, int(args.minutes * 30)) // 2 * 2
    args.out = report.output_folder(args.out, "chaos")
    say("starting a 3-node Kafka cluster")
    cluster = LocalCluster(nodes=3).start(timeout=120)
    try:
        result = asyncio.run(Soak(args, cluster).run())
    finally:
        cluster.stop(timeout=20)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    png = plot(result, args.out / "chaos.png")
    for key in ("steps_done", "steps_expected", "episodes_expected", "episodes_lost",
                "episodes_trained_twice", "episodes_unexpected", "injected", "dead_letters"):
        print(f"{key:>24}: {result[key]}")
    print(f"{'verdict':>24}: {'OK' if result['ok'] else 'FAILED'}  ({png})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m loadtest.gateway_bench``: what the OpenAI gateway costs per call.

Side by side in one run, over the same broker, rollout instance and inference replica (the
synthetic engine at zero latency, so only the path is measured), in one process on the
event loop the services use (uvloop unless ``--event-loop asyncio``):

- **direct**: one StepRequest round trip, as the built-in agent makes it (``Rollout._ask``);
- **gateway**: one chat completion through the official ``openai`` client to the rollout
  tier's gateway, which renders the chat template, makes the same StepRequest and answers;
- **stream**: the same with ``stream=True``, timed until the last event is read;
- **http**: the same request as a plain ``httpx`` POST, its answer read with ``json()``:
  the gateway without the SDK's own work (building the request, parsing the answer).

An agent makes several calls per episode with one client: each measured session has its
own client (so its first call opens the connection, later ones reuse it) and
plays ``--turns`` turns, appending each reply and a new user message. Each direct call
sends a context as long as that turn's gateway context (recorded in the warm-up). Calls are
sequential (one in flight) and interleaved: each turn times one call of every arm, in an
order that rotates, so a slow moment of a busy machine falls on all arms alike. Warm-up
sessions (every arm) are left out. Besides wall-clock percentiles, each arm's CPU time per
call (this process: client, gateway and both services) is less sensitive to other load.

Then ``--sessions`` one-call sessions at once through the gateway, each with a new client,
give sessions/s. Prints a table and writes ``gateway_bench.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from rlbus.api import ChatAgent, ChatSession, Generation
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.chat_model import build_chat_model
from rlbus.messages import Prompt, Sampling
from rlbus.ops.broker import bootstrap_or_start
from rlbus.rollout.service import KafkaPolicy, Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.runner import loop_factory
from rlbus.settings import KafkaSettings, ServiceSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus

SYSTEM = {"role": "system", "content": "you are terse"}
QUESTION = "what is {} + 2 ? answer with a number"
ARMS = ("direct", "http", "gateway", "stream")
PROMPT = Prompt(group_id="bench", task="guess_number", spec={}, group_size=1,
                sampling=Sampling(max_new_tokens=8))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@dataclass
class Timings:
    """Per arm: wall and CPU seconds of every measured call, and of first calls apart."""

    wall: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    first: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})

    def add(self, arm: str, wall: float, cpu: float, first: bool) -> None:
        self.wall[arm].append(wall)
        self.cpu[arm].append(cpu)
        if first:
            self.first[arm].append(wall)

    def summary(self, arm: str) -> dict[str, float]:
        ms, wall = 1000.0, self.wall[arm]
        return {"p50": pct(wall, 0.5) * ms, "p99": pct(wall, 0.99) * ms,
                "mean": statistics.mean(wall) * ms,
                "cpu_mean": statistics.mean(self.cpu[arm]) * ms,
                "first_call_p50": pct(self.first[arm], 0.5) * ms}


class Recording:
    """A policy that keeps the context of each call (what a direct call of that turn sends)."""

    def __init__(self, policy: KafkaPolicy) -> None:
        self.policy = policy
        self.contexts: list[list[int]] = []

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        self.contexts.append(list(input_ids))
        return await self.policy.generate(input_ids, sampling)


class Chat:
    """One measured session of one arm: its client, its conversation, its turn."""

    def __init__(self, rollout: Rollout, name: str, arm: str) -> None:
        self.rollout, self.name, self.arm = rollout, name, arm
        self.messages: list[dict[str, Any]] = [SYSTEM, {"role": "user",
                                                        "content": QUESTION.format(0)}]
        self.policy = Recording(KafkaPolicy(rollout, PROMPT, name))
        self.turn = 0

    async def call(self, client: Any, model: str) -> None:
        if self.arm == "http":
            r = await client.post("chat/completions", json={
                "model": model, "messages": self.messages, "max_tokens": 8})
            r.raise_for_status()
            content = r.json()["choices"][0]["message"]["content"] or ""
        elif self.arm == "stream":
            parts = []
            events = await client.chat.completions.create(
                model=model, messages=self.messages, max_tokens=8, stream=True)
            async for event in events:
                parts.extend(c.delta.content or "" for c in event.choices)
            content = "".join(parts)
        else:
            r = await client.chat.completions.create(model=model, messages=self.messages,
                                                     max_tokens=8)
            content = r.choices[0].message.content or ""
        self.turn += 1
        self.messages = [*self.messages, {"role": "assistant", "content": content},
                         {"role": "user", "content": QUESTION.format(self.turn)}]


async def timed(work: Awaitable[Any]) -> tuple[float, float]:
    c0, t0 = time.thread_time(), time.perf_counter()
    await work
    return time.perf_counter() - t0, time.thread_time() - c0


class Bench:
    """The arms over one rollout instance (and its gateway) and one inference replica."""

    def __init__(self, rollout: Rollout, arms: tuple[str, ...], turns: int) -> None:
        assert rollout.gateway is not None and rollout.tokenizer is not None
        self.rollout, self.gateway, self.tok = rollout, rollout.gateway, rollout.tokenizer.tok
        self.arms, self.turns = arms, turns
        self.contexts: list[list[int]] = []
        self.timings = Timings()

    async def record_contexts(self) -> None:
        """Play one gateway session: its contexts are what the direct arm sends per turn."""
        arms, self.arms = self.arms, ("gateway",)
        try:
            self.contexts = await self.session_round("contexts", measured=False)
        finally:
            self.arms = arms

    async def session_round(self, tag: str, measured: bool) -> list[list[int]]:
        """A session per gateway arm, ``turns`` turns, every arm timed once per turn in a
        rotating order; returns the contexts of the non-streamed session."""
        chats = {a: Chat(self.rollout, f"bench/{tag}-{a}", a)
                 for a in self.arms if a != "direct"}
        async with contextlib.AsyncExitStack() as stack:
            clients = {a: await self.client(stack, chat) for a, chat in chats.items()}
            for turn in range(self.turns):
                for k in range(len(self.arms)):
                    arm = self.arms[(turn + k) % len(self.arms)]
                    if arm == "direct":
                        work = self.rollout._ask(f"bench/{tag}-direct", turn,
                                                 list(self.contexts[turn]), PROMPT,
                                                 PROMPT.sampling)
                    else:
                        work = chats[arm].call(clients[arm], self.gateway.model)
                    wall, cpu = await timed(work)
                    if measured:
                        self.timings.add(arm, wall, cpu, first=turn == 0)
        return chats["gateway"].policy.contexts if "gateway" in chats else []

    async def client(self, stack: contextlib.AsyncExitStack, chat: Chat) -> Any:
        """A gateway session for ``chat`` and the agent's client for it, as an agent has."""
        s = await stack.enter_async_context(self.gateway.session(
            policy=chat.policy, tokenizer=self.tok, sampling=PROMPT.sampling,
            max_context_tokens=4096))
        url = self.gateway.base_url(s.id)
        if chat.arm == "http":
            plain = httpx.AsyncClient(base_url=url + "/", timeout=30)
            stack.push_async_callback(plain.aclose)
            return plain
        client = openai.AsyncOpenAI(base_url=url, api_key=s.id, max_retries=0)
        stack.push_async_callback(client.close)
        return client

    async def one_call_session(self, i: int) -> None:
        async with self.gateway.session(
                policy=KafkaPolicy(self.rollout, PROMPT, f"bench/c{i}"), tokenizer=self.tok,
                sampling=PROMPT.sampling, max_context_tokens=4096) as s:
            client = openai.AsyncOpenAI(base_url=self.gateway.base_url(s.id), api_key=s.id,
                                        max_retries=0)
            await client.chat.completions.create(model=self.gateway.model,
                                                 messages=[SYSTEM, {"role": "user",
                                                           "content": QUESTION.format(0)}],
                                                 max_tokens=8)
            await client.close()

    async def run(self, warmup: int, measured: int, sessions: int) -> dict[str, Any]:
        await self.record_contexts()
        for i in range(warmup):
            await self.session_round(f"w{i}", measured=False)
        for i in range(measured):
            await self.session_round(f"m{i}", measured=True)
        t0 = time.perf_counter()
        await asyncio.gather(*(self.one_call_session(i) for i in range(sessions)))
        wall = time.perf_counter() - t0
        return {"arms": {a: self.timings.summary(a) for a in self.arms},
                "calls_per_arm": measured * self.turns, "sessions_per_s": sessions / wall}


async def bench(bootstrap: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    kafka = KafkaSettings(bootstrap=bootstrap)
    topics = TopicSettings(prefix=f"gwbench-{int(time.time())}", partitions=2,
                           result_partitions=2)
    await ensure_topics(kafka, topics)
    common = {"kafka": kafka, "topics": topics}
    dlq = Topics(topics).dlq
    inference = Inference(InferenceSettings(**common, engine="synthetic", batch_wait_ms=0,
                                            synthetic={"base_ms": 0, "per_token_ms": 0}),
                          KafkaBus(kafka, dlq_topic=dlq, service="inference"))
    rollout = Rollout(RolloutSettings(**common, model_path=model,
                                      agent="loadtest.gateway_bench:NoAgent",
                                      max_concurrent_episodes=args.sessions),
                      KafkaBus(kafka, dlq_topic=dlq, service="rollout"))
    runs = [asyncio.create_task(s.run()) for s in (inference, rollout)]
    try:
        while rollout.gateway is None or rollout.gateway.port == 0:
            for r in runs:
                if r.done():
                    r.result()  # a service that failed to start: say why
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)  # consumer groups settle
        arms = tuple(a for a in ARMS if a != "stream" or args.stream)
        result = await Bench(rollout, arms, args.turns).run(args.warmup, args.measured,
                                                            args.sessions)
    finally:
        for s in (inference, rollout):
            s.request_stop("bench over")
        await asyncio.gather(*runs, return_exceptions=True)
    return {"event_loop": args.event_loop, "turns": args.turns, "sessions": args.sessions,
            **result}


class NoAgent(ChatAgent):
    """Only there to make the rollout start its gateway (no prompts are fed)."""

    async def run(self, session: ChatSession) -> None:
        raise RuntimeError("never called: the benchmark feeds no prompts")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gateway_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--measured", type=int, default=75, help="measured sessions per arm")
    p.add_argument("--turns", type=int, default=4, help="calls per session")
    p.add_argument("--warmup", type=int, default=5, help="sessions per arm left out")
    p.add_argument("--sessions", type=int, default=64, help="one-call sessions at once")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="leave out the streamed arm")
    p.add_argument("--event-loop", choices=["uvloop", "asyncio"],
                   default=ServiceSettings.model_fields["event_loop"].default)
    p.add_argument("--out", type=Path, default=Path("runs"))
    args = p.parse_args(argv)
    bootstrap, cluster = bootstrap_or_start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build_chat_model(Path(tmp) / "chat")
            with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
                result = runner.run(bench(bootstrap, model, args))
    finally:
        if cluster is not None:
            cluster.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    arms = result["arms"]
    lines = [f"{result['calls_per_arm']} calls per arm ({result['turns']} per session, "
             f"interleaved), event loop {result['event_loop']}",
             f"{'per call (ms)':<14}{'p50':>8}{'p99':>8}{'mean':>8}{'cpu':>8}{'1st p50':>9}"]
    lines += [f"{a:<14}{t['p50']:8.2f}{t['p99']:8.2f}{t['mean']:8.2f}{t['cpu_mean']:8.2f}"
              f"{t['first_call_p50']:9.2f}" for a, t in arms.items()]
    d = arms["direct"]
    lines += [f"{a} / direct: p50 {t['p50'] / d['p50']:.2f}x, p99 {t['p99'] / d['p99']:.2f}x, "
              f"+{t['cpu_mean'] - d['cpu_mean']:.2f} ms CPU per call"
              for a, t in arms.items() if a != "direct"]
    lines.append(f"{result['sessions']} concurrent one-call sessions (a new client each): "
                 f"{result['sessions_per_s']:.1f} sessions/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

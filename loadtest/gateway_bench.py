"""``python -m loadtest.gateway_bench``: what the OpenAI gateway costs per call.

Side by side in one run, over the same broker, rollout instance and inference replica (the
synthetic engine at zero latency, so only the path is measured):

- **direct**: one StepRequest round trip, as the built-in agent makes it (``Rollout._ask``);
- **gateway**: one chat completion through the official ``openai`` client to the rollout
  tier's gateway, which renders the chat template, makes the same StepRequest and answers.

Calls are sequential (one in flight) for the latency percentiles; then ``--sessions``
one-call sessions at once through the gateway give sessions/s. Prints a table and writes
``gateway_bench.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from rlbus.api import ChatAgent, ChatSession
from rlbus.inference.service import Inference
from rlbus.inference.settings import InferenceSettings
from rlbus.learner.chat_model import build_chat_model
from rlbus.messages import Prompt, Sampling
from rlbus.ops.broker import bootstrap_or_start
from rlbus.rollout.service import KafkaPolicy, Rollout
from rlbus.rollout.settings import RolloutSettings
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus

MESSAGES = [{"role": "system", "content": "you are terse"},
            {"role": "user", "content": "what is 2 + 2 ? answer with a number"}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def bench(bootstrap: str, model: Path, calls: int, sessions: int) -> dict[str, Any]:
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
                                      max_concurrent_episodes=sessions),
                      KafkaBus(kafka, dlq_topic=dlq, service="rollout"))
    runs = [asyncio.create_task(s.run()) for s in (inference, rollout)]
    try:
        while rollout.gateway is None or rollout.gateway.port == 0:
            for r in runs:
                if r.done():
                    r.result()  # a service that failed to start: say why
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)  # consumer groups settle
        tok = rollout.tokenizer.tok  # type: ignore[union-attr]
        prompt = Prompt(group_id="bench", task="guess_number", spec={}, group_size=1,
                        sampling=Sampling(max_new_tokens=8))
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        direct = []
        for i in range(calls):
            t0 = time.perf_counter()
            await rollout._ask(f"bench/d{i}", 0, list(ids), prompt, prompt.sampling)
            direct.append(time.perf_counter() - t0)
        gateway = rollout.gateway
        via = []
        for i in range(calls):
            async with gateway.session(policy=KafkaPolicy(rollout, prompt, f"bench/g{i}"),
                                       tokenizer=tok, sampling=prompt.sampling,
                                       max_context_tokens=4096) as s:
                client = openai.AsyncOpenAI(base_url=gateway.base_url(s.id), api_key=s.id,
                                            max_retries=0)
                t0 = time.perf_counter()
                await client.chat.completions.create(model=gateway.model, messages=MESSAGES,
                                                     max_tokens=8)
                via.append(time.perf_counter() - t0)
                await client.close()

        async def one(i: int) -> None:
            async with gateway.session(policy=KafkaPolicy(rollout, prompt, f"bench/c{i}"),
                                       tokenizer=tok, sampling=prompt.sampling,
                                       max_context_tokens=4096) as s:
                client = openai.AsyncOpenAI(base_url=gateway.base_url(s.id), api_key=s.id,
                                            max_retries=0)
                await client.chat.completions.create(model=gateway.model, messages=MESSAGES,
                                                     max_tokens=8)
                await client.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        wall = time.perf_counter() - t0
    finally:
        for s in (inference, rollout):
            s.request_stop("bench over")
        await asyncio.gather(*runs, return_exceptions=True)
    ms = 1000.0
    return {
        "calls": calls, "sessions": sessions,
        "direct_ms": {"p50": pct(direct, 0.5) * ms, "p99": pct(direct, 0.99) * ms,
                      "mean": statistics.mean(direct) * ms},
        "gateway_ms": {"p50": pct(via, 0.5) * ms, "p99": pct(via, 0.99) * ms,
                       "mean": statistics.mean(via) * ms},
        "sessions_per_s": sessions / wall,
    }


class NoAgent(ChatAgent):
    """Only there to make the rollout start its gateway (no prompts are fed)."""

    async def run(self, session: ChatSession) -> None:
        raise RuntimeError("never called: the benchmark feeds no prompts")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gateway_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("runs"))
    args = p.parse_args(argv)
    bootstrap, cluster = bootstrap_or_start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build_chat_model(Path(tmp) / "chat")
            result = asyncio.run(bench(bootstrap, model, args.calls, args.sessions))
    finally:
        if cluster is not None:
            cluster.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    d, g = result["direct_ms"], result["gateway_ms"]
    print(f"{'per call (ms)':<16}{'p50':>8}{'p99':>8}{'mean':>8}")
    print(f"{'direct':<16}{d['p50']:8.2f}{d['p99']:8.2f}{d['mean']:8.2f}")
    print(f"{'gateway':<16}{g['p50']:8.2f}{g['p99']:8.2f}{g['mean']:8.2f}")
    print(f"gateway adds {g['p50'] - d['p50']:.2f} ms at p50 ({g['p50'] / d['p50']:.1f}x); "
          f"{result['sessions']} concurrent one-call sessions: "
          f"{result['sessions_per_s']:.1f} sessions/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

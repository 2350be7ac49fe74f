"""Existing agent code, trained: a ChatAgent written with the official `openai` SDK plays
episodes through the rollout tier's gateway, over the real broker, against a real (tiny,
random-init Qwen2) chat model served by the `hf` engine, and the learner trains on the exact
tokens recorded. 32 episodes run at once (4 groups of 8)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from rlbus.api import ChatAgent, ChatSession
from rlbus.services.learner.chat_model import build_chat_model
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import bus_factory, run_pipeline, settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "adds two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


class TwoTurnAgent(ChatAgent):
    """An agent as users write them: an OpenAI client, a conversation, tool calls handled."""

    async def run(self, session: ChatSession) -> None:
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                    max_retries=0)
        messages: list = [{"role": "system", "content": "answer with one number"},
                          {"role": "user", "content": await session.env.reset(session.spec)}]
        for _ in range(2):
            r = await client.chat.completions.create(model=session.model, messages=messages,
                                                     tools=TOOLS, max_tokens=6)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:  # a random model rarely calls; handled anyway
                try:
                    args = json.loads(call.function.arguments)
                    result = str(int(args["a"]) + int(args["b"]))
                except (ValueError, KeyError, TypeError) as exc:
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not msg.tool_calls:
                outcome = await session.env.step(msg.content or "")
                if outcome.done:
                    return
                messages.append({"role": "user", "content": outcome.observation})


AGENT = f"{__name__}:TwoTurnAgent"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat"))


async def test_an_openai_agent_trains_through_the_gateway(kafka_bootstrap, unique_name,
                                                          chat_model, tmp_path):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("gw"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(chat_model, tmp_path, {"kafka": kafka, "topics": topics},
                 max_steps=1, groups_per_step=4, group_size=8, max_new_tokens=6)
    s["rollout"] = s["rollout"].model_copy(update={"agent": AGENT, "max_context_tokens": 2048,
                                                   "max_concurrent_episodes": 32})
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq))
    learner, (_, reward, rollout) = out["learner"], out["others"]

    assert learner.step == 1
    assert reward.handled == 32
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "loss" in r]
    assert row["episodes"] == 32
    # Every episode is two gateway calls, recorded exactly (the first rendered by the chat
    # template, the second the recorded ids + the new messages only). The documented rule
    # for a history that no longer renders to the tokens the model saw (fail the episode)
    # does not fire: the agent echoes what it was sent, and the template is prefix-stable.
    assert row["masked"] == 0 and row["turns_mean"] == 2.0, row
    assert rollout.gateway is not None and not rollout.gateway.sessions  # all closed
    assert rollout.counters.get("failed_episodes", 0) == row["masked"]


async def test_a_chat_agent_needs_the_policy_tokenizer(unique_name):
    from rlbus.services.rollout.service import Rollout
    from rlbus.services.rollout.settings import RolloutSettings
    from rlbus.topics import memory_broker
    from rlbus.transport import MemoryBus

    topics = TopicSettings(prefix=unique_name("gwtok"), partitions=1, result_partitions=1)
    rollout = Rollout(RolloutSettings(topics=topics, tokenizer="synthetic", agent=AGENT),
                      MemoryBus(memory_broker(topics)))
    with pytest.raises(ValueError, match="needs the policy's own tokenizer"):
        await asyncio.wait_for(rollout.run(), 30)

"""Claude-style agent code, trained: a ChatAgent written with the official `anthropic` SDK
plays episodes through the rollout tier's ``/v1/messages``, over the real broker, against a
real (tiny, random-init Qwen2) chat model served by the `hf` engine, and the learner trains
on the exact tokens recorded."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")

from rlbus.api import ChatAgent, ChatSession  # noqa: E402
from rlbus.learner.chat_model import build_chat_model  # noqa: E402
from rlbus.settings import KafkaSettings, TopicSettings  # noqa: E402
from rlbus.topics import Topics, ensure_topics  # noqa: E402
from rlbus.transport import KafkaBus  # noqa: E402
from tests.pipeline import bus_factory, run_pipeline, settings  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TOOLS = [{"name": "add", "description": "adds two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


class ClaudeStyleAgent(ChatAgent):
    """An agent as Anthropic-SDK users write them: system prompt, tools, tool_use handled."""

    async def run(self, session: ChatSession) -> None:
        client = anthropic.AsyncAnthropic(base_url=session.anthropic_base_url,
                                          api_key=session.api_key, max_retries=0)
        messages: list = [{"role": "user", "content": await session.env.reset(session.spec)}]
        for _ in range(2):
            r = await client.messages.create(model=session.model, max_tokens=6, tools=TOOLS,
                                             system="answer with one number", messages=messages)
            messages.append(r.to_param())
            uses = [b for b in r.content if b.type == "tool_use"]
            if uses:  # a random model rarely calls; handled anyway
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": _add(b.input)}
                    for b in uses]})
                continue
            text = "".join(b.text for b in r.content if b.type == "text")
            outcome = await session.env.step(text)
            if outcome.done:
                return
            messages.append({"role": "user", "content": outcome.observation})


def _add(arguments: dict) -> str:
    try:
        return str(int(arguments["a"]) + int(arguments["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat"))


async def test_an_anthropic_agent_trains_through_the_gateway(kafka_bootstrap, unique_name,
                                                             chat_model, tmp_path):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("gwa"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(chat_model, tmp_path, {"kafka": kafka, "topics": topics},
                 max_steps=1, groups_per_step=2, group_size=4, max_new_tokens=6)
    s["rollout"] = s["rollout"].model_copy(update={
        "agent": f"{__name__}:ClaudeStyleAgent", "max_context_tokens": 2048})
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq))
    learner, (_, reward, rollout) = out["learner"], out["others"]

    assert learner.step == 1 and reward.handled == 8
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "loss" in r]
    # every episode is two calls recorded exactly, one segment: the second call's history
    # (Anthropic blocks sent back as the SDK sends them) extended the tokens the model saw
    assert row["episodes"] == 8 and row["masked"] == 0 and row["turns_mean"] == 2.0, row
    assert row["segments"] == 8, row
    assert rollout.gateway is not None and not rollout.gateway.sessions

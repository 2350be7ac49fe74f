"""Existing agent code, trained: a ChatAgent written with the official `openai` SDK plays
episodes through the rollout tier's gateway, over the real broker, against a real (tiny,
random-init Qwen2) chat model served by the `hf` engine, and the learner trains on the exact
tokens recorded. 32 episodes run at once (4 groups of 8). Then the gateway's edge cases over
Kafka: chat, bad requests, a disconnect, and a tool round trip with a model taught to call."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from rlbus.api import ChatAgent, ChatSession
from rlbus.learner.chat_model import build_chat_model
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import bus_factory, run_pipeline, settings
from tests.polling import wait_until

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
    # template, the second the recorded ids + the new messages only): one segment each.
    # The documented rule for a history that no longer renders to the tokens the model saw
    # (a new segment) does not fire: the agent echoes what it was sent, and the template
    # is prefix-stable.
    assert row["masked"] == 0 and row["turns_mean"] == 2.0, row
    assert row["segments"] == 32, row
    assert rollout.gateway is not None and not rollout.gateway.sessions  # all closed
    assert rollout.counters.get("failed_episodes", 0) == row["masked"]


class TrimmingAgent(ChatAgent):
    """An agent that keeps its memory short: its third call drops the first exchange and
    carries a summary instead, so the history does not extend what the model was given."""

    async def run(self, session: ChatSession) -> None:
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                    max_retries=0)
        system = {"role": "system", "content": "answer with one number"}
        messages: list = [system, {"role": "user",
                                   "content": await session.env.reset(session.spec)}]
        for ask in ("try again", None):
            r = await client.chat.completions.create(model=session.model, messages=messages,
                                                     max_tokens=6)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": ask or "last try"}]
        messages = [system, {"role": "user", "content": "(earlier guesses summarised)"},
                    *messages[-2:]]
        await client.chat.completions.create(model=session.model, messages=messages,
                                             max_tokens=6)
        await client.close()


async def test_an_agent_that_trims_its_history_trains_each_segment(
        kafka_bootstrap, unique_name, chat_model, tmp_path):
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("gwseg"), partitions=2, result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(chat_model, tmp_path, {"kafka": kafka, "topics": topics},
                 max_steps=1, groups_per_step=2, group_size=4, max_new_tokens=6,
                 entropy_coef=0.01)  # a group that scored alike trains too (its entropy)
    s["rollout"] = s["rollout"].model_copy(update={
        "agent": f"{__name__}:TrimmingAgent", "max_context_tokens": 2048})
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq))
    assert out["learner"].step == 1
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "loss" in r]
    # 8 episodes of 3 calls: calls 1-2 one segment, the trimmed call 3 another; all trained
    assert (row["episodes"], row["masked"], row["turns_mean"]) == (8, 0, 3.0), row
    assert row["segments"] == 16 and row["loss"] is not None and row["entropy"] > 0, row


async def test_a_chat_agent_needs_the_policy_tokenizer(unique_name):
    from rlbus.rollout.service import Rollout
    from rlbus.rollout.settings import RolloutSettings
    from rlbus.topics import memory_broker
    from rlbus.transport import MemoryBus

    topics = TopicSettings(prefix=unique_name("gwtok"), partitions=1, result_partitions=1)
    rollout = Rollout(RolloutSettings(topics=topics, tokenizer="synthetic", agent=AGENT),
                      MemoryBus(memory_broker(topics)))
    with pytest.raises(ValueError, match="needs the policy's own tokenizer"):
        await asyncio.wait_for(rollout.run(), 30)


# ------------------------------------------------------- the gateway's edge cases, over Kafka


class Idle(ChatAgent):
    """Makes the rollout start its gateway; the test opens sessions itself."""

    async def run(self, session: ChatSession) -> None:
        raise RuntimeError("no prompts are fed in these tests")


@pytest.fixture
async def served(kafka_bootstrap, unique_name, chat_model):
    """A rollout instance with its gateway, and an inference replica (synthetic engine,
    400 ms a batch, so a call can be interrupted), over the real broker."""
    from rlbus.inference.service import Inference
    from rlbus.inference.settings import InferenceSettings
    from rlbus.rollout.service import Rollout
    from rlbus.rollout.settings import RolloutSettings

    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("gwe"), partitions=1, result_partitions=1)
    await ensure_topics(kafka, topics)
    common = {"kafka": kafka, "topics": topics}
    inference = Inference(InferenceSettings(**common, engine="synthetic",
                                            synthetic={"base_ms": 400, "per_token_ms": 0}),
                          KafkaBus(kafka, dlq_topic=None, service="inference"))
    rollout = Rollout(RolloutSettings(**common, model_path=chat_model,
                                      agent=f"{__name__}:Idle", max_context_tokens=512),
                      KafkaBus(kafka, dlq_topic=None, service="rollout"))
    runs = [asyncio.create_task(s.run()) for s in (inference, rollout)]
    while rollout.gateway is None or rollout.gateway.port == 0:
        for r in runs:
            if r.done():
                r.result()
        await asyncio.sleep(0.05)
    yield rollout
    for s in (inference, rollout):
        s.request_stop("test over")
    await asyncio.gather(*runs)


def _session(rollout, name: str):
    from rlbus.messages import Prompt, Sampling
    from rlbus.rollout.service import KafkaPolicy

    prompt = Prompt(group_id=name, task="guess_number", spec={}, group_size=1,
                    sampling=Sampling(max_new_tokens=8))
    return rollout.gateway.session(policy=KafkaPolicy(rollout, prompt, f"{name}/0"),
                                   tokenizer=rollout.tokenizer.tok, sampling=prompt.sampling,
                                   max_context_tokens=512)


async def test_plain_and_multi_turn_chat_over_kafka(served):
    async with _session(served, "chat") as s:
        client = openai.AsyncOpenAI(base_url=served.gateway.base_url(s.id), api_key=s.id,
                                    max_retries=0)
        messages: list = [{"role": "user", "content": "hello"}]
        for turn in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"and now {turn}?"})
        assert s.failed is None and len(s.turns) == 3
        assert all(t.policy_version == 0 and len(t.completion_ids) == 8 for t in s.turns)
        await client.close()
        assert r.usage.prompt_tokens == sum(len(t.input_ids) + len(t.completion_ids)
                                            for t in s.turns[:2]) + len(s.turns[2].input_ids)


async def test_bad_requests_and_a_disconnect_over_kafka(served):
    async with _session(served, "bad") as s:
        client = openai.AsyncOpenAI(base_url=served.gateway.base_url(s.id), api_key=s.id,
                                    max_retries=0)
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=hi)
        with pytest.raises(openai.BadRequestError, match="context is 512 tokens") as err:
            await client.chat.completions.create(model="policy", messages=hi, max_tokens=600)
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="n: must be 1"):
            await client.chat.completions.create(model="policy", messages=hi, n=3)
        with pytest.raises(openai.BadRequestError, match="logprobs: is not returned"):
            await client.chat.completions.create(model="policy", messages=hi, top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="unsupported parameter: best_of"):
            await client.chat.completions.create(model="policy", messages=hi,
                                                 extra_body={"best_of": 2})
        assert s.failed is None and not s.turns
        impatient = openai.AsyncOpenAI(base_url=served.gateway.base_url(s.id), api_key=s.id,
                                       max_retries=0, timeout=0.1)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="policy", messages=hi)
        # the call is given up (no request left waiting: a late answer finds nothing to
        # deliver to); nothing of it is recorded, and the session goes on
        await wait_until(lambda: not served._pending and not s.busy, "the call is given up")
        assert s.failed is None and not s.turns
        await client.close()
        await impatient.close()


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """The chat model, taught (70-odd steps of supervised fine-tuning on one example) to
    answer "what is 2 + 40?" with a well-formed call of its `add` tool: a random-init model
    never writes one, and the round trip needs a model that does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_chat_model(tmp_path_factory.mktemp("tool_caller"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                     tokenize=False)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    t_ids = [*tok.encode(TOOL_CALL, add_special_tokens=False), tok.eos_token_id]
    ids = torch.tensor([p_ids + t_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.save_pretrained(folder)
    return folder


QUESTION = [{"role": "user", "content": "what is 2 + 40?"}]
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


async def test_a_tool_round_trip_over_kafka(kafka_bootstrap, unique_name, tool_caller):
    from rlbus.inference.service import Inference
    from rlbus.inference.settings import InferenceSettings
    from rlbus.messages import Prompt, Sampling
    from rlbus.rollout.service import KafkaPolicy, Rollout
    from rlbus.rollout.settings import RolloutSettings

    kafka = KafkaSettings(bootstrap=kafka_bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=unique_name("gwt"), partitions=1, result_partitions=1)
    await ensure_topics(kafka, topics)
    common = {"kafka": kafka, "topics": topics}
    inference = Inference(InferenceSettings(**common, model_path=tool_caller, batch_wait_ms=1),
                          KafkaBus(kafka, dlq_topic=None, service="inference"))
    rollout = Rollout(RolloutSettings(**common, model_path=tool_caller,
                                      agent=f"{__name__}:Idle"),
                      KafkaBus(kafka, dlq_topic=None, service="rollout"))
    runs = [asyncio.create_task(s.run()) for s in (inference, rollout)]
    try:
        while rollout.gateway is None or rollout.gateway.port == 0:
            for r in runs:
                if r.done():
                    r.result()
            await asyncio.sleep(0.05)
        prompt = Prompt(group_id="tool", task="guess_number", spec={}, group_size=1,
                        sampling=Sampling(max_new_tokens=40))
        async with rollout.gateway.session(
            policy=KafkaPolicy(rollout, prompt, "tool/0"), tokenizer=rollout.tokenizer.tok,
            sampling=prompt.sampling, max_context_tokens=2048,
        ) as s:
            client = openai.AsyncOpenAI(base_url=rollout.gateway.base_url(s.id),
                                        api_key=s.id, max_retries=0)
            messages: list = list(QUESTION)
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
            (call,) = r.choices[0].message.tool_calls
            args = json.loads(call.function.arguments)
            assert call.function.name == "add" and args == {"a": 2, "b": 40}
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args["a"] + args["b"])})
            again = await client.chat.completions.create(model="policy", messages=messages,
                                                         tools=TOOLS, temperature=0,
                                                         max_tokens=4)
            assert again.choices[0].message.role == "assistant"
            await client.close()
        assert s.failed is None and len(s.turns) == 2
        # the tool's answer reached the model as the template renders it, after its call
        tok = rollout.tokenizer.tok
        assert tok.decode(s.turns[0].completion_ids, skip_special_tokens=False).startswith(
            TOOL_CALL)
        assert "<tool_response>\n42\n</tool_response>" in tok.decode(s.turns[1].input_ids)
    finally:
        for svc in (inference, rollout):
            svc.request_stop("test over")
        await asyncio.gather(*runs)

"""Anthropic's Messages API on the gateway, against the official `anthropic` SDK with a
scripted policy: every recorded context is checked against the chat template's rendering of
the conversation the Anthropic messages mean."""

from __future__ import annotations

import asyncio
import json

import pytest

anthropic = pytest.importorskip("anthropic")

import httpx  # noqa: E402

from rlbus.api import ChatSession  # noqa: E402
from rlbus.messages import Sampling  # noqa: E402
from rlbus.rollout.gateway import Gateway  # noqa: E402
from rlbus.rollout.gateway_anthropic import parse, to_chat  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from tests.unit.rollout.conftest import Scripted  # noqa: E402

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
TOOLS = [{"name": "add", "description": "a + b", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b", "parameters": TOOLS[0]["input_schema"]}}]
USE = {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


def _base_url(g: Gateway, sid: str) -> str:
    return ChatSession(base_url=g.base_url(sid), api_key=sid, model=g.model, task=None,
                       spec={}, env=None).anthropic_base_url


def _client(g: Gateway, sid: str, **kw):
    return anthropic.AsyncAnthropic(base_url=_base_url(g, sid), api_key=sid, max_retries=0,
                                    **kw)


def _session(g: Gateway, tokenizer, replies: list[str], max_context_tokens: int = 4096,
             history: str = "segments"):
    policy = Scripted(tokenizer, replies)
    return policy, g.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                             max_context_tokens=max_context_tokens, history=history)


def _linear(s) -> bool:
    """Every call extended the recorded history (one training segment), nothing failed."""
    return s.failed is None and not any(t.fresh_context for t in s.turns)


def _rendered(tokenizer, chat: list[dict], tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True,
                                         tokenize=False)


def _seen(tokenizer, context: list[int]) -> str:
    return tokenizer.decode(context, skip_special_tokens=False)


def test_the_session_gives_an_anthropic_base_url():
    assert _base_url(Gateway("policy", port=8), "s1") == "http://127.0.0.1:8/s/s1"


def test_blocks_become_chat_messages_in_their_order():
    body = {"model": "policy", "max_tokens": 8, "system": "sys", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}, USE,
                                          {**USE, "id": "call_2", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "tool_result", "tool_use_id": "call_2", "content": "two"},
            {"type": "tool_result", "tool_use_id": "call_1", "is_error": True,
             "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "!"}]},
            {"type": "text", "text": "then"}]},
        {"role": "system", "content": "late"}, {"role": "user", "content": "end"}]}
    req = to_chat(parse(json.dumps(body).encode()))
    assert req.messages == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "user", "content": "first"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "tool", "tool_call_id": "call_1", "content": "Error: one\n!"},
        {"role": "user", "content": "then"}, {"role": "system", "content": "late"},
        {"role": "user", "content": "end"}]
    assert req.max_tokens == 8 and req.tools is None and req.tool_choice is None


async def test_a_conversation_with_a_system_prompt_records_exact_tokens(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["hello there", "four"])
    async with session as s:
        client = _client(gateway, s.id)
        system = [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]
        messages: list = [{"role": "user", "content": "hi"}]
        first = await client.messages.create(model="policy", max_tokens=32, system=system,
                                             messages=messages)
        assert first.id.startswith("msg_") and first.role == "assistant"
        assert first.model == "policy" and first.stop_reason == "end_turn"
        assert _blocks(first) == [{"type": "text", "text": "hello there"}]
        assert first.usage.input_tokens == len(policy.contexts[0])
        assert first.usage.output_tokens == len(s.turns[0].completion_ids)
        messages += [first.to_param(),
                     {"role": "user", "content": [{"type": "text", "text": "2 + 2"},
                                                  {"type": "text", "text": "?"}]}]
        second = await client.messages.create(model="policy", max_tokens=32, system="be brief",
                                              messages=messages, extra_body={"temperature": 0})
        assert second.content[0].text == "four"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "2 + 2\n?"}]
    t0, t1 = s.turns
    assert policy.contexts[1] == t0.input_ids + t0.completion_ids + t1.input_ids
    assert _seen(tokenizer, policy.contexts[1]) == _rendered(tokenizer, chat)
    assert _linear(s)


async def test_a_tool_round_trip(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["let me add\n" + CALL, "it is 42"])
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "what is 2 + 40?"}]
        r = await client.messages.create(model="policy", max_tokens=64, tools=TOOLS,
                                         tool_choice={"type": "auto"}, messages=messages)
        assert r.stop_reason == "tool_use"
        text, use = r.content
        assert text.type == "text" and text.text == "let me add"
        assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 40}
        messages += [{"role": "assistant", "content": r.content},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use.id,
                          "content": [{"type": "text", "text": "42"}]},
                         {"type": "text", "text": "and so?"}]}]
        r2 = await client.messages.create(model="policy", max_tokens=64, tools=TOOLS,
                                          messages=messages)
        assert r2.content[0].text == "it is 42" and r2.stop_reason == "end_turn"
    chat = [{"role": "user", "content": "what is 2 + 40?"},
            {"role": "assistant", "content": "let me add", "tool_calls": [
                {"id": use.id, "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "42"},
            {"role": "user", "content": "and so?"}]
    assert _seen(tokenizer, policy.contexts[1]) == _rendered(tokenizer, chat, CHAT_TOOLS)
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(s.turns[1].input_ids)
    assert _linear(s) and len(s.turns) == 2


async def test_a_failed_tool_says_so_to_the_policy(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, [CALL, "sorry"])
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "add"}]
        r = await client.messages.create(model="policy", max_tokens=64, tools=TOOLS,
                                         messages=messages)
        assert [b.type for b in r.content] == ["tool_use"]
        messages += [r.to_param(), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": r.content[0].id, "content": "overflow",
             "is_error": True}]}]
        await client.messages.create(model="policy", max_tokens=64, tools=TOOLS,
                                     messages=messages)
    call = {"id": r.content[0].id, "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}
    chat = [{"role": "user", "content": "add"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "Error: overflow"}]
    assert _seen(tokenizer, policy.contexts[1]) == _rendered(tokenizer, chat, CHAT_TOOLS)
    assert _linear(s)


async def test_tool_choice_none_returns_a_call_as_the_text_it_is(gateway, tokenizer):
    _, session = _session(gateway, tokenizer, [CALL])
    async with session as s:
        r = await _client(gateway, s.id).messages.create(
            model="policy", max_tokens=64, tools=TOOLS, tool_choice={"type": "none"},
            messages=HI)
    assert _blocks(r) == [{"type": "text", "text": CALL}] and r.stop_reason == "end_turn"


def _blocks(message, ids: bool = True) -> list[dict]:
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    return blocks if ids else [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def _stream_and_create(base_url: str, sid: str, other: str, kwargs: dict):
    """The sync client in a thread (the gateway serves on the test's event loop): the
    stream helper's final message in one session, the plain answer in another."""
    client = anthropic.Anthropic(base_url=base_url, api_key=sid, max_retries=0)
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    whole = client.messages.create(**kwargs, extra_headers={"x-api-key": other})
    return events, final, whole


@pytest.mark.parametrize("reply", ["plain words", "first " + CALL])
async def test_a_streamed_answer_is_the_whole_answer_and_records_the_same(gateway, tokenizer,
                                                                          reply):
    p1, session1 = _session(gateway, tokenizer, [reply])
    p2, session2 = _session(gateway, tokenizer, [reply])
    kwargs = dict(model="policy", max_tokens=64, tools=TOOLS,
                  messages=[{"role": "user", "content": "go"}])
    async with session1 as s1, session2 as s2:
        events, final, whole = await asyncio.to_thread(
            _stream_and_create, f"{gateway.url}", s1.id, s2.id, kwargs)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    # a tool call gets a fresh id in each session: all else is the same
    assert _blocks(final, ids=False) == _blocks(whole, ids=False)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    (t1,), (t2,) = s1.turns, s2.turns
    assert (t1.input_ids, t1.completion_ids) == (t2.input_ids, t2.completion_ids)
    assert p1.contexts == p2.contexts
    assert _seen(tokenizer, p1.contexts[0]) == _rendered(
        tokenizer, [{"role": "user", "content": "go"}], CHAT_TOOLS)


async def test_the_raw_stream_is_framed_as_anthropic_frames_it(gateway, tokenizer):
    text = "thinking aloud, at some length"  # two deltas of text, two of input JSON
    policy, session = _session(gateway, tokenizer, [f"{text} {CALL}"])
    async with session as s:
        stream = await _client(gateway, s.id).messages.create(
            model="policy", max_tokens=64, tools=TOOLS, stream=True,
            messages=[{"role": "user", "content": "go"}])
        events = [e async for e in stream]
    block = ["content_block_start", "content_block_delta", "content_block_delta",
             "content_block_stop"]
    assert [e.type for e in events] == ["message_start", *block, *block, "message_delta",
                                        "message_stop"]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.stop_sequence is None
    assert start.usage.input_tokens == len(policy.contexts[0])
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert {e.delta.type for e in events[2:4]} == {"text_delta"}
    assert "".join(e.delta.text for e in events[2:4]) == text
    assert events[5].content_block.type == "tool_use" and events[5].content_block.input == {}
    assert events[5].content_block.name == "add"
    assert {e.delta.type for e in events[6:8]} == {"input_json_delta"}
    assert json.loads("".join(e.delta.partial_json for e in events[6:8])) == {"a": 2, "b": 40}
    assert [e.index for e in events[1:9]] == [0] * 4 + [1] * 4
    assert events[9].delta.stop_reason == "tool_use"
    assert events[9].usage.output_tokens == len(s.turns[0].completion_ids)


async def test_a_stop_sequence_ends_the_answer_where_the_recorded_tokens_end(gateway,
                                                                            tokenizer):
    policy, session = _session(gateway, tokenizer, ["one two STOP three", "four STOP",
                                                    "five"])
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "count"}]
        r = await client.messages.create(model="policy", max_tokens=32, messages=messages,
                                         stop_sequences=["STOP"])
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
        (block,) = r.content
        assert "one two STOP three".startswith(block.text) and "STOP" not in block.text
        assert _seen(tokenizer, s.turns[0].completion_ids) == block.text  # returned = recorded
        messages += [r.to_param(), {"role": "user", "content": "more"}]
        async with client.messages.stream(model="policy", max_tokens=32, messages=messages,
                                          stop_sequences=["STOP", "never"]) as stream:
            streamed = await stream.get_final_message()
        # of several, which one matched is not known: its token was dropped with the rest
        assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence is None
        messages += [streamed.to_param(), {"role": "user", "content": "last"}]
        r3 = await client.messages.create(model="policy", max_tokens=32, messages=messages,
                                          stop_sequences=["STOP"])
        assert r3.stop_reason == "end_turn" and r3.stop_sequence is None
    assert _linear(s) and len(s.turns) == 3
    chat = [{"role": "user", "content": "count"},
            {"role": "assistant", "content": r.content[0].text},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": streamed.content[0].text},
            {"role": "user", "content": "last"}]
    # a cut answer has no end-of-turn token: the template's follows it in the context
    assert _seen(tokenizer, policy.contexts[2]) == _rendered(tokenizer, chat)


async def test_a_client_that_leaves_mid_stream_loses_nothing_recorded(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["one two three", "four"])
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "count"}]
        async with client.messages.stream(model="policy", max_tokens=32,
                                          messages=messages) as stream:
            async for event in stream:
                assert event.type == "message_start"
                break  # and the context manager closes the connection
        assert len(s.turns) == 1 and s.failed is None  # recorded before the first event
        messages += [{"role": "assistant", "content": "one two three"},
                     {"role": "user", "content": "go on"}]
        r = await client.messages.create(model="policy", max_tokens=32, messages=messages)
        assert r.content[0].text == "four"
    assert len(s.turns) == 2 and _linear(s)
    chat = [{"role": "user", "content": "count"},
            {"role": "assistant", "content": "one two three"},
            {"role": "user", "content": "go on"}]
    assert _seen(tokenizer, policy.contexts[1]) == _rendered(tokenizer, chat)


async def test_a_client_that_leaves_during_the_generation_cancels_only_that_call(
        gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["at last"])
    policy.gate.clear()
    async with session as s:
        with pytest.raises(anthropic.APITimeoutError):
            await _client(gateway, s.id, timeout=0.5).messages.create(
                model="policy", max_tokens=8, messages=HI)
        await wait_until(lambda: not s.busy, "the call is cancelled")
        assert not s.turns and s.failed is None
        policy.gate.set()
        r = await _client(gateway, s.id).messages.create(model="policy", max_tokens=8,
                                                         messages=HI)
        assert r.content[0].text == "at last" and len(s.turns) == 1


async def test_a_second_call_at_once_is_a_conflict(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["slow"])
    policy.gate.clear()
    async with session as s:
        client = _client(gateway, s.id)
        first = asyncio.create_task(client.messages.create(model="policy", max_tokens=8,
                                                           messages=HI))
        await wait_until(lambda: policy.contexts, "the first call reaches the policy")
        with pytest.raises(anthropic.ConflictError) as err:
            await client.messages.create(model="policy", max_tokens=8, messages=HI)
        assert err.value.type == "conflict_error" and err.value.error_code == "concurrent_call"
        policy.gate.set()
        assert (await first).content[0].text == "slow"
    assert len(s.turns) == 1 and s.failed is None


async def test_an_edited_history_starts_a_new_segment(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["one", "two"])
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "count"}]
        await client.messages.create(model="policy", max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": "ONE"}, {"role": "user", "content": "on"}]
        r = await client.messages.create(model="policy", max_tokens=8, messages=messages)
        assert r.content[0].text == "two"
    assert s.failed is None and [t.fresh_context for t in s.turns] == [False, True]
    chat = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "ONE"},
            {"role": "user", "content": "on"}]
    assert policy.contexts[1] == s.turns[1].input_ids  # all of it new: the template's text
    assert _seen(tokenizer, policy.contexts[1]) == _rendered(tokenizer, chat)


async def test_in_strict_mode_an_edited_history_fails_the_episode(gateway, tokenizer):
    _, session = _session(gateway, tokenizer, ["one", "two"], history="strict")
    async with session as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "count"}]
        await client.messages.create(model="policy", max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": "ONE"}, {"role": "user", "content": "on"}]
        with pytest.raises(anthropic.BadRequestError) as err:
            await client.messages.create(model="policy", max_tokens=8, messages=messages)
        assert err.value.error_code == "context_diverged"
        assert "other text than the tokens the model saw" in err.value.api_message
    assert s.failed and len(s.turns) == 1


async def test_the_session_is_found_by_either_api_key_header(gateway, tokenizer):
    _, session = _session(gateway, tokenizer, ["a", "b"])
    async with session as s:
        # the SDK on the bare host sends the key as a bearer token ...
        keyed = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=s.id, max_retries=0)
        r = await keyed.messages.create(model="policy", max_tokens=8,
                                        messages=[{"role": "user", "content": "x"}])
        assert r.content[0].text == "a"
        # ... older SDKs and Claude-style agents send x-api-key
        async with httpx.AsyncClient(base_url=gateway.url) as raw:
            r2 = await raw.post("/v1/messages", headers={"x-api-key": s.id,
                                                         "anthropic-version": "2023-06-01"},
                                json={"model": "policy", "max_tokens": 8, "messages": [
                                    {"role": "user", "content": "x"},
                                    {"role": "assistant", "content": "a"},
                                    {"role": "user", "content": "y"}]})
        assert r2.status_code == 200 and r2.json()["content"] == [{"type": "text", "text": "b"}]
    assert len(s.turns) == 2 and _linear(s)
    nobody = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        await nobody.messages.create(model="policy", max_tokens=8,
                                     messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"


BAD = [  # (create kwargs, exception, words the message must hold)
    (dict(model="claude-x", max_tokens=8, messages=HI), "NotFoundError", "claude-x"),
    (dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": [IMAGE]}]),
     "BadRequestError", "'image' are not supported: the policy reads text only"),
    (dict(model="policy", max_tokens=8, messages=HI, extra_body={"frobnicate": 1}),
     "BadRequestError", "unsupported parameter: frobnicate"),
    (dict(model="policy", max_tokens=8, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_2"}]}]),
     "BadRequestError", "'call_2' answers no tool_use"),
    (dict(model="policy", max_tokens=8, messages=HI, extra_body={"max_tokens": "many"}),
     "BadRequestError", "max_tokens"),
    (dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": 5}]),
     "BadRequestError", "messages.0.content"),
    (dict(model="policy", max_tokens=8, messages=HI, system=7), "BadRequestError", "system"),
    (dict(model="policy", max_tokens=0, messages=HI), "BadRequestError", "max_tokens"),
    (dict(model="policy", max_tokens=8, messages=HI, extra_body={"max_tokens": True}),
     "BadRequestError", "max_tokens"),
    (dict(model="policy", max_tokens=8, messages=[]), "BadRequestError", "messages"),
    (dict(model="policy", max_tokens=8, messages=HI, extra_body={"top_k": 5}),
     "BadRequestError", "top_k: is not supported"),
    (dict(model="policy", max_tokens=8, messages=HI, stop_sequences=list("abcde")),
     "BadRequestError", "stop_sequences is not supported: more than 4"),
    (dict(model="policy", max_tokens=8, messages=HI,
          thinking={"type": "enabled", "budget_tokens": 1024}),
     "BadRequestError", "thinking is not supported"),
    (dict(model="policy", max_tokens=8, messages=HI, tools=TOOLS, tool_choice={"type": "any"}),
     "BadRequestError", "tool_choice.type is not supported"),
    (dict(model="policy", max_tokens=8, messages=HI, tools=TOOLS,
          tool_choice={"type": "auto", "disable_parallel_tool_use": True}),
     "BadRequestError", "tool_choice.disable_parallel_tool_use is not supported"),
    (dict(model="policy", max_tokens=8, messages=HI,
          tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "BadRequestError", "tools.0: server tools such as 'web_search_20250305' are not"),
    (dict(model="policy", max_tokens=8, messages=[*HI, {"role": "assistant", "content": "Su"}]),
     "BadRequestError", "prefill"),
    (dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": [USE]}]),
     "BadRequestError", "a tool_use belongs in an assistant message"),
    (dict(model="policy", max_tokens=8, messages=HI, extra_body={"temperature": 1.5}),
     "BadRequestError", "temperature"),
    (dict(model="policy", max_tokens=10_000, messages=HI), "BadRequestError",
     "context is 512 tokens"),
]


async def test_bad_requests_get_anthropic_errors_never_a_500(gateway, tokenizer):
    policy, session = _session(gateway, tokenizer, ["x"], max_context_tokens=512)
    async with session as s:
        client = _client(gateway, s.id)
        for kwargs, error, words in BAD:
            with pytest.raises(getattr(anthropic, error)) as err:
                await client.messages.create(**kwargs)
            body = err.value.body
            assert body["type"] == "error" and words in body["error"]["message"], (kwargs, body)
            assert err.value.type == ("not_found_error" if error == "NotFoundError"
                                      else "invalid_request_error")
        with pytest.raises(anthropic.BadRequestError, match="image"):  # streamed: the same
            async with client.messages.stream(model="policy", max_tokens=8, messages=[
                    {"role": "user", "content": [IMAGE]}]) as stream:
                await stream.get_final_message()
        async with httpx.AsyncClient(base_url=_base_url(gateway, s.id)) as raw:
            r = await raw.post("/v1/messages", json={"model": "policy", "messages": HI})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"type": "invalid_request_error",
                                         "message": "invalid max_tokens: Field required"}
            deep = b"[" * 100_000 + b"]" * 100_000
            for body in (b"{not json", b"[1, 2]", b"\xff\xfe", deep):
                r = await raw.post("/v1/messages", content=body)
                assert r.status_code == 400 and r.json()["type"] == "error", r.text
            r = await raw.post("/v1/messages", content=b"x" * (17 * 1024 * 1024))
            assert r.status_code == 413
            assert r.json()["error"]["type"] == "request_too_large"
    assert s.failed is None and not s.turns and not policy.contexts  # none reached the policy

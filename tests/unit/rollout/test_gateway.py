"""The OpenAI gateway against the official `openai` SDK, with a scripted policy (no Kafka:
tests/integration/test_gateway_kafka.py runs it through the four tiers)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from rlbus.messages import Sampling, Trajectory, Turn
from rlbus.rollout.gateway import Gateway
from rlbus.rollout.sessions import GatewayCode, GatewayError, parse_tool_calls
from tests.polling import wait_until
from tests.unit.rollout.conftest import Scripted

pytestmark = pytest.mark.slow


def _client(g: Gateway, sid: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=g.base_url(sid), api_key=sid, max_retries=0, **kw)


async def test_multi_turn_chat_records_exact_tokens(gateway, tokenizer):
    policy = Scripted(tokenizer, ["hello there", "four"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048) as s:
        client = _client(gateway, s.id)
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        assert first.choices[0].message.content == "hello there"
        assert first.choices[0].finish_reason == "stop"
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "2 + 2 ?"}]
        second = await client.chat.completions.create(model="policy", messages=messages)
        assert second.choices[0].message.content == "four"
        assert (await client.models.list()).data[0].id == "policy"
    t0, t1 = s.turns
    # the second context is the first context + the sampled ids + only the new messages
    assert policy.contexts[1][: len(policy.contexts[0])] == policy.contexts[0]
    assert policy.contexts[1] == t0.input_ids + t0.completion_ids + t1.input_ids
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    assert tokenizer.decode(policy.contexts[1], skip_special_tokens=False) == rendered
    assert {t.policy_version for t in s.turns} == {7}
    assert s.failed is None
    assert not any(t.fresh_context for t in s.turns)  # linear: one segment
    assert [len(seg) for seg in _trajectory(s.turns).segments()] == [2]


async def test_a_tool_round_trip(gateway, tokenizer):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    policy = Scripted(tokenizer, [call, "it is 42"])
    tools = [{"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "integer"}}}}}]
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=4096) as s:
        client = _client(gateway, s.id)
        messages: list = [{"role": "user", "content": "what is 2 + 40?"}]
        r = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        (tc,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2,
                                                                                   "b": 40}
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "42"}]
        r2 = await client.chat.completions.create(model="policy", messages=messages,
                                                  tools=tools)
        assert r2.choices[0].message.content == "it is 42"
    assert s.failed is None and len(s.turns) == 2
    assert "<tool_response>" in tokenizer.decode(s.turns[1].input_ids)


def test_malformed_tool_calls_stay_content():
    text = 'sure <tool_call>{"name": broken</tool_call> and <tool_call>[1]</tool_call>'
    assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}'
                                      "</tool_call> done")
    assert content == "done" and calls[0]["function"] == {"name": "f",
                                                          "arguments": '{"x": 1}'}


async def test_in_strict_mode_an_edited_history_fails_the_episode_with_the_reason(
        gateway, tokenizer):
    policy = Scripted(tokenizer, ["one", "two"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048, history="strict") as s:
        client = _client(gateway, s.id)
        messages = [{"role": "user", "content": "count"}]
        await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": "ONE (edited)"},
                     {"role": "user", "content": "again"}]
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=messages)
        assert err.value.code == "context_diverged"
        assert "other text than the tokens the model saw" in str(err.value)
        with pytest.raises(openai.BadRequestError, match="this episode has failed"):
            await client.chat.completions.create(model="policy", messages=messages[:1])
    assert s.failed and len(s.turns) == 1


async def test_bad_requests_get_openai_errors_never_a_500(gateway, tokenizer):
    policy = Scripted(tokenizer, ["x"] * 10)
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=64) as s:
        client = _client(gateway, s.id)
        hi = [{"role": "user", "content": "hi"}]
        cases = [
            (dict(model="gpt-4", messages=hi), openai.NotFoundError, "model_not_found"),
            (dict(model="policy", messages=[{"role": "user", "content": "word " * 200}]),
             openai.BadRequestError, "context_length_exceeded"),
            (dict(model="policy", messages=hi, n=2), openai.BadRequestError,
             "unsupported_parameter"),
            (dict(model="policy", messages=hi, logprobs=True), openai.BadRequestError,
             "unsupported_parameter"),
            (dict(model="policy", messages=hi, presence_penalty=0.5), openai.BadRequestError,
             "unsupported_parameter"),
            (dict(model="policy", messages=[]), openai.BadRequestError, None),
            (dict(model="policy", messages=hi, temperature=-1), openai.BadRequestError, None),
        ]
        for kwargs, error, code in cases:
            with pytest.raises(error) as err:
                await client.chat.completions.create(**kwargs)
            assert err.value.code == code, (kwargs, err.value.body)
            assert err.value.body["type"] == "invalid_request_error"
        refused = [dict(frequency_penalty=0.1), dict(logit_bias={"5": 1}), dict(top_k=5),
                   dict(response_format={"type": "json_object"}),
                   dict(tool_choice={"type": "function", "function": {"name": "f"}}),
                   dict(top_logprobs=2)]
        for kwargs in refused:
            (param,) = kwargs
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=hi,
                                                     extra_body=kwargs)
            assert err.value.code == "unsupported_parameter"
            assert err.value.param == ("logprobs" if param == "top_logprobs" else param)
        async with httpx.AsyncClient(base_url=gateway.base_url(s.id)) as raw:
            for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
                r = await raw.post("/chat/completions", content=body,
                                   headers={"content-type": "application/json"})
                assert r.status_code == 400 and "error" in r.json(), r.text
            r = await raw.post("/chat/completions", json={"model": "policy"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = await raw.get("/nope")
            assert r.status_code == 404 and "error" in r.json()
            r = await raw.post("/chat/completions", content=b"x" * (17 * 1024 * 1024),
                               headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no content-length: the cap holds on the stream too
                for _ in range(20):
                    yield b"y" * (1024 * 1024)

            r = await raw.post("/chat/completions", content=chunks())
            assert r.status_code == 413
        assert s.failed is None and not s.turns  # none of it reached the policy


async def test_an_unknown_session_is_refused(gateway):
    client = _client(gateway, "not-a-session")
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="policy",
                                             messages=[{"role": "user", "content": "hi"}])
    # the API key alone also names the session, on the plain /v1 base url
    keyed = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await keyed.chat.completions.create(model="policy",
                                            messages=[{"role": "user", "content": "hi"}])


async def test_a_client_that_disconnects_mid_call_loses_only_that_call(gateway, tokenizer):
    policy = Scripted(tokenizer, ["late"], delay_s=30)
    hi = [{"role": "user", "content": "hi"}]
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048) as s:
        client = _client(gateway, s.id, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="policy", messages=hi)
        await wait_until(lambda: policy.cancelled, "the generation is cancelled")
        assert policy.cancelled == 1  # the generation was cancelled, not left running
        assert s.failed is None and not s.turns and not s.busy
        policy.delay_s = 0  # the client retries: the session goes on
        r = await _client(gateway, s.id).chat.completions.create(model="policy", messages=hi)
        assert r.choices[0].message.content == "late"
    assert len(s.turns) == 1 and s.failed is None


async def test_concurrent_sessions_are_independent(gateway, tokenizer):
    async def one(i: int) -> tuple[str, list]:
        policy = Scripted(tokenizer, [f"answer {i}"], delay_s=0.05)
        async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                                   max_context_tokens=2048) as s:
            r = await _client(gateway, s.id).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"q {i}"}])
            return r.choices[0].message.content, s.turns

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert [c for c, _ in results] == [f"answer {i}" for i in range(32)]
    assert all(len(t) == 1 for _, t in results)
    assert not gateway.sessions  # every session closed


# -- histories that are not linear: each such call is a new segment ("segments" mode)


def _trajectory(turns: list[Turn]) -> Trajectory:
    return Trajectory(episode_id="g/0", group_id="g", index=0, group_size=1, task="t",
                      spec={}, turns=turns)


def _rendered(tokenizer, messages: list, tools: list | None = None) -> list[int]:
    """What a first call with ``messages`` is given: the template's rendering, tokenised."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _starts_a_segment(tokenizer, policy: Scripted, turns: list[Turn], k: int,
                      messages: list, tools: list | None = None) -> None:
    """Call ``k`` was given exactly the rendering of its messages, recorded as a new segment
    whose whole context is its input."""
    assert turns[k].fresh_context
    assert turns[k].input_ids == _rendered(tokenizer, messages, tools) == policy.contexts[k]


def _extends(policy: Scripted, turns: list[Turn], k: int) -> None:
    """Call ``k`` was given call ``k-1``'s context, its sampled ids and only what is new."""
    assert not turns[k].fresh_context
    assert policy.contexts[k] == (policy.contexts[k - 1] + turns[k - 1].completion_ids
                                  + turns[k].input_ids)


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_a_trimmed_history_starts_a_segment_that_later_calls_extend(gateway, tokenizer):
    policy = Scripted(tokenizer, ["a1", "a2", "a3", "a4"])
    system = {"role": "system", "content": "be brief"}
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048) as s:
        client = _client(gateway, s.id)
        calls = [[system, _user("u1")]]
        calls.append([*calls[0], _reply("a1"), _user("u2")])
        calls.append([system, _user("u2"), _reply("a2"), _user("u3")])  # u1, a1 dropped
        calls.append([*calls[2], _reply("a3"), _user("u4")])
        for messages in calls:
            await client.chat.completions.create(model="policy", messages=messages)
    assert s.failed is None and len(s.turns) == 4
    _extends(policy, s.turns, 1)
    _starts_a_segment(tokenizer, policy, s.turns, 2, calls[2])
    _extends(policy, s.turns, 3)
    assert [len(seg) for seg in _trajectory(s.turns).segments()] == [2, 2]
    assert tokenizer.decode(policy.contexts[3]) == tokenizer.apply_chat_template(
        calls[3], add_generation_prompt=True, tokenize=False)


async def test_an_edited_reply_starts_a_segment_with_the_edit_in_its_context(gateway,
                                                                            tokenizer):
    policy = Scripted(tokenizer, ["one", "two"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048) as s:
        client = _client(gateway, s.id)
        first = [_user("count")]
        await client.chat.completions.create(model="policy", messages=first)
        edited = [*first, _reply("ONE (edited)"), _user("again")]
        r = await client.chat.completions.create(model="policy", messages=edited)
        assert r.choices[0].message.content == "two"
    assert s.failed is None
    _starts_a_segment(tokenizer, policy, s.turns, 1, edited)
    assert "ONE (edited)" in tokenizer.decode(s.turns[1].input_ids)


async def test_a_retried_call_whose_reply_was_not_kept_is_a_segment_of_its_own(gateway,
                                                                               tokenizer):
    policy = Scripted(tokenizer, ["first", "again", "next", "retried"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=2048) as s:
        client = _client(gateway, s.id)
        ask = [_user("q")]
        await client.chat.completions.create(model="policy", messages=ask)
        await client.chat.completions.create(model="policy", messages=ask)  # "first" dropped
        later = [*ask, _reply("again"), _user("q2")]
        await client.chat.completions.create(model="policy", messages=later)
        await client.chat.completions.create(model="policy", messages=later)  # "next" dropped
    assert s.failed is None
    _starts_a_segment(tokenizer, policy, s.turns, 1, ask)
    assert policy.contexts[1] == policy.contexts[0]  # the same call, sampled twice
    _extends(policy, s.turns, 2)
    _starts_a_segment(tokenizer, policy, s.turns, 3, later)
    assert [len(seg) for seg in _trajectory(s.turns).segments()] == [1, 2, 1]


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}


async def test_changed_tools_start_a_segment_rendered_with_the_new_tools(gateway, tokenizer):
    policy = Scripted(tokenizer, ["a1", "a2", "a3"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=4096) as s:
        client = _client(gateway, s.id)
        messages = [_user("u1")]
        await client.chat.completions.create(model="policy", messages=messages,
                                             tools=[_tool("add")])
        messages += [_reply("a1"), _user("u2")]
        tools = [_tool("add"), _tool("mul")]
        await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        messages += [_reply("a2"), _user("u3")]
        await client.chat.completions.create(model="policy", messages=messages, tools=tools)
    assert s.failed is None
    _starts_a_segment(tokenizer, policy, s.turns, 1, messages[:3], tools)
    assert '"mul"' in tokenizer.decode(s.turns[1].input_ids)
    _extends(policy, s.turns, 2)  # the same new tools: the segment goes on


async def test_in_strict_mode_changed_tools_fail_the_episode(gateway, tokenizer):
    policy = Scripted(tokenizer, ["a1", "a2"])
    async with gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=4096, history="strict") as s:
        client = _client(gateway, s.id)
        messages = [_user("u1")]
        await client.chat.completions.create(model="policy", messages=messages,
                                             tools=[_tool("add")])
        messages += [_reply("a1"), _user("u2")]
        with pytest.raises(openai.BadRequestError, match="the tools differ") as err:
            await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[_tool("mul")])
        assert err.value.code == "context_diverged"
    assert s.failed and len(s.turns) == 1


def test_an_error_answer_says_with_its_code_whether_to_try_again():
    busy = GatewayError(409, "one at a time", code=GatewayCode.CONCURRENT_CALL)
    diverged = GatewayError(400, "context diverged", code=GatewayCode.CONTEXT_DIVERGED)
    assert busy.retriable and not diverged.retriable and not GatewayError(400, "x").retriable
    assert json.loads(json.dumps(busy.body()))["error"]["code"] == "concurrent_call"


TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


async def _recorded(gateway, tokenizer, replies, calls):
    """Run ``calls(client)`` in a fresh session; (its result, the session)."""
    async with gateway.session(policy=Scripted(tokenizer, replies), tokenizer=tokenizer,
                               sampling=Sampling(), max_context_tokens=4096) as s:
        return await calls(_client(gateway, s.id)), s


async def test_streamed_and_plain_calls_record_the_same_tokens(gateway, tokenizer):
    text = "a longer answer, so that its content comes in several pieces"
    q = [{"role": "user", "content": "what is 2 + 40?"}]

    async def plain(client):
        return await client.chat.completions.create(model="policy", messages=q, tools=TOOLS)

    async def streamed(client):
        stream = await client.chat.completions.create(
            model="policy", messages=q, tools=TOOLS, stream=True,
            stream_options={"include_usage": True})
        return [c async for c in stream]

    turns: dict[str, list] = {"plain": [], "streamed": []}
    answers = {}
    for reply in (text, CALL):
        for kind, calls in (("plain", plain), ("streamed", streamed)):
            answers[reply, kind], s = await _recorded(gateway, tokenizer, [reply], calls)
            turns[kind] += s.turns
    p_text, p_call = answers[text, "plain"], answers[CALL, "plain"]
    s_text, s_call = answers[text, "streamed"], answers[CALL, "streamed"]
    assert [(t.input_ids, t.completion_ids, t.logprobs) for t in turns["plain"]] == \
        [(t.input_ids, t.completion_ids, t.logprobs) for t in turns["streamed"]]
    # the text arrives in several deltas that add up to the plain answer
    deltas = [c.choices[0].delta.content for c in s_text if c.choices and
              c.choices[0].delta.content]
    assert len(deltas) > 2 and "".join(deltas) == p_text.choices[0].message.content
    assert s_text[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in s_text if c.choices][-1] == "stop"
    assert s_text[-1].choices == [] and s_text[-1].usage.total_tokens == p_text.usage.total_tokens
    # tool call: id and name once, then the arguments in deltas, then finish_reason
    (plain_call,) = p_call.choices[0].message.tool_calls
    parts = [tc for c in s_call if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "add"
    args = "".join(tc.function.arguments or "" for tc in parts)
    assert len(parts) > 2 and json.loads(args) == json.loads(plain_call.function.arguments)
    assert [c.choices[0].finish_reason for c in s_call if c.choices][-1] == "tool_calls"


async def test_the_sdk_stream_helper_accumulates_a_tool_call(gateway, tokenizer):
    async def helper(client):
        async with client.chat.completions.stream(
                model="policy", messages=[{"role": "user", "content": "2 + 40?"}],
                tools=TOOLS) as stream:
            return await stream.get_final_completion()

    final, s = await _recorded(gateway, tokenizer, [CALL], helper)
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2,
                                                                                  "b": 40}
    assert len(s.turns) == 1


async def test_stop_sequences_cut_what_is_returned_and_recorded_alike(gateway, tokenizer):
    async def calls(client):
        messages = [{"role": "user", "content": "count"}]
        r = await client.chat.completions.create(model="policy", messages=messages,
                                                 stop=["three"])
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return r

    r, s = await _recorded(gateway, tokenizer, ["one two three four", "five"], calls)
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].message.content
    assert "three" not in content and "one two".startswith(content.strip()[:3])
    first = s.turns[0]
    assert tokenizer.decode(first.completion_ids, skip_special_tokens=False) == content
    assert len(first.logprobs) == len(first.completion_ids)
    assert len(s.turns) == 2 and s.failed is None  # the history extends what was recorded


async def test_fields_clients_send_by_default_are_taken(gateway, tokenizer):
    async def calls(client):
        return await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, user="u", seed=3, store=False,
            metadata={"k": "v"}, max_completion_tokens=8, stream=False, n=1,
            presence_penalty=0, frequency_penalty=0, logprobs=False,
            response_format={"type": "text"}, service_tier="auto", reasoning_effort="low")

    r, s = await _recorded(gateway, tokenizer, ["fine"], calls)
    assert r.choices[0].message.content == "fine" and len(s.turns) == 1


async def test_session_bounds_each_give_a_clear_error(tokenizer):
    from rlbus.rollout.gateway import Bounds, SessionIdle, TooManySessions

    g = Gateway("policy", bounds=Bounds(max_sessions=1, max_body_bytes=2048,
                                        max_session_tokens=60, idle_timeout_s=0.3))
    await g.start()
    try:
        kw = dict(policy=Scripted(tokenizer, ["short"] * 3), tokenizer=tokenizer,
                  sampling=Sampling(max_new_tokens=8), max_context_tokens=4096)
        async with g.session(**kw) as s:
            with pytest.raises(TooManySessions, match="RLBUS_GATEWAY_MAX_SESSIONS"):
                async with g.session(**kw):
                    pass
            client = _client(g, s.id)
            with pytest.raises(openai.APIStatusError) as err:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "x" * 4096}])
            assert err.value.status_code == 413 and "RLBUS_GATEWAY_MAX_BODY_BYTES" in str(
                err.value)
            messages = [{"role": "user", "content": "hi"}]
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "tell me a longer story " * 4}]
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=messages)
            assert err.value.code == "session_too_long"
            assert len(s.turns) == 1 and s.tokens <= 60

            async def agent():  # makes no call: the idle bound stops it
                await asyncio.Event().wait()

            with pytest.raises(SessionIdle, match="RLBUS_GATEWAY_IDLE_TIMEOUT_S"):
                await g.run(s, agent())
            assert s.failed and len(s.turns) == 1  # what it recorded stays
    finally:
        await g.stop()


async def test_a_client_gone_mid_stream_loses_nothing_recorded(gateway, tokenizer):
    async with gateway.session(policy=Scripted(tokenizer, ["word " * 200]),
                               tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=4096) as s:
        body = {"model": "policy", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=gateway.base_url(s.id)) as raw, \
                raw.stream("POST", "/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # read one event, then hang up
        assert len(s.turns) == 1 and s.failed is None and not s.busy
        assert tokenizer.decode(s.turns[0].completion_ids).count("word") == 200


async def test_text_parts_render_as_the_string_they_join_to(gateway, tokenizer):
    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "2 + 40?"}]

    async def calls(client):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": parts}])
        with pytest.raises(openai.BadRequestError, match="only text parts"):
            await client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])

    _, s = await _recorded(gateway, tokenizer, ["42"], calls)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "what is\n2 + 40?"}],
                                             add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(s.turns[0].input_ids, skip_special_tokens=False) == rendered


async def test_a_deeply_nested_body_is_a_400_on_every_route(gateway):
    deep = b"[" * 100_000 + b"]" * 100_000
    async with gateway.session(policy=None, tokenizer=None, sampling=Sampling(),
                               max_context_tokens=64) as s, \
            httpx.AsyncClient(base_url=gateway.base_url(s.id)) as raw:
        for route in ("/chat/completions", "/responses", "/messages"):
            r = await raw.post(route, content=deep, headers={"x-api-key": s.id})
            assert r.status_code == 400 and "not valid JSON" in r.text, (route, r.text)


def test_tool_call_arguments_keep_their_characters():
    _, (call,) = parse_tool_calls('<tool_call>{"name": "weather", "arguments": '
                                  '{"city": "Zürich"}}</tool_call>')
    assert call["function"]["arguments"] == '{"city": "Zürich"}'

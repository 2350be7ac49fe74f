"""The gateway's Responses API (``POST /v1/responses``) against the official `openai` SDK and
the OpenAI Agents SDK, with a scripted policy: the answers parse as the SDKs' types, and the
turns are recorded in the exact tokens of the chat template's rendering."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rlbus.api import Generation
from rlbus.messages import Sampling
from rlbus.rollout.gateway import Gateway
from rlbus.rollout.gateway_responses import stream_events
from tests.polling import wait_until
from tests.unit.rollout.conftest import Scripted

pytestmark = pytest.mark.slow

ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
ADD_PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"},
                                                   "b": {"type": "integer"}}}
ADD_TOOL = {"type": "function", "name": "add", "description": "a + b",
            "parameters": ADD_PARAMETERS}
ADD_CHAT_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                                  "parameters": ADD_PARAMETERS}}


@pytest.fixture
def open_session(gateway, tokenizer):
    """A session of ``gateway`` answered by a scripted policy."""

    def open_(policy, max_context_tokens: int = 4096):
        return gateway.session(policy=policy, tokenizer=tokenizer, sampling=Sampling(),
                               max_context_tokens=max_context_tokens)

    return open_


class Truncated(Scripted):
    """Scripted replies cut at the token budget, as an engine reports them."""

    async def generate(self, input_ids: list[int], sampling: Sampling) -> Generation:
        gen = await super().generate(input_ids, sampling)
        ids = gen.completion_ids[: sampling.max_new_tokens]
        return Generation(ids, gen.logprobs[: len(ids)], gen.policy_version, "length")


def _client(g: Gateway, sid: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=g.base_url(sid), api_key=sid, max_retries=0, **kw)


def _rendered(tokenizer, messages: list, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)


def _scripted_ids(tokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def _chat_call(call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}


async def test_a_text_answer_is_a_response_with_the_exact_tokens(open_session, gateway,
                                                                  tokenizer):
    policy = Scripted(tokenizer, ["hello there"])
    async with open_session(policy) as s:
        r = await _client(gateway, s.id).responses.create(
            model="policy", input="hi", instructions="be brief", temperature=0.5,
            metadata={"episode": "1"})
    assert isinstance(r, Response) and r.output_text == "hello there"
    Response.model_validate(r.model_dump())  # every field the type requires is there
    assert r.id.startswith("resp_") and r.status == "completed" and r.error is None
    assert r.instructions == "be brief" and r.temperature == 0.5 and r.top_p == 1.0
    assert r.metadata == {"episode": "1"} and r.model == "policy"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    (t,) = s.turns
    assert r.usage.input_tokens == len(t.input_ids)
    assert r.usage.output_tokens == len(t.completion_ids) == r.usage.total_tokens - len(
        t.input_ids)
    assert tokenizer.decode(policy.contexts[0], skip_special_tokens=False) == _rendered(
        tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert t.completion_ids == _scripted_ids(tokenizer, "hello there")
    assert s.failed is None and r.id in s.responses


async def test_a_tool_round_trip_with_function_call_items(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, [ADD_CALL, "it is 42"])
    async with open_session(policy) as s:
        client = _client(gateway, s.id)
        items: list = [{"role": "user", "content": [{"type": "input_text",
                                                     "text": "what is 2 + 40?"}]}]
        r = await client.responses.create(model="policy", input=items, tools=[ADD_TOOL])
        (call,) = r.output
        assert call.type == "function_call" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 2, "b": 40} and r.output_text == ""
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        r2 = await client.responses.create(model="policy", input=items, tools=[ADD_TOOL])
        assert r2.output_text == "it is 42"
    assert s.failed is None and len(s.turns) == 2
    expected = [{"role": "user", "content": "what is 2 + 40?"},
                {"role": "assistant", "content": None, "tool_calls": [_chat_call("c")]},
                {"role": "tool", "tool_call_id": "c", "content": "42"}]
    assert tokenizer.decode(policy.contexts[1], skip_special_tokens=False) == _rendered(
        tokenizer, expected, [ADD_CHAT_TOOL])
    assert policy.contexts[1] == (s.turns[0].input_ids + s.turns[0].completion_ids
                                  + s.turns[1].input_ids)
    assert s.turns[1].completion_ids == _scripted_ids(tokenizer, "it is 42")


async def test_previous_response_id_continues_the_stored_conversation(open_session, gateway,
                                                                      tokenizer):
    policy = Scripted(tokenizer, ["Let me add.\n" + ADD_CALL, "it is 42", "bye"])
    async with open_session(policy) as s:
        client = _client(gateway, s.id)
        kw = dict(model="policy", instructions="use the tools", tools=[ADD_TOOL])
        r1 = await client.responses.create(input="what is 2 + 40?", **kw)
        assert [o.type for o in r1.output] == ["message", "function_call"]
        assert r1.output_text == "Let me add."
        r2 = await client.responses.create(
            previous_response_id=r1.id, **kw, input=[{
                "type": "function_call_output", "call_id": r1.output[1].call_id,
                "output": [{"type": "input_text", "text": "42"}]}])
        r3 = await client.responses.create(previous_response_id=r2.id, input="thanks", **kw)
        assert (r2.output_text, r3.output_text) == ("it is 42", "bye")
        assert r3.previous_response_id == r2.id
    expected = [{"role": "system", "content": "use the tools"},
                {"role": "user", "content": "what is 2 + 40?"},
                {"role": "assistant", "content": "Let me add.", "tool_calls": [_chat_call("c")]},
                {"role": "tool", "tool_call_id": "c", "content": "42"},
                {"role": "assistant", "content": "it is 42"},
                {"role": "user", "content": "thanks"}]
    assert tokenizer.decode(policy.contexts[2], skip_special_tokens=False) == _rendered(
        tokenizer, expected, [ADD_CHAT_TOOL])
    assert policy.contexts[2][: len(policy.contexts[1])] == policy.contexts[1]
    assert s.failed is None and len(s.turns) == 3


async def test_streamed_events_parse_and_record_the_same_tokens(open_session, gateway,
                                                                tokenizer):
    long = "a long answer that takes more than one delta event to stream"
    recorded = []
    for stream in (False, True):
        policy = Scripted(tokenizer, [long])
        async with open_session(policy) as s:
            client = _client(gateway, s.id)
            if stream:
                async with client.responses.stream(model="policy", input="hi") as events:
                    seen = [e async for e in events]
                    final = await events.get_final_response()
            else:
                final = await client.responses.create(model="policy", input="hi")
            assert final.output_text == long and final.status == "completed"
            recorded.append((s.turns[0].input_ids, s.turns[0].completion_ids))
    assert recorded[0] == recorded[1]
    types = [e.type for e in seen]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-5:] == ["response.output_text.delta", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == long
    assert [e.sequence_number for e in seen] == list(range(len(seen)))


async def test_a_streamed_tool_call_and_the_raw_frames(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, ["Let me add.\n" + ADD_CALL])
    async with open_session(policy) as s, httpx.AsyncClient(
            base_url=gateway.base_url(s.id)) as raw:
        r = await raw.post("/responses", json={"model": "policy", "input": "2 + 40?",
                                                "tools": [ADD_TOOL], "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-1] == ""  # every frame ends with a blank line; no [DONE] for Responses
    events = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        STREAM_EVENT.validate_python(event)  # strictly: every field the SDK's type requires
        events.append(event)
    types = [e["type"] for e in events]
    args = types.index("response.function_call_arguments.done")
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * (args - 9),
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert args > 10  # the arguments come in several deltas
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    assert events[8]["item"]["arguments"] == ""
    message, call = events[-1]["response"]["output"]
    assert events[4]["delta"] == events[5]["text"] == "Let me add."
    deltas = "".join(e["delta"] for e in events[9:args])
    assert deltas == events[args]["arguments"] == call["arguments"]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == [
        message, call]
    assert len(s.turns) == 1


async def test_a_response_cut_at_max_output_tokens_is_incomplete(open_session, gateway,
                                                                 tokenizer):
    policy = Truncated(tokenizer, ["one two three four five six seven eight"] * 2)
    async with open_session(policy) as s:
        client = _client(gateway, s.id)
        r = await client.responses.create(model="policy", input="count", max_output_tokens=3)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.max_output_tokens == 3 and r.output[0].status == "incomplete"
        stream = await client.responses.create(model="policy", input="go on",
                                               previous_response_id=r.id,
                                               max_output_tokens=3, stream=True)
        last = [e async for e in stream][-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert [len(t.completion_ids) for t in s.turns] == [3, 3]


async def test_a_client_that_leaves_mid_stream_loses_nothing(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, ["x " * 200, "still here"])
    async with open_session(policy) as s:
        async with httpx.AsyncClient(base_url=gateway.base_url(s.id)) as raw:
            req = {"model": "policy", "input": "hi", "stream": True}
            async with raw.stream("POST", "/responses", json=req) as r:
                first = await anext(r.aiter_lines())
        assert first == "event: response.created" and len(s.turns) == 1
        (rid,) = s.responses
        r2 = await _client(gateway, s.id).responses.create(
            model="policy", input="more", previous_response_id=rid)
        assert r2.output_text == "still here"
    assert s.failed is None and len(s.turns) == 2


async def test_store_false_keeps_nothing(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, ["one"])
    async with open_session(policy) as s:
        client = _client(gateway, s.id)
        r = await client.responses.create(model="policy", input="hi", store=False)
        assert r.store is False and not s.responses
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="policy", input="on",
                                          previous_response_id=r.id)
        assert err.value.code == "previous_response_not_found"


async def test_bad_requests_are_refused_naming_the_field(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, ["x"])
    async with open_session(policy) as s:
        client = _client(gateway, s.id)
        hi = {"model": "policy", "input": "hi"}
        cases = [
            ({"model": "gpt-4o", "input": "hi"}, 404, "model_not_found", "model"),
            ({**hi, "previous_response_id": "resp_nope"}, 400, "previous_response_not_found",
             "previous_response_id"),
            ({**hi, "frobnicate": 1}, 400, "unsupported_parameter", "frobnicate"),
            ({**hi, "background": True}, 400, "unsupported_parameter", "background"),
            ({**hi, "top_logprobs": 5}, 400, "unsupported_parameter", "top_logprobs"),
            ({**hi, "max_tool_calls": 3}, 400, "unsupported_parameter", "max_tool_calls"),
            ({**hi, "conversation": "conv_1"}, 400, "unsupported_parameter", "conversation"),
            ({**hi, "tool_choice": {"type": "function", "name": "add"}}, 400,
             "unsupported_parameter", "tool_choice"),
            ({**hi, "truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
            ({**hi, "include": ["message.output_text.logprobs"]}, 400,
             "unsupported_parameter", "include"),
            ({**hi, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
             400, "unsupported_parameter", "text.format"),
            ({**hi, "tools": [{"type": "web_search"}]}, 400, "unsupported_parameter",
             "tools[0]"),
            ({**hi, "tools": [{**ADD_TOOL, "defer_loading": True}]}, 400,
             "unsupported_parameter", "tools[0].defer_loading"),
            ({"model": "policy", "input": 42}, 400, None, "input"),
            ({"model": "policy", "input": {"role": "user", "content": "hi"}}, 400, None,
             "input"),
            ({"model": "policy", "input": ["hi"]}, 400, None, "input[0]"),
            ({"model": "policy", "input": [{"role": "user", "content": "hi"}, {
                "type": "function_call_output", "call_id": "call_x", "output": "1"}]},
             400, None, "input[1].call_id"),
            ({"model": "policy", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, None,
             "input[0].content[0].type"),
            ({"model": "policy", "input": [{"type": "item_reference", "id": "msg_1"}]}, 400,
             "unsupported_parameter", "input[0].type"),
            ({"model": "policy", "input": [{"role": "user", "content": "hi"}, {
                "type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}]},
             400, "unsupported_parameter", "input[1]"),
            ({"model": "policy", "input": [{"role": "user", "content": "hi", "foo": 1}]},
             400, "unsupported_parameter", "input[0].foo"),
            ({"model": "policy", "input": []}, 400, None, "input"),
            ({**hi, "temperature": 3}, 400, None, "temperature"),
            ({**hi, "text": {"format": "json"}}, 400, None, "text.format"),
            ({"model": "policy"}, 400, None, "input"),
        ]
        async with httpx.AsyncClient(base_url=gateway.base_url(s.id)) as raw:
            for body, status, code, param in cases:
                r = await raw.post("/responses", json=body)
                error = r.json()["error"]
                assert (r.status_code, error["code"], error["param"]) == (status, code, param), (
                    body, error)
                assert error["type"] == "invalid_request_error" and error["message"]
            for body in (b"{not json", b"[1]"):
                r = await raw.post("/responses", content=body)
                assert r.status_code == 400 and "error" in r.json()
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(model="policy", input="x", previous_response_id="r")
    assert s.failed is None and not s.turns and not policy.contexts


async def test_fields_ignored_on_purpose_are_taken(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, [ADD_CALL])
    async with open_session(policy) as s:
        r = await _client(gateway, s.id).responses.create(
            model="policy", input="2 + 40?", tools=[ADD_TOOL], tool_choice="required",
            parallel_tool_calls=False, reasoning={"effort": "high", "summary": "auto"},
            text={"format": {"type": "text"}, "verbosity": "low"}, service_tier="auto",
            prompt_cache_key="k", safety_identifier="u1", user="u1", truncation="disabled",
            include=["reasoning.encrypted_content"], background=False, top_logprobs=0,
            store=True)
    assert r.output[0].type == "function_call"  # required is taken as auto
    assert r.tool_choice == "required" and r.parallel_tool_calls is False and r.user == "u1"
    assert s.failed is None and len(s.turns) == 1


async def test_tool_choice_none_keeps_a_call_as_text(open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, [ADD_CALL])
    async with open_session(policy) as s:
        r = await _client(gateway, s.id).responses.create(
            model="policy", input="2 + 40?", tools=[ADD_TOOL], tool_choice="none")
    assert [o.type for o in r.output] == ["message"] and r.output_text == ADD_CALL


async def test_a_client_that_leaves_during_the_generation_cancels_only_that_call(
        open_session, gateway, tokenizer):
    policy = Scripted(tokenizer, ["on time"], delay_s=30)  # the cancelled call takes none
    async with open_session(policy) as s:
        impatient = _client(gateway, s.id).with_options(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await impatient.responses.create(model="policy", input="hi", stream=True)
        await wait_until(lambda: policy.cancelled, "the generation is cancelled")
        assert not s.turns and not s.responses and s.failed is None
        policy.delay_s = 0
        r = await _client(gateway, s.id).responses.create(model="policy", input="hi")
        assert r.output_text == "on time" and len(s.turns) == 1


async def test_an_empty_reasoning_item_and_developer_messages_are_taken(open_session, gateway,
                                                                       tokenizer):
    policy = Scripted(tokenizer, ["ok"])
    async with open_session(policy) as s:
        r = await _client(gateway, s.id).responses.create(model="policy", input=[
            {"role": "developer", "content": "terse"},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": []}])
        assert r.output_text == "ok"
    assert tokenizer.decode(policy.contexts[0], skip_special_tokens=False) == _rendered(
        tokenizer, [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}])


async def test_the_plain_v1_route_finds_the_session_by_its_key(open_session, gateway,
                                                              tokenizer):
    async with open_session(Scripted(tokenizer, ["keyed"])) as s:
        keyed = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=s.id, max_retries=0)
        assert (await keyed.responses.create(model="policy", input="hi")).output_text == "keyed"
    with pytest.raises(openai.AuthenticationError):
        await keyed.responses.create(model="policy", input="hi")  # the session has ended


def test_event_sequence_numbers_count_from_zero():
    response = {"id": "resp_1", "status": "completed", "output": [
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}]}
    events = stream_events(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.output_text.delta" not in [e["type"] for e in events]  # empty text
    assert events[-1]["response"] is response


# The OpenAI Agents SDK (the `agents` extra), its default model: OpenAIResponsesModel.


def _agent(agents, gateway: Gateway, sid: str, bodies: list | None = None):
    """An agent with an ``add`` tool on the gateway (the bodies it sends go to ``bodies``),
    and that tool as the template sees it."""
    agents.set_tracing_disabled(True)

    async def keep(request: httpx.Request) -> None:
        if bodies is not None:
            bodies.append(json.loads(request.content))

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    client = _client(gateway, sid, http_client=httpx.AsyncClient(
        event_hooks={"request": [keep]}))
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="adder", instructions="use the tools", tools=[add], model=model)
    chat_tool = {"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": add.params_json_schema,
        "strict": add.strict_json_schema}}
    return agent, chat_tool


async def test_the_agents_sdk_runs_a_tool_round_trip(open_session, gateway, tokenizer):
    agents = pytest.importorskip("agents")
    policy = Scripted(tokenizer, [ADD_CALL, "it is 42"])
    async with open_session(policy) as s:
        agent, chat_tool = _agent(agents, gateway, s.id)
        result = await agents.Runner.run(agent, "what is 2 + 40?")
    assert result.final_output == "it is 42" and s.failed is None
    expected = [{"role": "system", "content": "use the tools"},
                {"role": "user", "content": "what is 2 + 40?"},
                {"role": "assistant", "content": None, "tool_calls": [_chat_call("c")]},
                {"role": "tool", "tool_call_id": "c", "content": "42"}]
    assert tokenizer.decode(policy.contexts[0], skip_special_tokens=False) == _rendered(
        tokenizer, expected[:2], [chat_tool])
    assert tokenizer.decode(policy.contexts[1], skip_special_tokens=False) == _rendered(
        tokenizer, expected, [chat_tool])
    assert [t.completion_ids for t in s.turns] == [
        _scripted_ids(tokenizer, ADD_CALL), _scripted_ids(tokenizer, "it is 42")]


async def test_the_agents_sdk_streams_and_chains_by_response_id(open_session, gateway,
                                                                tokenizer):
    agents = pytest.importorskip("agents")
    replies = [ADD_CALL, "it is 42"]
    contexts, bodies = [], []
    for streamed in (False, True):
        policy = Scripted(tokenizer, replies)
        async with open_session(policy) as s:
            agent, _ = _agent(agents, gateway, s.id, bodies if streamed else None)
            if streamed:  # and each call sends only the new items, after the previous id
                result = agents.Runner.run_streamed(agent, "what is 2 + 40?",
                                                    auto_previous_response_id=True)
                kinds = {e.type async for e in result.stream_events()}
                assert {"raw_response_event", "run_item_stream_event"} <= kinds
            else:
                result = await agents.Runner.run(agent, "what is 2 + 40?")
            assert result.final_output == "it is 42" and s.failed is None
            contexts.append(policy.contexts)
    first, second = bodies  # the chained run sends only the new items after the previous id
    assert first["stream"] and "previous_response_id" not in first
    assert second["previous_response_id"] == result.raw_responses[0].response_id
    assert [i["type"] for i in second["input"]] == ["function_call_output"]
    assert contexts[0] == contexts[1]  # the same tokens, streamed and chained or not


async def test_the_agents_sdk_sends_its_answer_back_as_history(open_session, gateway,
                                                               tokenizer):
    agents = pytest.importorskip("agents")
    policy = Scripted(tokenizer, ["hello there", "bye"])
    async with open_session(policy) as s:
        agent, chat_tool = _agent(agents, gateway, s.id)
        first = await agents.Runner.run(agent, "hi")
        history = [*first.to_input_list(), {"role": "user", "content": "again"}]
        assert history[1]["type"] == "message" and history[1]["role"] == "assistant"
        second = await agents.Runner.run(agent, history)
    assert (first.final_output, second.final_output) == ("hello there", "bye")
    expected = [{"role": "system", "content": "use the tools"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "again"}]
    assert tokenizer.decode(policy.contexts[1], skip_special_tokens=False) == _rendered(
        tokenizer, expected, [chat_tool])
    assert s.failed is None and len(s.turns) == 2

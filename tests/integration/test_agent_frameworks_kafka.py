"""Agent frameworks, unchanged, train through the gateway over the real broker.

Each client — the ``openai`` SDK (sync, async, streamed with usage), LangChain's
``ChatOpenAI.bind_tools`` (invoke, stream), the OpenAI Agents SDK (on chat completions; on its
default, the Responses API, run and streamed), smolagents' ``ToolCallingAgent``, LiteLLM
(async, streamed) and the ``anthropic`` SDK (create, stream) — plays one GRPO group of a
tool-using episode as its users write it: ask "what is a + b?", let the framework parse the
policy's call of an ``add`` tool, run the tool, send its result back, take the final answer.
One pipeline (real Kafka broker; inference, rollout, reward and learner services) runs every
client's group, and the learner takes one step on all of them.

A random tiny model never writes a tool call, so inference runs a scripted policy:
:class:`ScriptedEngine` decodes each context with the chat tokenizer and answers as a
tool-calling Qwen would (``<tool_call>`` JSON while the question has no tool answer yet,
then the answer; for smolagents, a call of its ``final_answer`` tool), tokenised with the
same tokenizer, each token's logprob that of the tiny chat model being trained (a
teacher-forced forward pass), so the learner's step is the one a sampling policy would get.

Per client, for each episode: the group was trained (valid, in the learner's step); the
framework ran the tool with the policy's arguments and ended with the sum; and the recorded
tokens are exactly what the framework asked for: for every call it made, the context ids of
that turn (the recorded history, or the whole context where a turn starts a new segment)
decode to the chat template's rendering of the messages that call sent, the completion ids
are the scripted ones, and the tool's result is in the next turn's input ids as the
template renders it. The calls are the HTTP bodies as the gateway received them: an ASGI
tap around the gateway's real app records them (the only thing this test adds to the
rollout tier's path). Responses and Anthropic requests are mapped to chat messages here,
independently of the gateway, the way its docs say they map.

smolagents sends its history back rewritten as text, so each of its calls is a segment of
its own (``fresh_context``). Every framework is ``importorskip``-guarded, and the pipeline
runs only the clients whose packages import (``pip install -e '.[agents]'``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlbus.api import ChatAgent, ChatSession
from rlbus.inference.engine import Completion
from rlbus.inference.engines import HFEngine
from rlbus.inference.settings import InferenceSettings
from rlbus.messages import Sampling, ScoredTrajectory, Trajectory
from rlbus.prompt_data import DatasetSettings
from rlbus.settings import KafkaSettings, TopicSettings
from rlbus.topics import Topics, ensure_topics
from rlbus.transport import KafkaBus
from tests.pipeline import bus_factory, run_pipeline, settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no network at import

MAX_NEW_TOKENS = 64
MAX_CALLS = 4
"""Most model calls an agent makes: a tool call and the answer take two (three: smolagents)."""
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"]}
ADD_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two integers.", "parameters": ADD_SCHEMA}}]
SYNC_AGENTS = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="sync-agent")
"""Sync clients block a thread each for a whole episode: never the loop's default pool,
which the inference engine needs to answer them."""


# ------------------------------------------------------------------ the scripted policy


def scripted_reply(context: str) -> str:
    """What the scripted policy answers to ``context`` (a rendered chat): the ``add`` call
    while the last user turn has no tool answer, then the answer (smolagents: a call of its
    ``final_answer`` tool with it)."""
    users = context.split("<|im_start|>user")[1:]
    question = re.search(r"(\d+) \+ (\d+)", users[0] if users else "")
    a, b = (int(question[1]), int(question[2])) if question else (0, 0)
    result = (re.search(r"<tool_response>\n(.*?)\n</tool_response>", users[-1], re.S)
              or re.search(r"Observation:\s*(\S+)", users[-1])) if users else None
    tools = re.search(r"<tools>\n(.*?)\n</tools>", context, re.S)
    names = [_tool_name(line) for line in tools[1].splitlines()] if tools else []
    if result is None and names:
        name = next(n for n in names if n != "final_answer")
        return _call(name, {"a": a, "b": b})
    answer = result[1].strip() if result else str(a + b)
    if "final_answer" in names:
        return _call("final_answer", {"answer": answer})
    return f"The answer is {answer}."


def _tool_name(line: str) -> str:
    tool = json.loads(line)
    return str(tool.get("function", tool)["name"])


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def scripted_ids(tokenizer: Any, context: str) -> list[int]:
    ids: list[int] = tokenizer.encode(scripted_reply(context), add_special_tokens=False)
    return [*ids, tokenizer.eos_token_id]


class ScriptedEngine(HFEngine):
    """The hf engine with the completions scripted (:func:`scripted_reply`) instead of
    sampled; logprobs, weight loads and versions are the hf engine's."""

    def __init__(self, settings: InferenceSettings) -> None:
        from transformers import AutoTokenizer

        super().__init__(settings)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model_path)

    def _generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        return [self._script(p, sampling) for p in prompts]

    def _script(self, prompt: list[int], sampling: Sampling) -> Completion:
        torch = self.torch
        context = self.tokenizer.decode(prompt, skip_special_tokens=False)
        ids = scripted_ids(self.tokenizer, context)[: sampling.max_new_tokens]
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt + ids], device=self.device)).logits
        logits = logits[0, len(prompt) - 1 : -1].float()  # (N, V): the logits of each new id
        if sampling.temperature > 0:
            logits = logits / sampling.temperature
        logp = logits.log_softmax(-1).gather(-1, torch.tensor(ids, device=self.device)[:, None])
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return Completion(ids, logp[:, 0].tolist(), finish)


# ------------------------------------------------------------- the agents, one per client


@dataclass
class Played:
    """What one episode's agent did: the tool's calls as the framework ran them, its answer."""

    client: str
    tool_calls: list[tuple[int, int]] = field(default_factory=list)
    output: str = ""

    def add(self, a: int, b: int) -> int:
        self.tool_calls.append((int(a), int(b)))
        return int(a) + int(b)

    def tool(self) -> Callable[[int, int], int]:
        """``add`` as a plain function: what frameworks turn into a tool."""
        def add(a: int, b: int) -> int:
            """Adds two integers.

            Args:
                a: the first integer
                b: the second integer
            """
            return self.add(a, b)
        return add


PLAYED: dict[str, Played] = {}
"""Each episode's record, by its session's API key (the agents run in the test's process)."""


def question(session: ChatSession) -> str:
    return f"What is {session.spec['a']} + {session.spec['b']}? Use the add tool."


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(SYNC_AGENTS, fn, *args)


def _run_call(played: Played, name: str, arguments: str) -> str:
    assert name == "add", name
    return str(played.add(**json.loads(arguments)))


def openai_sync(session: ChatSession, played: Played) -> str:
    import openai

    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question(session)}]
    for _ in range(MAX_CALLS):
        msg = client.chat.completions.create(model=session.model, messages=messages,
                                             tools=ADD_TOOLS).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or ""
        messages += [{"role": "tool", "tool_call_id": c.id,
                      "content": _run_call(played, c.function.name, c.function.arguments)}
                     for c in msg.tool_calls]
    raise AssertionError("no final answer")


async def openai_async(session: ChatSession, played: Played) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question(session)}]
    for _ in range(MAX_CALLS):
        r = await client.chat.completions.create(model=session.model, messages=messages,
                                                 tools=ADD_TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or ""
        messages += [{"role": "tool", "tool_call_id": c.id,
                      "content": _run_call(played, c.function.name, c.function.arguments)}
                     for c in msg.tool_calls]
    raise AssertionError("no final answer")


async def openai_stream(session: ChatSession, played: Played) -> str:
    """stream=True with stream_options.include_usage, the chunks put together by hand."""
    import openai

    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question(session)}]
    for _ in range(MAX_CALLS):
        stream = await client.chat.completions.create(
            model=session.model, messages=messages, tools=ADD_TOOLS, stream=True,
            stream_options={"include_usage": True})
        content, calls, usage = "", {}, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                    call["id"] = d.id or call["id"]
                    call["function"]["name"] += (d.function and d.function.name) or ""
                    call["function"]["arguments"] += (d.function and d.function.arguments) or ""
        assert usage is not None and usage.completion_tokens > 0, "no usage chunk"
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(msg)
        if not calls:
            return content
        messages += [{"role": "tool", "tool_call_id": c["id"],
                      "content": _run_call(played, c["function"]["name"],
                                           c["function"]["arguments"])}
                     for c in msg["tool_calls"]]
    raise AssertionError("no final answer")


def langchain(session: ChatSession, played: Played, stream: bool = False) -> str:
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    add = tool(played.tool())
    llm = ChatOpenAI(model=session.model, base_url=session.base_url, api_key=session.api_key,
                     max_retries=0).bind_tools([add])
    messages: list[Any] = [HumanMessage(question(session))]
    for _ in range(MAX_CALLS):
        if stream:
            ai = None
            for chunk in llm.stream(messages):
                ai = chunk if ai is None else ai + chunk
        else:
            ai = llm.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            return str(ai.content)
        messages += [add.invoke(call) for call in ai.tool_calls]  # ToolMessages
    raise AssertionError("no final answer")


async def openai_agents(session: ChatSession, played: Played, responses: bool,
                        stream: bool = False) -> str:
    import openai
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no export to OpenAI
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                max_retries=0)
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(
        model=session.model, openai_client=client)
    agent = Agent(name="adder", instructions="Answer with the add tool's result.",
                  model=model, tools=[function_tool(played.tool())])
    if not stream:
        return str((await Runner.run(agent, question(session), max_turns=MAX_CALLS))
                   .final_output)
    streamed = Runner.run_streamed(agent, question(session), max_turns=MAX_CALLS)
    async for _ in streamed.stream_events():
        pass
    return str(streamed.final_output)


def smolagents(session: ChatSession, played: Played) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=session.model, api_base=session.base_url,
                              api_key=session.api_key)
    agent = ToolCallingAgent(tools=[tool(played.tool())], model=model, max_steps=MAX_CALLS,
                             verbosity_level=-1)
    return str(agent.run(question(session)))


async def litellm(session: ChatSession, played: Played, stream: bool = False) -> str:
    import litellm as lite

    messages: list[Any] = [{"role": "user", "content": question(session)}]
    for _ in range(MAX_CALLS):
        r = await lite.acompletion(model=f"openai/{session.model}", api_base=session.base_url,
                                   api_key=session.api_key, messages=messages, tools=ADD_TOOLS,
                                   stream=stream)
        if stream:
            r = lite.stream_chunk_builder([chunk async for chunk in r], messages=messages)
        msg = r.choices[0].message
        calls = msg.tool_calls or []
        messages.append({"role": "assistant", "content": msg.content, **(
            {"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            return msg.content or ""
        messages += [{"role": "tool", "tool_call_id": c.id,
                      "content": _run_call(played, c.function.name, c.function.arguments)}
                     for c in calls]
    raise AssertionError("no final answer")


async def anthropic(session: ChatSession, played: Played, stream: bool = False) -> str:
    import anthropic as anth

    client = anth.AsyncAnthropic(base_url=session.anthropic_base_url, api_key=session.api_key,
                                 max_retries=0)
    tools: Any = [{"name": "add", "description": "Adds two integers.",
                   "input_schema": ADD_SCHEMA}]
    messages: list[Any] = [{"role": "user", "content": question(session)}]
    for _ in range(MAX_CALLS):
        ask = {"model": session.model, "max_tokens": MAX_NEW_TOKENS, "messages": messages,
               "tools": tools}
        if stream:
            async with client.messages.stream(**ask) as s:
                r = await s.get_final_message()
        else:
            r = await client.messages.create(**ask)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in r.content]})
        uses = [b for b in r.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in r.content if b.type == "text")
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id,
             "content": _run_call(played, u.name, json.dumps(u.input))} for u in uses]})
    raise AssertionError("no final answer")


@dataclass(frozen=True)
class Client:
    """One framework's way of playing an episode, and what its calls look like."""

    modules: tuple[str, ...]
    """The modules ``play`` imports."""
    play: Callable[[ChatSession, Played], Any]
    sync: bool = False
    """``play`` blocks (a sync client): it runs in a thread of its own."""
    rewrites: bool = False
    """It sends the history back other than it got it: each call starts a new segment."""
    observation: str = "<tool_response>\n{}\n</tool_response>"
    """How the template renders the tool's result in the next turn's input."""


OPENAI, AGENTS, LITELLM, ANTHROPIC = ("openai",), ("openai", "agents"), ("litellm",), \
    ("anthropic",)
LANGCHAIN = ("langchain_core.messages", "langchain_core.tools", "langchain_openai")
CLIENTS: dict[str, Client] = {
    "openai-sync": Client(OPENAI, openai_sync, sync=True),
    "openai-async": Client(OPENAI, openai_async),
    "openai-stream": Client(OPENAI, openai_stream),
    "langchain": Client(LANGCHAIN, langchain, sync=True),
    "langchain-stream": Client(LANGCHAIN, lambda s, p: langchain(s, p, stream=True),
                               sync=True),
    "agents-chat": Client(AGENTS, lambda s, p: openai_agents(s, p, responses=False)),
    "agents-responses": Client(AGENTS, lambda s, p: openai_agents(s, p, responses=True)),
    "agents-responses-stream": Client(
        AGENTS, lambda s, p: openai_agents(s, p, responses=True, stream=True)),
    # smolagents sends its history back as text ("Calling tools: [...]", the result as a
    # user's "Observation:"), never as the tokens it was given: a new segment each call
    "smolagents": Client(("openai", "smolagents"), smolagents, sync=True, rewrites=True,
                         observation="Observation:\n{}"),
    "litellm": Client(LITELLM, litellm),
    "litellm-stream": Client(LITELLM, lambda s, p: litellm(s, p, stream=True)),
    "anthropic": Client(ANTHROPIC, anthropic),
    "anthropic-stream": Client(ANTHROPIC, lambda s, p: anthropic(s, p, stream=True)),
}


class FrameworkAgent(ChatAgent):
    """Plays the episode with the client its spec names."""

    async def run(self, session: ChatSession) -> None:
        name = session.spec["client"]
        client, played = CLIENTS[name], PLAYED.setdefault(session.api_key, Played(name))
        if client.sync:
            played.output = await in_thread(client.play, session, played)
        else:
            played.output = await client.play(session, played)


def available(name: str) -> bool:
    return all(importlib.util.find_spec(m.split(".")[0]) is not None
               for m in CLIENTS[name].modules)


# ---------------------------------------------------------------- what the gateway received


@dataclass
class Call:
    """One POST to the gateway, as it arrived."""

    key: str
    path: str
    body: bytearray = field(default_factory=bytearray)
    status: int | None = None


CALLS: list[Call] = []


class Tap:
    """ASGI middleware around the gateway's app: records every POST's session, path, body
    and status, in the order they arrive (one session's calls are sequential)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path = scope["path"]
        key = (path.split("/")[2] if path.startswith("/s/") else
               headers.get("authorization", "").removeprefix("Bearer ").strip()
               or headers.get("x-api-key", ""))
        call = Call(key, path)
        CALLS.append(call)

        async def tapped_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                call.body += message.get("body", b"")
            return message

        async def tapped_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                call.status = message["status"]
            await send(message)

        await self.app(scope, tapped_receive, tapped_send)


def tapped(app: Any) -> Any:
    app.add_middleware(Tap)  # outermost, whatever routes are added to the app later
    return app


def chat_view(call: Call) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) of ``call`` in chat completions terms."""
    body = json.loads(call.body)
    if call.path.endswith("/chat/completions"):
        return body["messages"], body.get("tools")
    if call.path.endswith("/responses"):
        return responses_view(body)
    if call.path.endswith("/messages"):
        return anthropic_view(body)
    raise AssertionError(f"not a generation: {call.path}")


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def responses_view(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """As docs/extending.md maps the Responses API: instructions first as system, messages
    as messages (developer as system), consecutive function calls one assistant message's
    tool_calls, each output a tool message; function tools in the chat shape."""
    items = body["input"]
    items = [{"type": "message", "role": "user", "content": items}] \
        if isinstance(items, str) else items
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    turn: dict[str, Any] | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
            turn = messages[-1] if role == "assistant" else None
        elif kind == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            turn.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"])})
            turn = None
    keys = ("name", "description", "parameters", "strict")
    tools = [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}}
             for t in body.get("tools") or []]
    return messages, tools or None


def anthropic_view(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The Messages API as chat: system first; an assistant's text blocks (joined by
    newlines) and tool_use blocks one message with tool_calls (arguments: the input as
    JSON); a user's tool_result blocks tool messages, its text blocks a user message; tools
    in the chat shape."""
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text(body["system"])})
    for m in body["messages"]:
        blocks = m["content"]
        if isinstance(blocks, str):
            messages.append({"role": m["role"], "content": blocks})
        elif m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(
                b["text"] for b in blocks if b["type"] == "text")}
            calls = [{"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"])}}
                for b in blocks if b["type"] == "tool_use"]
            messages.append({**msg, "tool_calls": calls} if calls else msg)
        else:
            messages += [{"role": "tool", "tool_call_id": b["tool_use_id"],
                          "content": _text(b["content"])}
                         for b in blocks if b["type"] == "tool_result"]
            text = "\n".join(b["text"] for b in blocks if b["type"] == "text")
            if text:
                messages.append({"role": "user", "content": text})
    tools = [{"type": "function", "function": {
        "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
        "parameters": t["input_schema"]}} for t in body.get("tools") or []]
    return messages, tools or None


def check_episode(t: Trajectory, calls: list[Call], tokenizer: Any, client: Client) -> None:
    """The recorded tokens are exactly the answered calls (see the module docstring)."""
    answered = [c for c in calls if c.status == 200]
    assert len(answered) == len(t.turns), (len(answered), len(t.turns), t.error)
    # one token sequence, unless the framework rewrites what it was given
    assert [turn.fresh_context for turn in t.turns[1:]] == [client.rewrites] * (len(t.turns) - 1)
    context: list[int] = []
    for k, (call, turn) in enumerate(zip(answered, t.turns, strict=True)):
        context = turn.input_ids if k == 0 or turn.fresh_context else \
            context + t.turns[k - 1].completion_ids + turn.input_ids
        messages, tools = chat_view(call)
        rendered = tokenizer.apply_chat_template(messages, tools=tools,
                                                 add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(context, skip_special_tokens=False) == rendered, \
            f"turn {k}: the context ids are not the rendering of the call's messages"
        assert turn.completion_ids == scripted_ids(tokenizer, rendered), f"turn {k}"
    first = tokenizer.decode(t.turns[0].completion_ids, skip_special_tokens=False)
    assert first.startswith('<tool_call>\n{"name": "add"'), first
    total = str(t.spec["a"] + t.spec["b"])
    after = tokenizer.decode(t.turns[1].input_ids, skip_special_tokens=False)
    assert client.observation.format(total) in after, after[-300:]


# ---------------------------------------------------------------------------- the pipeline


@dataclass
class Run:
    learner: Any
    rollout: Any
    row: dict[str, Any]
    scored: dict[str, ScoredTrajectory]
    """Every scored episode, by id."""
    tokenizer: Any


@pytest.fixture(scope="module")
def clients() -> list[str]:
    names = [n for n in CLIENTS if available(n)]
    if not names:
        pytest.skip("no agent framework is installed (pip install -e '.[agents]')")
    return names


@pytest.fixture(scope="module")
def run(kafka_bootstrap: str, clients: list[str], tmp_path_factory: pytest.TempPathFactory,
        ) -> Run:
    """One pipeline, one group of two per client, one learner step over all of them."""
    from transformers import AutoTokenizer

    from rlbus.learner.chat_model import build_chat_model
    from rlbus.rollout import gateway_app

    for name in clients:  # imported before the loop runs: a first import blocks it seconds
        for module in CLIENTS[name].modules:
            importlib.import_module(module)
    folder = tmp_path_factory.mktemp("frameworks")
    model = build_chat_model(folder / "model")
    rows = folder / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"client": name, "a": 2 + i, "b": 40, "max_turns": 1})
                            + "\n" for i, name in enumerate(clients)))
    with pytest.MonkeyPatch.context() as patch:
        make_app = gateway_app.make_app
        patch.setattr(gateway_app, "make_app", lambda *a, **kw: tapped(make_app(*a, **kw)))
        out = asyncio.run(_pipeline(kafka_bootstrap, model, folder, rows, len(clients)))
    return Run(**out, tokenizer=AutoTokenizer.from_pretrained(model))


async def _pipeline(bootstrap: str, model: Path, folder: Path, rows: Path,
                    groups: int) -> dict[str, Any]:
    kafka = KafkaSettings(bootstrap=bootstrap, request_timeout_s=20)
    topics = TopicSettings(prefix=f"frameworks-{uuid.uuid4().hex[:8]}", partitions=2,
                           result_partitions=2)
    await ensure_topics(kafka, topics)
    s = settings(model, folder / "run", {"kafka": kafka, "topics": topics}, max_steps=1,
                 groups_per_step=groups, group_size=2, max_new_tokens=MAX_NEW_TOKENS,
                 task="addition", dataset=DatasetSettings(path=rows, shuffle_seed=None))
    s["rollout"] = s["rollout"].model_copy(update={
        "agent": f"{__name__}:FrameworkAgent", "max_context_tokens": 4096,
        "agent_timeout_s": 60.0})
    out = await run_pipeline(s, bus_factory(KafkaBus, kafka=kafka, dlq_topic=Topics(topics).dlq),
                             engine=ScriptedEngine(s["inference"]))
    metrics = (folder / "run" / "metrics.jsonl").read_text().splitlines()
    (row,) = [r for r in map(json.loads, metrics) if "loss" in r]
    return {"learner": out["learner"], "rollout": out["others"][2], "row": row,
            "scored": await _read_scored(kafka, Topics(topics).scored)}


async def _read_scored(kafka: KafkaSettings, topic: str) -> dict[str, ScoredTrajectory]:
    bus = KafkaBus(kafka, dlq_topic=None, service="test")
    try:
        out = {}
        for p in await bus.partitions(topic):  # one consumer each: read_to_end reads one
            consumer = await bus.consumer([topic], ScoredTrajectory, assign=[(topic, p)])
            for d in await consumer.read_to_end((topic, p)):
                out.setdefault(d.message.trajectory.episode_id, d.message)
        return out
    finally:
        await bus.close()


# ----------------------------------------------------------------------------- the checks


def test_the_learner_steps_on_every_clients_group(run: Run, clients: list[str]) -> None:
    assert run.learner.step == 1
    (trained,) = run.learner.ledger
    assert len(trained) == run.row["episodes"] == 2 * len(clients)
    assert {run.scored[e].trajectory.spec["client"] for e in trained} == set(clients)
    assert run.rollout.gateway is not None and not run.rollout.gateway.sessions  # all closed


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_framework_trains_through_the_gateway(run: Run, clients: list[str],
                                                name: str) -> None:
    for module in CLIENTS[name].modules:
        pytest.importorskip(module)
    client = CLIENTS[name]
    episodes = [e for e in run.scored.values() if e.trajectory.spec.get("client") == name]
    assert len(episodes) == 2
    (trained,) = run.learner.ledger
    for e in episodes:
        assert e.trajectory.status == "ok" and e.valid, e.trajectory.error or e.error
        assert e.trajectory.episode_id in trained
    sessions = [k for k, p in PLAYED.items() if p.client == name]
    assert len(sessions) == 2
    for key in sessions:
        played, spec = PLAYED[key], episodes[0].trajectory.spec
        assert played.tool_calls == [(spec["a"], spec["b"])], played
        assert str(spec["a"] + spec["b"]) in played.output, played
    # which session played which episode: the only pairing under which every call checks
    errors = []
    for order in itertools.permutations(sessions):
        try:
            for e, key in zip(episodes, order, strict=True):
                check_episode(e.trajectory, [c for c in CALLS if c.key == key],
                              run.tokenizer, client)
            return
        except AssertionError as exc:
            errors.append(exc)
    raise errors[0]

"""OpenAI's Responses API on the gateway (``POST /v1/responses``), the OpenAI Agents SDK's
default: each call is one chat completion of the session, recorded in the same exact tokens.

A request becomes the :class:`ChatRequest` a chat client would send for the same
conversation, and goes through :meth:`Session.complete`: ``instructions`` is the first
system message; ``message`` items are messages (``developer`` as ``system``, text parts
joined); ``function_call`` items are the ``tool_calls`` of one assistant message
(consecutive calls merged, with the assistant text right before them); a
``function_call_output`` is a ``role: tool`` message. The answer is a ``response`` object:
a ``message`` item with the text, and one ``function_call`` item per tool call (call_id =
the chat tool call id). Without a tool call there is always a message item, empty text
included, so that sending the output back renders the same history.

Stored conversations: the session keeps, by response id, the items of the conversation
(those of its ``previous_response_id``, its input, its output), so a request naming it
continues it. ``store: false`` keeps nothing. They end with the session. As on OpenAI,
``instructions`` is not carried over: each request sends its own (and if it changed, the
history no longer renders to the recorded tokens: the call starts a new segment, or in
``strict`` mode gets ``context_diverged``).

Streaming: the generation is not token-streamed over Kafka, so the events are emitted once
the completion is back, after the turn is recorded and the response stored; a client that
leaves mid-stream loses nothing recorded, and the tokens are the same whether it streamed
or not. A client that leaves during the generation cancels that call, as on the chat route:
nothing of it is recorded or stored, and the session goes on.

Every field the API takes is honoured, ignored on purpose or refused with a 400 that names
it, by the chat route's rules where both have the field (docs/extending.md, "The Responses
API"); an unknown field is ``unsupported_parameter``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlbus.rollout.sessions import (
    ChatRequest,
    GatewayCode,
    GatewayError,
    Session,
    json_object,
    pieces,
    sse,
)

Completion = dict[str, Any]
"""A chat.completion body, as :meth:`Session.complete` returns it."""

REFUSED: dict[str, str] = {
    "conversation": "conversations are stored at OpenAI; continue with previous_response_id "
                    "or send the whole input",
    "prompt": "prompt templates are stored at OpenAI; send instructions and input instead",
    "max_tool_calls": "the agent runs the tools and decides when to stop; leave it out",
}
"""Request fields refused with a reason whenever set; any other unknown field is refused as
an unsupported parameter."""

INCLUDE_NOOP = {"reasoning.encrypted_content"}
"""``include`` values that ask for nothing the gateway would return: it emits no reasoning
items, so there is no reasoning content to encrypt."""



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text part of a message: the agent's (``input_text``) or the policy's
    (``output_text``, sent back as history with the annotations and logprobs it had)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Item(_Strict):
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class Message(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCall(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class Reasoning(_Item):
    """Only an empty one is taken (it renders to nothing): this gateway emits none (the
    policy's reasoning is in its message text), and the chat template has no place for
    another model's."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


Item = Message | FunctionCall | FunctionCallOutput | Reasoning

ITEM_TYPES: dict[str, type[Item]] = {
    "message": Message, "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput, "reasoning": Reasoning,
}


class FunctionTool(_Strict):
    """A function tool in the Responses (flat) shape; ``strict`` reaches the template like
    any other key, it does not constrain sampling."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        """The same tool in the chat completions shape."""
        fields = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fields}


class TextFormat(BaseModel):
    """``text.format``: only ``text`` is taken; the other kinds carry a schema (extra keys)."""

    type: str


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Ignored: the chat template decides how the policy writes (as on the chat route)."""


class ResponsesRequest(_Strict):
    """The accepted subset of OpenAI's Responses create request."""

    model: str
    input: Any
    """A string or a list of items; checked by :func:`parse_items` for clearer errors."""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | None = None
    """As on the chat route: ``none`` keeps calls as text, ``required`` is taken as auto."""
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    previous_response_id: str | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    # ignored on purpose: the chat template decides how the policy thinks (the chat route's
    # reasoning_effort), or bookkeeping of a hosted API, meaningless for a local policy
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None


def _path(loc: Sequence[int | str]) -> str:
    """``tools[0].name`` from a pydantic location, without the names of union members."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "str" and "[" not in part:
            out += f".{part}" if out else part
    return out


def _invalid(exc: ValidationError, prefix: str = "") -> GatewayError:
    # of a union's failures the deepest is the branch the value was meant for
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    loc = _path(err.get("loc", ()))
    loc = f"{prefix}.{loc}" if prefix and loc else prefix or loc
    if err.get("type") == "extra_forbidden":
        return GatewayError(400, f"unsupported parameter: {loc}",
                            code=GatewayCode.UNSUPPORTED_PARAMETER, param=loc)
    return GatewayError(400, f"invalid {loc or 'request'}: {err.get('msg')}", param=loc or None)


def _unsupported(param: str, why: str) -> GatewayError:
    return GatewayError(400, f"{param} is not supported: {why}",
                        code=GatewayCode.UNSUPPORTED_PARAMETER, param=param)


def parse_request(body: bytes) -> ResponsesRequest:
    """The request in ``body``, or a 400 that names what is wrong with it."""
    data = json_object(body)
    _refuse(data)
    try:
        req = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None
    _check(req)
    return req


def _refuse(data: dict[str, Any]) -> None:
    """Refuse, with the reason, what validation would only call invalid."""
    for name, why in REFUSED.items():
        if data.get(name) is not None:
            raise _unsupported(name, why)
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(f"tools[{i}]", f"{kind!r} tools: the gateway takes function "
                                              "tools only (the agent runs them)")
    if isinstance(data.get("tool_choice"), dict):
        raise _unsupported("tool_choice", "a named or allowed set of tools: the policy "
                                          "chooses its calls (it is never constrained); use "
                                          "'auto' (or 'required', taken as 'auto')")


def _check(req: ResponsesRequest) -> None:
    """Refuse the values of accepted fields that the gateway cannot honour."""
    if req.background:
        raise _unsupported("background", "a call runs while the client waits; leave it out")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "must be 0: each token's logprob is recorded for "
                                           "training; read them from the trajectory")
    if req.truncation == "auto":
        raise _unsupported("truncation", "'auto': the context is the recorded tokens and is "
                                         "never cut; use 'disabled' (a call over the context "
                                         "is a 400 context_length_exceeded)")
    for value in req.include or []:
        if value not in INCLUDE_NOOP:
            raise _unsupported("include", f"{value!r}: the gateway returns text and function "
                                          "calls only (each token's logprob is recorded for "
                                          "training: read them from the trajectory)")
    text = req.text or TextConfig()
    if text.format is not None and text.format.type != "text":
        raise _unsupported("text.format", f"{text.format.type!r}: the gateway does not "
                                          "constrain decoding to a schema; ask for JSON in the "
                                          "instructions and parse the text")


def parse_items(value: Any) -> list[Item]:
    """The input as items: a string is one user message."""
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    if not isinstance(value, list):
        raise GatewayError(400, "input must be a string or a list of items, not "
                                f"{type(value).__name__}", param="input")
    return [_item(i, raw) for i, raw in enumerate(value)]


def _item(i: int, raw: Any) -> Item:
    if not isinstance(raw, dict):
        raise GatewayError(400, f"input[{i}] must be an object", param=f"input[{i}]")
    kind = raw.get("type", "message")
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise _unsupported(f"input[{i}].type", f"{kind!r} items: the gateway takes "
                                               f"{', '.join(ITEM_TYPES)} items")
    try:
        item = model.model_validate(raw)
    except ValidationError as exc:
        raise _invalid(exc, f"input[{i}]") from None
    if isinstance(item, Reasoning) and (item.summary or item.content or item.encrypted_content):
        raise _unsupported(f"input[{i}]", "a reasoning item with content: this gateway emits "
                                          "none (the policy's reasoning is in its message "
                                          "text), and the chat template has no place for "
                                          "another model's; drop it")
    return item


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_messages(items: Sequence[Item], first_new: int = 0) -> list[dict[str, Any]]:
    """The items as chat messages; ``first_new`` is the index of ``input[0]`` in ``items``
    (for error messages)."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    turn: dict[str, Any] | None = None  # the assistant message a function_call joins
    for i, item in enumerate(items):
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
            turn = messages[-1] if role == "assistant" else None
        elif isinstance(item, FunctionCall):
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            turn.setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}})
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutput):
            if item.call_id not in calls:
                where = f"input[{i - first_new}].call_id"
                raise GatewayError(400, f"{where}: no function_call with call_id "
                                        f"{item.call_id!r} comes before this output",
                                   param=where)
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
            turn = None
    return messages


def chat_request(req: ResponsesRequest, items: Sequence[Item], first_new: int) -> ChatRequest:
    messages = chat_messages(items, first_new)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise GatewayError(400, "the conversation is empty: send input", param="input")
    try:
        return ChatRequest(
            model=req.model, messages=messages,
            tools=[t.chat() for t in req.tools] if req.tools else None,
            tool_choice=req.tool_choice,
            temperature=req.temperature, top_p=req.top_p,
            max_completion_tokens=req.max_output_tokens, user=req.user,
            parallel_tool_calls=req.parallel_tool_calls)
    except ValidationError as exc:
        raise _invalid(exc) from None


def output_items(completion: Completion) -> list[dict[str, Any]]:
    """The Responses output items of a chat completion."""
    choice = completion["choices"][0]
    message, finished = choice["message"], choice["finish_reason"] != "length"
    status = "completed" if finished else "incomplete"
    calls = message.get("tool_calls") or []
    items: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        items.append({
            "type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [{"type": "output_text",
                                              "text": message.get("content") or "",
                                              "annotations": [], "logprobs": []}]})
    items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
               "name": c["function"]["name"], "arguments": c["function"]["arguments"],
               "status": "completed"} for c in calls]
    return items


def response_body(req: ResponsesRequest, session: Session, completion: Completion,
                  created_at: int) -> dict[str, Any]:
    """The ``response`` object: the output and usage, and the request's settings echoed
    (sampling as the session applied it)."""
    usage = completion["usage"]
    incomplete = completion["choices"][0]["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created_at,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": None if incomplete else int(time.time()),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "model": req.model,
        "output": output_items(completion),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "temperature": (session.sampling.temperature if req.temperature is None
                        else req.temperature),
        "top_p": session.sampling.top_p if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "reasoning": None, "store": req.store is not False, "background": False,
        "metadata": req.metadata or {}, "user": req.user,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


async def respond(model: str, session: Session, body: bytes,
                  run: Callable[[Awaitable[Completion]], Awaitable[Completion]]) -> Response:
    """Answer one Responses call of ``session``; ``run`` awaits the completion (the route's
    guard against a client that leaves while it is generated)."""
    req = parse_request(body)
    if req.model != model:
        raise GatewayError(404, f"the model {req.model!r} does not exist; this gateway "
                                f"serves {model!r}", code=GatewayCode.MODEL_NOT_FOUND,
                           param="model")
    history = _history(session, req.previous_response_id)
    items = history + parse_items(req.input)
    chat = chat_request(req, items, first_new=len(history))
    created_at = int(time.time())
    response = response_body(req, session, await run(session.complete(chat)), created_at)
    if req.store is not False:
        session.responses[response["id"]] = items + [
            ITEM_TYPES[o["type"]].model_validate(o) for o in response["output"]]
    if req.stream:
        return sse(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
                   for event in stream_events(response))
    return JSONResponse(response)


def _history(session: Session, previous: str | None) -> list[Item]:
    if previous is None:
        return []
    if previous not in session.responses:
        raise GatewayError(400, f"previous_response_id: this session holds no response "
                                f"{previous!r} (stored responses live as long as the session, "
                                "and store: false keeps none)",
                           code=GatewayCode.PREVIOUS_RESPONSE_NOT_FOUND,
                           param="previous_response_id")
    return list(session.responses[previous])


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The events OpenAI streams for ``response``, in order, numbered."""
    shell = {**response, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None, "completed_at": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": shell},
                                    {"type": "response.in_progress", "response": shell}]
    for index, item in enumerate(response["output"]):
        events += (_message_events if item["type"] == "message" else _call_events)(index, item)
    terminal = ("response.incomplete" if response["status"] == "incomplete"
                else "response.completed")
    events.append({"type": terminal, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]



def _message_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    part = item["content"][0]
    at = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        *({"type": "response.output_text.delta", **at, "delta": d, "logprobs": []}
          for d in pieces(part["text"])),
        {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]


def _call_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": index}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": {**item, "status": "in_progress", "arguments": ""}},
        *({"type": "response.function_call_arguments.delta", **at, "delta": d}
          for d in pieces(item["arguments"])),
        {"type": "response.function_call_arguments.done", **at,
         "arguments": item["arguments"]},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]

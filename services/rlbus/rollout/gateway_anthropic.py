"""Anthropic's Messages API on the gateway: ``POST /v1/messages``, for Claude-style agent code.

A call is translated to the OpenAI chat request the gateway already serves and run by the
same :meth:`Session.complete`, so a turn is recorded exactly as a chat completion's is (exact
tokens, the divergence check, the one-call-at-a-time rule, stop sequences cut where the
recorded tokens are cut); the answer is translated back. The session id is in the path
(``http://host:port/s/<session>``: the SDK appends ``/v1/messages``) or is the API key
(``x-api-key``, or ``Authorization: Bearer`` as anthropic 2.x sends it). Every refusal is
Anthropic's error body (``{"type": "error", "error": {"type": ..., "message": ...}}``) with
a 4xx, so the SDK raises its matching exception; the gateway's own code
(``context_diverged`` ...) is in ``error.details.error_code``.

Translation. ``system`` becomes a system message; assistant ``tool_use`` blocks become
``tool_calls`` (the block id is the call id, the input JSON-dumped as the chat route's
arguments are); ``tool_result`` blocks become ``tool`` messages in order; text blocks of one
message are joined by newlines. The answer's text block and tool_use blocks are the chat
completion's content and tool calls, so the history an agent sends back renders to the
tokens that were sampled. A field that would make the policy sample other than asked (top_k,
thinking, forced tool use) is refused with the reason, never ignored; where the chat route
has the field, its rule applies.

Streaming (``stream: true``): the generation is not token-streamed over Kafka, so the whole
completion is generated and recorded first, then sent as Anthropic's events (message_start,
a start/deltas/stop per block, message_delta, message_stop). The recorded tokens are the
same whether the client streamed or not, and a client that goes away mid-stream loses
nothing that was recorded. A client that leaves during the generation cancels that call, as
on the chat route: nothing of it is recorded, and the session goes on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

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



class _Strict(BaseModel):
    """Unknown fields are a 400 naming them. ``cache_control`` is accepted wherever Anthropic
    takes it, and ignored: there is no prompt cache to direct (each turn encodes only the
    messages that are new)."""

    model_config = ConfigDict(extra="forbid")


def _as_text_blocks(value: Any) -> Any:
    """A string is shorthand for one text block, as Anthropic reads it."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    _text = field_validator("content", mode="before")(_as_text_blocks)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    _text = field_validator("content", mode="before")(_as_text_blocks)


class ToolDef(_Strict):
    """A client tool; Anthropic's server tools (a dated ``type``) run nowhere here."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_server_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools such as {kind!r} are not supported: nothing runs "
                             "them here; declare a client tool with an input_schema")
        return data


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    """The accepted subset of Anthropic's Messages request; any other field is a 400 naming
    it, and the supported-but-refused ones are refused with a reason (:func:`to_chat`)."""

    model: str
    max_tokens: int = Field(ge=1, strict=True)
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    """Ignored: Anthropic's ``user_id`` for abuse tracking; it has no bearing on sampling."""
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None

    _text = field_validator("system", mode="before")(_as_text_blocks)


async def answer(model: str, session: Session, body: bytes,
                 run: Callable[[Awaitable[Completion]], Awaitable[Completion]]) -> Response:
    """Answer one Messages call of ``session``; ``run`` awaits the completion (the route's
    guard against a client that leaves while it is generated). Raises :class:`GatewayError`,
    which the route answers with :func:`error_response`."""
    req = parse(body)
    if req.model != model:
        raise GatewayError(404, f"the model {req.model!r} does not exist; this gateway "
                                f"serves {model!r}", code=GatewayCode.MODEL_NOT_FOUND)
    chat = to_chat(req)
    message = to_message(await run(session.complete(chat)), session, chat.stops)
    if req.stream:
        return sse(stream_events(message))
    return JSONResponse(message)


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 409: "conflict_error", 413: "request_too_large"}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """Anthropic's error shape; the type follows the status as Anthropic's does."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500
                            else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": exc.message}
    if exc.code is not None:
        error["details"] = {"error_code": str(exc.code)}
    return {"type": "error", "error": error}


# ---- request ------------------------------------------------------------------------------

_FIELDS = ", ".join(MessagesRequest.model_fields)
_BLOCK_REASONS = {
    "image": "the policy reads text only",
    "document": "the policy reads text only",
    "thinking": "this gateway returns no thinking blocks, so none can come back",
    "redacted_thinking": "this gateway returns no thinking blocks, so none can come back",
}


def parse(body: bytes) -> MessagesRequest:
    data = json_object(body)
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> GatewayError:
    err = exc.errors()[0]
    loc = _where(err["loc"])
    if err["type"] == "extra_forbidden":
        known = f" (this gateway takes {_FIELDS})" if "." not in loc else ""
        return GatewayError(400, f"unsupported parameter: {loc}{known}",
                            code=GatewayCode.UNSUPPORTED_PARAMETER)
    tag = _block_type(err)
    if tag is not None:
        why = _BLOCK_REASONS.get(tag, "only text, tool_use and tool_result blocks are")
        return GatewayError(400, f"{loc.removesuffix('.type')}: content blocks of type {tag!r} "
                                 f"are not supported: {why}",
                            code=GatewayCode.UNSUPPORTED_PARAMETER)
    if err["type"] == "value_error":
        return GatewayError(400, f"{loc}: {err['ctx']['error']}")
    return GatewayError(400, f"invalid {loc or 'request'}: {err['msg']}")


def _where(loc: tuple[int | str, ...]) -> str:
    """``loc`` as the request spells it: without the block type pydantic puts after each
    content block's index (``content.0.text.text`` is ``content.0.text``)."""
    kept = [p for k, p in enumerate(loc)
            if not (2 <= k < len(loc) - 1 and loc[k - 2] == "content"
                    and isinstance(loc[k - 1], int) and p in ("text", "tool_use", "tool_result"))]
    return ".".join(str(p) for p in kept)


def _block_type(err: Any) -> str | None:
    """The type of a content block refused where ``err`` is, if that is what it says."""
    if err["type"] == "union_tag_invalid":
        return str(err.get("ctx", {}).get("tag"))
    if err["type"] == "literal_error" and err["loc"][-1] == "type":  # text-only content
        return str(err["input"])
    return None


MAX_STOP_SEQUENCES = 4


def _refuse(param: str, why: str) -> GatewayError:
    return GatewayError(400, f"{param} is not supported: {why}",
                        code=GatewayCode.UNSUPPORTED_PARAMETER, param=param)


def to_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request ``req`` means; raises for what the policy cannot do as asked."""
    if req.stop_sequences and len(req.stop_sequences) > MAX_STOP_SEQUENCES:
        raise _refuse("stop_sequences", f"more than {MAX_STOP_SEQUENCES}: the chat route's "
                      "bound (OpenAI's)")
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise _refuse("thinking", "the completion is returned as the policy sampled it, "
                      "without thinking blocks; leave it out or send {\"type\": \"disabled\"}")
    if req.messages[-1].role == "assistant":
        raise GatewayError(400, "messages: a final assistant message (prefill) is not "
                                "supported: the policy would continue a text it did not "
                                "sample; end with a user message", param="messages")
    system = [{"role": "system", "content": _text(req.system)}] if req.system else []
    return ChatRequest(
        model=req.model, messages=system + chat_messages(req.messages),
        tools=[_tool(t) for t in req.tools] if req.tools else None,
        tool_choice=_tool_choice(req.tool_choice), temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, max_tokens=req.max_tokens,
        stop=req.stop_sequences or None)


def _text(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _tool(tool: ToolDef) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice | None) -> Literal["auto", "none"] | None:
    if choice is None:
        return None
    if choice.type in ("any", "tool"):
        raise _refuse("tool_choice.type", f"{choice.type!r} would force a tool call, which "
                      "needs constrained decoding the policy does not do; use auto or none")
    if choice.disable_parallel_tool_use:
        raise _refuse("tool_choice.disable_parallel_tool_use", "the policy samples freely and "
                      "may call several tools at once; nothing holds it to one")
    return "auto" if choice.type == "auto" else "none"


def chat_messages(messages: list[InputMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages for Anthropic ones, in order (tool results as ``tool`` turns)."""
    out: list[dict[str, Any]] = []
    called: set[str] = set()  # tool_use ids of the previous assistant message
    for i, m in enumerate(messages):
        if m.role == "assistant":
            out.append(_assistant(m, i))
            called = {b.id for b in m.content if isinstance(b, ToolUseBlock)}
        elif m.role == "user":
            out += _user(m, i, called)
            called = set()
        else:
            out.append({"role": "system", "content": _text(_only_text(m, i))})
    return out


def _only_text(m: InputMessage, i: int) -> list[TextBlock]:
    for j, b in enumerate(m.content):
        if not isinstance(b, TextBlock):
            raise GatewayError(400, f"messages.{i}.content.{j}: a {m.role} message holds text "
                                    f"only, not {b.type}", param=f"messages.{i}.content.{j}")
    return [b for b in m.content if isinstance(b, TextBlock)]


def _assistant(m: InputMessage, i: int) -> dict[str, Any]:
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        if isinstance(b, ToolResultBlock):
            raise GatewayError(400, f"messages.{i}.content.{j}: a tool_result belongs in a "
                                    "user message", param=f"messages.{i}.content.{j}")
        if isinstance(b, TextBlock):
            texts.append(b)
        else:
            calls.append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input)}})
    message: dict[str, Any] = {"role": "assistant", "content": _text(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(m: InputMessage, i: int, called: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for j, b in enumerate(m.content):
        at = f"messages.{i}.content.{j}"
        if isinstance(b, ToolUseBlock):
            raise GatewayError(400, f"{at}: a tool_use belongs in an assistant message",
                               param=at)
        if isinstance(b, TextBlock):
            texts.append(b)
            continue
        if b.tool_use_id not in called:
            raise GatewayError(400, f"{at}.tool_use_id: {b.tool_use_id!r} answers no tool_use "
                                    f"of the previous assistant message", param=at)
        if texts:
            out.append({"role": "user", "content": _text(texts)})
            texts = []
        content = _text(b.content)
        out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": f"Error: {content}" if b.is_error else content})
    if texts or not out:
        out.append({"role": "user", "content": _text(texts)})
    return out


# ---- answer -------------------------------------------------------------------------------

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def to_message(completion: Completion, session: Session, stops: list[str]) -> dict[str, Any]:
    """Anthropic's message for a chat.completion body of ``session.complete``."""
    choice = completion["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls", []):
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    stop_reason = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
    if stop_reason == "end_turn" and stops and _cut_at_stop(session):
        stop_reason = "stop_sequence"
    usage = completion["usage"]
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": completion["model"], "content": content, "stop_reason": stop_reason,
        # which one matched is known only if there was one: the token that reached it is
        # dropped with the rest (what is returned is what is recorded)
        "stop_sequence": stops[0] if stop_reason == "stop_sequence" and len(stops) == 1
        else None,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "output_tokens": usage["completion_tokens"]},
    }


def _cut_at_stop(session: Session) -> bool:
    """Whether the last completion ended at a stop sequence: a stopped completion that does
    not end with its end-of-turn token was cut there (:meth:`Session.cut_at_stop`)."""
    ids = session.turns[-1].completion_ids
    return not ids or ids[-1] != session.tokenizer.eos_token_id


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stream_events(message: dict[str, Any]) -> Iterator[str]:
    """Anthropic's server-sent events for a whole ``message``."""
    usage = message["usage"]
    yield _event("message_start", message={
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start, kind, key, text = {**block, "text": ""}, "text_delta", "text", block["text"]
        else:
            start, kind, key = {**block, "input": {}}, "input_json_delta", "partial_json"
            text = json.dumps(block["input"])
        yield _event("content_block_start", index=index, content_block=start)
        for piece in pieces(text):
            yield _event("content_block_delta", index=index, delta={"type": kind, key: piece})
        yield _event("content_block_stop", index=index)
    yield _event("message_delta", delta={"stop_reason": message["stop_reason"],
                                         "stop_sequence": message["stop_sequence"]},
                 usage={"output_tokens": usage["output_tokens"]})
    yield _event("message_stop")


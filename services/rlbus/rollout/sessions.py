"""A gateway session: one episode's chat with the policy, in exact tokens.

Exact tokens. The first call is rendered with the model's chat template
(``apply_chat_template``). From then on the context is the ids recorded so far (prompts and
the sampled ids as they were sampled, never re-tokenised) plus the rendering of only the
messages the agent added since the last reply: the text the template puts after that
reply's end-of-turn token. Before appending, the session checks that the template renders
the whole history to exactly the text of the recorded ids (byte-level decoding is
lossless). A call that does not extend the history so (a template that drops earlier
``<think>`` blocks, history the agent trimmed, summarised or edited, a call retried after a
reply it did not keep, a tool call the template re-formats, tools that changed) is handled
by the session's ``history`` mode:

* ``segments``: the call's context is the template's rendering of its messages, tokenised
  as a first call's; its turn is recorded with ``fresh_context`` (a new training segment:
  :meth:`rlbus.messages.Trajectory.segments`) and the next calls may extend it.
* ``strict``: the call is refused with a 400 ``context_diverged`` that says where the texts
  part, and the episode fails with that reason (published as failed, masked by the
  learner).

Either way nothing is trained on a context the model did not see.

Tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the
completion (the Hermes/Qwen convention, read by :mod:`rlbus.tool_calls` as the default agent
reads it) are returned as OpenAI ``tool_calls``; a malformed block stays in the content as
text.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NoReturn

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlbus.api import Generation, Policy
from rlbus.errors import RlbusError
from rlbus.messages import FinishReason, Sampling, Turn, cut_spans
from rlbus.rollout.settings import GatewayHistory
from rlbus.tool_calls import find_tool_calls, without_calls

log = logging.getLogger(__name__)


class GatewayCode(StrEnum):
    """Why the gateway refused a call: the ``code`` of its OpenAI-style error answer
    (``error.details.error_code`` in the Messages route's Anthropic-style one)."""

    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_API_KEY = "invalid_api_key"
    REQUEST_TOO_LARGE = "request_too_large"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONTEXT_DIVERGED = "context_diverged"
    """``strict`` mode: the history no longer renders to the tokens the model saw, and the
    episode fails (``segments`` mode starts a new segment instead)."""
    SESSION_FAILED = "session_failed"
    CONCURRENT_CALL = "concurrent_call"
    """Another call of the session is running: the only code worth retrying."""
    CLIENT_DISCONNECTED = "client_disconnected"
    SESSION_TOO_LONG = "session_too_long"
    """The session has recorded its bound of tokens: the episode should end."""
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    """A Responses call continues a response this session does not hold."""


ErrorKind = Literal["invalid_request_error", "authentication_error", "server_error"]


class GatewayError(RlbusError):
    """An error answer: HTTP status, message, type, code, param; :meth:`body` is OpenAI's
    shape (the Messages route renders Anthropic's, :mod:`.gateway_anthropic`). A call
    without a ``code`` is malformed in a way OpenAI gives no code for either (bad JSON, an
    invalid field)."""

    def __init__(self, status: int, message: str, *, code: GatewayCode | None = None,
                 param: str | None = None, kind: ErrorKind = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = (
            status, message, code, param, kind)
        self.retriable = code is GatewayCode.CONCURRENT_CALL

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class Diverged(Exception):
    """A call's messages do not extend the session's recorded history; the text says why."""


class ChatRequest(BaseModel):
    """OpenAI's chat completion request as the gateway takes it. Every field a common
    client sends is honoured, ignored on purpose (it means nothing for a policy being
    trained) or refused when set to a value we cannot honour, naming the field
    (:meth:`check`); an unknown field is a 400 naming it: silently ignoring a parameter
    would train on something else than asked. The table is in docs/extending.md."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # ignored on purpose: bookkeeping of a hosted API, meaningless for a local policy
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    seed: int | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # honoured only at their neutral value: anything else changes the sampling distribution
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @field_validator("messages")
    @classmethod
    def _flat_text(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Content given as a list of text parts (smolagents, LangChain, the Agents SDK send
        it so) becomes the string of those parts joined by newlines, as vLLM does for a
        string-content template: a template renders it, never a Python list repr. Any
        other part (an image, audio) is refused: the policy is a text model."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind not in ("text", "input_text", "output_text"):
                        raise ValueError(f"messages[{i}]: a content part of type {kind!r}; "
                                         "only text parts are taken (a text policy)")
                    texts.append(str(part.get("text", "")))
                m = {**m, "content": "\n".join(texts)}
            out.append(m)
        return out

    def check(self) -> None:
        """Refuse what we cannot honour, naming the field and what to do instead."""
        def refuse(param: str, why: str) -> NoReturn:
            raise GatewayError(400, f"{param}: {why}", code=GatewayCode.UNSUPPORTED_PARAMETER,
                               param=param)

        if self.n not in (None, 1):
            refuse("n", "must be 1: each completion is one turn of one episode; run several "
                        "episodes (the group size) for several samples")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                refuse(name, "must be 0: a penalty samples from another distribution than "
                             "the policy the learner trains")
        if self.repetition_penalty not in (None, 1):
            refuse("repetition_penalty", "must be 1 (see frequency_penalty)")
        if self.top_k not in (None, 0, -1):
            refuse("top_k", "is not supported: top_p is (the engines sample top-p only)")
        if self.logit_bias:
            refuse("logit_bias", "must be empty: a bias samples from another distribution "
                                 "than the policy the learner trains")
        if self.logprobs or self.top_logprobs:
            refuse("logprobs", "is not returned: the gateway records each token's logprob "
                               "for training; read them from the trajectory")
        if self.response_format and self.response_format.get("type") != "text":
            refuse("response_format", "only {'type': 'text'}: the policy is not constrained "
                                      "(a constraint would train on another distribution)")
        if isinstance(self.tool_choice, dict):
            refuse("tool_choice", "a named function is not supported: the policy chooses "
                                  "its calls; use 'auto' (or 'required', taken as 'auto')")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            refuse("stop", "at most 4 stop sequences (as OpenAI)")

    @property
    def stops(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


@dataclass
class Session:
    """One episode's conversation: the ids the model has seen and the turns recorded."""

    id: str
    policy: Policy
    tokenizer: Any  # a transformers tokenizer with a chat template
    sampling: Sampling
    max_context_tokens: int
    turns: list[Turn] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    tools: str = ""
    failed: str | None = None
    busy: bool = False
    tokens: int = 0
    """Tokens recorded so far (prompts and completions of every call)."""
    max_tokens: int = 1 << 20
    """Most tokens one session may record (``RLBUS_GATEWAY_MAX_SESSION_TOKENS``)."""
    last_call: float = field(default_factory=time.monotonic)
    """When its last call ended (or it opened): the idle bound counts from here."""
    responses: dict[str, list[Any]] = field(default_factory=dict)
    """Responses API: each stored response's conversation (its input items, those of the
    response it continued, its output items), by id, for ``previous_response_id``
    (:mod:`.gateway_responses`)."""
    history: GatewayHistory = "segments"
    """What a call that does not extend the recorded history does (module docstring)."""
    fresh: bool = False
    """Whether the call being completed starts a new segment (set by :meth:`context`)."""

    @property
    def eos_text(self) -> str:
        return str(self.tokenizer.eos_token)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as exc:  # the template rejects the conversation (jinja raise)
            raise GatewayError(400, f"the chat template cannot render these messages: "
                                    f"{type(exc).__name__}: {exc}", param="messages") from exc
        return str(text)

    def context(self, req: ChatRequest) -> tuple[list[int], list[int]]:
        """(full context, ids new this turn) for ``req``: the recorded history extended, or
        (``segments``) a new segment whose ids are all new; raises on divergence in
        ``strict``."""
        tools = json.dumps(req.tools, sort_keys=True) if req.tools else ""
        full = self.render(req.messages, req.tools, generation_prompt=True)
        self.fresh = False
        if self.ids:
            try:
                new = self.extension(req, full, tools)
                return self.ids + new, new
            except Diverged as d:
                if self.history == "strict":
                    self.diverge(str(d))
                log.debug("session %s: call %d starts a new segment: %s", self.id,
                          len(self.turns), d)
                self.fresh = True
        self.tools = tools
        new = self.tokenizer.encode(full, add_special_tokens=False)
        return new, new

    def extension(self, req: ChatRequest, full: str, tools: str) -> list[int]:
        """The ids ``req`` adds to the recorded history (``full`` is its rendering); raises
        :class:`Diverged` saying why where it does not extend that history."""
        if tools != self.tools:
            raise Diverged("the tools differ from the session's first call")
        # The text of the recorded ids must begin the rendering and the new ids are the
        # rest: one rendering per call, as the template is most of the gateway's own cost
        # and grows with the history.
        seen = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if not full.startswith(seen):
            at = next((i for i, (a, b) in enumerate(zip(seen, full, strict=False)) if a != b),
                      min(len(seen), len(full)))
            raise Diverged(f"the history renders to other text than the tokens the model "
                           f"saw, from character {at}: saw {seen[at:at + 40]!r}, template "
                           f"gives {full[at:at + 40]!r}")
        if (self.ids[-1] != self.tokenizer.eos_token_id
                and not full.startswith(self.eos_text, len(seen))):
            raise Diverged("the last reply ended without an end-of-turn token and the "
                           "messages go on with it")
        return list(self.tokenizer.encode(full[len(seen):], add_special_tokens=False))

    def diverge(self, why: str) -> NoReturn:
        self.failed = f"context diverged: {why} (rlbus trains only the exact tokens sampled)"
        raise GatewayError(400, self.failed, code=GatewayCode.CONTEXT_DIVERGED, param="messages")

    async def complete(self, req: ChatRequest) -> dict[str, Any]:
        if self.failed:
            raise GatewayError(400, f"this episode has failed: {self.failed}",
                               code=GatewayCode.SESSION_FAILED)
        if self.busy:
            raise GatewayError(409, "a call of this session is still running: one at a time",
                               code=GatewayCode.CONCURRENT_CALL)
        req.check()
        self.busy = True
        try:
            return await self._complete(req)
        finally:
            self.busy = False
            self.last_call = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since its last call ended; 0 while one runs."""
        return 0.0 if self.busy else time.monotonic() - self.last_call

    async def _complete(self, req: ChatRequest) -> dict[str, Any]:
        context, new = self.context(req)
        max_new = req.max_completion_tokens or req.max_tokens or self.sampling.max_new_tokens
        if len(context) + max_new > self.max_context_tokens:
            raise GatewayError(400, f"this model's context is {self.max_context_tokens} tokens; "
                                    f"the messages take {len(context)} and {max_new} more "
                                    "were asked for", code=GatewayCode.CONTEXT_LENGTH_EXCEEDED,
                               param="messages")
        if self.tokens + len(new) + max_new > self.max_tokens:
            raise GatewayError(400, f"this session has recorded {self.tokens} tokens; with "
                                    f"{len(new)} new and {max_new} more asked for it would "
                                    f"pass its bound of {self.max_tokens} "
                                    "(RLBUS_GATEWAY_MAX_SESSION_TOKENS): end the episode",
                               code=GatewayCode.SESSION_TOO_LONG, param="messages")
        sampling = Sampling(
            temperature=self.sampling.temperature if req.temperature is None else req.temperature,
            top_p=self.sampling.top_p if req.top_p is None else req.top_p,
            max_new_tokens=max_new)
        gen: Generation = await self.policy.generate(context, sampling)
        completion, logprobs, finish = gen.completion_ids, gen.logprobs, gen.finish_reason
        if req.stops:
            completion, logprobs, finish = self.cut_at_stop(completion, logprobs, finish,
                                                            req.stops)
        # Special tokens stay in the text (but the final end-of-turn): the agent echoes the
        # content back, and only then does the history render to the text of these ids.
        ids = completion
        if ids and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = (parse_tool_calls(text) if req.tools and req.tool_choice != "none"
                          else (text, []))
        self.turns.append(Turn(
            input_ids=new, completion_ids=completion, logprobs=logprobs,
            policy_version=gen.policy_version, finish_reason=finish, action=text,
            fresh_context=self.fresh,
            version_spans=cut_spans(gen.version_spans, len(completion)),
        ))
        self.ids = context + completion
        self.tokens += len(new) + len(completion)
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
            "created": int(time.time()), "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "finish_reason": reason,
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(context), "completion_tokens": len(completion),
                      "total_tokens": len(context) + len(completion)},
        }

    def cut_at_stop(self, ids: list[int], logprobs: list[float], finish: FinishReason,
                    stops: list[str]) -> tuple[list[int], list[float], FinishReason]:
        """The completion up to (not including) the first token whose text reaches a stop
        sequence: what is returned is exactly what is recorded, and the tokens sampled past
        the stop are dropped from both (the kept ones' logprobs are unchanged)."""
        def reached(n: int) -> bool:  # monotone in n: a prefix's text is a prefix
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=False)
            return any(stop in text for stop in stops)

        if reached(len(ids)):
            lo, hi = 1, len(ids)  # the first n whose text reaches a stop is in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if reached(mid) else (mid + 1, hi)
            return ids[:lo - 1], logprobs[:lo - 1], "stop"
        return ids, logprobs, finish


def json_object(body: bytes) -> dict[str, Any]:
    """A request body as the JSON object every route takes, or a 400 saying why not."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return data


STREAM_PIECE = 16
"""Characters of text (or of a tool call's arguments) per streamed delta, on every route."""


def sse(events: Iterable[str]) -> StreamingResponse:
    """A streamed answer of server-sent events, each already framed (``data: ...\\n\\n``),
    on every route. An async generator: Starlette pulls a plain iterator through its
    thread pool, one thread hop per event."""
    async def each() -> AsyncIterator[str]:
        for event in events:
            yield event

    return StreamingResponse(each(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


def pieces(text: str) -> list[str]:
    """``text`` in the deltas a streamed answer sends it in."""
    return [text[i:i + STREAM_PIECE] for i in range(0, len(text), STREAM_PIECE)]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the well-formed call blocks, OpenAI tool_calls); a malformed block
    stays in the content as text (:mod:`rlbus.tool_calls`)."""
    blocks = find_tool_calls(text)
    calls = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
              "function": {"name": b.name,
                           "arguments": json.dumps(b.arguments, ensure_ascii=False)}}
             for b in blocks if b.ok]
    # without calls the text is returned as sampled, to the byte: it comes back as history
    return (without_calls(text, blocks).strip() if calls else text), calls

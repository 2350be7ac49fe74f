"""The gateway's HTTP surface (FastAPI): the routes (OpenAI's ``/v1/chat/completions``,
``/v1/responses`` and ``/v1/models``, Anthropic's ``/v1/messages``, each also under
``/s/<session>``), authentication by session, errors, server-sent events.

Every refusal is a body with a 4xx status, never a hung connection: malformed JSON and
unknown fields are 400, an unknown session 401, an unknown model 404, a second concurrent
call of one session 409. The chat and Responses routes answer in OpenAI's shape
(``{"error": {...}}``); the Messages route catches its own :class:`GatewayError` and
answers in Anthropic's (``{"type": "error", "error": {...}}``,
:func:`gateway_anthropic.error_response`). The app's generic handlers answer in OpenAI's
shape on every path, ``/v1/messages`` ones included: an unknown path (404 ``not_found``,
e.g. ``/v1/messages/count_tokens``), a wrong method (405 ``method_not_allowed``), and a
bug (500 of type ``server_error``, still a body).

A client that disconnects mid-call cancels that call's generation: nothing of it is
recorded, what was recorded before stays, and the session goes on (a client that retries
continues it). A streamed call is generated whole and recorded first, then sent as events
(the engines answer a step request at once, not token by token over Kafka), so the
recorded tokens are the same whether the client streamed or not, and a client that goes
away mid-stream loses nothing that was recorded."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from rlbus.rollout import gateway_anthropic
from rlbus.rollout.gateway_responses import respond
from rlbus.rollout.sessions import (
    ChatRequest,
    GatewayCode,
    GatewayError,
    Session,
    json_object,
    pieces,
    sse,
)


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation(exc: ValidationError | RequestValidationError) -> GatewayError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "extra_forbidden":
        return GatewayError(400, f"unsupported parameter: {loc}",
                            code=GatewayCode.UNSUPPORTED_PARAMETER, param=loc)
    return GatewayError(400, f"invalid {loc or 'request'}: {err.get('msg')}", param=loc or None)


def make_app(model: str, sessions: Mapping[str, Session], *,
             max_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """The routes of a gateway serving ``model`` to the open ``sessions`` (by id)."""
    app = FastAPI(title="rlbus gateway", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation(exc))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return _error(GatewayError(404, f"no route {request.method} {request.url.path}",
                                   code=GatewayCode.NOT_FOUND))

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return _error(GatewayError(405, f"{request.method} is not allowed on "
                                        f"{request.url.path}", code=GatewayCode.METHOD_NOT_ALLOWED))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # still an answer
        return _error(GatewayError(500, f"gateway error: {type(exc).__name__}: {exc}",
                                   kind="server_error"))

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "rlbus"}]}

    app.get("/v1/models")(models)
    app.get("/s/{session_id}/v1/models")(models)

    async def chat(request: Request) -> Response:
        session = _session(sessions, request, request.path_params.get("session_id"))
        req = await _parse(request, max_body_bytes)
        if req.model != model:
            raise GatewayError(404, f"the model {req.model!r} does not exist; this gateway "
                                    f"serves {model!r}", code=GatewayCode.MODEL_NOT_FOUND,
                               param="model")
        completion = await _until_disconnect(request, session.complete(req))
        if req.stream:
            return sse(itertools.chain(
                (f"data: {json.dumps(c)}\n\n" for c in chat_chunks(completion,
                                                                    req.include_usage)),
                ["data: [DONE]\n\n"]))
        return JSONResponse(completion)

    async def responses(request: Request) -> Response:
        session = _session(sessions, request, request.path_params.get("session_id"))
        return await respond(model, session, await read_body(request, max_body_bytes),
                             lambda work: _until_disconnect(request, work))

    async def messages(request: Request) -> Response:
        try:
            session = _session(sessions, request, request.path_params.get("session_id"))
            return await gateway_anthropic.answer(
                model, session, await read_body(request, max_body_bytes),
                lambda work: _until_disconnect(request, work))
        except GatewayError as exc:  # Anthropic's error shape on Anthropic's route
            return gateway_anthropic.error_response(exc)

    # plain Starlette routes: each handler reads its body itself, and FastAPI's parameter
    # solving and response wrapping would only add to every call (docs/performance.md §5)
    for path, handler in (("/v1/chat/completions", chat), ("/v1/responses", responses),
                          ("/v1/messages", messages)):
        app.add_route(path, handler, methods=["POST"])
        app.add_route(f"/s/{{session_id}}{path}", handler, methods=["POST"])
    return app


def _session(sessions: Mapping[str, Session], request: Request,
             session_id: str | None) -> Session:
    key = (request.headers.get("x-api-key")  # Anthropic's header
           or request.headers.get("authorization", "").removeprefix("Bearer ").strip())
    sid = session_id or key
    session = sessions.get(sid)
    if session is None:
        raise GatewayError(401, "no open episode has this session id (the path or the API "
                                "key); it may have ended", code=GatewayCode.INVALID_API_KEY,
                           kind="authentication_error")
    return session


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; a 413 naming the bound once it passes ``limit`` bytes (declared
    or streamed), before more of it is held in memory."""
    too_large = GatewayError(413, f"the request body is over {limit} bytes "
                                  "(RLBUS_GATEWAY_MAX_BODY_BYTES)",
                             code=GatewayCode.REQUEST_TOO_LARGE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _parse(request: Request, limit: int) -> ChatRequest:
    body = await read_body(request, limit)
    data = json_object(body)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise _validation(exc) from None


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Run ``work``; if the client goes away first, cancel it (nothing of it is recorded)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise GatewayError(499, "the client disconnected mid-call; nothing of this call "
                                    "was recorded", code=GatewayCode.CLIENT_DISCONNECTED)
    return task.result()


def chat_chunks(completion: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """A chat.completion as the ``chat.completion.chunk`` objects OpenAI streams: the role,
    content deltas, each tool call's id and name then its argument deltas, the finish
    reason, the usage chunk (``stream_options.include_usage``), then ``[DONE]``."""
    (choice,) = completion["choices"]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        c = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    yield chunk({"role": "assistant", "content": ""})
    for piece in pieces(message.get("content") or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in pieces(fn["arguments"]):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": completion["usage"]}

"""The gateway's HTTP surface (FastAPI): routes, authentication by session, OpenAI-style
errors. Every failure is an ``{"error": {...}}`` body with a 4xx status, never a 500 or a
hung connection: malformed JSON and unknown fields are 400, an unknown session 401, an
unknown model 404, a second concurrent call of one session 409. A client that disconnects
mid-call cancels its generation, and its episode fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rlbus.rollout.sessions import ChatRequest, GatewayCode, GatewayError, Session


def _error(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation(exc: ValidationError | RequestValidationError) -> GatewayError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "extra_forbidden":
        return GatewayError(400, f"unsupported parameter: {loc}",
                            code=GatewayCode.UNSUPPORTED_PARAMETER, param=loc)
    return GatewayError(400, f"invalid {loc or 'request'}: {err.get('msg')}", param=loc or None)


def make_app(model: str, sessions: Mapping[str, Session]) -> FastAPI:
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

    async def chat(request: Request, session_id: str | None = None) -> JSONResponse:
        session = _session(sessions, request, session_id)
        req = await _parse(request)
        if req.model != model:
            raise GatewayError(404, f"the model {req.model!r} does not exist; this gateway "
                                    f"serves {model!r}", code=GatewayCode.MODEL_NOT_FOUND,
                               param="model")
        if req.n not in (None, 1):
            raise GatewayError(400, "n must be 1: each completion is one turn of one episode",
                               code=GatewayCode.UNSUPPORTED_PARAMETER, param="n")
        if req.stream:
            raise GatewayError(400, "stream is not supported",
                               code=GatewayCode.UNSUPPORTED_PARAMETER, param="stream")
        return JSONResponse(await _until_disconnect(request, session, session.complete(req)))

    app.post("/v1/chat/completions")(chat)
    app.post("/s/{session_id}/v1/chat/completions")(chat)
    return app


def _session(sessions: Mapping[str, Session], request: Request,
             session_id: str | None) -> Session:
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    sid = session_id or key
    session = sessions.get(sid)
    if session is None:
        raise GatewayError(401, "no open episode has this session id (the path or the API "
                                "key); it may have ended", code=GatewayCode.INVALID_API_KEY,
                           kind="authentication_error")
    return session


MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body read; a bigger one is a 413 before it is held in memory."""


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise GatewayError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                           code=GatewayCode.REQUEST_TOO_LARGE)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise GatewayError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                               code=GatewayCode.REQUEST_TOO_LARGE)
    return bytes(body)


async def _parse(request: Request) -> ChatRequest:
    body = await _read_body(request)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "the body must be a JSON object")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise _validation(exc) from None


async def _until_disconnect(request: Request, session: Session, work: Any) -> Any:
    """Run ``work``; if the client goes away first, cancel it and fail the episode."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            session.failed = session.failed or "the client disconnected mid-call"
            raise GatewayError(499, session.failed, code=GatewayCode.CLIENT_DISCONNECTED)
    return task.result()

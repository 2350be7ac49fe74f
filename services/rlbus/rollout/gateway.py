"""The gateway: existing agent code (OpenAI or Anthropic clients), trained with exact tokens.

The rollout tier serves OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/responses``
(:mod:`.gateway_responses`), Anthropic's ``POST /v1/messages`` (:mod:`.gateway_anthropic`)
and ``GET /v1/models`` (FastAPI on uvicorn, in the rollout process and on its event loop;
the routes are :mod:`.gateway_app`). A session is one episode (:mod:`.sessions`); its id is
in the path of the ``base_url`` the agent gets (``http://host:port/s/<session>/v1``) and is
also its API key, so a client that only lets you set a key works against
``http://host:port/v1`` too. A Responses or Messages call is translated to the chat request
for the same conversation, so every call of every route is one chat completion of the
session: a StepRequest over Kafka like any other turn, so batching, the staleness gate,
tracing and fault handling are the rollout tier's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from rlbus.errors import RefusalReason, RefusedError
from rlbus.rollout.sessions import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bounds:
    """What one gateway holds at most (the rollout tier's ``gateway_*`` settings)."""

    max_sessions: int = 1024
    """Sessions (episodes) open at once; one more fails its episode with the reason."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body read; a bigger one is a 413 before it is held in memory."""
    max_session_tokens: int = 1 << 20
    """Tokens one session may record; a call past it is a 400 ``session_too_long``."""
    idle_timeout_s: float = 300.0
    """A session with no call for this long fails its episode (the agent is stopped)."""


class TooManySessions(RefusedError):
    """The gateway has its bound of open sessions: this episode fails with the reason."""

    reason = RefusalReason.OVER_LIMIT


class SessionIdle(RefusedError):
    """A session had no call for longer than its bound: its episode fails."""

    reason = RefusalReason.OVER_LIMIT


class Gateway:
    """The sessions of one rollout instance and the HTTP server that serves them."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0,
                 bounds: Bounds | None = None) -> None:
        self.model, self.host, self.port = model, host, port
        self.bounds = bounds or Bounds()
        self.sessions: dict[str, Session] = {}
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: str) -> str:
        return f"{self.url}/s/{session}/v1"

    @contextlib.asynccontextmanager
    async def session(self, **kwargs: Any) -> AsyncIterator[Session]:
        if len(self.sessions) >= self.bounds.max_sessions:
            raise TooManySessions(f"the gateway has {len(self.sessions)} open sessions, its "
                                  "bound (RLBUS_GATEWAY_MAX_SESSIONS): raise it, or lower "
                                  "RLBUS_MAX_CONCURRENT_EPISODES")
        kwargs.setdefault("max_tokens", self.bounds.max_session_tokens)
        s = Session(id=f"rlbus-{uuid.uuid4().hex}", **kwargs)
        self.sessions[s.id] = s
        try:
            yield s
        finally:
            self.sessions.pop(s.id, None)

    async def run(self, session: Session, agent: Any) -> Any:
        """Await ``agent`` (the episode's agent code) while ``session`` is in use: if it
        makes no call for ``idle_timeout_s``, the agent is cancelled and
        :class:`SessionIdle` raised (what it recorded stays in ``session.turns``)."""
        task = asyncio.ensure_future(agent)
        limit = self.bounds.idle_timeout_s
        try:
            while True:
                idle = session.idle_s()
                done, _ = await asyncio.wait({task}, timeout=max(limit - idle, 0.0) + 0.05)
                if done:
                    return task.result()
                if session.idle_s() >= limit:
                    session.failed = session.failed or (
                        f"the session made no call for {limit:g} s "
                        "(RLBUS_GATEWAY_IDLE_TIMEOUT_S)")
                    raise SessionIdle(session.failed)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def start(self) -> None:
        import uvicorn

        from rlbus.rollout.gateway_app import make_app

        app = make_app(self.model, self.sessions, max_body_bytes=self.bounds.max_body_bytes)
        config = uvicorn.Config(app, host=self.host, port=self.port,
                                log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the service owns signals
        self._task = asyncio.create_task(self._server.serve(), name="gateway")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the bind failed: say why
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("gateway serving %s/v1 (model %r)", self.url, self.model)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)

"""The OpenAI-compatible gateway: existing agent code, trained with exact tokens.

The rollout tier serves ``/v1/chat/completions`` and ``/v1/models`` (FastAPI on uvicorn, in
the rollout process; the routes are :mod:`.gateway_app`). A session is one episode
(:mod:`.sessions`); its id is in the path of the ``base_url`` the agent gets
(``http://host:port/s/<session>/v1``) and is also its API key, so a client that only lets
you set a key works against ``http://host:port/v1`` too. Every chat completion becomes a
StepRequest over Kafka like any other turn, so batching, the staleness gate, tracing and
fault handling are the rollout tier's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rlbus.rollout.sessions import Session

log = logging.getLogger(__name__)


class Gateway:
    """The sessions of one rollout instance and the HTTP server that serves them."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.model, self.host, self.port = model, host, port
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
        s = Session(id=f"rlbus-{uuid.uuid4().hex}", **kwargs)
        self.sessions[s.id] = s
        try:
            yield s
        finally:
            self.sessions.pop(s.id, None)

    async def start(self) -> None:
        import uvicorn

        from rlbus.rollout.gateway_app import make_app

        config = uvicorn.Config(make_app(self.model, self.sessions), host=self.host, port=self.port,
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

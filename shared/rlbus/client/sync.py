"""The client for code that is not async: the same calls, on a private event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from rlbus.client.groups import ScoredGroup
from rlbus.client.position import Position
from rlbus.client.rollout_client import Purpose, RolloutClient
from rlbus.client.served import Served
from rlbus.client.settings import ClientSettings
from rlbus.messages import Prompt, Sampling, Trajectory, WeightVersion
from rlbus.transport import Bus

T = TypeVar("T")


class SyncRolloutClient:
    """:class:`RolloutClient` behind blocking calls: its event loop runs on a thread of its
    own. Calls block the calling thread (a ``submit`` waiting for credit blocks until
    another thread publishes weights). Close it, or use it as a context manager."""

    def __init__(self, settings: ClientSettings, bus: Bus | None = None, *,
                 position: Position | None = None,
                 admit: Callable[[Trajectory], None] | None = None) -> None:
        """As :class:`RolloutClient`; a ``bus`` given is used only on the client's own
        loop (an in-memory one in tests)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlbus-client",
                                        daemon=True)
        self._thread.start()
        try:
            self.client = self.run(RolloutClient.connect(settings, bus, position=position,
                                                          admit=admit))
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop and return its result (for what only that loop
        may touch, such as the in-memory bus a test gave the client)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def credit(self) -> int:
        return self.client.credit()

    def submit(self, task: str, spec: Mapping[str, Any], *, group_size: int,
               sampling: Sampling | None = None, purpose: Purpose = "train",
               group_id: str | None = None, eval_round: int | None = None,
               wait_s: float = 0.0) -> Prompt:
        return self.run(self.client.submit(
            task, spec, group_size=group_size, sampling=sampling, purpose=purpose,
            group_id=group_id, eval_round=eval_round, wait_s=wait_s))

    def receive(self, n: int | None = None, *,
                timeout_s: float | None = None) -> list[ScoredGroup]:
        return self.run(self.client.receive(n, timeout_s=timeout_s))

    def evaluations(self, timeout_s: float = 0.0) -> list[ScoredGroup]:
        return self.run(self.client.evaluations(timeout_s))

    def position(self) -> Position:
        async def position() -> Position:  # on the loop: the offset tracker is its
            return self.client.position()

        return self.run(position())

    def commit(self, position: Position) -> None:
        self.run(self.client.commit(position))

    def publish_weights(self, weights: Any, *, step: int | None = None,
                        samples_trained: int = 0,
                        samples_masked: Mapping[str, int] | None = None,
                        wait_served: bool = False, timeout_s: float = 120.0,
                        min_members: int = 1) -> WeightVersion:
        return self.run(self.client.publish_weights(
            weights, step=step, samples_trained=samples_trained,
            samples_masked=samples_masked, wait_served=wait_served, timeout_s=timeout_s,
            min_members=min_members))

    def wait_served(self, version: int | None = None, *, timeout_s: float = 120.0,
                    min_members: int = 1) -> Served:
        return self.run(self.client.wait_served(version, timeout_s=timeout_s,
                                                 min_members=min_members))

    def close(self) -> None:
        try:
            self.run(self.client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""One lifecycle for every long-lived component: setup → main loop → drain → close.

Signals only set a flag. On SIGTERM (or SIGINT) a service stops taking new input, finishes or
hands back its in-flight work within ``drain_timeout_s``, commits, flushes, closes its Kafka
clients and logs one summary line. Bounded runs (``max_messages``, ``until_idle_s``) let
tests end deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import Any, ClassVar, Generic, TypeVar

from rlbus import acl, telemetry
from rlbus.health import HealthServer
from rlbus.settings import ServiceSettings
from rlbus.topics import Topics
from rlbus.transport import Bus, KafkaBus

log = logging.getLogger(__name__)


S = TypeVar("S", bound=ServiceSettings)


class Service(ABC, Generic[S]):
    """Base of the four services. Subclasses implement ``setup``, ``main`` and ``drain``;
    their settings are ``self.settings``, typed by the parameter (``Service[RewardSettings]``)."""

    name: ClassVar[str] = "service"

    def __init__(self, settings: S, bus: Bus | None = None) -> None:
        self.settings = settings
        self.topics = Topics(settings.topics)
        self.member = f"{self.name}-{settings.instance}"
        self.group = settings.group or acl.group_name(settings.topics.prefix, self.name)
        self.bus = bus or KafkaBus(settings.kafka, dlq_topic=self.topics.dlq, service=self.member)
        self.bus.service = self.member  # names this member in dead letters and spans
        self.bus.max_message_bytes = settings.topics.max_message_bytes
        self.bus.limits = settings.limits  # decode limits of its consumers
        self.handled = 0
        self.counters: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._last_input = time.monotonic()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._started = time.monotonic()
        # Set once setup is done and the main loop starts ("ready" in the log): what a test or
        # an embedding program waits on instead of sleeping for a service to come up.
        self.ready = asyncio.Event()
        # /ready answers from the same state: ready and not asked to stop (draining).
        self.health = HealthServer(lambda: self.ready.is_set() and not self.stopping)

    # -- what subclasses provide

    @abstractmethod
    async def setup(self) -> None:
        """Build what the service owns: producers, consumers, models. What ``drain`` uses may
        be plain attributes set here; what ``close`` releases starts as None in ``__init__``."""

    @abstractmethod
    async def main(self) -> None:
        """The main loop; must return soon after ``self.stopping`` turns true."""

    async def drain(self) -> None:
        """Finish or hand back in-flight work and commit; called once on the way out, and
        only after a setup that completed (a failed one took no work)."""

    async def close(self) -> None:
        """Release what ``setup`` made besides Kafka clients; called last, even after a
        failed setup."""

    def transactional_ids(self) -> list[str]:
        """The transactional ids this member will use (checked before setup)."""
        return []

    async def check_access(self) -> None:
        """Before any work: on a broker where this member logs in as a principal (SASL),
        that the principal holds every right the role needs (:func:`rlbus.acl.check_access`),
        so that a missing ACL stops the start with a line naming it, not a send later."""
        if not isinstance(self.bus, KafkaBus) or self.name not in acl.TIER_ROLES:
            return
        kafka = self.bus.kafka
        if kafka.security_protocol.startswith("SASL_"):
            await acl.check_access(kafka, self.settings.topics, acl.Role(self.name),
                                   group=self.group, transactional_ids=self.transactional_ids())

    # -- lifecycle

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, reason: str = "requested") -> None:
        if not self._stop.is_set():
            log.info("%s stopping: %s", self.member, reason)
            self._stop_reason = reason
            self._stop.set()

    async def wait_stopped(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True if a stop was requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout_s)
        return self._stop.is_set()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A named background task; its crash stops the service instead of vanishing."""
        task = asyncio.create_task(coro, name=f"{self.member}:{name}")
        self._tasks[name] = task
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed", task.get_name(), exc_info=task.exception())
            self.request_stop(f"task {task.get_name()} crashed: {task.exception()!r}")

    def count_input(self, n: int = 1) -> None:
        """Record handled input; ends a bounded run at ``max_messages``."""
        self.handled += n
        self._last_input = time.monotonic()
        limit = self.settings.max_messages
        if limit is not None and self.handled >= limit:
            self.request_stop(f"handled {self.handled} messages (max_messages)")

    def bump(self, counter: str, n: float = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + n

    async def _watch_loop_lag(self) -> None:
        """How late a short sleep wakes up: blocking code in a handler shows here first."""
        while not self.stopping:
            t0 = time.perf_counter()
            await asyncio.sleep(0.1)
            telemetry.LOOP_LAG.record(
                max(0.0, time.perf_counter() - t0 - 0.1), {"rlbus.service": self.member}
            )
            await self.wait_stopped(1.0)

    async def _watch_idle(self) -> None:
        idle = self.settings.until_idle_s
        if idle is None:
            return
        while not self.stopping:
            quiet = time.monotonic() - self._last_input
            if quiet >= idle:
                self.request_stop(f"idle for {quiet:.1f}s (until_idle_s)")
                return
            await self.wait_stopped(min(1.0, idle - quiet))

    async def run(self) -> dict[str, Any]:
        """setup → main until stopped → drain → close. Returns the summary."""
        try:
            await self.health.start(
                port=self.settings.health_port, socket=self.settings.health_socket
            )
            await self.check_access()
            await self.setup()
            log.info("%s ready", self.member)
            self.ready.set()
            self._last_input = time.monotonic()  # idle counts from here: start-up is not idle
            self.spawn("idle-watch", self._watch_idle())
            self.spawn("loop-lag", self._watch_loop_lag())
            main = asyncio.create_task(self.main(), name=f"{self.member}:main")
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
            if main.done():
                main.result()  # re-raise a crash of the main loop
                self.request_stop("main loop returned")
            else:
                await self._join(main)
        finally:
            await self._shutdown()
        return self.summary()

    async def _join(self, main: asyncio.Task[Any]) -> None:
        try:
            await asyncio.wait_for(main, self.settings.drain_timeout_s)
        except TimeoutError:
            log.warning("%s main loop did not return in time; cancelled", self.member)

    async def _shutdown(self) -> None:
        try:
            if self.ready.is_set():
                await asyncio.wait_for(self.drain(), self.settings.drain_timeout_s)
        except TimeoutError:
            log.warning("%s drain timed out; uncommitted work will be redelivered", self.member)
        except Exception:
            log.exception("%s drain failed; uncommitted work will be redelivered", self.member)
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self.bus.close()
        try:
            await self.close()
        except Exception:
            log.exception("%s close failed", self.member)
        await self.health.close()
        log.info("%s", self.summary_line())

    def summary(self) -> dict[str, Any]:
        return {
            "service": self.member,
            "handled": self.handled,
            "seconds": round(time.monotonic() - self._started, 2),
            "stop_reason": self._stop_reason,
            **self.counters,
        }

    def summary_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.summary().items())

    async def serve(self) -> dict[str, Any]:
        """``run`` with SIGTERM/SIGINT handlers: what ``rlbus run SERVICE`` calls."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        return await self.run()

"""Verifiers in worker processes, each call under a deadline that really stops it.

A verifier is user code: it may hang, burn CPU or leak. Each of ``workers`` processes (a
fresh ``python -m rlbus.reward.pool`` in a session of its own, so it starts clean of
the service's threads and sockets and never re-runs the service's main module, as
multiprocessing's start methods do; the installed plugins are imported as it starts) serves
one call at a time over a socket pair: the trajectory's
bytes in; ``("loaded",)`` once its verifier is imported (importing a plugin named by an
import string for the first time is not the verifier's time: it gets ``LOAD_TIMEOUT_S``),
then ``(name, reward, valid, info)`` or an error text. The service waits for the answer
without blocking its event loop (the pipe's fd is watched by the loop; no threads). A call
past ``timeout_s`` has its worker's whole process group killed and a fresh worker takes its
place, so a slow verifier holds one worker, never the tier, and nothing of it is left
running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from rlbus.codec import decode, encode
from rlbus.errors import RefusedError
from rlbus.messages import Trajectory
from rlbus.processes import die_with_parent

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
"""Longest a worker may take to import the verifier of one call (a first import of a user's
plugin may pull in a heavy library)."""


class VerifierFailed(RefusedError, RuntimeError):
    """The verifier raised, timed out or its process died; the message says which: the
    sample is masked, the pool goes on."""


def _serve(conn: Connection) -> None:  # pragma: no cover - runs in the worker process
    """The worker: one trajectory at a time, until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the service's to handle
    from rlbus import plugins
    from rlbus.reward.verifiers import resolve

    for kind in ("task", "verifier"):  # the service checked them already: no error here
        with contextlib.suppress(plugins.PluginError):
            plugins.check_all(kind)
    loop = asyncio.new_event_loop()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            t = decode(data, Trajectory)
            try:
                name, verifier = resolve(t)
            finally:
                conn.send(("loaded",))
            verdict = loop.run_until_complete(verifier.verify(t))
            reply: tuple[Any, ...] = ("ok", name, float(verdict.reward), bool(verdict.valid),
                                      dict(verdict.info))
        except BaseException as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            reply = ("error", f"{type(exc).__name__}: {exc}"[:400] + where)
        try:
            conn.send(reply)
        except (TypeError, ValueError, AttributeError) as exc:  # info that does not pickle
            conn.send(("error", f"verdict not transferable: {exc}"))


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Worker:
    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # its own session: a timeout kills its process group, whatever it started too
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlbus.reward.pool", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, start_new_session=True,
            preexec_fn=die_with_parent())
        child.close()
        self.conn = Connection(parent.detach())

    async def call(self, payload: bytes, timeout_s: float) -> tuple[Any, ...]:
        try:
            self.conn.send_bytes(payload)
            loaded = await self._recv(LOAD_TIMEOUT_S)
            assert loaded == ("loaded",), loaded
            reply: tuple[Any, ...] = await self._recv(timeout_s)
            return reply
        except EOFError:
            raise VerifierFailed(
                f"verifier process died (exit code {self.proc.poll()})") from None

    async def _recv(self, timeout_s: float) -> Any:
        """The next message, waiting on the loop (never in ``recv``) for it to arrive."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        fd = self.conn.fileno()
        while not self.conn.poll():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _wake, readable)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(readable, left)
            finally:
                loop.remove_reader(fd)
        return self.conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and what it started
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.conn.close()


class VerifierPool:
    """``workers`` verifier processes; :meth:`verify` waits for a free one."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.size = workers
        self.timeout_s = timeout_s
        self.killed = 0
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: list[_Worker] = []

    def start(self) -> None:
        for _ in range(self.size):
            self._add()

    def _add(self) -> None:
        w = _Worker()
        self._all.append(w)
        self._idle.put_nowait(w)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._all.remove(w)
        self._add()

    async def verify(self, t: Trajectory) -> tuple[str, float, bool, dict[str, Any]]:
        """(verifier name, reward, valid, info); raises :class:`VerifierFailed`."""
        payload = encode(t)
        w = await self._idle.get()
        try:
            reply = await w.call(payload, self.timeout_s)
        except TimeoutError:
            self.killed += 1
            log.warning("verifier for %s past %.1fs: its process is killed",
                        t.episode_id, self.timeout_s)
            self._replace(w)
            raise VerifierFailed(f"TimeoutError: verifier still running after "
                                 f"{self.timeout_s:g}s; its process was killed") from None
        except BaseException:
            self._replace(w)  # a cancelled call leaves the pipe mid-answer: start afresh
            raise
        self._idle.put_nowait(w)
        if reply[0] == "error":
            raise VerifierFailed(reply[1])
        _, name, reward, valid, info = reply
        return name, reward, valid, info

    def close(self) -> None:
        for w in self._all:
            w.kill()
        self._all.clear()


if __name__ == "__main__":  # pragma: no cover - the worker process
    _serve(Connection(int(sys.argv[1])))

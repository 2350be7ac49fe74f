"""Run services as separate OS processes: the one launcher of the demo, the load-test fleet
and the fault tests.

Each process is ``python -m rlbus.<name>`` in its own session (Ctrl-C reaches only the
launcher, which stops them in order), with the environment of :func:`child_env` plus exactly
the RLBUS_* variables it is given, and its output appended to ``<log_dir>/<name>-<i>.log``.
On Linux a child is also SIGKILLed when the launcher dies, however it dies, so no run leaves
orphans behind (:func:`die_with_parent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
"""Loaded here, not in the child: between fork and exec the child should do as little as it
can (Python's warning on ``preexec_fn`` with threads), so it only makes one libc call."""


def child_env(extra: dict[str, str] | None = None,
              drop: Iterable[str] = ("RLBUS_",)) -> dict[str, str]:
    """This process's environment without any variable starting with one of ``drop``
    (every RLBUS_* by default: settings refuse keys they do not know, and a child must see
    only the ones it is meant to), then ``extra`` on top."""
    prefixes = tuple(drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**env, **(extra or {})}


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that binds the child's life to ours: Linux's parent-death signal
    SIGKILLs it when the thread that starts it dies (a no-op elsewhere).

    SIGKILL, not SIGTERM: a parent that dies without stopping its children (SIGKILL, a crash)
    has abandoned the run, and a drain would only wait on peers that are dying too (a rollout
    waited its whole ``drain_timeout_s`` for replies from a dead inference member). Every
    tier's contract already holds under SIGKILL of any member; a broker's data survives it.

    The signal is armed in the child between fork and exec, so a parent killed before that
    would leave a child that never gets it; the child therefore checks that its parent is
    still the process that forked it and kills itself if not (it was adopted by init or a
    subreaper in the meantime).
    """
    parent = os.getpid()

    def arm() -> None:  # pragma: no cover - runs in the child between fork and exec
        if _LIBC is None:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def spawn_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own, output appended to ``log``, SIGKILL on our death."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent(),
        )


@dataclass
class Proc:
    service: str
    index: int
    env: dict[str, str]
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path
    restarts: int = 0

    @property
    def label(self) -> str:
        return f"{self.service}-{self.index}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        return tail(self.log, lines)


@dataclass
class ServiceProcesses:
    """The service processes of one run. ``profile_dir``: run each under cProfile, writing
    ``<profile_dir>/<label>.prof`` when it exits."""

    log_dir: Path
    profile_dir: Path | None = None
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, service: str, index: int, env: dict[str, str],
              python: str | None = None) -> Proc:
        """``python``: another interpreter (the vllm engine's own venv); default this one."""
        label = f"{service}-{index}"
        argv = [python or sys.executable, "-m", f"rlbus.{service}"]
        if self.profile_dir is not None:
            argv[1:1] = ["-m", "cProfile", "-o", str(self.profile_dir / f"{label}.prof")]
        log = self.log_dir / f"{label}.log"
        proc = Proc(service, index, env, argv, spawn_process(argv, env, log), log)
        self.procs.append(proc)
        return proc

    def get(self, label: str) -> Proc:
        return next(p for p in self.procs if p.label == label)

    def kill(self, label: str) -> None:
        """SIGKILL: no drain, no commit, no flush — the fault the contract must survive."""
        proc = self.get(label)
        proc.popen.kill()
        proc.popen.wait()

    def restart(self, label: str) -> Proc:
        """Start the same member again (same instance name, same environment)."""
        proc = self.get(label)
        if proc.alive:
            raise RuntimeError(f"{label} is still running")
        proc.popen = spawn_process(proc.argv, proc.env, proc.log)
        proc.restarts += 1
        return proc

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if not p.alive]

    def stop(self, first: str = "learner", timeout: float = 40.0) -> None:
        """SIGTERM ``first`` (the learner checkpoints on the way out), then the rest;
        SIGKILL whatever has not exited by ``timeout``."""
        order = sorted(self.procs, key=lambda p: p.service != first)
        for p in order:
            if p.alive:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            if p.alive:
                p.popen.kill()
                p.popen.wait()


def tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""

"""Run services as separate OS processes: the one launcher of the demo, the load-test fleet
and the fault tests.

Each process is ``python -m rlbus.<name>`` in its own session (Ctrl-C reaches only the
launcher, which stops them in order), with the environment of
:func:`rlbus.processes.child_env` plus exactly the RLBUS_* variables it is given, and its
output appended to ``<log_dir>/<name>-<i>.log``. On Linux a child is also SIGKILLed when the
launcher dies, however it dies, so no run leaves orphans behind
(:func:`rlbus.processes.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.processes import spawn_process, tail


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
